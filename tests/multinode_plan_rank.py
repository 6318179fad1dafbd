"""One rank of tests/test_multinode.py's world with a burst bucket: the bridge's online check of its
all_reduce choice (vcga.bridge.verify), on real namespace nodes under ``torchrun``.

    multinode_plan_rank.py OUTDIR CALLS MIB

The world group measures the link at creation. Two more ``vcga`` groups over the same ranks are
given figures that mislead as a calibration inside a token bucket's burst does: the leaders' link
four times as fast as measured (so leader is predicted fastest for MIB MiB, which it is not). One
group checks its choice online (the default), the other has ``bridge_verify: false``. Each runs
CALLS all_reduces of MIB MiB; the rank writes ``OUTDIR/rank<r>.json``: the algorithm each call ran
in each group, the choice at the end, and whether the sums were right.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

import vcga  # noqa: F401 - registers backend "vcga"
from vcga.bridge.cost import AlphaBeta, LinkFigures
from vcga.config import load_config
from vcga.contract import ReduceOp
from vcga.process_group import VcgaOptions

ALGORITHMS = ("leader", "bandwidth", "replicated")


def misled(fig: LinkFigures) -> LinkFigures:
    """``fig`` with the leaders' link four times as fast as measured (past any knee too)."""
    d = fig.to_json()
    ab = AlphaBeta(*d["bridge"]["leaders"])
    d["bridge"]["leaders"] = AlphaBeta(ab.alpha_s, ab.beta_Bps * 4, 0.0, 0.0).pair()
    return LinkFigures.from_json(d)


def main() -> None:
    out, calls, mib = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    dist.init_process_group(backend="vcga")
    rank, world = dist.get_rank(), dist.get_world_size()
    measured = dist.group.WORLD.transport.group.reducer.figures
    cfg = replace(load_config(), bridge_calibration="off")
    groups = {"checked": dist.new_group(backend="vcga", pg_options=VcgaOptions(config=cfg)),
              "unchecked": dist.new_group(backend="vcga",
                                          pg_options=VcgaOptions(config=replace(cfg, bridge_verify=False)))}
    x = torch.empty(mib << 18)
    record: dict = {"host": os.uname().nodename, "predicted": None}
    for name, g in groups.items():
        reducer = g.transport.group.reducer
        reducer.apply_figures(misled(measured))  # the same figures on every rank
        record["predicted"] = reducer.auto_choice(x.numel() * 4)
        ran, right = [], True
        for i in range(calls):
            x.fill_(float(rank + i))
            before = dict(reducer.counts)
            dist.all_reduce(x, group=g)
            ran.append(next(a for a in ALGORITHMS if reducer.counts[a] > before[a]))
            right &= bool((x == float(world * i + world * (world - 1) // 2)).all())
        record[name] = {"ran": ran, "final": reducer.algorithm(x, ReduceOp.SUM), "sums_right": right,
                        "verification": reducer.verification}
    tmp = out / f"rank{rank}.tmp"
    tmp.write_text(json.dumps(record))
    os.replace(tmp, out / f"rank{rank}.json")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
