"""Writing mindspore-ckpt: :class:`MindSporeCkptWriter`, streamed, atomic (summary in
:mod:`vcga.formats.mindspore_ckpt`)."""

from __future__ import annotations

import os
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from vcga import dtypes as _dtypes
from vcga.contract import TensorEntry
from vcga.errors import VcgaConfigError, VcgaConversionError
from vcga.formatkit import WriterContext, is_unicode, pack_tensor_metadata

from ._proto import (
    _FIELD_EXTRA,
    _FIELD_VALUE,
    CKPT_DTYPES,
    CRC_MARK,
    DEFAULT_SLICE_SIZE,
    WRITEBACK_BYTES,
    message_classes,
    value_prefix,
)


class MindSporeCkptWriter(WriterContext):
    """The ``mindspore-ckpt`` :class:`~vcga.contract.FormatWriter`.

    :param path: the ``.ckpt`` file to create.
    :param crc: append MindSpore's ``crc_num`` trailer (``save_checkpoint(crc_check=True)``).
    :param slice_size: split tensors into Values of at most this many bytes (MindSpore: 512 MiB;
        protobuf cannot parse a message of 2 GiB).
    :param publish_into: name the output in this folder at commit (see :class:`~vcga.formatkit.WriterContext`).
    """

    def __init__(self, path: str | os.PathLike[str], *, crc: bool = False,
                 slice_size: int = DEFAULT_SLICE_SIZE, publish_into: str | os.PathLike[str] | None = None) -> None:
        self._init_outputs(publish_into)
        if not isinstance(slice_size, int) or isinstance(slice_size, bool) or not 0 < slice_size <= (1 << 30):
            raise VcgaConfigError("slice_size", slice_size, "1 byte to 1 GiB")
        self.path = Path(path)
        if not self.path.parent.is_dir():
            raise VcgaConversionError(f"{self.path}: directory {self.path.parent} does not exist")
        self.crc_enabled = bool(crc)
        self.slice_size = slice_size
        self.metadata: dict[str, str] = {}
        self.names: set[str] = set()
        self.tensor_metadata: dict[str, dict[str, str]] = {}
        self.crc = 0
        self.unsynced = 0
        self.out = self._open_output(self.path)

    def set_metadata(self, metadata: Mapping[str, str]) -> None:
        self._check_open()
        if not all(isinstance(k, str) and k and isinstance(v, str) and is_unicode(k) and is_unicode(v)
                   for k, v in metadata.items()):
            raise VcgaConversionError("mindspore-ckpt metadata must map non-empty strings to strings "
                                      "(valid Unicode: no lone surrogates)")
        trailing = sorted(k for k, v in metadata.items() if v.endswith("\x00"))
        if trailing:  # MindSpore stores strings as numpy UCS-4 arrays, which drop trailing NULs
            raise VcgaConversionError(f"mindspore-ckpt metadata values of {trailing} end with NUL characters, "
                                      "which a MindSpore checkpoint cannot keep")
        self.metadata = dict(metadata)

    def _emit(self, *parts: Any) -> None:
        """Append ``parts`` with one ``writev`` (the tensor's bytes go from the caller's buffer to the
        file; every write of this writer goes this way, so the buffered file object stays empty)."""
        views = [memoryview(p).cast("B") for p in parts if len(p)]
        for v in views:
            if self.crc_enabled:
                self.crc = zlib.crc32(v, self.crc)
            self.unsynced += len(v)
        fd = self.out.file.fileno()
        while views:
            n = os.writev(fd, views[:512])
            while n:
                if n >= len(views[0]):
                    n -= len(views.pop(0))
                else:
                    views[0], n = views[0][n:], 0
        if self.unsynced >= WRITEBACK_BYTES:  # let the disk work while the next tensors arrive
            self.out.writeback()
            self.unsynced = 0

    def write(self, entry: TensorEntry) -> None:
        self._check_open()
        name, dtype, shape = entry.name, entry.dtype, tuple(entry.shape)
        if dtype not in CKPT_DTYPES:
            raise VcgaConversionError(
                f"tensor {name!r} has dtype {dtype}, which MindSpore checkpoints cannot hold "
                f"(they hold {', '.join(sorted(CKPT_DTYPES))}); cast it explicitly to convert",
                tensor=name, dtype=dtype, target="mindspore-ckpt")
        if not isinstance(name, str) or not name or not is_unicode(name):
            raise VcgaConversionError(f"tensor name {name!r} is not a non-empty Unicode string", tensor=str(name))
        if name in self.names:
            raise VcgaConversionError(f"tensor {name!r} is written twice", tensor=name)
        if any(not isinstance(d, int) or isinstance(d, bool) or d < 0 for d in shape):
            raise VcgaConversionError(f"tensor {name!r}: invalid shape {list(shape)}", tensor=name)
        if not all(isinstance(k, str) and isinstance(v, str) and is_unicode(k) and is_unicode(v)
                   for k, v in entry.metadata.items()):
            raise VcgaConversionError(f"tensor {name!r}: metadata must map Unicode strings to strings", tensor=name)
        data = memoryview(entry.data if entry.data is not None else b"").cast("B")
        if data.nbytes != entry.nbytes:
            raise VcgaConversionError(f"tensor {name!r}: {data.nbytes} bytes of data, but {dtype} "
                                      f"{list(shape)} needs {entry.nbytes}", tensor=name, dtype=dtype)
        self.names.add(name)
        if entry.metadata:
            self.tensor_metadata[name] = dict(entry.metadata)
        tensor_type = _dtypes.get(dtype).mindspore
        assert tensor_type is not None  # every dtype in CKPT_DTYPES has a MindSpore name
        itemsize = _dtypes.get(dtype).itemsize
        step = max(self.slice_size - self.slice_size % itemsize, itemsize)
        # shape (0,) goes to field 1001: MindSpore would read dims [0] as a 0-d scalar.
        field_number = _FIELD_EXTRA if shape == (0,) else _FIELD_VALUE
        pos = 0
        while True:
            piece = data[pos:pos + step]
            self._emit(value_prefix(field_number, name, shape, tensor_type, len(piece)), piece)
            pos += step
            if pos >= data.nbytes:
                break

    def _finish(self) -> None:
        strings = pack_tensor_metadata(self.metadata, self.tensor_metadata)
        clash = self.names & set(strings)
        if clash:
            raise VcgaConversionError(f"{self.path}: metadata keys {sorted(clash)} are also tensor names; "
                                      "MindSpore keeps both in one dictionary")
        checkpoint_cls, _ = message_classes()
        for key, text in strings.items():
            # save_checkpoint(append_dict={key: text}): dims [0], type "str", numpy UCS-4 bytes.
            msg = checkpoint_cls()
            value = msg.value.add()
            value.tag = key
            value.tensor.dims.append(0)
            value.tensor.tensor_type = "str"
            # numpy stores "" as one NUL character (dtype <U1), and MindSpore cannot load zero bytes.
            value.tensor.tensor_content = text.encode("utf-32-le") or b"\x00" * 4
            self._emit(msg.SerializeToString())
        if self.crc_enabled:
            trailer = CRC_MARK + self.crc.to_bytes(10, "big")
            self.crc_enabled = False  # the trailer is not part of the checksum
            self._emit(trailer)
