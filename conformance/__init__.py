"""The checks behind ``vcga verify`` (installed as ``vcga.conformance``)."""
