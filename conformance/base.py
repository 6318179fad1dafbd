"""What the built-in checks share: option handling, capability lookups, comparisons."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from vcga import dtypes as _dtypes
from vcga.contract import CapabilityTable, CheckResult, Collective, ReduceOp, Support, cell_name

from . import bounds
from .context import CellRef, Context, Verdict

if TYPE_CHECKING:
    import torch

__all__ = ["Check", "runnable", "needs", "compare_exact", "compare_ulps", "compare_reference", "ulps", "judge_refusal"]


class Check:
    """Base of the built-in checks: a name, a description, options with defaults.

    ``defaults`` lists every option the check accepts; a profile may override any of them and
    nothing else (the runner rejects unknown keys). ``dtypes: all`` means every dtype VCGA knows;
    ``ops: all`` every reduce op."""

    name: ClassVar[str]
    description: ClassVar[str]
    defaults: ClassVar[dict[str, Any]] = {}
    #: heavy modules every rank of the check imports: the rank server imports them once instead
    preload: ClassVar[tuple[str, ...]] = ()

    def run(self, ctx: Context) -> Iterator[CheckResult]:  # pragma: no cover - abstract
        raise NotImplementedError

    # -- options -----------------------------------------------------------------------------------

    def opt(self, ctx: Context, key: str) -> Any:
        return ctx.options.get(key, self.defaults[key])

    def dtypes(self, ctx: Context, key: str = "dtypes") -> list[str]:
        value = self.opt(ctx, key)
        names = list(_dtypes.ALL) if value == "all" else list(value)
        for name in names:
            _dtypes.get(name)
        return names

    def ops(self, ctx: Context, key: str = "ops") -> list[ReduceOp]:
        value = self.opt(ctx, key)
        return list(ReduceOp) if value == "all" else [ReduceOp(str(v).upper()) for v in value]


def runnable(ctx: Context, table: CapabilityTable | None, collective: Collective, dtype: str,
             op: ReduceOp | None) -> str | None:
    """None when this check should run the combination, else why it is skipped.

    Refused cells are skipped with the table's reason (the dtype-matrix check proves they raise the
    typed error); emulated cells need the ``vcga`` group's dispatch and are skipped on a native group."""
    if table is None:
        return None
    cell = table.lookup(collective, dtype, op)
    if cell.support is Support.REFUSED:
        return (f"refused by the {table.backend} capability table: {cell.note or 'no reason given'} "
                "(dtype-matrix checks that the refusal is typed)")
    if cell.support is Support.EMULATED and not ctx.through_vcga:
        return f"emulated by VCGA ({cell.via}); a native group cannot run it"
    return None


def needs(ctx: Context, table: CapabilityTable | None, cells: Sequence[CellRef], what: str) -> str | None:
    """For a case that uses several cells (DDP, object collectives): None when all of them run
    here, else what is missing, cell by cell, with the table's reasons."""
    missing = []
    for coll, dt, op in cells:
        why = runnable(ctx, table, coll, dt, op)
        if why:
            key = (Collective(coll), dt, ReduceOp(op) if op is not None and Collective(coll).reduces else None)
            missing.append(f"{cell_name(key)} ({why})")
    if not missing:
        return None
    return f"{what} needs {len(cells)} cells of which {len(missing)} cannot run here: " + "; ".join(missing)


def judge_refusal(ctx: Context, e: BaseException, elapsed: float, what: str = "refused") -> Verdict:
    """Whether an exception counts as a clean refusal of an operation torch lets a backend refuse
    (a non-contiguous tensor, a v-variant the library lacks): it must come promptly -- an error
    after most of the timeout is a hang that timed out -- and, from the vcga group, be typed.
    (The caller checks that nothing was written.) The group is rebuilt after any refusal, since a
    library may refuse on one rank after the others advanced their sequence numbers."""
    from vcga.errors import VcgaError

    from .context import first_line

    if elapsed >= ctx.timeout_s / 2:
        return Verdict(False, detail=f"raised {first_line(e)} after {elapsed:.1f} s: a timeout, not a refusal",
                       reset=True)
    if ctx.through_vcga and not isinstance(e, VcgaError):
        return Verdict(False, detail=f"refused with an untyped error: {first_line(e)}", reset=True)
    return Verdict(True, detail=f"{what}: {first_line(e)}", reset=True)


def _as_float64(t: torch.Tensor) -> torch.Tensor:
    import torch

    if t.is_complex():
        return torch.view_as_real(t.to(torch.complex128)).reshape(-1)
    if t.dtype == torch.bool:
        return t.to(torch.float64)
    return t.to(torch.float64).reshape(-1)


def _mismatch_detail(got: torch.Tensor, want: torch.Tensor) -> tuple[float, str]:
    import torch

    g, w = got.reshape(-1), want.reshape(-1)
    if g.shape != w.shape:
        return float("inf"), f"got {tuple(got.shape)} elements, expected {tuple(want.shape)}"
    if g.dtype != w.dtype:
        return float("inf"), f"got dtype {g.dtype}, expected {w.dtype}"
    gb = g.contiguous().view(torch.uint8).reshape(g.numel(), -1)
    wb = w.contiguous().view(torch.uint8).reshape(w.numel(), -1)
    bad = (gb != wb).any(1).nonzero().reshape(-1)
    i = int(bad[0])
    gd, wd = _as_float64(g), _as_float64(w)
    if g.is_complex():
        diff = (gd - wd).abs().reshape(-1, 2).amax(1)
        gv, wv = g[i].item(), w[i].item()
    else:
        diff = (gd - wd).abs()
        gv, wv = gd[i].item(), wd[i].item()
    shown_g, shown_w = f"{gv}", f"{wv}"
    if gv == wv or (gv != gv and wv != wv):  # equal values, different bytes: show the bytes
        shown_g, shown_w = f"bytes {bytes(gb[i].tolist()).hex()}", f"bytes {bytes(wb[i].tolist()).hex()}"
    finite = diff[torch.isfinite(diff)]
    worst = float(finite.max()) if finite.numel() and len(finite) == len(diff) else float("inf")
    return worst, f"{len(bad)} of {g.numel()} elements differ; first at [{i}]: got {shown_g}, expected {shown_w}"


def compare_exact(got: torch.Tensor, want: torch.Tensor, what: str = "") -> Verdict:
    """Bit-exact comparison (every byte, NaN payloads and signed zeros included)."""
    from .data import same_bits

    if same_bits(got.reshape(-1), want.reshape(-1)):
        return Verdict.ok(0.0, 0.0)
    worst, detail = _mismatch_detail(got, want)
    return Verdict.fail(f"{what}: {detail}, expected bit-exact" if what else f"{detail}, expected bit-exact",
                        worst, 0.0)


def ulps(got: torch.Tensor, exact: torch.Tensor, dtype: str) -> torch.Tensor:
    """|got − exact| in units in the last place of ``exact`` in ``dtype`` (float64 tensor)."""
    import torch

    real = {"complex64": "float32", "complex128": "float64"}.get(dtype, dtype)
    g, x = _as_float64(got), _as_float64(exact)
    _, e = torch.frexp(x)
    p = bounds.SIGNIFICAND_BITS[real]
    spacing = torch.pow(2.0, (e - p).to(torch.float64))
    spacing = torch.where(x.abs() < bounds.min_normal(real), torch.full_like(spacing, bounds.tiny(real)), spacing)
    return (g - x).abs() / spacing


def compare_ulps(got: torch.Tensor, exact: torch.Tensor, dtype: str, max_ulps: float) -> Verdict:
    """Every element within ``max_ulps`` ulp of the exact value."""
    import torch

    d = ulps(got, exact, dtype)
    if d.numel() == 0:
        return Verdict.ok(0.0, max_ulps)
    worst = float(d.max()) if not torch.isnan(d).any() else float("inf")
    if worst <= max_ulps:
        return Verdict.ok(worst, max_ulps)
    i = int(torch.nan_to_num(d, nan=float("inf")).argmax())
    return Verdict.fail(f"{worst:.3g} ulp at [{i}] (got {_as_float64(got)[i].item()!r}, exact "
                        f"{_as_float64(exact)[i].item()!r}); allowed {max_ulps:g} ulp", worst, max_ulps)


def compare_reference(got: torch.Tensor, value: torch.Tensor, bound: torch.Tensor) -> Verdict:
    """Every element within its bound of the float64 reference. The reported error and bound are
    those of the element closest to (or furthest past) its bound."""
    import torch

    g = _as_float64(got)
    if g.numel() == 0:
        return Verdict.ok(0.0, 0.0)
    err = (g - value).abs()
    err = torch.nan_to_num(err, nan=float("inf"))
    ratio = torch.where(bound > 0, err / bound, torch.where(err > 0, torch.full_like(err, float("inf")),
                                                               torch.zeros_like(err)))
    i = int(ratio.argmax())
    worst, b = float(err[i]), float(bound[i])
    if bool((err <= bound).all()):
        return Verdict.ok(worst, b)
    bad = int((err > bound).sum())
    return Verdict.fail(f"{bad} of {g.numel()} elements beyond the bound; worst at [{i}]: got {g[i].item()!r}, "
                        f"reference {value[i].item()!r}, error {worst:.3g} > bound {b:.3g}", worst, b)


def sizes_label(sizes: Sequence[int]) -> str:
    return ",".join(map(str, sizes))
