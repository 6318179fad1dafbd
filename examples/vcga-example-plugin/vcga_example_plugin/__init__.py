"""An example out-of-tree VCGA plugin (see plugin.py)."""
