"""Writing HDF5: one dataset per tensor, groups from '/' in names, attributes from metadata,
published atomically by the shared writer base."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from vcga import dtypes
from vcga.contract import TensorEntry
from vcga.errors import VcgaConversionError
from vcga.formatkit import WriterContext, entry_array
from vcga.tensors import check_entry

from ._format import ATTR_PREFIX, DTYPE_ATTR, GROUPS_KEY, NAME, OPAQUE_DTYPES, _h5py, decode_attr

# ---------------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------------


class Hdf5Writer(WriterContext):
    """Writes an HDF5 file atomically, one dataset per tensor, groups from '/' in names.

    :param path: the destination (appears only on :meth:`commit`).
    :param compression: ``None`` (contiguous datasets, the fastest), ``"gzip"`` or ``"lzf"``.
    :param compression_opts: gzip level 0-9.
    :param shuffle: byte-shuffle before compressing.
    """

    def __init__(self, path: str | os.PathLike[str], *, compression: str | None = None,
                 compression_opts: int | None = None, shuffle: bool = False,
                 publish_into: str | os.PathLike[str] | None = None) -> None:
        h5py = _h5py()
        self._init_outputs(publish_into)
        if compression not in (None, "gzip", "lzf"):
            raise VcgaConversionError(f"hdf5 compression must be gzip or lzf, not {compression!r}", target=NAME)
        self.path = Path(path)
        self._filters: dict[str, Any] = {}
        if compression:
            self._filters = {"compression": compression, "shuffle": bool(shuffle)}
            if compression_opts is not None:
                self._filters["compression_opts"] = int(compression_opts)
        self._af = self._open_output(self.path, "w+b")
        try:
            # HDF5 is given the file object, not a path: the output is an anonymous file (vcga.atomic),
            # and HDF5 resolves a path's real name, which /proc/self/fd/N does not have. (h5py's
            # file-object driver writes big datasets as fast as the path driver: docs/benchmarks.md,
            # "Checkpoint conversion", hdf5 -> hdf5.)
            # track_order: groups list their members in creation order, so a round trip keeps the order.
            self._h5 = h5py.File(self._af.file, "w", track_order=True)
        except BaseException:
            self.abort()
            raise
        self._metadata: dict[str, str] = {}

    def set_metadata(self, metadata: Mapping[str, str]) -> None:
        """File metadata: root attributes, plus the groups (and their attributes) listed under
        :data:`GROUPS_KEY`, created now so they keep the source's order."""
        self._check_open()
        self._metadata = dict(metadata)
        self._write_groups()

    def _group(self, parts: Sequence[str], full: str) -> Any:
        h5py = _h5py()
        g = self._h5
        for i, part in enumerate(parts):
            if part in g:
                nxt = g[part]
                if not isinstance(nxt, h5py.Group):
                    raise VcgaConversionError(
                        f"tensor {full!r} needs group {'/'.join(parts[:i + 1])!r}, but a tensor of that name was "
                        "already written; HDF5 names are paths, so one name cannot be both", tensor=full, target=NAME)
                g = nxt
            else:
                g = g.create_group(part, track_order=True)
        return g

    def write(self, entry: TensorEntry) -> None:
        import numpy as np

        self._check_open()
        name = entry.name
        parts = name.split("/")
        if not name or "\x00" in name or any(p in ("", ".") for p in parts):
            raise VcgaConversionError(
                f"tensor name {name!r} is not a valid HDF5 path (a NUL character, empty or '.' components, leading, "
                "trailing or doubled '/'); rename it before converting to hdf5", tensor=name, target=NAME)
        buf = check_entry(entry, target=NAME)
        label = entry.metadata.get(DTYPE_ATTR)
        if entry.dtype in OPAQUE_DTYPES and label is not None and label != entry.dtype:
            # The attribute holds the dtype label of the opaque data (Keras' convention): writing the
            # tensor's own value there would change its dtype on read, and dropping it would lose it.
            raise VcgaConversionError(
                f"tensor {name!r} ({entry.dtype}) has metadata {DTYPE_ATTR!r} = {label!r}, but HDF5 keeps the dtype "
                f"label of {entry.dtype} data in that attribute; rename the metadata key or convert to a format "
                "that keeps it (safetensors, vendor-bin)", tensor=name, target=NAME)
        group = self._group(parts[:-1], name)
        leaf = parts[-1]
        if leaf in group:
            raise VcgaConversionError(f"tensor {name!r} written twice (or is also a group)", tensor=name, target=NAME)
        shape = tuple(entry.shape)
        filters = self._filters if (self._filters and shape and entry.numel) else {}
        if entry.dtype in OPAQUE_DTYPES:
            # Exactly what Keras 3 writes for bf16: h5py's untagged OPAQUE type for numpy's void dtype
            # plus attrs["dtype"]. (A tag would make HDF5 refuse Keras' opaque-to-opaque read.)
            size = dtypes.get(entry.dtype).itemsize
            ds = group.create_dataset(leaf, shape=shape, dtype=np.dtype(f"V{size}"), **filters)
            if entry.numel:
                ds.write_direct(np.frombuffer(buf, dtype=np.dtype(f"V{size}")).reshape(shape))
            ds.attrs[DTYPE_ATTR] = entry.dtype
        else:
            arr = entry_array(entry, target=NAME)
            ds = group.create_dataset(leaf, shape=shape, dtype=arr.dtype, **filters)
            if entry.numel:
                ds.write_direct(np.ascontiguousarray(arr))
        for key, text in entry.metadata.items():
            if entry.dtype in OPAQUE_DTYPES and key == DTYPE_ATTR:
                continue
            _set_attr(ds, key, text, name)

    def _write_groups(self) -> None:
        meta = dict(self._metadata)
        raw = meta.pop(GROUPS_KEY, None)
        if raw is not None:
            try:
                groups = json.loads(raw)
                if not isinstance(groups, dict):
                    raise ValueError("not an object")
            except ValueError as e:
                raise VcgaConversionError(f"metadata {GROUPS_KEY!r} is not a JSON object: {e}", target=NAME) from None
            for gpath, attrs in groups.items():
                parts = gpath.split("/")
                if any(p in ("", ".") for p in parts) or not isinstance(attrs, dict):
                    raise VcgaConversionError(f"metadata {GROUPS_KEY!r} names an invalid group {gpath!r}", target=NAME)
                g = self._group(parts, gpath)
                for key, text in attrs.items():
                    _set_attr(g, key, text, gpath)
        for key, text in meta.items():
            _set_attr(self._h5, key, text, "/")

    def _finish(self) -> None:
        self._h5.close()  # HDF5 writes its last metadata into the file object

    def _discard(self) -> None:
        h5 = getattr(self, "_h5", None)
        if h5 is not None:
            try:
                h5.close()
            except Exception:  # noqa: BLE001 - discarding: the output is dropped whatever h5py says
                pass


def _set_attr(obj: Any, key: str, text: Any, where: str) -> None:
    if not isinstance(text, str):
        raise VcgaConversionError(f"metadata {key!r} of {where!r} is not a string", target=NAME)
    # HDF5 names and variable-length strings are C strings: a NUL would silently cut them short.
    if not key or "\x00" in key:
        raise VcgaConversionError(f"metadata key {key!r} of {where!r} cannot be an HDF5 attribute name "
                                  "(empty or containing NUL)", target=NAME)
    if "\x00" in text and not text.startswith(ATTR_PREFIX):
        raise VcgaConversionError(f"metadata {key!r} of {where!r} contains a NUL character, which HDF5 strings "
                                  "cannot hold", target=NAME)
    try:
        value, dt = decode_attr(text)
        if dt is None:
            obj.attrs[key] = value
        else:
            obj.attrs.create(key, value, dtype=dt)
    except (ValueError, KeyError, TypeError) as e:
        raise VcgaConversionError(f"metadata {key!r} of {where!r} is not a valid {ATTR_PREFIX} attribute: {e}",
                                  target=NAME) from None
