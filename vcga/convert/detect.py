"""Which format a checkpoint path is in, for ``vcga convert`` and ``vcga inspect``: ``--from``/``--to``
by name, else the file's signature (every format's ``FormatSpec.sniff``), else its extension;
MindSpore's shard names (``name0 .. nameN-1``), a Hugging Face shard index beside the path, and
torch.distributed.checkpoint directories are recognised. Imports no format: they load through the
plugin manager."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Sequence
from pathlib import Path

from vcga.contract import FormatSpec
from vcga.errors import VcgaConversionError, VcgaFormatError
from vcga.formatkit import check_regular_file

__all__ = ["available_formats", "format_by_name", "detect_source", "detect_target"]

log = logging.getLogger("vcga.convert")  # the package's name, the one users configure for conversion messages

_SHARD_SUFFIX = re.compile(r"^(?P<stem>.*?)(?P<digits>\d+)$")


def available_formats() -> list[FormatSpec]:
    """Every format the loaded plugins contribute (built-ins first)."""
    from vcga.plugin_manager import get_plugin_manager

    return get_plugin_manager().formats()


def _names(specs: Sequence[FormatSpec]) -> str:
    return ", ".join(s.name for s in specs) or "(none: no format plugin loaded; see `vcga info`)"


def format_by_name(name: str, specs: Sequence[FormatSpec] | None = None) -> FormatSpec:
    """The format called ``name`` (``--from``/``--to``)."""
    specs = available_formats() if specs is None else specs
    for s in specs:
        if s.name == name:
            return s
    if name == "dcp":
        raise VcgaConversionError("format dcp is a directory layout (torch.distributed.checkpoint), read-only: give "
                                  "the checkpoint directory as the source")
    raise VcgaConversionError(f"unknown format {name!r}; known formats: {_names(specs)}")


def _by_extension(path: Path, specs: Sequence[FormatSpec]) -> FormatSpec | None:
    """Longest matching extension; then the same with a MindSpore shard number stripped
    (``model.mindrecord3`` -> ``.mindrecord``)."""
    lname = path.name.lower()
    best: tuple[int, FormatSpec] | None = None
    for s in specs:
        for ext in s.extensions:
            if lname.endswith(ext.lower()) and (best is None or len(ext) > best[0]):
                best = (len(ext), s)
    if best is not None:
        return best[1]
    m = _SHARD_SUFFIX.match(path.name)
    if m and m.group("stem"):
        return _by_extension(path.with_name(m.group("stem")), specs)
    return None


def _safe_sniff(spec: FormatSpec, path: Path) -> bool:
    try:
        return bool(spec.sniff(path))
    except Exception as e:  # noqa: BLE001 - sniff must not raise; a plugin that does is not the user's problem
        log.warning("format %s: sniff(%s) raised %r; treated as no match", spec.name, path, e)
        return False


def _first_shard(path: Path) -> Path | None:
    """MindSpore's FileWriter(name, shard_num=N) writes name0 .. name{N-1}, zero-padded to the width of N-1."""
    for width in range(1, 6):
        cand = path.with_name(path.name + "0" * width)
        if cand.is_file():
            return cand
    return None


def detect_source(path: str | os.PathLike[str], name: str | None = None,
                  specs: Sequence[FormatSpec] | None = None) -> tuple[FormatSpec, Path]:
    """The source's format and the path to open.

    A name given (``--from``) wins. Otherwise the file's signature decides (every format's
    ``sniff``; when several claim it, the one whose extension also matches), then its extension.
    A path that does not exist but whose MindSpore shards do (``model.mindrecord`` ->
    ``model.mindrecord0``) opens the first shard; one with a Hugging Face shard index beside it
    (``model.safetensors`` -> ``model.safetensors.index.json``) opens the index.

    :raises VcgaFormatError: no such file, or no format recognises it.
    """
    specs = available_formats() if specs is None else specs
    p = Path(path)
    if not p.exists():
        index = p.with_name(p.name + ".index.json")  # Hugging Face: model.safetensors -> its shard index
        shard = index if index.is_file() else _first_shard(p)
        if shard is None:
            raise VcgaFormatError(p, "no such file (nor MindSpore shards named like it: "
                                  f"{p.name}0, {p.name}00, ..., nor a shard index {index.name})")
        p = shard
    if p.is_dir():
        # A torch.distributed.checkpoint directory (torch's layout or vcga.checkpoint's) is read as one
        # checkpoint of whole tensors. It is a layout, not a plugin's file format: read-only, so it is
        # not among the registered formats.
        from vcga.checkpoint.directory import DCP_SPEC, is_dcp_directory

        if name in (None, DCP_SPEC.name) and is_dcp_directory(p):
            return DCP_SPEC, p
        raise VcgaFormatError(p, "is a directory; give the checkpoint file (or its first shard), or a "
                              "torch.distributed.checkpoint directory (one holding .metadata)")
    check_regular_file(p)  # before any sniff opens it: a FIFO would block it, a device never end
    if name is not None:
        return format_by_name(name, specs), p
    sniffed = [s for s in specs if _safe_sniff(s, p)]
    by_ext = _by_extension(p, specs)
    if sniffed:
        return (by_ext if by_ext in sniffed else sniffed[0]), p
    if by_ext is not None:
        return by_ext, p
    raise VcgaFormatError(p, f"no format recognises this file's signature or extension; pass --from with one of: "
                          f"{_names(specs)}")


def detect_target(path: str | os.PathLike[str], name: str | None = None,
                  specs: Sequence[FormatSpec] | None = None) -> FormatSpec:
    """The destination's format: ``--to`` if given, else its extension."""
    specs = available_formats() if specs is None else specs
    if name is not None:
        return format_by_name(name, specs)
    spec = _by_extension(Path(path), specs)
    if spec is None:
        exts = ", ".join(f"{s.name} ({' '.join(s.extensions)})" for s in specs)
        raise VcgaConversionError(f"cannot tell the target format from {Path(path).name!r}; pass --to, or use an "
                                  f"extension of: {exts}")
    return spec
