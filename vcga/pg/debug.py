"""Debug mode: ranks compare a fingerprint of every collective before running it.

Enabled by ``VCGA_DEBUG=1`` (config key ``debug``), in the spirit of
``TORCH_DISTRIBUTED_DEBUG=DETAIL``. Before collective number ``seq`` each rank writes its
fingerprint -- collective, dtype, shape, reduce op, root -- under ``<seq>/<rank>`` in the group's
store and waits (with the collective timeout) for every other rank's. Then every rank compares the
same set of fingerprints, so either all ranks proceed or all raise
:class:`~vcga.errors.VcgaMismatchError` naming the ranks and fields that differ -- instead of a
hang or garbage. A rank that never arrives makes the others raise
:class:`~vcga.errors.VcgaTimeoutError` naming the missing ranks.

It costs one store round trip per collective, which is why it is off by default.

Keys are garbage-collected: a rank deletes its own key of collective ``seq - 2`` when it posts
``seq``. That is safe: a rank that reached ``seq`` read everyone's ``seq - 1`` keys, and each of those
was posted after its owner finished reading ``seq - 2``.
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

from vcga.errors import VcgaMismatchError, VcgaTimeoutError

__all__ = ["FingerprintCheck", "fingerprint"]

#: Field order in error messages.
FIELDS = ("collective", "dtype", "shape", "op", "root")


def fingerprint(collective: str, tensors: Any = None, op: str | None = None, root: int | None = None) -> dict[str, Any]:
    """The fingerprint of one call. ``tensors``: the tensor (or list of tensors) whose dtype and
    shape every rank must agree on; None when there is none (barrier) or it may differ
    (all_to_all with uneven splits)."""
    fp: dict[str, Any] = {"collective": collective}
    if tensors is not None:
        ts = tensors if isinstance(tensors, (list, tuple)) else [tensors]
        dts = [str(t.dtype).removeprefix("torch.") for t in ts]
        shapes = [list(t.shape) for t in ts]
        fp["dtype"] = dts[0] if len(dts) == 1 else dts
        fp["shape"] = shapes[0] if len(shapes) == 1 else shapes
    if op is not None:
        fp["op"] = op
    if root is not None:
        fp["root"] = root
    return fp


class FingerprintCheck:
    """Compares fingerprints across the ranks of one group through its store.

    :param store: a store private to this check (the caller prefixes it).
    :param rank: this rank in the group; :param size: the group size.
    :param timeout: how long to wait for the other ranks.
    """

    def __init__(self, store: Any, rank: int, size: int, timeout: timedelta) -> None:
        self.store, self.rank, self.size, self.timeout = store, rank, size, timeout

    def check(self, seq: int, fp: dict[str, Any]) -> None:
        """Publish ``fp`` for collective ``seq`` and compare with every rank's.

        :raises VcgaMismatchError: on every rank, when any field differs.
        :raises VcgaTimeoutError: when a rank does not arrive within the timeout.
        """
        self.store.set(f"{seq}/{self.rank}", json.dumps(fp, sort_keys=True))
        if seq > 2:
            self.store.delete_key(f"{seq - 2}/{self.rank}")
        keys = [f"{seq}/{r}" for r in range(self.size)]
        try:
            self.store.wait(keys, self.timeout)
        except Exception as e:  # the store raises DistStoreError on timeout
            missing = [r for r, k in enumerate(keys) if not self.store.check([k])]
            raise VcgaTimeoutError(fp["collective"], self.timeout.total_seconds(), rank=self.rank, seq=seq,
                                   missing_ranks=missing,
                                   detail="debug mode: the ranks listed never reached this collective") from e
        prints = {r: json.loads(v) for r, v in enumerate(self.store.multi_get(keys))}
        differences: dict[str, dict[int, Any]] = {}
        fields = [f for f in FIELDS if any(f in p for p in prints.values())]
        fields += sorted({f for p in prints.values() for f in p} - set(fields))
        for f in fields:
            values = {r: _show(p.get(f)) for r, p in prints.items()}
            if len(set(values.values())) > 1:
                differences[f] = values
        if differences:
            raise VcgaMismatchError(seq, differences, rank=self.rank)


def _show(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, list) and all(isinstance(x, int) for x in v):
        return "(" + ", ".join(map(str, v)) + ("," if len(v) == 1 else "") + ")"
    return str(v) if not isinstance(v, list) else json.dumps(v)
