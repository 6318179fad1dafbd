"""PyTorch ``.pt`` / ``.pth`` / ``.bin`` state dicts (installed as ``vcga.formats.torch_pt``).

The only format allowed to import torch, and it does so only when a file is opened (module import,
sniffing and ``vcga --help`` stay torch-free).

Reading: ``torch.load(..., weights_only=True)`` and nothing else -- a pickle that names any code
outside torch's weights-only allow-list (``os.system``, a custom class) is refused with
:class:`~vcga.errors.VcgaFormatError` before anything of it runs. That allow-list is the whole
defence, and torch up to 2.5.1 could be made to run code through it (CVE-2025-32434), so on a
torch older than 2.6 the reader refuses every file, asking for an upgrade. Before torch sees a
zip-format file, its records are bounded (at most :data:`vcga.formatkit.MAX_TENSORS`, stored
uncompressed as ``torch.save`` writes them, the pickle at most :data:`MAX_PICKLE` bytes making at
most two tensor-building calls per allowed tensor): torch builds every object of the pickle before
VCGA sees one. Zip-format files (every
``torch.save`` since 1.6) load with ``mmap=True``: no tensor byte is read until its entry is
consumed, and after each entry the reader tells the kernel it no longer needs those pages
(``madvise(MADV_DONTNEED)`` on the read-only private mapping), so the resident set stays near one
tensor however large the file. Nested dicts flatten with '.' (``{"model": {"w": t}}`` ->
``model.w``); lists and tuples by index. Non-tensor leaves (``epoch``, ``lr``) are kept in the
file metadata under ``torch.extra`` as JSON, and ``state_dict()``'s ``_metadata`` (module
versions) under ``torch.state_dict_metadata``.

Tied and shared tensors: torch stores a tensor once per storage. When two names view exactly the
same elements (same storage, offset, shape and strides -- ``lm_head.weight`` tied to
``embed.weight``) the second gets the metadata ``torch.tied_to = <first name>``; when they share
a storage but view different elements, ``torch.shares_storage_with = <first name>`` (information
only). Every name still yields its own complete data, so formats without aliasing lose nothing.

Writing: :class:`TorchWriter` writes the zip archive ``torch.save`` writes -- same records, same
pickle (a test checks ``data.pkl`` is byte-identical) -- but one tensor at a time with
``torch._C.PyTorchFileWriter``: each tensor's bytes go straight to its ``data/<key>`` record and
the pickle that describes them is written from lightweight stubs. A name whose metadata says
``torch.tied_to`` a tensor with the same dtype, shape and bytes shares its storage again, so a
tied model round-trips tied. A plain ``dict`` is written (an ``OrderedDict`` with ``_metadata``
when the source had one), loadable by ``torch.load(weights_only=True)`` and ``load_state_dict``.
"""

from __future__ import annotations

import ctypes
import json
import logging
import mmap
import os
import pickle
import pickletools
import re
import struct
import sys
import zipfile
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, SupportsIndex

from vcga import dtypes, formatkit
from vcga.contract import FormatSpec, TensorEntry, hookimpl
from vcga.errors import VcgaConversionError, VcgaFormatError
from vcga.formatkit import ReaderContext, WriterContext, check_regular_file, open_regular
from vcga.tensors import check_entry, checksum

__all__ = ["TorchReader", "TorchWriter", "sniff", "SPEC", "TIED_TO", "SHARES_STORAGE_WITH"]

log = logging.getLogger(__name__)

NAME = "torch"
TIED_TO = "torch.tied_to"
SHARES_STORAGE_WITH = "torch.shares_storage_with"
EXTRA_KEY = "torch.extra"
STATE_DICT_METADATA_KEY = "torch.state_dict_metadata"
#: The oldest torch whose ``weights_only=True`` loader VCGA trusts: torch <= 2.5.1 could be made to
#: run code through it (CVE-2025-32434, fixed in 2.6.0).
SAFE_TORCH = (2, 6)
#: The largest pickle (``data.pkl``) VCGA lets torch unpickle: about 256 bytes for each of
#: :data:`vcga.formatkit.MAX_TENSORS` tensors (a name and a rebuild call take about 100).
MAX_PICKLE = 64 << 20
#: torch's legacy (pre-1.6) files start with the pickled magic number 0x1950a86a20f9469cfc6c.
_LEGACY_MAGIC = b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19"


def sniff(path: Any) -> bool:
    """A zip whose first record is ``<archive>/data.pkl``, ``.../data/<n>`` or ``.../.format_version``,
    or a legacy torch pickle. Reads the first ~300 bytes, without importing torch."""
    try:
        with open(path, "rb") as f:
            head = f.read(320)
    except OSError:
        return False
    if head.startswith(_LEGACY_MAGIC):
        return True
    if len(head) < 30 or head[:4] != b"PK\x03\x04":
        return False
    name_len = int.from_bytes(head[26:28], "little")
    name = head[30:30 + name_len].decode("utf-8", "replace")
    _, _, rest = name.partition("/")
    return rest in ("data.pkl", ".format_version", "byteorder") or (
        rest.startswith("data/") and rest[5:].isdigit())


# ---------------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------------

_PAGE = mmap.PAGESIZE
_MADV_DONTNEED = 4


def _madvise_dontneed() -> Any:
    """libc's madvise, or None where it is unavailable (then pages stay until memory pressure)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.madvise
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        fn.restype = ctypes.c_int
        return fn
    except (OSError, AttributeError):
        return None


class TorchReader(ReaderContext):
    """Streams the tensors of a torch state dict (nested containers flattened), in insertion order."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        import torch

        self.path = Path(path)
        check_safe_torch(torch.__version__)
        check_regular_file(self.path)
        try:
            use_mmap = zipfile.is_zipfile(self.path)
            if use_mmap:
                self._check_archive()
        except (OSError, zipfile.BadZipFile, ValueError, EOFError, struct.error) as e:  # a damaged archive
            raise VcgaFormatError(self.path, f"damaged zip archive: {e}") from None
        self._mapped = use_mmap
        try:
            obj = torch.load(self.path, map_location="cpu", weights_only=True, mmap=use_mmap)
        except pickle.UnpicklingError as e:
            # torch's text is a paragraph; keep the line that names what the pickle asked for.
            lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
            why = next((ln for ln in lines if "GLOBAL" in ln or "unsupported" in ln.lower()),
                       lines[-1] if lines else "")
            raise VcgaFormatError(self.path, f"refused: the pickle needs code outside torch's weights-only allow-list "
                                  f"({why[:200]}). VCGA never runs code from a checkpoint; re-save it from trusted "
                                  "code as a plain state dict") from None
        except Exception as e:  # noqa: BLE001 - whatever torch.load raises on a bad file: one typed error
            raise VcgaFormatError(self.path, f"not a loadable torch checkpoint: {type(e).__name__}: "
                                  f"{' '.join(str(e).split())[:300]}") from None
        self.metadata: dict[str, str] = {}
        self._tensors: list[tuple[str, Any]] = []
        extra: dict[str, Any] = {}
        sd_meta = getattr(obj, "_metadata", None)
        if isinstance(obj, Mapping) and isinstance(sd_meta, Mapping):
            try:
                self.metadata[STATE_DICT_METADATA_KEY] = json.dumps(sd_meta, sort_keys=False)
            except (TypeError, ValueError):
                log.info("%s: state_dict _metadata is not JSON-serialisable; not kept", self.path)
        if isinstance(obj, torch.Tensor):
            raise VcgaFormatError(self.path, "holds a bare tensor, not a state dict; save it as {'name': tensor}")
        self._flatten(obj, "", extra, torch)
        if extra:
            self.metadata[EXTRA_KEY] = json.dumps(extra, sort_keys=False)
        self._index = self._describe(torch)
        self._madvise = _madvise_dontneed() if use_mmap else None

    def _check_archive(self) -> None:
        """Bound what torch will build from this zip archive before it opens it (see the module docstring)."""
        limit = formatkit.MAX_TENSORS
        fd = open_regular(self.path)
        with os.fdopen(fd, "rb") as f:
            records = _zip_records(f)
            if records > limit + 16:  # a storage per tensor, and a few records of torch's own
                raise VcgaFormatError(self.path, f"holds {records} zip records, more than the {limit} tensors VCGA "
                                      "reads from one file (vcga.formatkit.MAX_TENSORS)")
            with zipfile.ZipFile(f) as zf:
                infos = zf.infolist()
                packed = next((i.filename for i in infos if i.compress_type != zipfile.ZIP_STORED), None)
                if packed is not None:
                    raise VcgaFormatError(self.path, f"record {packed!r} is compressed; torch.save stores every "
                                          "record uncompressed")
                pkl = [i for i in infos if i.filename.endswith("/data.pkl") and i.filename.count("/") == 1]
                if len(pkl) != 1:
                    return  # not a torch archive: torch says what is wrong
                if pkl[0].file_size > MAX_PICKLE:
                    raise VcgaFormatError(self.path, f"its pickle is {pkl[0].file_size} bytes, more than the "
                                          f"{MAX_PICKLE} VCGA lets torch unpickle")
                data = zf.read(pkl[0])
        # Two calls build a tensor (_rebuild_tensor_v2 and its hooks' OrderedDict). Counting them
        # walks the pickle's opcodes (slow); the count of 'R' bytes bounds them first (fast).
        calls = 2 * limit + 1024
        if data.count(b"R") > calls and _reduce_calls(data, calls) > calls:
            raise VcgaFormatError(self.path, f"its pickle builds more than {limit} tensors, the most VCGA reads "
                                  "from one file (vcga.formatkit.MAX_TENSORS)")

    def _flatten(self, obj: Any, prefix: str, extra: dict[str, Any], torch: Any) -> None:
        if isinstance(obj, torch.Tensor):
            self._tensors.append((prefix, obj))
        elif isinstance(obj, Mapping):
            for k, v in obj.items():
                self._flatten(v, f"{prefix}.{k}" if prefix else str(k), extra, torch)
        elif isinstance(obj, (list, tuple)) and any(isinstance(v, (torch.Tensor, Mapping, list, tuple)) for v in obj):
            for i, v in enumerate(obj):
                self._flatten(v, f"{prefix}.{i}" if prefix else str(i), extra, torch)
        else:
            try:
                json.dumps(obj)
                extra[prefix] = obj
            except (TypeError, ValueError):
                extra[prefix] = repr(obj)

    def _describe(self, torch: Any) -> list[TensorEntry]:
        out = []
        if len(self._tensors) > formatkit.MAX_TENSORS:
            raise VcgaFormatError(self.path, f"holds {len(self._tensors)} tensors, more than the "
                                  f"{formatkit.MAX_TENSORS} VCGA reads from one file (vcga.formatkit.MAX_TENSORS)")
        names = [n for n, _ in self._tensors]
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise VcgaFormatError(self.path, f"two tensors flatten to the same name {dup!r}")
        exact: dict[tuple[Any, ...], str] = {}
        by_storage: dict[Any, str] = {}
        for name, t in self._tensors:
            if t.layout != torch.strided:
                raise VcgaFormatError(self.path, f"tensor {name!r} has layout {t.layout}; VCGA converts dense tensors")
            if t.is_quantized:
                raise VcgaFormatError(self.path, f"tensor {name!r} is quantized ({t.dtype}); dequantize it first")
            dt = str(t.dtype).removeprefix("torch.")
            if dt not in dtypes.DTYPES:
                raise VcgaFormatError(self.path, f"tensor {name!r} has dtype {t.dtype}, which VCGA does not support "
                                      f"(supported: {', '.join(dtypes.EVERY)})")
            meta: dict[str, str] = {}
            st = t.untyped_storage()
            skey = (st.data_ptr(), st.nbytes()) if st.data_ptr() else ("empty", id(st))
            ekey = (skey, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
            if t.numel() and ekey in exact:
                meta[TIED_TO] = exact[ekey]
            elif t.numel() and skey in by_storage:
                meta[SHARES_STORAGE_WITH] = by_storage[skey]
            if t.numel():
                exact.setdefault(ekey, name)
                by_storage.setdefault(skey, name)
            out.append(TensorEntry(name, dt, tuple(int(d) for d in t.shape), None, meta))
        return out

    def index(self) -> Sequence[TensorEntry]:
        return list(self._index)

    def entries(self) -> Iterator[TensorEntry]:
        import torch

        # strict=False: after close() the tensors are released and nothing is yielded
        for (_, t), e in zip(self._tensors, self._index, strict=False):
            src = t.detach()
            if t.is_conj():
                src = src.resolve_conj()
            if src.is_neg():
                src = src.resolve_neg()
            flat = src.contiguous().reshape(-1)
            if flat.numel() == 0:
                data: Any = b""
            else:
                # A uint8 view of the same memory; numpy wraps it without copying.
                data = memoryview(flat.view(torch.uint8).numpy()).cast("B")
            yield TensorEntry(e.name, e.dtype, e.shape, data, e.metadata)
            if self._madvise is not None and flat.numel() and flat.data_ptr() == src.data_ptr():
                # The consumer is done with this tensor: drop its pages from our resident set. They
                # are clean pages of a private read-only file mapping, so a later access re-reads them.
                start = flat.data_ptr() & ~(_PAGE - 1)
                end = flat.data_ptr() + flat.numel() * flat.element_size()
                self._madvise(start, end - start, _MADV_DONTNEED)

    def close(self) -> None:
        self._tensors = []



def check_safe_torch(version: str) -> None:
    """Refuse to read ``.pt`` files with a torch older than :data:`SAFE_TORCH`.

    :raises VcgaFormatError: naming the version and what to do.
    """
    m = re.match(r"(\d+)\.(\d+)", str(version))
    if m is None or (int(m.group(1)), int(m.group(2))) >= SAFE_TORCH:
        return
    need = ".".join(map(str, SAFE_TORCH))
    raise VcgaFormatError("torch", f"torch {version} is too old to read .pt files safely: its weights_only=True "
                          f"loader can be made to run code from the file (CVE-2025-32434, fixed in torch {need}). "
                          f"Upgrade torch (pip install -U 'torch>={need}')")


def _zip_records(f: Any) -> int:
    """How many records a zip archive holds, from its end-of-central-directory record (zip64 too),
    before anything parses the directory itself."""
    size = os.fstat(f.fileno()).st_size
    tail_len = min(size, 22 + 0xFFFF)  # the record, and a comment of at most 64 KiB
    f.seek(size - tail_len)
    tail = f.read(tail_len)
    at = tail.rfind(b"PK\x05\x06")
    if at < 0 or at + 22 > len(tail):
        raise zipfile.BadZipFile("no end-of-central-directory record")
    (records,) = struct.unpack_from("<H", tail, at + 10)
    if records != 0xFFFF:
        return records
    if at < 20 or tail[at - 20:at - 16] != b"PK\x06\x07":
        raise zipfile.BadZipFile("no zip64 end-of-central-directory locator")
    (where,) = struct.unpack_from("<Q", tail, at - 20 + 8)
    f.seek(where)
    record = f.read(56)
    if len(record) != 56 or record[:4] != b"PK\x06\x06":
        raise zipfile.BadZipFile("bad zip64 end-of-central-directory record")
    return int(struct.unpack_from("<Q", record, 32)[0])


def _reduce_calls(data: bytes, stop_after: int) -> int:
    """How many REDUCE opcodes (calls) the pickle ``data`` makes, counting no further than ``stop_after + 1``."""
    import io

    n = 0
    try:
        for op, _, _ in pickletools.genops(io.BytesIO(data)):
            if op.name == "REDUCE":
                n += 1
                if n > stop_after:
                    break
    except (ValueError, EOFError):  # a damaged pickle: torch says what is wrong
        pass
    return n


# ---------------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------------


class _StorageStub:
    """Stands for one storage in the pickle: torch's persistent id is computed from it."""

    __slots__ = ("key", "dtype", "numel", "nbytes", "typed")

    def __init__(self, key: str, dtype: str, numel: int, nbytes: int, typed: bool) -> None:
        self.key, self.dtype, self.numel, self.nbytes, self.typed = key, dtype, numel, nbytes, typed


class _TensorStub:
    """Pickles exactly as a contiguous CPU tensor does (``Tensor._reduce_ex_internal``)."""

    __slots__ = ("storage", "shape", "dtype")

    def __init__(self, storage: _StorageStub, shape: tuple[int, ...], dtype: str) -> None:
        self.storage, self.shape, self.dtype = storage, shape, dtype

    def __reduce_ex__(self, proto: SupportsIndex) -> Any:
        import torch

        stride = []
        acc = 1
        for d in reversed(self.shape):
            stride.append(acc)
            acc *= max(d, 1)
        stride_t = tuple(reversed(stride))
        # torch pickles each tensor with a fresh storage wrapper; mirror that so memoisation matches.
        s = _StorageStub(self.storage.key, self.storage.dtype, self.storage.numel, self.storage.nbytes,
                         self.storage.typed)
        args: tuple[Any, ...] = (s, 0, self.shape, stride_t, False, OrderedDict())
        if not s.typed:
            return (torch._utils._rebuild_tensor_v3, args + (getattr(torch, self.dtype),))
        return (torch._utils._rebuild_tensor_v2, args)


def _pickle_state_dict(obj: Any) -> bytes:
    """Pickle ``obj`` (containing :class:`_TensorStub`) the way ``torch.serialization._save`` does."""
    import io

    import torch

    legacy = torch.storage._dtype_to_storage_type_map()

    class _Pickler(pickle.Pickler):
        def persistent_id(self, o: Any) -> Any:
            if isinstance(o, _StorageStub):
                if o.typed:
                    storage_type = getattr(torch, legacy[getattr(torch, o.dtype)])
                    return ("storage", storage_type, o.key, "cpu", o.numel)
                return ("storage", torch.UntypedStorage, o.key, "cpu", o.nbytes)
            return None

    buf = io.BytesIO()
    _Pickler(buf, protocol=2).dump(obj)  # torch.serialization.DEFAULT_PROTOCOL
    return buf.getvalue()


class TorchWriter(WriterContext):
    """Writes a torch state dict file atomically, one tensor at a time (memory: one tensor).

    :param path: the destination (appears only on :meth:`commit`).
    :param plan: optional: every tensor to be written, in order (a reader's index). With it the
        archive's records come in ``torch.save``'s order (pickle first); without, the pickle is last.
    """

    def __init__(self, path: str | os.PathLike[str], *, plan: Sequence[TensorEntry] | None = None,
                 publish_into: str | os.PathLike[str] | None = None) -> None:
        import torch

        self._init_outputs(publish_into)
        self.path = Path(path)
        self.notes: list[str] = []
        self._metadata: dict[str, str] = {}
        self._af = self._open_output(self.path, "w+b")
        try:
            align = getattr(torch.serialization, "_get_storage_alignment", lambda: 64)()
            self._zip = torch._C.PyTorchFileWriter(self._af.file, torch.serialization.get_crc32_options(), align)
        except BaseException:
            self.abort()
            raise
        self._align = align
        self._names: dict[str, tuple[str, tuple[int, ...], str]] = {}  # name -> (dtype, shape, storage key)
        self._key_state: dict[str, str | None] = {}  # storage key -> checksum of its bytes once written
        self._order: list[str] = []
        self._plan: list[TensorEntry] | None = list(plan) if plan is not None else None
        self._planned_keys: dict[str, str] = {}
        self._pickle_written = False
        self._dropped_tensor_meta = 0

    def set_metadata(self, metadata: Mapping[str, str]) -> None:
        self._check_open()
        self._metadata = dict(metadata)

    def _assign_key(self, name: str, dtype: str, shape: tuple[int, ...], meta: Mapping[str, str],
                    known: Mapping[str, tuple[str, tuple[int, ...], str]]) -> str:
        target = meta.get(TIED_TO)
        if target is not None and target in known:
            tdt, tshape, tkey = known[target]
            if (tdt, tuple(tshape)) == (dtype, tuple(shape)):
                return tkey
        return str(len({k for _, _, k in known.values()}))

    def _write_pickle(self, layout: Sequence[tuple[str, str, tuple[int, ...], str]]) -> None:
        stubs: dict[str, _StorageStub] = {}
        legacy_names = _legacy_dtypes()
        obj: Any
        raw_meta = self._metadata.get(STATE_DICT_METADATA_KEY)
        sd_meta = None
        if raw_meta is not None:
            try:
                sd_meta = json.loads(raw_meta)
            except ValueError:
                sd_meta = None
        obj = OrderedDict() if isinstance(sd_meta, dict) else {}
        for name, dt, shape, key in layout:
            numel = 1
            for d in shape:
                numel *= d
            if key not in stubs:
                stubs[key] = _StorageStub(key, dt, numel, numel * dtypes.get(dt).itemsize, dt in legacy_names)
            obj[name] = _TensorStub(stubs[key], tuple(shape), dt)
        if isinstance(obj, OrderedDict):
            obj._metadata = OrderedDict((k, v) for k, v in sd_meta.items())  # type: ignore[attr-defined,union-attr]
        data = _pickle_state_dict(obj)
        self._zip.write_record("data.pkl", data, len(data))
        self._zip.write_record(".format_version", b"1", 1)
        align = str(self._align).encode()
        self._zip.write_record(".storage_alignment", align, len(align))
        self._zip.write_record("byteorder", sys.byteorder.encode(), len(sys.byteorder))
        self._pickle_written = True

    def _start_planned(self) -> None:
        assert self._plan is not None
        known: dict[str, tuple[str, tuple[int, ...], str]] = {}
        layout = []
        for e in self._plan:
            _check_entry_dtype(e)
            if e.name in known:
                raise VcgaConversionError(f"tensor {e.name!r} appears twice", tensor=e.name, target=NAME)
            key = self._assign_key(e.name, e.dtype, tuple(e.shape), e.metadata, known)
            known[e.name] = (e.dtype, tuple(e.shape), key)
            layout.append((e.name, e.dtype, tuple(e.shape), key))
        self._planned_keys = {n: k for n, (_, _, k) in known.items()}
        self._planned = known
        self._write_pickle(layout)

    def write(self, entry: TensorEntry) -> None:
        """Write one tensor's bytes to its record now; keep only its name, dtype, shape and key."""
        self._check_open()
        _check_entry_dtype(entry)
        if entry.name in self._names:
            raise VcgaConversionError(f"tensor {entry.name!r} written twice", tensor=entry.name, target=NAME)
        buf = check_entry(entry, target=NAME)
        shape = tuple(entry.shape)
        if self._plan is not None:
            if not self._pickle_written:
                self._start_planned()
            planned = self._planned.get(entry.name)
            if planned is None or planned[:2] != (entry.dtype, shape):
                raise VcgaConversionError(f"tensor {entry.name!r} ({entry.dtype} {list(shape)}) does not match the "
                                          "writer's plan", tensor=entry.name, dtype=entry.dtype, target=NAME)
            key = planned[2]
        else:
            key = self._assign_key(entry.name, entry.dtype, shape, entry.metadata, self._names)
        other_meta = [k for k in entry.metadata if k not in (TIED_TO, SHARES_STORAGE_WITH)]
        if other_meta:
            self._dropped_tensor_meta += 1
        digest = checksum(buf)
        if key in self._key_state:
            if self._key_state[key] != digest:
                raise VcgaConversionError(
                    f"tensor {entry.name!r} is marked {TIED_TO} another tensor, but their bytes differ; "
                    "drop the tie metadata or fix the source", tensor=entry.name, dtype=entry.dtype, target=NAME)
        else:
            if buf.nbytes:
                import warnings

                import torch

                with warnings.catch_warnings():  # a read-only source buffer: torch warns, we never write to it
                    warnings.simplefilter("ignore", UserWarning)
                    storage = torch.frombuffer(buf, dtype=torch.uint8).untyped_storage()  # no copy
                # an UntypedStorage, which write_record takes; torch's type stub omits that overload
                self._zip.write_record(f"data/{key}", storage, buf.nbytes)  # type: ignore[arg-type]
            else:
                self._zip.write_record(f"data/{key}", b"", 0)
            self._key_state[key] = digest
        self._names[entry.name] = (entry.dtype, shape, key)
        self._order.append(entry.name)

    def _finish(self) -> None:
        if self._plan is not None:
            if not self._pickle_written:
                self._start_planned()
            missing = [e.name for e in self._plan if e.name not in self._names]
            if missing:
                raise VcgaConversionError(f"{len(missing)} planned tensors were never written, e.g. "
                                          f"{missing[0]!r}", tensor=missing[0], target=NAME)
        else:
            layout = [(n, *self._names[n]) for n in self._order]
            self._write_pickle(layout)
        self._zip.write_end_of_file()
        del self._zip
        dropped = [k for k in self._metadata if k != STATE_DICT_METADATA_KEY]
        if dropped:
            self.notes.append(f"torch .pt has no place for file metadata; dropped keys: {', '.join(dropped)}")
        if self._dropped_tensor_meta:
            self.notes.append(f"torch .pt has no place for per-tensor metadata; dropped it for "
                              f"{self._dropped_tensor_meta} tensors")

    def _discard(self) -> None:
        # Finish the zip writer while its file is still open: its destructor would otherwise write
        # the end of the archive into a closed file, which aborts the process. Then drop the output.
        zip_writer = getattr(self, "_zip", None)
        if zip_writer is not None:
            try:
                zip_writer.write_end_of_file()
            except Exception:  # noqa: BLE001 - discarding: the output is dropped whatever the writer says
                pass
            del self._zip, zip_writer


def _legacy_dtypes() -> frozenset[str]:
    """Canonical dtypes torch pickles with a legacy typed storage (``FloatStorage``); the rest go
    through ``_rebuild_tensor_v3`` with an untyped storage."""
    import torch

    return frozenset(str(d).removeprefix("torch.") for d in torch.storage._dtype_to_storage_type_map())


def _check_entry_dtype(entry: TensorEntry) -> None:
    if entry.dtype not in dtypes.DTYPES:
        raise VcgaConversionError(f"tensor {entry.name!r} has unknown dtype {entry.dtype!r}", tensor=entry.name,
                                  dtype=entry.dtype, target=NAME)


SPEC = FormatSpec(
    name=NAME,
    extensions=(".pt", ".pth", ".bin"),
    dtypes=frozenset(dtypes.EVERY),
    sniff=sniff,
    open_reader=TorchReader,
    open_writer=TorchWriter,
    description="PyTorch state dict (torch.save zip); read with weights_only=True only, tied tensors kept",
)


@hookimpl
def vcga_formats() -> list[FormatSpec]:
    return [SPEC]
