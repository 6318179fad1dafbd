"""Built-in checkpoint formats (installed as ``vcga.formats``).

Every format is a reader/writer pair speaking the one stream of ``vcga.contract.TensorEntry``:
N readers and N writers, never N^2 converters. Formats never import torch, except the torch format.
"""
