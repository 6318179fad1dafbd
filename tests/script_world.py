"""Run a training script's ranks forked from the rank server, with the environment torchrun gives
its workers -- for the reference runs that a test compares a real torchrun launch with.

A torchrun launch starts a fresh interpreter per worker (and one for torchrun itself): about 2.5
CPU-s each before the script does anything (torch, then torch._dynamo for DDP). The reference a
test compares with does not need that launcher -- only the script's numbers -- so
:func:`run_script` runs ``world`` ranks of the same script, each forked from the server of
:func:`vcga.spawn.get_context` (torch already imported), with ``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` and
``TORCHELASTIC_RESTART_COUNT=0`` set as torchrun sets them, and ``sys.argv`` as the script would see
it. The launches under test (restarts, faults, the user's command line) stay torchrun's: its agent
(tests/elastic_run.py).
"""

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from vcga.testing import run_world


def _script_rank(rank: int, world: int, init_method: str, script: str, argv: list[str]) -> int:
    host, port = init_method.removeprefix("tcp://").rsplit(":", 1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      GROUP_RANK="0", ROLE_RANK=str(rank), MASTER_ADDR=host, MASTER_PORT=port,
                      TORCHELASTIC_RESTART_COUNT="0")
    if os.environ.get("OMP_NUM_THREADS"):  # read when the server imported torch: apply it as a worker would have
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    sys.argv = [script, *argv]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 0 if e.code is None else 1
    return 0


def run_script(script: str | Path, world: int, argv: Sequence[str], env: Mapping[str, str] | None = None,
               timeout: float = 300.0) -> list[int]:
    """Run ``script`` (with ``argv``) on ``world`` forked ranks as torchrun's workers would be set up,
    with ``env``; return each rank's exit status. A rank that raises fails with its traceback
    (:class:`vcga.testing.WorldFailed`)."""
    return run_world(_script_rank, world, str(script), list(argv), env=env, timeout=timeout)
