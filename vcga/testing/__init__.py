"""Tools for testing and measuring VCGA itself (not needed to train): :mod:`vcga.testing.multinode`
builds several nodes on one machine for the test suite and the benchmarks (docs/multinode.md)."""
