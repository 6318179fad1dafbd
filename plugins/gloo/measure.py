"""Measuring gloo's capability table: every (collective, dtype, reduce op) run on a real gloo group
of :data:`MEASURE_WORLD_SIZE` ranks, each result compared with the value computed independently.

``python -m vcga.plugins.gloo --measure`` runs :func:`write_table`; ``tests/test_gloo_capabilities.py``
re-measures the installed torch and checks every cell of the table.
"""

from __future__ import annotations

import json
import os
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vcga import dtypes
from vcga.contract import Collective, ReduceOp

from . import COLUMNS, TABLE_FILE

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

#: Ranks the measurement spawns (see :func:`write_table` for why three).
MEASURE_WORLD_SIZE = 3


#: Every cell the measurement covers.
def all_cells() -> list[tuple[Collective, str, ReduceOp | None]]:
    out: list[tuple[Collective, str, ReduceOp | None]] = []
    for coll in Collective:
        for dt in dtypes.ALL:
            if coll.reduces:
                out.extend((coll, dt, op) for op in ReduceOp)
            else:
                out.append((coll, dt, None))
    return out


# Two per-rank inputs whose combination under every op is distinct and exactly representable in
# every dtype (fp8 e5m2 included): a = 6 = 0b110, b = 3 = 0b011.
_A, _B = 6, 3


def _value(rank: int) -> int:
    return _A if rank % 2 == 0 else _B


def _rank_input(dt: str, rank: int) -> Any:
    """What rank ``rank`` contributes: 6 or 3, or for bool True (even ranks) / False (odd)."""
    return (rank % 2 == 0) if dt == "bool" else _value(rank)


def _expected(op: ReduceOp, dt: str, values: list[int]) -> Any:
    """The exact result, computed without the library, as a Python number (or bool)."""
    import math

    if dt == "bool":
        bits = [v % 2 == 0 for v in values]  # a -> True, b -> False
        if op in (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.BOR):
            return any(bits)
        if op in (ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.BAND):
            return all(bits)
        if op is ReduceOp.BXOR:
            return sum(bits) % 2 == 1
        return None  # AVG / PREMUL_SUM of bools has no meaning
    if op is ReduceOp.SUM:
        return sum(values)
    if op is ReduceOp.PRODUCT:
        return math.prod(values)
    if op is ReduceOp.MIN:
        return min(values)
    if op is ReduceOp.MAX:
        return max(values)
    if op is ReduceOp.AVG:
        return sum(values) / len(values)
    if op is ReduceOp.PREMUL_SUM:
        return sum(v * 2 for v in values)  # factor 2
    if dtypes.get(dt).kind not in "ui":
        return None
    acc = values[0]
    for v in values[1:]:
        acc = {ReduceOp.BAND: acc & v, ReduceOp.BOR: acc | v, ReduceOp.BXOR: acc ^ v}[op]
    return acc


def _full(dt: str, n: int, value: Any) -> torch.Tensor:
    import torch

    tdt = dtypes.to_torch(dt)
    if dt == "bool":
        return torch.full((n,), bool(value), dtype=torch.bool)
    if dtypes.get(dt).kind == "c":
        return torch.full((n,), complex(value), dtype=tdt)
    # build in float64 / int64 then cast: torch.full lacks some dtypes (fp8, uint16..64)
    base = torch.full((n,), value, dtype=torch.float64 if isinstance(value, float) else torch.int64)
    return base.to(tdt)


def _same(t: torch.Tensor, want: torch.Tensor) -> bool:
    import torch

    if t.dtype != want.dtype or t.shape != want.shape:
        return False
    # compare bytes: exact, and defined for dtypes torch cannot compare (fp8, uint32)
    return bool(torch.equal(t.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)))


def _reduce_op(op: ReduceOp) -> Any:
    import torch.distributed as dist

    if op is ReduceOp.PREMUL_SUM:
        return dist._make_nccl_premul_sum(2.0)
    return getattr(dist.ReduceOp, op.value)


def measure_cell(pg: Any, rank: int, world_size: int, coll: Collective, dt: str,
                 op: ReduceOp | None) -> tuple[bool, str]:
    """Run one cell on ``pg`` (every rank must call with the same arguments): a c10d ``Backend``
    (``ProcessGroupGloo``), whose collectives torch's type stub does not declare.

    :returns: (ok, detail): ok when the call returned and the value is exactly right on this rank.
    """
    import torch.distributed as dist

    n = 2 * world_size  # divisible by the world size for reduce_scatter / all_to_all
    values = [_value(r) for r in range(world_size)]
    inputs = [_rank_input(dt, r) for r in range(world_size)]
    mine = _full(dt, n, inputs[rank])
    try:
        if coll.reduces:
            assert op is not None
            exp_value = _expected(op, dt, values)
            if exp_value is None:
                exp_value = 0  # the library should refuse; anything it returns is wrong
            want_full = _full(dt, n, exp_value)
            if coll is Collective.ALL_REDUCE:
                ar_opts = dist.AllreduceOptions()
                ar_opts.reduceOp = _reduce_op(op)
                t = mine.clone()
                pg.allreduce([t], ar_opts).wait()
                got, want = t, want_full
            elif coll is Collective.REDUCE:
                red_opts = dist.ReduceOptions()
                red_opts.reduceOp = _reduce_op(op)
                red_opts.rootRank = 0
                t = mine.clone()
                pg.reduce([t], red_opts).wait()
                got, want = (t, want_full) if rank == 0 else (t, t)
            else:  # REDUCE_SCATTER (list form, as torch.distributed.reduce_scatter)
                rs_opts = dist.ReduceScatterOptions()
                rs_opts.reduceOp = _reduce_op(op)
                out = _full(dt, 2, 0)
                pg.reduce_scatter([out], [[_full(dt, 2, inputs[rank]) for _ in range(world_size)]], rs_opts).wait()
                got, want = out, _full(dt, 2, exp_value)
        elif coll is Collective.BROADCAST:
            t = mine.clone()
            bc_opts = dist.BroadcastOptions()
            bc_opts.rootRank = 0
            pg.broadcast([t], bc_opts).wait()
            got, want = t, _full(dt, n, inputs[0])
        elif coll is Collective.ALL_GATHER:
            outs = [_full(dt, n, 0) for _ in range(world_size)]
            pg.allgather([outs], [mine.clone()]).wait()
            got = _cat(outs)
            want = _cat([_full(dt, n, v) for v in inputs])
        elif coll is Collective.GATHER:
            outs = [_full(dt, n, 0) for _ in range(world_size)] if rank == 0 else []
            ga_opts = dist.GatherOptions()
            ga_opts.rootRank = 0
            pg.gather([outs] if rank == 0 else [], [mine.clone()], ga_opts).wait()
            got, want = (_cat(outs), _cat([_full(dt, n, v) for v in inputs])) if rank == 0 else (mine, mine)
        elif coll is Collective.SCATTER:
            ins = [_full(dt, n, inputs[r]) for r in range(world_size)] if rank == 0 else []
            out = _full(dt, n, 0)
            sc_opts = dist.ScatterOptions()
            sc_opts.rootRank = 0
            pg.scatter([out], [ins] if rank == 0 else [], sc_opts).wait()
            got, want = out, _full(dt, n, inputs[rank])
        elif coll is Collective.ALL_TO_ALL:
            out = _full(dt, n, 0)
            pg.alltoall_base(out, mine.clone(), [], [], dist.AllToAllOptions()).wait()
            got = out
            want = _cat([_full(dt, n // world_size, v) for v in inputs])
        elif coll is Collective.SEND_RECV:
            if world_size < 2:
                return True, "no peer"
            if rank == 0:
                pg.send([mine.clone()], 1, 7).wait()
                got = want = mine
            elif rank == 1:
                t = _full(dt, n, 0)
                pg.recv([t], 0, 7).wait()
                got, want = t, _full(dt, n, inputs[0])
            else:
                got = want = mine
        else:  # pragma: no cover
            raise AssertionError(coll)
    except Exception as e:  # noqa: BLE001 - whatever the library raises is its refusal, recorded in the table
        line = (str(e).strip().splitlines() or [type(e).__name__])[0]
        # torch prints some reduce ops as raw control bytes; keep the detail printable
        return False, "".join(ch if ch.isprintable() else "?" for ch in line)[:160]
    if not _same(got, want):
        return False, "returned a wrong result"
    return True, "ok"


def _cat(ts: list[torch.Tensor]) -> torch.Tensor:
    import torch

    return torch.cat([t.view(torch.uint8) for t in ts]).view(ts[0].dtype) if ts else torch.empty(0)


def measure_capabilities(store: dist.Store, rank: int, world_size: int,
                         cell_timeout: timedelta = timedelta(seconds=10)) -> dict[tuple, tuple[bool, str]]:
    """Measure every cell over ``store``.

    Each cell runs on a fresh gloo group (a refused call can leave one rank waiting and the pair
    desynchronised; a fresh group confines that to the cell, and ``cell_timeout`` bounds it).
    A cell counts as working only if it worked on *every* rank: a control group all-reduces the
    verdicts (MIN over int32, which gloo supports) so every rank records the same answer.
    """
    import torch
    import torch.distributed as dist

    # c10d Backends, whose collectives torch's type stub does not declare
    control: Any = dist.ProcessGroupGloo(dist.PrefixStore("control", store), rank, world_size, timedelta(seconds=120))
    out = {}
    for i, cell in enumerate(all_cells()):
        pg = dist.ProcessGroupGloo(dist.PrefixStore(f"cell{i}", store), rank, world_size, cell_timeout)
        ok, detail = measure_cell(pg, rank, world_size, *cell)
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp(dist.ReduceOp.MIN)
        control.allreduce([flag], opts).wait()
        agreed = bool(flag.item())
        out[cell] = (agreed, "ok" if agreed else (detail if not ok else "failed on another rank"))
        del pg
    return out


def _measure_worker(rank: int, world_size: int, port: int, queue: Any) -> None:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, world_size, rank == 0, timeout=timedelta(seconds=60))
    result = measure_capabilities(store, rank, world_size)
    if rank == 0:
        queue.put({(c.value, dt, op.value if op else None): v for (c, dt, op), v in result.items()})


def measure_in_subprocesses(world_size: int = 2) -> dict[tuple, tuple[bool, str]]:
    """Spawn a real ``world_size``-rank gloo world and measure every cell."""
    from vcga.spawn import run_ranks

    return run_ranks(_measure_worker, world_size, timeout=600)


def write_table(path: Path = TABLE_FILE) -> None:
    import torch

    # Three ranks, not two: gloo sums bools as bytes, so True+True+False comes back as a bool
    # tensor holding the byte 2 -- wrong, and invisible in a 2-rank world (True+False = 1).
    result = measure_in_subprocesses(MEASURE_WORLD_SIZE)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(table_text(torch.__version__.split("+")[0], result))
    os.replace(tmp, path)


def table_text(torch_version: str, result: dict[tuple, tuple[bool, str]]) -> str:
    """The table file: JSON, one cell a line as ``[collective, dtype, op or null, ok, detail]``
    (:data:`COLUMNS`). Rows, not objects: every rank of every job parses the file at its first
    collective, and rows parse in a third of the time; one a line, a re-measurement's diff shows
    each cell that changed."""
    head = json.dumps({"torch": torch_version, "world_size": MEASURE_WORLD_SIZE, "columns": COLUMNS})
    rows = ",\n".join(" " + json.dumps([c, dt, op, ok, detail]) for (c, dt, op), (ok, detail) in result.items())
    return head[:-1] + ', "cells": [\n' + rows + "\n]}\n"
