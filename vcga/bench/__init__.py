"""``vcga bench``: nccl-tests' measurements for every backend and for mixed-vendor worlds.

- :mod:`~vcga.bench.spec` -- what is measured and how it is reckoned (no torch at import);
- :mod:`~vcga.bench.runner` -- the run over the world and the tiers' subgroups, and the exact checks.

The command line is :mod:`vcga.cli.bench` (docs/bench.md).
"""
