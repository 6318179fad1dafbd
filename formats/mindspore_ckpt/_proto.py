"""mindspore-ckpt's wire: the Checkpoint message classes, the Value prefix, varints and limits.

What the reader (:mod:`.reader`), the writer (:mod:`.writer`) and ``sniff`` share; the format is
summarised in :mod:`vcga.formats.mindspore_ckpt`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vcga import dtypes as _dtypes

#: mindspore/ccsrc/utils/checkpoint.proto (MindSpore 2.10), plus VCGA's field 1001, as the protobuf
#: text format of a FileDescriptorProto. Field numbers, labels and types are MindSpore's.
CHECKPOINT_PROTO = """
name: "vcga/mindspore_checkpoint.proto"
message_type {
  name: "Checkpoint"
  field { name: "value" number: 1 label: LABEL_REPEATED type: TYPE_MESSAGE type_name: ".Checkpoint.Value" }
  # VCGA: tensors MindSpore cannot load faithfully (shape (0,)); MindSpore's parser skips field 1001.
  field { name: "vcga_extra" number: 1001 label: LABEL_REPEATED type: TYPE_MESSAGE type_name: ".Checkpoint.Value" }
  nested_type {
    name: "Value"
    field { name: "tag" number: 1 label: LABEL_REQUIRED type: TYPE_STRING }
    field { name: "tensor" number: 2 label: LABEL_OPTIONAL type: TYPE_MESSAGE type_name: ".TensorProto" oneof_index: 0 }
    field { name: "maptensor" number: 3 label: LABEL_OPTIONAL type: TYPE_MESSAGE type_name: ".MapTensorProto"
            oneof_index: 0 }
    oneof_decl { name: "value" }
  }
}
message_type {
  name: "TensorProto"
  field { name: "dims" number: 1 label: LABEL_REPEATED type: TYPE_INT64 }
  field { name: "tensor_type" number: 2 label: LABEL_REQUIRED type: TYPE_STRING }
  field { name: "tensor_content" number: 3 label: LABEL_REQUIRED type: TYPE_BYTES }
}
message_type {
  name: "MapTensorProto"
  field { name: "tensor" number: 1 label: LABEL_REPEATED type: TYPE_MESSAGE type_name: ".TensorProto" }
}
"""

#: Dtypes MindSpore 2.10's load_checkpoint maps (serialization.py tensor_to_ms_type), so a VCGA-written
#: .ckpt holding them loads in MindSpore. (It also *writes* Complex64/128, which its loader rejects:
#: VCGA reads those but does not write them.)
CKPT_DTYPES = frozenset({"bool", "uint8", "int8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
                         "float16", "bfloat16", "float32", "float64"})

#: MindSpore splits a tensor into Values of at most 512 MiB (serialization.py SLICE_SIZE, in KiB).
DEFAULT_SLICE_SIZE = 512 * 1024 * 1024
#: Start writing to disk in the background after this many bytes (vcga.atomic.AtomicFile.writeback).
WRITEBACK_BYTES = 64 << 20
CRC_MARK = b"crc_num"
CRC_TRAILER = len(CRC_MARK) + 10

_FIELD_VALUE = 1
_FIELD_EXTRA = 1001
_MAX_NAME = 1 << 20  # longest tag or tensor_type VCGA reads: a name is not a megabyte
_MAX_DIMS = 64  # more dims than any framework allows
_MAX_PREFIX = 1 << 16  # a Value's bytes before its content: tag, dims, type and a few lengths
_MAX_MESSAGE = (1 << 31) - 1  # protobuf cannot parse a message of 2 GiB or more

_classes: tuple[Any, Any] | None = None


def message_classes() -> tuple[Any, Any]:
    """``(Checkpoint, Value)`` message classes, built once from :data:`CHECKPOINT_PROTO`."""
    global _classes
    if _classes is None:
        from google.protobuf import descriptor_pb2, descriptor_pool, message_factory, text_format

        fdp = text_format.Parse(CHECKPOINT_PROTO, descriptor_pb2.FileDescriptorProto())
        pool = descriptor_pool.DescriptorPool()
        pool.Add(fdp)
        checkpoint = message_factory.GetMessageClass(pool.FindMessageTypeByName("Checkpoint"))
        value = message_factory.GetMessageClass(pool.FindMessageTypeByName("Checkpoint.Value"))
        _classes = (checkpoint, value)
    return _classes


def _varint_bytes(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def value_prefix(field_number: int, tag: str, dims: Sequence[int], tensor_type: str, content_len: int) -> bytes:
    """The bytes that, followed by ``content_len`` bytes of tensor content, are exactly
    ``Checkpoint(<field>=[Value(tag, TensorProto(dims, tensor_type, content))]).SerializeToString()``.

    protobuf serializes the tag, dims and tensor_type; only the keys and lengths of the three fields
    that enclose the content are added here, by the wire format's rules. This lets the writer hand a
    tensor's bytes to the file as they are -- protobuf's Python API can only serialize a whole message
    into a new bytes object, copying every tensor three times. The tests check that the result equals
    SerializeToString byte for byte.
    """
    _, value_cls = message_classes()
    head = value_cls()
    head.tag = tag
    head.tensor.dims.extend(dims)
    head.tensor.tensor_type = tensor_type
    tensor_head = head.tensor.SerializePartialToString()  # dims, tensor_type (content not set yet)
    head.ClearField("tensor")
    tag_part = head.SerializePartialToString()  # field 1
    tensor_len = len(tensor_head) + 1 + len(_varint_bytes(content_len)) + content_len
    value_len = len(tag_part) + 1 + len(_varint_bytes(tensor_len)) + tensor_len
    return b"".join((_varint_bytes(field_number << 3 | 2), _varint_bytes(value_len), tag_part,
                     b"\x12", _varint_bytes(tensor_len), tensor_head, b"\x1a", _varint_bytes(content_len)))


def _dtype_of(tensor_type: str) -> str | None:
    for d in _dtypes.DTYPES.values():
        if d.mindspore == tensor_type:
            return d.name
    return None


# ---------------------------------------------------------------------------------------------------
# Wire-level walking (framing only; messages are parsed by protobuf)
# ---------------------------------------------------------------------------------------------------


def _varint(buf: bytes | memoryview, pos: int) -> tuple[int, int] | None:
    """Decode a base-128 varint at ``pos``; None when ``buf`` ends first or it exceeds 10 bytes."""
    result = shift = 0
    for i in range(pos, min(pos + 10, len(buf))):
        b = buf[i]
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, i + 1
        shift += 7
    return None
