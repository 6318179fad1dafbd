"""What ``vcga info --plan --compression SPEC`` shows: where compression applies in a layout, what
the compressor declares, and from which part size it pays on each link class.

The layout and the declared sizes need no torch; the crossover needs the compressor's cost, which
is measured here (compress and decode of 16 K and 1 M float32 elements on this host's CPU: on an
accelerator it is cheaper, so the crossover printed is on the safe side). Link figures are the
transport's α–β table where a running group publishes one; ``info --plan`` creates no group, so it
shows the nominal classes of :data:`vcga.compress.cost.NOMINAL_LINKS`, labelled so.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from vcga.compress.layout import Layout, declared_sent
from vcga.compress.meter import sent_bytes
from vcga.compress.spec import CompressionSpec

__all__ = ["describe", "render", "SIZES"]

#: Part sizes (bytes, float32) the crossover is searched over: 4 KiB .. 1 GiB.
SIZES = tuple(4 << (10 + i) for i in range(19))


def _shape_for(compressor: Any, nbytes: int) -> tuple[int, ...]:
    n = max(nbytes // 4, 1)
    if compressor.elementwise:
        return (n,)
    side = max(1, math.isqrt(n))
    return (side, n // side)


def _collectives(compressor: Any) -> int:
    from vcga.contract import Combine

    if compressor.combine is Combine.SUM:
        return compressor.rounds
    return 2 if compressor.server else 1


def _size(n: float) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            v = n / (1 << shift)
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{n:.0f} B"


def describe(spec: CompressionSpec, facts: Sequence[Sequence[str]], *, links: Sequence[Any] | None = None,
             measure: bool = True) -> dict[str, Any]:
    """The compression plan for ranks with ``facts`` (backend, node, device type) under ``spec``."""
    from vcga.compress.engine import create_compressor

    layout = Layout.from_facts(facts)
    comp = create_compressor(spec)
    scope = spec.scope or ("bridge" if len(layout.islands) > 1 else "all")
    out: dict[str, Any] = {"spec": spec.canonical(), "scope": scope, "scope_default": spec.scope is None,
                           "layout": layout.describe(), "compressor": comp.describe(), "when": spec.when,
                           "start": spec.start}
    if scope == "bridge" and len(layout.islands) > 1:
        k = len(layout.islands[0]) if layout.equal else 1
        peers = len(layout.islands)
        out["applies"] = (f"exact inside each of the {len(layout.islands)} islands; compressed across the "
                          f"{layout.hop} hop among {len(layout.peer_sets())} peer set(s) of {peers}")
    elif scope == "bridge":
        k, peers = 1, 1
        out["applies"] = "one island: nothing crosses a slow hop, every bucket is reduced exactly"
    else:
        k, peers = 1, len(layout.facts)
        out["applies"] = f"the whole all_reduce compressed among all {peers} ranks"
    out["parts_per_bucket"] = k
    # what the compressor declares, for a 4 MiB part (a 1024 x 1024 matrix where it needs shapes)
    shape = _shape_for(comp, 4 << 20)
    plain = sent_bytes("all_reduce", 4 << 20, max(peers, 2))
    wire = declared_sent(comp, [shape], "float32", max(peers, 2), native_sum=True)
    out["declared"] = {"part_shape": list(shape), "payload_bytes": comp.payload_nbytes(shape, "float32"),
                       "ratio": (4 << 20) / comp.payload_nbytes(shape, "float32"),
                       "sent_bytes": wire, "wire_ratio": plain / wire if wire else None}
    if measure and peers > 1:
        from vcga.compress.cost import NOMINAL_LINKS, measure_compressor, should_compress

        cost = measure_compressor(comp, peers=peers)
        out["compress_cost"] = cost.to_json()
        rows = []
        for link in links or NOMINAL_LINKS:
            first = None
            for nbytes in SIZES:
                sh = _shape_for(comp, nbytes)
                c_sent = declared_sent(comp, [sh], "float32", peers, native_sum=True)
                if should_compress(nbytes, sent_bytes("all_reduce", nbytes, peers), c_sent, _collectives(comp), link,
                                   cost):
                    first = nbytes
                    break
            rows.append({**link.to_json(), "crossover_part_bytes": first,
                         "crossover_bucket_bytes": first * k if first is not None else None})
        out["crossover"] = rows
    return out


def render(data: dict[str, Any]) -> list[str]:
    """The plan's compression section as text lines."""
    lines = ["", f"compression: {data['spec']}"]
    lay = data["layout"]
    isl = "  ".join(f"[{','.join(map(str, i['ranks']))}] {i['backend']}@{i['node']}" for i in lay["islands"])
    default = " (default for this layout)" if data["scope_default"] else ""
    lines.append(f"  scope {data['scope']}{default}: {data['applies']}")
    lines.append(f"  islands (one backend on one node): {isl}")
    if data["scope"] == "bridge" and lay["peer_sets"]:
        lines.append("  compressed exchange among: "
                     + "  ".join(f"[{','.join(map(str, p))}]" for p in lay["peer_sets"]))
    c = data["compressor"]
    d = data["declared"]
    lines.append(f"  compressor: {c['combine']}, {c['rounds']} round(s)"
                 + (", error feedback" if c["error_feedback"] else "") + (", two-phase (server)" if c["server"] else "")
                 + (", unbiased" if c["unbiased"] else "")
                 + f"; a 4 MiB part ({'x'.join(map(str, d['part_shape']))} float32) sends {d['payload_bytes']} B: "
                 f"{d['ratio']:.1f}x" + (f", {d['wire_ratio']:.1f}x on the wire" if d.get("wire_ratio") else ""))
    if data["start"]:
        lines.append(f"  the first {data['start']} step(s) reduced exactly")
    if "crossover" in data:
        cc = data["compress_cost"]
        lines.append(f"  when={data['when']}: " + ("every bucket compressed" if data["when"] == "always" else
                     "a bucket is compressed when its part is at least the crossover below"))
        lines.append(f"  crossover per link class (compress {cc['fixed_s'] * 1e6:.0f} us"
                     f" + {cc['per_byte_s'] * 1e9:.2f} ns/B measured here; links nominal):")
        w = max(len(r["name"]) for r in data["crossover"])
        for r in data["crossover"]:
            where = ("never (up to 1 GiB)" if r["crossover_part_bytes"] is None else
                     f"part >= {_size(r['crossover_part_bytes'])} (bucket >= {_size(r['crossover_bucket_bytes'])})")
            lines.append(f"    {r['name']:<{w}}  a {r['alpha_s'] * 1e6:.0f} us  b {r['beta_Bps'] / 1e9:.3g} GB/s"
                         f"  {where}")
    return lines
