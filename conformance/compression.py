"""Check 14: gradient compressors on the backend under test (``vcga verify --check compression``).

For every registered compressor (built-in or a plugin's), through ``vcga.compress``'s public engine
on the group under test -- scope ``bridge`` where the world has a slow hop (several vendors or
nodes), scope ``all`` otherwise -- on random data, several steps so that error feedback and warm
starts carry state:

- **ranks identical**: every rank's result has the same bits (digests swapped over the store);
- **error feedback**: on every rank and for every residual (worker and, in the two-phase exchange,
  server), ``sent + residual == input`` holds exactly (checked in rational arithmetic); and what a
  rank says it sent is what the others received: with one rank contributing and the others sending
  zeros, every rank's result equals that rank's ``sent`` (the two-phase exchange: the servers'
  inputs equal its sent chunks); and, a gathered compressor (one phase), with every rank
  contributing, the result is the float32 sum in peer order of what the peers sent, bit for bit
  (the driver adds the peers' values through the compressor's ``decompress_add``);
- **unbiased** (compressors that declare it, e.g. qsgd): the mean of T independent draws is within
  a Hoeffding bound of the exact sum: each decoded element lies in an interval of width w (one
  quantization step per peer, W = Σ w over peers), so P(|mean − x| ≥ t) ≤ 2·exp(−2Tt²/W²) and, for
  all N elements at once with probability 1 − δ, t = W·sqrt(ln(2N/δ)/(2T)) (δ = 10⁻⁹), plus the
  decoder's own rounding γ_{P+2}·Σ(|x| + w);
- **wire**: the bytes this rank hands the transport for the compressed exchange (counted there by
  ``vcga.compress.WireMeter``, after VCGA's emulations) are at most what the compressor declared
  (``payload_nbytes`` through the exchange's collectives); the detail shows the ratio against an
  uncompressed all_reduce of the same part.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from fractions import Fraction
from typing import Any

from vcga.contract import CheckResult, Combine

from . import bounds, data
from .base import Check
from .context import Context, Verdict

__all__ = ["Compression"]

_DELTA = 1e-9


def _exactly_equal(x: Any, sent: Any, hi: Any, lo: Any, limit: int) -> tuple[int, int]:
    """(elements checked, first element where sent + hi + lo != x in rational arithmetic, or -1)."""
    xs, ss, hs, ls = (t.reshape(-1).double().tolist() for t in (x, sent, hi, lo))
    n = min(len(xs), limit)
    for i in range(n):
        if Fraction(ss[i]) + Fraction(hs[i]) + Fraction(ls[i]) != Fraction(xs[i]):
            return n, i
    return n, -1


class Compression(Check):
    """Check 14: every compressor: identical ranks, exact error feedback, unbiasedness, bytes on the wire."""

    name = "compression"
    description = ("every gradient compressor: bitwise identical ranks, exact error-feedback bookkeeping, "
                   "truthful sent values, unbiased where declared, no more bytes on the wire than declared")
    defaults = {"compressors": "all", "n": 4096, "steps": 3, "trials": 64, "rational_limit": 4096, "scopes": "both"}
    #: numba and the fused loops, compiled or loaded and self-checked: about 0.7 CPU-s a rank, once in the server
    preload = ("vcga.compress.preload",)

    def run(self, ctx: Context) -> Iterator[CheckResult]:
        from vcga.compress import Topology, compressors, parse_spec

        registry = compressors()
        wanted = self.opt(ctx, "compressors")
        names = sorted(registry) if wanted == "all" else list(wanted)
        state: dict[str, Any] = {}

        def topo() -> Verdict:
            state["topo"] = Topology.build()
            return Verdict.ok(detail=f"{len(state['topo'].layout.islands)} island(s)")

        r = ctx.run_case("layout (islands and peer groups)", topo)
        yield r
        if not r.passed:
            return
        topology = state["topo"]
        state["resets"] = ctx.group_resets

        def current() -> Any:
            # a case that raised had every rank rebuild the default group (Context.run_case); the
            # islands and peer groups were made from the old one: build them again (every rank is at
            # the same case, so every rank does)
            if ctx.group_resets != state["resets"]:
                state["topo"], state["resets"] = Topology.build(), ctx.group_resets
            return state["topo"]

        # a world with a slow hop tests both scopes ("both"), or only its default ("default")
        scopes = ["bridge", "all"] if len(topology.layout.islands) > 1 else ["all"]
        if self.opt(ctx, "scopes") == "default":
            scopes = scopes[:1]
        for name in names:
            if name not in registry:
                yield ctx.result(f"{name}: registered", False, detail=f"no compressor {name!r}; known: "
                                 + ", ".join(sorted(registry)))
                continue
            # error feedback on wherever the compressor offers it: its sent() is then in use
            ef = ",ef=1" if "ef" in registry[name].options else ""
            for scope in scopes:
                spec = parse_spec(f"{name}:scope={scope}{ef}", registry)
                label = f"{name} scope={scope}"
                yield from self._compressor(ctx, spec, label, current)

    # -- one compressor ------------------------------------------------------------------------------

    def _reducer(self, spec: Any, topology: Any, **kw: Any) -> Any:
        from vcga.compress import Reducer

        return Reducer(spec, topology=topology, **kw)

    def _compressor(self, ctx: Context, spec: Any, label: str, topology: Callable[[], Any]) -> Iterator[CheckResult]:
        import torch

        n = int(self.opt(ctx, "n"))
        side = max(2, int(math.isqrt(n)))
        shapes = [(side, n // side), (n % side or 1,)]  # a matrix and a vector, as a DDP bucket holds
        total = sum(math.prod(s) for s in shapes)
        steps = int(self.opt(ctx, "steps"))
        holder: dict[str, Any] = {}

        def identical_in(dtype: Any, tag: str, **kw: Any) -> Verdict:
            red = self._reducer(spec, topology(), **kw)
            if kw.get("record"):
                holder["red"] = red  # its records serve the error-feedback case
            for step in range(steps):
                g = data.generator(f"compression{tag}", label, step, ctx.rank)
                flat = torch.randn(total, generator=g, dtype=torch.float64).to(dtype)
                red.step = step
                red.all_reduce(flat, shapes, key=f"check{tag}")
                if flat.dtype != dtype or not bool(torch.isfinite(flat).all()):
                    return Verdict.fail(f"step {step}: a {flat.dtype} result, or non-finite values in it")
                digests = ctx.exchange(f"{label}:identical{tag}:{step}", data.digest(flat).encode())
                if len(set(digests)) != 1:
                    return Verdict.fail(f"step {step}: results differ across ranks: " + ", ".join(
                        f"rank {r}: {d.decode()[:12]}" for r, d in enumerate(digests)))
            return Verdict.ok(detail=f"{steps} steps")

        def identical() -> Verdict:
            return identical_in(torch.float32, "", record=True)

        def identical_bf16() -> Verdict:
            # half-precision gradients (mixed-precision training): a payload the group cannot sum
            # natively is gathered and added in float32 -- the compressor must still get, and give
            # back, its own dtype, and every rank the same bits
            return identical_in(torch.bfloat16, "-bf16")

        yield ctx.run_case(f"{label}: ranks identical", identical)
        red = holder.get("red")
        if red is None:
            return
        comp = red.compressor
        if comp.error_feedback:
            yield ctx.run_case(f"{label}: error feedback sent + residual == input", lambda: self._ef_identity(ctx, red))
            yield ctx.run_case(f"{label}: sent is what the others receive",
                               lambda: self._truthful(ctx, spec, topology(), shapes, total, label))
            if comp.combine is Combine.GATHER and not comp.server:
                yield ctx.run_case(f"{label}: the sum is every peer's sent, added in peer order",
                                   lambda: self._summed(ctx, spec, topology(), shapes, total, label))
        if comp.unbiased:
            yield ctx.run_case(f"{label}: unbiased (Hoeffding bound)",
                               lambda: self._unbiased(ctx, spec, topology(), shapes, total, label))
        yield ctx.run_case(f"{label}: bytes on the wire <= declared",
                           lambda: self._wire(ctx, spec, topology(), shapes, total))
        yield ctx.run_case(f"{label}: ranks identical, bfloat16 gradients", identical_bf16)
        yield ctx.run_case(f"{label}: an overflow is seen, then forgotten",
                           lambda: self._overflow(ctx, spec, topology(), shapes, total, label))

    # -- the cases -----------------------------------------------------------------------------------

    def _overflow(self, ctx: Context, spec: Any, topology: Any, shapes: list[tuple[int, ...]], total: int,
                  label: str) -> Verdict:
        """Float16 training's routine overflow: at step 1 the last rank's gradient holds an inf and a
        NaN. That step's sum must not be finite (torch.amp's GradScaler must see it, to skip the
        step), and the steps after it must be finite again, the same bits on every rank: no
        residual or warm start may keep the overflow (``inf - inf`` is NaN, for good)."""
        import torch

        red = self._reducer(spec, topology)
        for step in range(4):
            g = data.generator("compression-overflow", label, step, ctx.rank)
            flat = torch.randn(total, generator=g, dtype=torch.float64).to(torch.float32)
            if step == 1 and ctx.rank == ctx.world_size - 1:
                flat[3], flat[-1] = math.inf, math.nan
            red.step = step
            red.all_reduce(flat, shapes, key="overflow")
            finite = bool(torch.isfinite(flat).all())
            if step == 1 and finite:
                return Verdict.fail("step 1: one rank's gradient held an inf and a NaN, and the sum came out finite: a "
                                    "loss scaler cannot see the overflow")
            if step != 1 and not finite:
                return Verdict.fail(f"step {step}: non-finite values in the sum" + (
                    " after the overflow of step 1 (a residual or warm start kept it)" if step > 1 else ""))
            digests = ctx.exchange(f"{label}:overflow:{step}", data.digest(flat).encode())
            if len(set(digests)) != 1:
                return Verdict.fail(f"step {step}: results differ across ranks")
        return Verdict.ok(detail="step 1 non-finite, steps 2-3 finite")

    def _ef_identity(self, ctx: Context, red: Any) -> Verdict:
        limit = int(self.opt(ctx, "rational_limit"))
        checked = 0
        for key, role, rec in red.exchange.records():
            n, bad = _exactly_equal(rec.x, rec.sent, rec.hi, rec.lo, limit)
            checked += n
            if bad >= 0:
                x, s = rec.x.reshape(-1)[bad].item(), rec.sent.reshape(-1)[bad].item()
                h, lo = rec.hi.reshape(-1)[bad].item(), rec.lo.reshape(-1)[bad].item()
                return Verdict.fail(f"{role} residual of {key!r} element {bad}: sent {s!r} + residual "
                                    f"{h!r} + {lo!r} != input {x!r}")
        return Verdict.ok(0.0, 0.0, detail=f"{checked} elements exact" if checked else "no residual on this rank")

    def _truthful(self, ctx: Context, spec: Any, topology: Any, shapes: list[tuple[int, ...]], total: int,
                  label: str) -> Verdict:
        import torch

        red = self._reducer(spec, topology, record=True)
        ex = red.exchange
        if red.size == 1:
            return Verdict.skip("one rank: nothing is exchanged")
        contributor = ctx.world_size - 1
        g = data.generator("compression-truthful", label)
        mine = torch.randn(total, generator=g, dtype=torch.float64).to(torch.float32)
        flat = mine.clone() if ctx.rank == contributor else torch.zeros(total)
        red.all_reduce(flat, shapes, key="truthful")
        # what the contributor's exchange says it sent, per tensor, as it laid the tensors out
        sent = {}
        for key, role, rec in ex.records():
            if role == "worker":
                sent[repr(key)] = rec.sent.reshape(-1).double().tolist()
        servers = {repr(key) + "|" + role: rec.x.reshape(-1).double().tolist()
                   for key, role, rec in ex.records() if role != "worker"}
        everyone = ctx.exchange_json(f"{label}:truthful", {"sent": sent, "servers": servers,
                                                           "result": flat.double().tolist()})
        if ex.c.server:
            # the servers' inputs must be the contributor's sent chunks (peers of the contributor)
            problems = 0
            owner = [e for e in everyone if any(any(v) for v in e["sent"].values())]
            if not owner:
                return Verdict.fail("no rank reported a sent value for the contributor's data")
            for e in everyone:
                for k, x in e["servers"].items():
                    base = k.split("|")[0]
                    j = int(k.split("server ")[1])
                    for o in owner:
                        if base in o["sent"]:
                            full = o["sent"][base]
                            c = -(-len(full) // max(ex.peers, 1))
                            want = full[j * c:(j + 1) * c]
                            if x != want:
                                problems += 1
            return Verdict.ok(0.0, 0.0) if problems == 0 else Verdict.fail(
                f"{problems} server input(s) differ from the chunks the contributor says it sent")
        # SUM and plain GATHER: every result equals the contributor's (and its island's) sent values
        result = torch.tensor(everyone[0]["result"], dtype=torch.float64)
        claimed = torch.zeros(total, dtype=torch.float64)
        covered = torch.zeros(total, dtype=torch.bool)
        for e in everyone:
            for key, values in e["sent"].items():
                if not any(values):
                    continue
                placed = self._place(red, key, values, shapes, total)
                if placed is None:
                    continue
                start, vals = placed
                claimed[start:start + len(vals)] = torch.tensor(vals, dtype=torch.float64)
                covered[start:start + len(vals)] = True
        if not bool(covered.any()):
            return Verdict.fail("no rank reported a sent value for the contributor's data")
        diff = (result - claimed)[covered].abs()
        worst = float(diff.max()) if diff.numel() else 0.0
        if worst != 0.0:
            i = int(diff.argmax())
            return Verdict.fail(f"a rank received {result[covered][i].item()!r} where the sender says it sent "
                                f"{claimed[covered][i].item()!r}", worst, 0.0)
        return Verdict.ok(0.0, 0.0, detail=f"{int(covered.sum())} elements")

    def _summed(self, ctx: Context, spec: Any, topology: Any, shapes: list[tuple[int, ...]], total: int,
                label: str) -> Verdict:
        """Every rank contributes: each element of the result must be the float32 sum, in peer order,
        of what the peers say they sent for it -- bit for bit (a -0.0 may read +0.0). The driver
        adds the first peer's decoded payload to the others' through the compressor's
        ``decompress_add``: a sparse one that overwrites, or adds elsewhere, fails here."""
        import torch

        red = self._reducer(spec, topology, record=True)
        ex = red.exchange
        g = data.generator("compression-summed", label, ctx.rank)
        flat = torch.randn(total, generator=g, dtype=torch.float64).to(torch.float32)
        red.all_reduce(flat, shapes, key="summed")
        sent = {repr(key): rec.sent.reshape(-1).tolist() for key, role, rec in ex.records() if role == "worker"}
        everyone = ctx.exchange_json(f"{label}:summed", {"peer": ex.peer, "sent": sent, "result": flat.tolist()})
        if red.size == 1:
            return Verdict.skip("one rank: nothing is exchanged")
        by_key: dict[str, list[tuple[int, list[float]]]] = {}
        for e in everyone:
            for key, values in e["sent"].items():
                by_key.setdefault(key, []).append((e["peer"], values))
        result = torch.tensor(everyone[ctx.rank]["result"], dtype=torch.float32)
        checked = 0
        for key, parts in sorted(by_key.items()):
            parts.sort(key=lambda pv: pv[0])
            want = torch.tensor(parts[0][1], dtype=torch.float32)
            for _, values in parts[1:]:  # left to right in peer order, in float32, as the driver adds
                want = want + torch.tensor(values, dtype=torch.float32)
            placed = self._place(red, key, want.tolist(), shapes, total)
            if placed is None:
                continue
            start = placed[0]
            got = result[start:start + want.numel()]
            if not torch.equal(got, want):
                i = int((got != want).nonzero()[0])
                return Verdict.fail(f"element {start + i} of the result is {got[i].item()!r}; the peers' sent values "
                                    f"added in peer order give {want[i].item()!r} ({len(parts)} peers)",
                                    abs(got[i].item() - want[i].item()), 0.0)
            checked += want.numel()
        if not checked:
            return Verdict.fail("no rank reported what it sent")
        return Verdict.ok(0.0, 0.0, detail=f"{checked} elements")

    @staticmethod
    def _place(red: Any, key: str, values: list[float], shapes: list[tuple[int, ...]],
               total: int) -> tuple[int, list[float]] | None:
        """Where a record's values sit in the flat buffer: keys are repr((bucket key, part, 0)) for
        an element-wise compressor (part p starts at the p-th cut), repr((bucket key, part,
        parameter index, start in the buffer)) for one that needs shapes."""
        import ast

        try:
            got = ast.literal_eval(key)
        except (ValueError, SyntaxError):
            return None
        if not isinstance(got, tuple) or len(got) not in (3, 4):
            return None
        if len(got) == 4:
            return int(got[3]), values
        k = len(red.island) if red.scope == "bridge" and red.layout.equal and len(red.layout.islands) > 1 else 1
        return red.cuts(total, k, None)[got[1]], values

    def _unbiased(self, ctx: Context, spec: Any, topology: Any, shapes: list[tuple[int, ...]], total: int,
                  label: str) -> Verdict:
        import torch

        from vcga.compress import create_compressor

        trials = int(self.opt(ctx, "trials"))
        red = self._reducer(spec, topology)
        g = data.generator("compression-unbiased", label, ctx.rank)
        mine = torch.randn(total, generator=g, dtype=torch.float64).to(torch.float32)
        everyone = [torch.randn(total, generator=data.generator("compression-unbiased", label, r),
                                dtype=torch.float64).to(torch.float32) for r in range(ctx.world_size)]
        exact = torch.stack([x.double() for x in everyone]).sum(0)
        acc = torch.zeros(total, dtype=torch.float64)
        for t in range(trials):
            flat = mine.clone()
            red.step = t  # a new draw per trial (the seed mixes in the step)
            red.all_reduce(flat, shapes, key="unbiased")
            acc += flat.double()
        mean = acc / trials
        # interval width per element: one quantization step of each peer's (bucket) scale. Under
        # scope bridge the peers quantize their island sums, which the check computes here too.
        comp = create_compressor(spec)
        step_of = getattr(comp, "step_width", None)
        if step_of is None:
            return Verdict.skip(f"{spec.name} declares itself unbiased but has no step_width(x) to bound it by")
        inputs = self._exchanged_inputs(red, everyone)
        k = len(red.island) if red.scope == "bridge" and red.layout.equal and len(red.layout.islands) > 1 else 1
        cuts = red.cuts(total, k, None)  # each part is quantized on its own (its buckets start there)
        width = torch.zeros(total, dtype=torch.float64)
        for x in inputs:
            for i in range(k):
                a, b = cuts[i], cuts[i + 1]
                if b > a:
                    width[a:b] += step_of(x[a:b]).double().reshape(-1)
        absx = sum(x.double().abs() for x in inputs)
        n = total
        t_bound = width * math.sqrt(math.log(2 * n / _DELTA) / (2 * trials))
        rounding = bounds.gamma(len(inputs) + 2, bounds.unit_roundoff("float32")) * (absx + width)
        bound = t_bound + rounding
        err = (mean - exact).abs()
        ratio = torch.where(bound > 0, err / bound, torch.where(err > 0, float("inf"), 0.0))
        i = int(ratio.argmax())
        if bool((err <= bound).all()):
            return Verdict.ok(float(err[i]), float(bound[i]), detail=f"{trials} draws")
        bad = int((err > bound).sum())
        return Verdict.fail(f"{bad} of {n} elements biased beyond the bound; worst [{i}]: mean {mean[i].item():.6g}, "
                            f"exact {exact[i].item():.6g}", float(err[i]), float(bound[i]))

    @staticmethod
    def _exchanged_inputs(red: Any, everyone: list[Any]) -> list[Any]:
        """What the peers of the compressed exchange quantize: each island's sum (scope bridge) or
        each rank's value (scope all), in float32 as the engine sums them."""
        import torch

        if red.scope == "bridge" and len(red.layout.islands) > 1:
            return [torch.stack([everyone[r] for r in isl]).sum(0) for isl in red.layout.islands]
        return list(everyone)

    def _wire(self, ctx: Context, spec: Any, topology: Any, shapes: list[tuple[int, ...]], total: int) -> Verdict:
        import torch

        from vcga.compress import WireMeter, sent_bytes

        meter = WireMeter()
        red = self._reducer(spec, topology, meter=meter)
        try:
            g = data.generator("compression-wire", ctx.rank)
            flat = torch.randn(total, generator=g)
            red.all_reduce(flat, shapes, key="wire")
        finally:
            red.close()
        # The compressor answers for its payload as handed to the collectives; what the backend's
        # emulation adds on the wire (padding a dtype it does not move natively) is reported beside.
        measured = meter.total_sent("cross:payload")
        at_transport = meter.total_sent("cross")
        declared = red.declared_cross_sent(total, shapes, "float32")
        ex = red.exchange
        if ex.peers <= 1:
            return Verdict.skip("nothing crosses a hop on this rank (one peer)")
        k = len(red.island) if red.scope == "bridge" and red.layout.equal and len(red.layout.islands) > 1 else 1
        plain = sent_bytes("all_reduce", -(-total // k) * 4, ex.peers)
        detail = (f"{measured:.0f} B sent of {declared:.0f} B declared ({at_transport:.0f} B at the transport); "
                  f"uncompressed all_reduce {plain:.0f} B: {plain / measured if measured else float('inf'):.1f}x")
        if measured > declared:
            return Verdict.fail("more bytes on the wire than declared: " + detail)
        if measured == 0:
            return Verdict.fail("no bytes counted at the transport: " + detail)
        return Verdict.ok(detail=detail)
