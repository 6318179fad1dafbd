"""One rank of the multi-node worlds of tests/test_multinode.py: launched by real ``torchrun`` on
namespace nodes (vcga.testing.multinode); the vendors are the simulated, fake-backed sim-nccl and
sim-hccl, one per node (``VCGA_BACKEND`` set per node, as each node of a mixed cluster has its own).

    multinode_rank.py OUTDIR [--train STEPS] [--count-bytes] [--fault-timeout SECONDS]
                      [--faults NAME,...] [--next-interface IF]

1. Writes ``OUTDIR/rank<r>.json``: its node, backend and the bridge's view of the plan; with
   ``--train``, examples/train_mixed.py's DDP run on the mixed group and on flat gloo over the same
   ranks, and its report (bitwise identical on every rank; within the derived bound of gloo). With
   ``--count-bytes``, the bytes its node's interfaces sent during one 8 MiB all_reduce of the mixed
   group (``/proc/net/dev`` shows this node's network namespace), between two barriers.
2. The fault phases, one per name in ``--faults``: a fresh ``vcga`` group with a collective timeout
   of ``--fault-timeout`` seconds, 1 MiB all_reduces in a loop; after the first one the rank writes
   ``OUTDIR/rank<r>.<name>.looping``. The test then makes the fault (a link down, a node killed);
   the first error goes to ``OUTDIR/rank<r>.<name>.error.json`` (its type, module, message and the
   time) and the rank goes on to the next phase, whose group talks over ``--next-interface`` (the
   earlier fault may have taken the first link). A loop that outlives ``--fault-timeout`` x 6 writes
   a "hang" record instead (the test fails on it). The rank exits 3 after the last phase, once every
   rank of its node has written its last record (or a bounded wait ran out).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import vcga  # noqa: F401 - registers backend "vcga"

ROOT = Path(__file__).resolve().parents[1]


def _train_mixed():
    spec = importlib.util.spec_from_file_location("train_mixed", ROOT / "examples" / "train_mixed.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


COUNT_BYTES = 8 << 20


def _sent() -> dict[str, int]:
    """Bytes sent so far by each interface of this node."""
    out = {}
    for line in Path("/proc/net/dev").read_text().splitlines()[2:]:
        name, _, rest = line.partition(":")
        out[name.strip()] = int(rest.split()[8])
    return out


def _write(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)  # the test polls for the file: never let it see half of one


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--train", type=int, default=0, help="DDP steps of examples/train_mixed.py (0: none)")
    ap.add_argument("--count-bytes", action="store_true")
    ap.add_argument("--fault-timeout", type=float, default=10.0)
    ap.add_argument("--faults", type=lambda v: v.split(","), default=["fault"],
                    help="names of the fault phases, in order (the test makes each fault)")
    ap.add_argument("--next-interface", default="eth0", help="GLOO_SOCKET_IFNAME from the second phase on")
    args = ap.parse_args()

    dist.init_process_group(backend="vcga")
    rank = dist.get_rank()
    transport = dist.group.WORLD.transport
    info = transport.describe()
    me = {"rank": rank, "host": socket.gethostname(), "backend": transport.backend_name,
          "local_backend": os.environ.get("VCGA_BACKEND"), "describe": info}
    if args.train:
        tm = _train_mixed()
        gloo = dist.new_group(backend="gloo")
        mixed, _ = tm.train(dist.group.WORLD, args.train, 0.05, 0.9)
        ref, abs_sums = tm.train(gloo, args.train, 0.05, 0.9, record_abs=gloo)
        me["train"] = tm.compare(mixed, ref, abs_sums, 0.05, 0.9, gloo)
    if args.count_bytes:
        gloo = dist.new_group(backend="gloo")
        t = torch.ones(COUNT_BYTES // 4)
        dist.barrier(group=gloo)
        before = _sent()
        dist.all_reduce(t)
        dist.barrier(group=gloo)
        after = _sent()
        me["sent_bytes"] = {k: after[k] - before.get(k, 0) for k in after}
        me["counted_all_reduce_bytes"] = COUNT_BYTES
    _write(args.out / f"rank{rank}.json", me)

    for i, phase in enumerate(args.faults):
        if i:  # the link of the earlier fault is gone: the next group talks over the other network
            os.environ["GLOO_SOCKET_IFNAME"] = args.next_interface
        fault_phase(args.out, rank, phase, args.fault_timeout)
    # torchrun stops a node's other ranks (SIGTERM) as soon as one of them exits with an error: wait
    # until every rank of this node has written its last record (a failing rank first dumps its
    # flight recorder, a second or more), bounded, as a rank of a dead node never writes one
    first = rank - int(os.environ.get("LOCAL_RANK", 0))
    node = [args.out / f"rank{r}.{args.faults[-1]}.error.json"
            for r in range(first, first + int(os.environ.get("LOCAL_WORLD_SIZE", 1)))]
    deadline = time.monotonic() + 2 * args.fault_timeout + 30
    while not all(p.exists() for p in node) and time.monotonic() < deadline:
        time.sleep(0.05)
    sys.stdout.flush()
    os._exit(3)  # every phase ended in an error; a normal exit would tear the groups down against dead peers


def fault_phase(out: Path, rank: int, phase: str, timeout_s: float) -> None:
    """A fresh group, all_reduces in a loop until the fault the test makes; the error to a file."""
    group = dist.new_group(backend="vcga", timeout=timedelta(seconds=timeout_s))
    t = torch.ones(256 * 1024)
    first = True
    start = time.monotonic()
    try:
        while time.monotonic() - start < 6 * timeout_s + 120:
            dist.all_reduce(t, group=group)
            t.fill_(1.0)
            if first:
                (out / f"rank{rank}.{phase}.looping").touch()
                first = False
        record = {"type": "hang", "time": time.time()}
    except Exception as e:  # noqa: BLE001 - the test inspects what came
        record = {"type": type(e).__name__, "module": type(e).__module__, "message": str(e)[:2000],
                  "time": time.time()}
    _write(out / f"rank{rank}.{phase}.error.json", record)
    if record["type"] == "hang":
        sys.stdout.flush()
        os._exit(4)


if __name__ == "__main__":
    main()
