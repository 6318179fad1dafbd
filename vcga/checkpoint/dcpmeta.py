"""Reading torch.distributed.checkpoint (DCP) metadata without running code from the file.

DCP stores a checkpoint's plan -- which tensors exist, their dtypes, shapes and chunks, and where
each chunk's bytes lie -- as a Python pickle (``.metadata``). torch reads it with a plain
``pickle.load``, which runs whatever the pickle names: a ``.metadata`` file with a ``__reduce__``
calling ``os.system`` is code execution. VCGA never does that. :func:`load_metadata` unpickles
with an allow-list of exactly the classes DCP's metadata consists of; anything else -- a function,
another class, a module DCP does not use -- is refused before it is called, with
:class:`~vcga.errors.VcgaFormatError` naming what the pickle asked for.

Two ways to materialise what is allowed:

- ``classes="standin"`` (the default; torch is never imported): small local classes with the same
  attribute names (``Metadata.state_dict_metadata``, ``TensorStorageMetadata.chunks``, ...), dtypes as
  their canonical names, ``torch.Size`` as a tuple. ``vcga convert``/``vcga inspect`` use these.
- ``classes="torch"``: the real DCP classes, for :mod:`vcga.checkpoint` handing the metadata to
  DCP's planner. Only the allow-listed names are imported.

The same module holds :class:`VbinItem`, where a VCGA checkpoint's metadata says a chunk lives
(file, tensor name, length, checksum), and the little JSON manifest beside ``.metadata``.
This module imports neither torch nor numpy.
"""

from __future__ import annotations

import contextvars
import importlib
import io
import json
import pickle
from dataclasses import dataclass
from typing import Any

import xxhash

from vcga import formatkit
from vcga.errors import VcgaChecksumError, VcgaFormatError

__all__ = [
    "METADATA_FILE",
    "MANIFEST_FILE",
    "MANIFEST_FORMAT",
    "VbinItem",
    "load_metadata",
    "dump_manifest",
    "load_manifest",
    "TORCH_DTYPES",
    "metadata_checksum",
]

METADATA_FILE = ".metadata"
MANIFEST_FILE = "vcga-checkpoint.json"
MANIFEST_FORMAT = "vcga-dcp-checkpoint"

_META = "torch.distributed.checkpoint.metadata"
_FS = "torch.distributed.checkpoint.filesystem"

#: Every dtype torch can name in a pickle (``torch.<name>``), whether or not VCGA holds it: an
#: unknown one is an error at the tensor that uses it, naming the dtype, not at unpickling.
TORCH_DTYPES = frozenset({
    "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
    "float16", "bfloat16", "float32", "float64", "complex32", "complex64", "complex128",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
    "float4_e2m1fn_x2", "qint8", "quint8", "qint32", "quint4x2", "quint2x4",
    "bits1x8", "bits2x4", "bits4x2", "bits8", "bits16",
})
_LAYOUTS = frozenset({"torch.strided", "torch.sparse_coo", "torch.sparse_csr", "torch.sparse_csc",
                      "torch.sparse_bsr", "torch.sparse_bsc", "torch._mkldnn", "torch.jagged"})


@dataclass(frozen=True)
class VbinItem:
    """Where a VCGA checkpoint keeps one DCP write item: tensor ``name`` of the vendor-bin file
    ``relative_path`` (beside ``.metadata``), ``length`` bytes whose XXH3-64 is ``checksum``.

    The checksum is the one the vendor-bin file's index stores for that tensor, so ``.metadata``
    pins the exact bytes of every file: a shard swapped in from another checkpoint is refused."""

    relative_path: str
    name: str
    length: int
    checksum: str


# --------------------------------------------------------------------------------------------------
# Stand-ins (torch-free)
# --------------------------------------------------------------------------------------------------

#: Stand-in objects one tensor's entries take at most (metadata, properties, sizes, a chunk with its
#: offsets and sizes, an index, a location), times :data:`vcga.formatkit.MAX_TENSORS`: the budget
#: of one :func:`load_metadata`, which stops a pickle declaring millions of entries before it has
#: built them.
OBJECTS_PER_TENSOR = 12
_budget: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar("dcpmeta_budget", default=None)


class _TooMany(pickle.UnpicklingError):
    pass


def _spend() -> None:
    left = _budget.get()
    if left is not None:
        left[0] -= 1
        if left[0] < 0:
            raise _TooMany()


class _Obj:
    """A plain object rebuilt from a pickle's state dict (what DCP's dataclasses pickle as)."""

    _fields: tuple[str, ...] = ()

    def __setstate__(self, state: Any) -> None:
        _spend()
        if isinstance(state, tuple) and len(state) == 2 and (state[0] is None or isinstance(state[0], dict)):
            state = {**(state[0] or {}), **(state[1] or {})}  # (dict, slots) form
        if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
            raise pickle.UnpicklingError(f"{type(self).__name__}: unexpected state {type(state).__name__}")
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.__dict__.items())})"


class Metadata(_Obj):
    """DCP's ``Metadata``: ``state_dict_metadata`` (fqn -> tensor or bytes metadata),
    ``storage_data`` (:class:`MetadataIndex` -> where the bytes are), ``planner_data``, ``version``."""


class TensorStorageMetadata(_Obj):
    """``properties`` (:class:`TensorProperties`), ``size`` (a tuple), ``chunks``."""


class BytesStorageMetadata(_Obj):
    """A non-tensor value (saved with torch.save)."""


class ChunkStorageMetadata(_Obj):
    """One chunk of a tensor: ``offsets`` and ``sizes`` (tuples)."""


class StorageMeta(_Obj):
    pass


class MetadataIndex(_Obj):
    """``fqn``, ``offset`` (a tuple or None), ``index`` (a hint). Hashable like DCP's (the index is
    not part of equality there either)."""

    def _key(self) -> tuple[Any, Any]:
        return (self.__dict__.get("fqn"), self.__dict__.get("offset"))

    def __hash__(self) -> int:
        return hash(self._key())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MetadataIndex) and self._key() == other._key()


class StorageInfo(_Obj):
    """torch's ``FileSystemWriter`` item location: ``relative_path``, ``offset``, ``length``
    (and ``transform_descriptors`` when stream transforms such as compression were used)."""


class TensorProperties:
    """``dtype`` (canonical name), ``layout`` (e.g. "torch.strided"), ``requires_grad``,
    ``memory_format`` (0 contiguous, 1 channels last, 2 preserve), ``pin_memory``."""

    def __setstate__(self, state: Any) -> None:
        _spend()
        if isinstance(state, dict):  # an old pickle without __getstate__
            self.__dict__.update(state)
            return
        if not isinstance(state, tuple) or len(state) != 5:
            raise pickle.UnpicklingError("TensorProperties: expected a 5-tuple state")
        self.dtype, self.layout, self.requires_grad, self.memory_format, self.pin_memory = state

    def __repr__(self) -> str:
        return f"TensorProperties(dtype={getattr(self, 'dtype', None)!r})"


class _Dtype(str):
    """A torch dtype by name (``torch.float32`` -> ``"float32"``)."""


class _MemFormat(int):
    """DCP's ``_MEM_FORMAT_ENCODING`` enum value."""


def _get_layout(name: Any) -> str:
    if not isinstance(name, str) or name not in _LAYOUTS:
        raise pickle.UnpicklingError(f"unknown tensor layout {name!r}")
    return name


def _size(*args: Any) -> tuple[int, ...]:
    _spend()
    dims = tuple(args[0]) if args else ()
    if not all(type(d) is int for d in dims):
        raise pickle.UnpicklingError(f"torch.Size of non-integers {dims!r}")
    return dims


def _mem_format(value: Any) -> _MemFormat:
    if value not in (0, 1, 2):
        raise pickle.UnpicklingError(f"unknown memory format encoding {value!r}")
    return _MemFormat(value)


def _path(*parts: Any) -> str:
    if not all(isinstance(p, str) for p in parts):
        raise pickle.UnpicklingError("a path of non-strings")
    return "/".join(parts).replace("//", "/")


_STANDINS: dict[tuple[str, str], Any] = {
    (_META, "Metadata"): Metadata,
    (_META, "TensorStorageMetadata"): TensorStorageMetadata,
    (_META, "BytesStorageMetadata"): BytesStorageMetadata,
    (_META, "ChunkStorageMetadata"): ChunkStorageMetadata,
    (_META, "TensorProperties"): TensorProperties,
    (_META, "MetadataIndex"): MetadataIndex,
    (_META, "StorageMeta"): StorageMeta,
    (_META, "_MEM_FORMAT_ENCODING"): _mem_format,
    (_FS, "_StorageInfo"): StorageInfo,
    ("torch", "Size"): _size,
    ("torch.serialization", "_get_layout"): _get_layout,
    ("pathlib", "PosixPath"): _path,
    ("pathlib", "PurePosixPath"): _path,
    ("pathlib", "WindowsPath"): _path,
    ("pathlib", "PureWindowsPath"): _path,
    ("collections", "OrderedDict"): dict,
    (__name__, "VbinItem"): VbinItem,
}


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, classes: str, where: Any) -> None:
        super().__init__(io.BytesIO(data))
        self.classes = classes
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        key = (module, name)
        if module == "torch" and name in TORCH_DTYPES:
            if self.classes == "torch":
                return _import(module, name)
            return _Dtype(name)
        if key not in _STANDINS:
            raise pickle.UnpicklingError(f"refused: the pickle needs {module}.{name}, which is not one of DCP's "
                                         "metadata classes")
        if self.classes == "torch" and module != "collections" and not module.startswith("pathlib"):
            return _import(module, name)
        return _STANDINS[key]

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("refused: DCP metadata holds no persistent references")


def _import(module: str, name: str) -> Any:
    return getattr(importlib.import_module(module), name)


def load_metadata(data: bytes, *, classes: str = "standin", where: Any = METADATA_FILE) -> Any:
    """Unpickle DCP metadata allowing only DCP's metadata classes.

    :param classes: "standin" (torch-free stand-ins) or "torch" (DCP's own classes).
    :raises VcgaFormatError: the pickle is damaged, or names anything outside the allow-list
        (nothing it names outside the list is ever imported or called)."""
    if classes not in ("standin", "torch"):
        raise ValueError(f"classes must be 'standin' or 'torch', got {classes!r}")
    limit = OBJECTS_PER_TENSOR * formatkit.MAX_TENSORS
    token = _budget.set([limit] if classes == "standin" else None)
    try:
        obj = _Unpickler(bytes(data), classes, where).load()
    except _TooMany:
        raise VcgaFormatError(where, f"DCP metadata builds more than {limit} objects, more than "
                              f"{formatkit.MAX_TENSORS} tensors take (vcga.formatkit.MAX_TENSORS)") from None
    except pickle.UnpicklingError as e:
        msg = str(e)
        if msg.startswith("refused"):
            raise VcgaFormatError(where, f"{msg}. VCGA never runs code from a checkpoint; re-save it with "
                                  "torch.distributed.checkpoint from trusted code") from None
        raise VcgaFormatError(where, f"DCP metadata is damaged: {msg}") from None
    except VcgaFormatError:
        raise
    except (EOFError, ValueError, TypeError, AttributeError, KeyError, IndexError, RecursionError,
            MemoryError, OverflowError, UnicodeDecodeError) as e:
        raise VcgaFormatError(where, f"DCP metadata is damaged ({type(e).__name__}: {str(e)[:200]})") from None
    finally:
        _budget.reset(token)
    want = _STANDINS[(_META, "Metadata")] if classes == "standin" else _import(_META, "Metadata")
    if type(obj) is not want:
        raise VcgaFormatError(where, f"holds a {type(obj).__name__}, not DCP Metadata")
    for key in ("state_dict_metadata", "storage_data"):
        if not isinstance(getattr(obj, key, None), dict):
            raise VcgaFormatError(where, f"DCP metadata lacks its {key} mapping")
    return obj


# --------------------------------------------------------------------------------------------------
# The manifest of a VCGA checkpoint directory
# --------------------------------------------------------------------------------------------------


def _checksum(data: bytes) -> str:
    return f"xxh3_64:{xxhash.xxh3_64_intdigest(data):016x}"


def _canonical(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False).encode("ascii")


def dump_manifest(doc: dict[str, Any]) -> bytes:
    """The manifest's bytes: canonical JSON of ``doc`` plus ``checksum`` (XXH3-64 of the JSON
    without it), so a damaged manifest is detected."""
    body = {k: v for k, v in doc.items() if k != "checksum"}
    return _canonical({**body, "checksum": _checksum(_canonical(body))}) + b"\n"


def load_manifest(data: bytes, where: Any = MANIFEST_FILE) -> dict[str, Any]:
    """Parse and check a manifest written by :func:`dump_manifest`.

    :raises VcgaFormatError: not JSON, wrong format name, or the checksum does not match."""
    try:
        doc = json.loads(data.decode("ascii"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise VcgaFormatError(where, f"checkpoint manifest is not valid JSON: {str(e)[:200]}") from None
    if not isinstance(doc, dict) or doc.get("format") != MANIFEST_FORMAT:
        raise VcgaFormatError(where, "is not a VCGA checkpoint manifest", expected=f'"format": "{MANIFEST_FORMAT}"')
    stored = doc.pop("checksum", None)
    got = _checksum(_canonical(doc))
    if stored != got:
        raise VcgaChecksumError(where, f"checkpoint manifest checksum mismatch (computed {got}); the file was "
                                "damaged after it was written", expected=str(stored))
    files = doc.get("files")
    meta = doc.get("metadata")
    if (not isinstance(files, list) or not all(isinstance(f, dict) and isinstance(f.get("file"), str)
                                               and type(f.get("size")) is int for f in files)
            or not isinstance(meta, dict) or not isinstance(meta.get("checksum"), str)
            or type(doc.get("step")) is not int):
        raise VcgaFormatError(where, "checkpoint manifest lacks its files, metadata checksum or step")
    for f in files:
        name = f["file"]
        if not formatkit.is_plain_name(name):
            raise VcgaFormatError(where, f"manifest names {name!r}, which is not a plain file name in its directory")
    return doc


def metadata_checksum(data: bytes) -> str:
    """The checksum a manifest records for the ``.metadata`` bytes."""
    return _checksum(bytes(data))
