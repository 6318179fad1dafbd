"""The conversion engine behind ``vcga convert`` and ``vcga inspect``: any format to any other.

Every format plugin contributes a :class:`~vcga.contract.FormatSpec` (reader + writer over one
stream of :class:`~vcga.contract.TensorEntry`); this module only joins a reader to a writer --
N readers and N writers, never N^2 converters:

1. find the formats (:mod:`vcga.convert.detect`: ``--from``/``--to``, else the source's signature via
   ``FormatSpec.sniff``, else file extensions; MindSpore's shard names ``name0 .. nameN-1`` are recognised);
2. read the source's index and check, before writing a byte, that the target can hold every
   dtype exactly -- otherwise :class:`~vcga.errors.VcgaConversionError` names the tensor and the
   dtype, unless an explicit cast (``--cast bfloat16=float32``) was asked for;
3. stream tensor by tensor from reader to writer (peak memory: about two tensors), checksumming
   each tensor on the way (xxh3) and checking checksums the source stored;
4. write anonymous files (:mod:`vcga.atomic`) and name them in a hidden staging directory beside
   the destination at the end, optionally re-read the output and compare every checksum
   (``--verify``), then move the files into place. On any error the staging directory is
   removed: the destination is left absent (or as it was), and the source is only ever opened for
   reading. A conversion killed while writing leaves nothing behind; one killed between naming and
   moving leaves the staging directory, which the next VCGA writer in that directory removes.

The library logs and raises; only :mod:`vcga.cli` prints. Importing this module imports neither
torch nor any format: formats load through the plugin manager, and only the torch format imports
torch, when a ``.pt`` file is opened.
"""

from __future__ import annotations

import errno
import inspect
import logging
import os
import re
import shutil
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from vcga import dtypes
from vcga.atomic import publish_set, remove_stale, temp_name
from vcga.contract import FormatSpec, TensorEntry

# finding formats lives in vcga.convert.detect; its names stay importable from here
from vcga.convert.detect import available_formats, detect_source, detect_target
from vcga.errors import VcgaChecksumError, VcgaConversionError, VcgaDiskFullError, VcgaError, VcgaFormatError
from vcga.tensors import check_entry, checksum

__all__ = [
    "ConversionReport",
    "parse_casts",
    "parse_size",
    "parse_options",
    "Progress",
    "check_dtypes",
    "convert",
]

log = logging.getLogger(__name__)

#: ``progress(phase, done_bytes, total_bytes, tensor_name)``; phase is "convert" or "verify".
Progress = Callable[[str, int, int, str], None]


# ---------------------------------------------------------------------------------------------------
# Options
# ---------------------------------------------------------------------------------------------------

_SIZE = re.compile(r"^\s*(?P<num>\d+(?:\.\d+)?)\s*(?P<unit>[kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "ki": 2**10, "kib": 2**10, "mi": 2**20, "mib": 2**20, "gi": 2**30,
          "gib": 2**30, "ti": 2**40, "tib": 2**40}


def parse_size(text: str | int) -> int:
    """``"2GiB"``, ``"500MB"``, ``"1048576"`` -> bytes (decimal units for kB/MB/GB, binary for KiB/MiB/GiB)."""
    if isinstance(text, int):
        return text
    m = _SIZE.match(text)
    unit = (m.group("unit") or "").lower() if m else ""
    if not m or unit not in _UNITS:
        raise VcgaConversionError(f"invalid size {text!r}; write e.g. 2GiB, 500MB or a number of bytes")
    n = int(float(m.group("num")) * _UNITS[unit])
    if n <= 0:
        raise VcgaConversionError(f"size {text!r} must be positive")
    return n


#: Which kinds may be cast to which, when asked: widening and same-kind casts. Floating or complex
#: to integer, anything to bool, and complex to real are refused (they drop information silently).
_CASTABLE = {"b": "buifc", "u": "uifc", "i": "uifc", "f": "fc", "c": "c"}


def parse_casts(specs: Iterable[str]) -> dict[str, str]:
    """``["bfloat16=float32", ...]`` -> ``{"bfloat16": "float32"}``, checked against the dtype table."""
    out: dict[str, str] = {}
    for spec in specs:
        src, sep, dst = spec.partition("=")
        src, dst = src.strip(), dst.strip()
        if not sep or not src or not dst:
            raise VcgaConversionError(f"invalid cast {spec!r}; write FROM=TO, e.g. bfloat16=float32")
        for n in (src, dst):
            if n not in dtypes.DTYPES:
                raise VcgaConversionError(f"invalid cast {spec!r}: unknown dtype {n!r}; "
                                          f"known: {', '.join(dtypes.EVERY)}")
        if src == "float4_e2m1fn_x2" or dst in dtypes.NUMPY_OPAQUE:
            raise VcgaConversionError(f"refusing cast {src} -> {dst}: VCGA casts through numpy, which has no "
                                      f"{src if src == 'float4_e2m1fn_x2' else dst}; casts from complex32 work")
        if dtypes.get(dst).kind not in _CASTABLE[dtypes.get(src).kind]:
            raise VcgaConversionError(f"refusing cast {src} -> {dst}: it would drop information silently "
                                      "(float/complex to integer, to bool, or complex to real)")
        if src in out and out[src] != dst:
            raise VcgaConversionError(f"two casts for {src}: {out[src]} and {dst}")
        out[src] = dst
    return out


def _parse_option_value(text: str) -> Any:
    low = text.lower()
    if low in ("true", "yes", "on"):
        return True
    if low in ("false", "no", "off"):
        return False
    if low in ("none", "null"):
        return None
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text


def parse_options(items: Iterable[str]) -> dict[str, Any]:
    """``["compression=gzip", "compression_opts=4"]`` -> keyword arguments for a writer."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, val = item.partition("=")
        if not sep or not key.strip().isidentifier():
            raise VcgaConversionError(f"invalid writer option {item!r}; write KEY=VALUE")
        out[key.strip()] = _parse_option_value(val.strip())
    return out


def _accepted(fn: Callable[..., Any]) -> tuple[set[str], bool]:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return set(), True
    names = {p.name for p in sig.parameters.values() if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}
    return names, any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values())


def _writer_kwargs(spec: FormatSpec, *, plan: Sequence[TensorEntry], shard_size: int | None,
                   options: Mapping[str, Any]) -> dict[str, Any]:
    names, var_kw = _accepted(spec.open_writer)
    kwargs: dict[str, Any] = {}
    if "plan" in names:  # lets a writer lay out its header before the data (one pass)
        kwargs["plan"] = plan
    if shard_size is not None:
        if "shard_size" not in names and not var_kw:
            raise VcgaConversionError(f"format {spec.name} does not shard; drop --shard-size")
        kwargs["shard_size"] = shard_size
    for k, v in options.items():
        if k not in names and not var_kw or k in ("plan", "shard_size"):
            raise VcgaConversionError(f"format {spec.name} has no writer option {k!r}"
                                      + (f"; it takes: {', '.join(sorted(names - {'path', 'plan'}))}" if names else ""))
        kwargs[k] = v
    return kwargs


# ---------------------------------------------------------------------------------------------------
# Dtypes and casts
# ---------------------------------------------------------------------------------------------------


def check_dtypes(index: Sequence[TensorEntry], target: FormatSpec, casts: Mapping[str, str]) -> list[str]:
    """The dtype each tensor will have in the target; refuses what the target cannot hold.

    :raises VcgaConversionError: naming the first tensor whose (cast) dtype the target lacks.
    """
    out = []
    for e in index:
        dt = casts.get(e.dtype, e.dtype)
        if dt not in target.dtypes:
            held = ", ".join(d for d in dtypes.EVERY if d in target.dtypes)
            if dt != e.dtype:
                msg = (f"tensor {e.name!r}: the cast {e.dtype} -> {dt} gives a dtype {target.name} cannot hold "
                       f"either; it holds: {held}")
            else:
                msg = (f"tensor {e.name!r} has dtype {e.dtype}, which {target.name} cannot hold exactly; "
                       f"pass --cast {e.dtype}=<dtype> to convert it (it holds: {held})")
            raise VcgaConversionError(msg, tensor=e.name, dtype=e.dtype, target=target.name)
        out.append(dt)
    return out


def _cast(entry: TensorEntry, dst: str) -> TensorEntry:
    """Cast with numpy/ml_dtypes, refusing values the target cannot represent (overflow, wrap-around)."""
    import numpy as np

    from vcga.formatkit import entry_array

    if entry.dtype == "complex32":  # numpy has none: its (re, im) fp16 pairs, widened exactly to complex64
        from vcga.tensors import check_entry

        halves = np.frombuffer(check_entry(entry), dtype="<f2")
        src = halves.astype("<f4").view("<c8").reshape(entry.shape)
    else:
        src = entry_array(entry)
    sk, dk = dtypes.get(entry.dtype).kind, dtypes.get(dst).kind
    out_dt = dtypes.to_numpy(dst)
    if dk in "ui" and sk in "bui" and src.size:
        info = np.iinfo(out_dt)
        lo, hi = (int(src.min()), int(src.max())) if sk != "b" else (0, 1)
        if lo < info.min or hi > info.max:
            raise VcgaConversionError(f"tensor {entry.name!r}: values {lo}..{hi} do not fit {dst} "
                                      f"({info.min}..{info.max}); cast refused", tensor=entry.name, dtype=entry.dtype)
    with np.errstate(over="ignore", invalid="ignore"):
        out = src.astype(out_dt)
    if dk in "fc" and src.size:
        # ml_dtypes gives bf16/fp8 their own isfinite; integers are always finite.
        now = np.isfinite(out)
        bad = (np.isfinite(src) & ~now) if sk in "fc" else ~now
        if bad.any():
            i = int(np.flatnonzero(bad.reshape(-1))[0])
            raise VcgaConversionError(
                f"tensor {entry.name!r}: element {i} ({src.reshape(-1)[i]!r}) overflows {dst}; cast refused",
                tensor=entry.name, dtype=entry.dtype)
    out = np.ascontiguousarray(out)
    data = out.reshape(-1).view(np.uint8).data if out.size else b""
    return TensorEntry(entry.name, dst, entry.shape, data, entry.metadata)


# ---------------------------------------------------------------------------------------------------
# Converting
# ---------------------------------------------------------------------------------------------------


@dataclass
class ConversionReport:
    """What one conversion did (the CLI prints it; ``--json`` dumps :meth:`to_json`)."""

    source: str
    destination: str
    source_format: str
    target_format: str
    tensors: int = 0
    bytes: int = 0
    largest_tensor_bytes: int = 0
    casts: dict[str, int] = field(default_factory=dict)  #: "bfloat16->float32" -> tensors cast
    verified: bool = False
    outputs: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def _inside(path: Path, directory: Path) -> bool:
    try:
        path.resolve().relative_to(directory.resolve())
        return True
    except (ValueError, OSError):
        return False


def _notes_of(obj: Any) -> list[str]:
    notes = getattr(obj, "notes", None)
    return [str(n) for n in notes] if isinstance(notes, (list, tuple)) else []


def convert(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, src_format: str | None = None,
            dst_format: str | None = None, casts: Mapping[str, str] | Iterable[str] = (),
            shard_size: int | str | None = None, verify: bool = False, overwrite: bool = False,
            writer_options: Mapping[str, Any] | None = None, progress: Progress | None = None,
            specs: Sequence[FormatSpec] | None = None) -> ConversionReport:
    """Convert the checkpoint ``src`` into ``dst``, streaming tensor by tensor.

    :param src_format: / :param dst_format: format names (``--from``/``--to``); detected when None.
    :param casts: ``{"bfloat16": "float32"}`` or ``["bfloat16=float32"]``: explicit dtype casts.
    :param shard_size: bytes (or ``"2GiB"``) per shard, for targets that shard.
    :param verify: re-read the output and compare every tensor's checksum before it is moved into place.
    :param overwrite: replace existing destination files (never the source).
    :param writer_options: extra keyword arguments for the target's writer (``compression="gzip"``).
    :param progress: called after each tensor; see :data:`Progress`.
    :raises VcgaConversionError: the target cannot hold a dtype, a cast overflows, a name is invalid there...
    :raises VcgaFormatError: the source is malformed. On any error the destination is left absent.
    :raises VcgaDiskFullError: the destination's filesystem filled up (naming the space needed and free).
    """
    t0 = time.perf_counter()
    specs = available_formats() if specs is None else specs
    cast_map = dict(casts) if isinstance(casts, Mapping) else parse_casts(casts)
    for a, b in cast_map.items():
        parse_casts([f"{a}={b}"])
    size = parse_size(shard_size) if shard_size is not None else None
    src_spec, src_path = detect_source(src, src_format, specs)
    dst_spec = detect_target(dst, dst_format, specs)
    dst_path = Path(dst)
    parent = dst_path.parent if str(dst_path.parent) else Path(".")
    if not parent.is_dir():
        raise VcgaConversionError(f"destination directory {str(parent)!r} does not exist")
    if _same_file(src_path, dst_path) or _same_file(Path(src), dst_path):
        raise VcgaConversionError(f"destination {str(dst_path)!r} is the source; VCGA never modifies a source")
    if src_path.is_dir() and _inside(parent, src_path):
        raise VcgaConversionError(f"destination {str(dst_path)!r} is inside the source directory {str(src_path)!r}; "
                                  "VCGA never modifies a source")
    if dst_path.exists() and not overwrite:
        raise VcgaConversionError(f"destination {str(dst_path)!r} exists; pass --overwrite to replace it")

    report = ConversionReport(str(src), str(dst_path), src_spec.name, dst_spec.name)
    needed = 0  # the output's size, at least (its tensor bytes), once known
    try:
        # The outputs are named in a staging folder first (checked, verified), then moved into place.
        # A writer that takes publish_into (every built-in, through formatkit.WriterContext) writes
        # anonymous files and creates the folder only at commit: a conversion killed while writing
        # leaves nothing. Any other writer writes into the folder from the start. Either way its name
        # is stamped with this process (vcga.atomic.temp_name): the next writer in this directory
        # removes it if this process died before removing it itself.
        staging = temp_name(dst_path)
        try:
            with src_spec.open_reader(src_path) as reader:
                index = list(reader.index())
                _check_unique(index, src_path)
                targets = check_dtypes(index, dst_spec, cast_map)
                plan = [replace(e, dtype=t, data=None, checksum=None) for e, t in zip(index, targets, strict=True)]
                total = sum(e.nbytes for e in index)
                needed = sum(e.nbytes for e in plan)
                staged = staging / dst_path.name
                kwargs = _writer_kwargs(dst_spec, plan=plan, shard_size=size, options=writer_options or {})
                sums: dict[str, str] = {}
                done = 0
                remove_stale(parent)
                if "publish_into" in _accepted(dst_spec.open_writer)[0]:
                    writer = dst_spec.open_writer(dst_path, publish_into=staging, **kwargs)
                else:
                    staging.mkdir()
                    writer = dst_spec.open_writer(staged, **kwargs)
                with writer:
                    writer.set_metadata(dict(reader.metadata))
                    n = 0
                    for entry in reader.entries():
                        if n >= len(index):
                            raise VcgaFormatError(src_path, f"reader yielded more tensors than its index lists "
                                                  f"({entry.name!r} is extra)")
                        _check_matches_index(entry, index[n], src_path)
                        out = _source_checked(entry, src_path)
                        if targets[n] != entry.dtype:
                            out = _cast(out, targets[n])
                            key = f"{entry.dtype}->{targets[n]}"
                            report.casts[key] = report.casts.get(key, 0) + 1
                        digest = checksum(check_entry(out, target=dst_spec.name))
                        sums[out.name] = digest
                        writer.write(replace(out, checksum=digest))
                        done += entry.nbytes
                        report.largest_tensor_bytes = max(report.largest_tensor_bytes, entry.nbytes)
                        n += 1
                        del out, entry
                        if progress is not None:
                            progress("convert", done, total, index[n - 1].name)
                    if n != len(index):
                        raise VcgaFormatError(src_path, f"reader yielded {n} tensors but its index lists {len(index)}")
                report.notes += _notes_of(reader) + _notes_of(writer)
            report.tensors, report.bytes = len(index), total
            if verify:
                _verify_output(dst_spec, staged, plan, sums, progress)
                report.verified = True
            report.outputs = _move_into_place(staging, parent, overwrite, [src_path, Path(src)])
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT) and not isinstance(e, VcgaError):
            raise _disk_full(dst_path, needed, e.errno == errno.EDQUOT) from e
        raise
    report.seconds = time.perf_counter() - t0
    return report


def _disk_full(dst: Path, needed: int, quota: bool) -> VcgaDiskFullError:
    """The typed error for a full disk, measured after the partial output was removed."""
    parent = dst.parent if str(dst.parent) else Path(".")
    try:
        st = os.statvfs(parent)
        free = st.f_bavail * st.f_frsize
    except OSError:
        free = 0
    mount = os.path.abspath(parent)
    while not os.path.ismount(mount) and os.path.dirname(mount) != mount:
        mount = os.path.dirname(mount)
    return VcgaDiskFullError(dst, needed, free, mount, quota=quota)


def _check_unique(index: Sequence[TensorEntry], path: Path) -> None:
    seen: set[str] = set()
    for e in index:
        if e.name in seen:
            raise VcgaFormatError(path, f"tensor name {e.name!r} appears twice; names must be unique to convert")
        seen.add(e.name)


def _check_matches_index(entry: TensorEntry, planned: TensorEntry, path: Path) -> None:
    if (entry.name, entry.dtype, tuple(entry.shape)) != (planned.name, planned.dtype, tuple(planned.shape)):
        raise VcgaFormatError(path, f"reader yielded {entry.name!r} {entry.dtype} {list(entry.shape)} where its "
                              f"index lists {planned.name!r} {planned.dtype} {list(planned.shape)}")


def _source_checked(entry: TensorEntry, path: Path) -> TensorEntry:
    """Check the entry's length (and stored checksum) -- a source problem is a VcgaFormatError."""
    try:
        buf = check_entry(entry)
    except VcgaConversionError as e:
        raise VcgaFormatError(path, str(e)) from None
    if entry.checksum is not None:
        got = checksum(buf)
        if got != entry.checksum:
            raise VcgaChecksumError(path, f"tensor {entry.name!r}: stored checksum {entry.checksum}, data hashes to "
                                    f"{got}; the file was damaged after it was written")
    return entry


def _verify_output(spec: FormatSpec, path: Path, plan: Sequence[TensorEntry], sums: Mapping[str, str],
                   progress: Progress | None) -> None:
    """Re-read what was written and compare names, dtypes, shapes and every tensor's checksum."""
    expected = {e.name: e for e in plan}
    total = sum(e.nbytes for e in plan)
    done = 0
    try:
        with spec.open_reader(path) as reader:
            index = {e.name: e for e in reader.index()}
            if set(index) != set(expected):
                missing = sorted(set(expected) - set(index))
                extra = sorted(set(index) - set(expected))
                raise VcgaChecksumError(path, f"verify: the output's tensors differ from the source's "
                                        f"(missing {missing[:3]}, unexpected {extra[:3]})")
            for entry in reader.entries():
                want = expected.get(entry.name)
                if want is None or (entry.dtype, tuple(entry.shape)) != (want.dtype, tuple(want.shape)):
                    raise VcgaChecksumError(path, f"verify: tensor {entry.name!r} came back as {entry.dtype} "
                                            f"{list(entry.shape)}")
                got = checksum(check_entry(entry))
                if got != sums[entry.name]:
                    raise VcgaChecksumError(path, f"verify: tensor {entry.name!r} reads back as {got}, "
                                            f"written as {sums[entry.name]}")
                done += entry.nbytes
                if progress is not None:
                    progress("verify", done, total, entry.name)
    except VcgaChecksumError:
        raise
    except VcgaError as e:
        raise VcgaChecksumError(path, f"verify: the output cannot be read back: {e}") from None


def _move_into_place(staging: Path, parent: Path, overwrite: bool, sources: Sequence[Path]) -> list[str]:
    """Rename every staged file into the destination directory (after checking none clobbers
    what it must not), then fsync the directory."""
    files = sorted(p for p in staging.iterdir() if p.is_file())
    if not files:
        raise VcgaConversionError("the writer produced no file")
    for f in files:
        final = parent / f.name
        if any(_same_file(final, s) for s in sources):
            raise VcgaConversionError(f"output {str(final)!r} would replace a source file; choose another name")
        if final.exists() and not overwrite:
            raise VcgaConversionError(f"output {str(final)!r} exists; pass --overwrite to replace it")
    # Index files go last, so a reader never finds an index whose shards are not there yet.
    files.sort(key=lambda f: ("index" in f.name.lower(), f.name))
    return publish_set(staging, parent, files)
