"""When compression pays: an α–β model of the hop and a measured cost of compressing.

Sending b bytes over a link costs α + b/β (latency α per collective, bandwidth β). Per bucket,
scope ``bridge`` puts each part of N bytes on the slow hop once: plain, that is an all_reduce,
``sent = 2(P−1)/P · N`` per rank; compressed, the compressor's declared payloads through its
collectives (:meth:`vcga.compress.engine.Exchange.declared_sent`), plus the time to compress and
decode, ``c₀ + c₁·N`` (measured). ``when=auto`` compresses a bucket only when

    c₀ + c₁·N + m·α + sent_c/β  <  α + sent_plain/β        (m: the compressed exchange's collectives)

With a wire ratio R = sent_plain/sent_c the crossover is

    N* = (c₀ + (m − 1)·α) / (f·(1 − 1/R)/β − c₁),   f = 2(P−1)/P,

and compression never pays when the denominator is ≤ 0: a link faster than the compressor
(β ≥ f·(1 − 1/R)/c₁). ``vcga info --plan --compression SPEC`` prints N* per link class.

Link figures come, in order, from the transport's α–β table per link class
(``transport.describe()["link_classes"][cls] = {"alpha_s", "beta_Bps"}``, measured at group
creation when the bridge provides it), else from a measurement on the exchange's own group at
hook creation (:func:`measure_link`).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["LinkCost", "CompressCost", "NOMINAL_LINKS", "crossover", "should_compress", "measure_link",
           "measure_compressor", "link_from_transport"]


@dataclass(frozen=True)
class LinkCost:
    """One link class: ``time(b) = alpha_s + b / beta_Bps`` per collective step."""

    name: str
    alpha_s: float
    beta_Bps: float  # noqa: N815 - B is bytes (bps would be bits); a public field and JSON key
    source: str = "nominal"

    def time(self, sent: float, collectives: int = 1) -> float:
        return collectives * self.alpha_s + sent / self.beta_Bps

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "alpha_s": self.alpha_s, "beta_Bps": self.beta_Bps, "source": self.source}


@dataclass(frozen=True)
class CompressCost:
    """Compress plus decode of N bytes: ``fixed_s + per_byte_s · N`` (measured)."""

    fixed_s: float
    per_byte_s: float
    source: str = "measured"

    def time(self, nbytes: float) -> float:
        return self.fixed_s + self.per_byte_s * nbytes

    def to_json(self) -> dict[str, Any]:
        return {"fixed_s": self.fixed_s, "per_byte_s": self.per_byte_s, "source": self.source}


#: Link classes ``vcga info --plan`` shows when it has no measurement (it creates no group):
#: nominal figures, labelled so. A running group measures its own.
NOMINAL_LINKS: tuple[LinkCost, ...] = (
    LinkCost("cross-vendor, same node (shared memory)", 35e-6, 2e9),
    LinkCost("cross-node 100 Gbit/s", 20e-6, 100e9 / 8),
    LinkCost("cross-node 10 Gbit/s", 50e-6, 10e9 / 8),
    LinkCost("cross-node 1 Gbit/s", 100e-6, 1e9 / 8),
    LinkCost("cross-node 200 Mbit/s", 200e-6, 200e6 / 8),
)


def should_compress(part_bytes: float, plain_sent: float, compressed_sent: float, collectives: int,
                    link: LinkCost, cost: CompressCost) -> bool:
    """True when compressing a part of ``part_bytes`` beats sending it plainly over ``link``."""
    return cost.time(part_bytes) + link.time(compressed_sent, collectives) < link.time(plain_sent, 1)


def crossover(link: LinkCost, cost: CompressCost, wire_ratio: float, peers: int, collectives: int) -> float | None:
    """The part size in bytes above which compression pays on ``link``; None when it never does."""
    if peers < 2 or wire_ratio <= 1:
        return None
    f = 2 * (peers - 1) / peers
    denom = f * (1 - 1 / wire_ratio) / link.beta_Bps - cost.per_byte_s
    if denom <= 0:
        return None
    return max(0.0, (cost.fixed_s + (collectives - 1) * link.alpha_s) / denom)


def _median_time(fn: Callable[[], None], reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_link(group: Any, name: str, small: int = 8, large: int = 1 << 20, reps: int = 5) -> LinkCost:
    """α and β of ``group``'s all_reduce, measured (collective: every member calls it). α is the
    median time of a ``small``-byte all_reduce, β from a ``large``-byte one."""
    import torch
    import torch.distributed as dist

    from vcga.compress.meter import sent_bytes

    size = group.size()
    a = torch.zeros(max(small // 4, 1))
    b = torch.zeros(max(large // 4, 1))
    dist.all_reduce(a, group=group)  # warm up the connections
    dist.all_reduce(b, group=group)
    alpha = _median_time(lambda: dist.all_reduce(a, group=group), reps)
    t = _median_time(lambda: dist.all_reduce(b, group=group), max(3, reps // 2))
    beta = sent_bytes("all_reduce", b.numel() * 4, size) / max(t - alpha, 1e-9)
    return LinkCost(name, alpha, beta, "measured")


def measure_compressor(compressor: Any, dtype: Any = None, sizes: tuple[int, int] = (1 << 14, 1 << 20),
                       reps: int = 3, peers: int = 2) -> CompressCost:
    """Time compress + decode (one peer's share of the work) at two sizes and fit a line.

    A compressor that needs shapes is timed on square matrices of those sizes."""
    import torch

    from vcga.contract import Combine, CompressContext

    dtype = dtype or torch.float32
    g = torch.Generator().manual_seed(0)
    points = []
    for n in sizes:
        if compressor.elementwise:
            x = torch.randn(n, generator=g, dtype=torch.float32).to(dtype)
        else:
            side = max(2, int(math.isqrt(n)))
            x = torch.randn(side, side, generator=g, dtype=torch.float32).to(dtype)

        def once(x: torch.Tensor = x) -> None:
            state: dict[str, Any] = {}
            ctx = CompressContext(peers, 0, 0, 1)
            out = None
            for rnd in range(compressor.rounds if compressor.combine is Combine.SUM else 1):
                pl = compressor.compress(x, state, ctx, rnd)
                if compressor.combine is Combine.SUM:
                    pl = [p * peers for p in pl]  # stands for the summed payload
                    out = compressor.decompress(pl, state, ctx, rnd)
                    if out is not None:
                        break
                else:
                    for _ in range(peers):
                        out = compressor.decompress(pl, state, ctx, rnd)

        once()
        points.append((x.numel() * x.element_size(), _median_time(once, reps)))
    (b0, t0), (b1, t1) = points
    per_byte = max((t1 - t0) / (b1 - b0), 0.0)
    return CompressCost(max(t0 - per_byte * b0, 0.0), per_byte)


def link_from_transport(group: Any, hop: str, *, equal: bool = True, peers: int = 2) -> LinkCost | None:
    """The α–β figures of the slow hop if ``group``'s transport publishes them, else None.

    Two forms are read: ``describe()["link_classes"][hop] = {"alpha_s", "beta_Bps"}`` (β per byte
    sent), and the bridge's measured figures ``describe()["calibration"]["figures"]["bridge"]`` --
    ``"all_sets"`` (every set of shard peers reducing at once: what scope ``bridge`` does on equal
    islands) or ``"leaders"``, each ``[α, β]`` (or ``[α, β, knee, sustained]`` past a burst knee:
    the sustained rate is read) with β per byte *reduced*; an all_reduce of N bytes
    among P peers sends 2(P−1)/P·N, so β per byte sent is that β times 2(P−1)/P."""
    transport = getattr(group, "transport", None)
    if transport is None:
        return None
    try:
        d = transport.describe()
    except Exception:  # noqa: BLE001 - a transport without a describe() we understand
        return None
    classes = d.get("link_classes") if isinstance(d, dict) else None
    fig = classes.get(hop) if isinstance(classes, dict) else None
    if isinstance(fig, dict) and "alpha_s" in fig and "beta_Bps" in fig:
        return LinkCost(hop, float(fig["alpha_s"]), float(fig["beta_Bps"]), "transport α–β")
    cal = d.get("calibration") if isinstance(d, dict) else None
    bridge = ((cal or {}).get("figures") or {}).get("bridge") if isinstance(cal, dict) else None
    if isinstance(bridge, dict):
        ab = bridge.get("all_sets" if equal else "leaders") or bridge.get("leaders")
        if isinstance(ab, (list, tuple)) and len(ab) in (2, 4):
            f = 2 * (peers - 1) / peers if peers > 1 else 1.0
            # past a burst knee (a token bucket), the sustained rate: a bucket's worth is what it lets by
            beta = float(ab[3]) if len(ab) == 4 and ab[2] else float(ab[1])
            return LinkCost(hop, float(ab[0]), beta * f, "bridge α–β")
    return None
