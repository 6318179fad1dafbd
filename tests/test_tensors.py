"""Tensor entries: bit-exact and zero-copy between torch, numpy and raw bytes."""

from __future__ import annotations

import gc
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from tensor_strategies import cases, torch_bytes

from vcga import dtypes, tensors
from vcga.contract import TensorEntry
from vcga.errors import VcgaChecksumError, VcgaConversionError

HYPO = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def test_importing_tensors_imports_neither_torch_nor_numpy():
    code = "import sys, vcga.tensors; print('torch' in sys.modules, 'numpy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["False", "False"]


@HYPO
@given(cases())
def test_numpy_entries_hold_exactly_the_c_order_bytes(case):
    e = tensors.from_numpy("x", case.array)
    assert (e.dtype, e.shape) == (case.dtype, case.shape)
    assert bytes(tensors.byte_view(e.data)) == case.expected
    back = tensors.to_numpy(e)
    assert back.dtype == dtypes.to_numpy(case.dtype) and back.shape == case.shape
    assert back.tobytes() == case.expected
    t = tensors.to_torch(e)
    assert t.dtype == dtypes.to_torch(case.dtype) and tuple(t.shape) == case.shape
    assert torch_bytes(t) == case.expected


@HYPO
@given(cases())
def test_torch_entries_hold_exactly_the_c_order_bytes(case):
    t = case.tensor()
    e = tensors.from_torch("x", t, with_checksum=True)
    assert (e.dtype, e.shape) == (case.dtype, case.shape)
    assert bytes(tensors.byte_view(e.data)) == case.expected
    assert e.checksum == f"xxh3_64:{xxhash.xxh3_64_intdigest(case.expected):016x}"
    back = tensors.to_torch(e)
    assert tensors.bits_equal(back, t)
    assert tensors.to_numpy(e).tobytes() == case.expected


def test_contiguous_sources_are_not_copied():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    e = tensors.from_numpy("a", a)
    assert np.shares_memory(tensors.to_numpy(e), a)
    t = torch.arange(12, dtype=torch.bfloat16).reshape(3, 4)
    e = tensors.from_torch("t", t)
    back = tensors.to_torch(e)  # data is a writable view of t's storage: shared, not copied
    assert back.data_ptr() == t.data_ptr()
    back[0, 0] = 42
    assert t[0, 0].item() == 42


def test_read_only_buffers_are_copied_for_torch_and_viewed_for_numpy():
    raw = np.arange(4, dtype=np.float32).tobytes()
    e = TensorEntry("x", "float32", (4,), raw)
    arr = tensors.to_numpy(e)
    assert not arr.flags.writeable  # a view of immutable bytes stays read-only
    t = tensors.to_torch(e)
    t += 1  # a copy: the bytes object is untouched
    assert raw == np.arange(4, dtype=np.float32).tobytes()
    shared = tensors.to_torch(TensorEntry("x", "float32", (4,), bytearray(raw)))
    assert tensors.to_torch(TensorEntry("x", "float32", (4,), raw), copy=True).data_ptr() != shared.data_ptr()


def test_misaligned_buffers_are_copied_for_torch():
    buf = bytearray(17)
    mv = memoryview(buf)[1:]
    t = tensors.to_torch(TensorEntry("x", "float64", (2,), mv))
    assert t.data_ptr() % 8 == 0


def test_lazy_conjugate_and_negative_views_are_materialised():
    z = torch.tensor([1 + 2j, -3 - 0j], dtype=torch.complex64)
    e = tensors.from_torch("z", z.conj())
    assert tensors.to_numpy(e).tolist() == [1 - 2j, -3 + 0j]
    n = torch._neg_view(torch.tensor([1.0, -0.0]))
    assert n.is_neg()
    e = tensors.from_torch("n", n)
    assert tensors.to_numpy(e).view(np.uint32).tolist() == [0xBF800000, 0x00000000]


@pytest.mark.parametrize("dtype,bits", [(torch.complex64, torch.int32), (torch.complex128, torch.int64)])
def test_strided_complex_tensors_are_packed_bit_exact(dtype, bits):
    """A non-contiguous complex tensor (a transpose) is packed in C order through same-width
    integers: a NaN payload in a real or imaginary part keeps its bits."""
    z = torch.complex(torch.arange(12.0), -torch.arange(12.0)).to(dtype).reshape(3, 4)
    parts = torch.view_as_real(z).view(bits)
    parts[1, 2, 0] = 0x7FA00001 if bits == torch.int32 else 0x7FF4000000000001  # a signalling NaN
    parts[2, 3, 1] = -1  # a quiet NaN with every payload bit set
    t = z.t()
    assert not t.is_contiguous()
    got = tensors.to_numpy(tensors.from_torch("z", t))
    assert got.shape == (4, 3) and got.dtype == np.dtype(str(dtype).split(".")[1])
    assert got.tobytes() == np.ascontiguousarray(z.numpy().T).tobytes()  # numpy copies bytes


def test_big_endian_numpy_arrays_become_little_endian():
    a = np.array([1.5, -0.0, np.nan], dtype=">f8")
    e = tensors.from_numpy("be", a)
    assert bytes(e.data) == np.array([1.5, -0.0, np.nan], dtype="<f8").tobytes()


def test_requires_grad_and_parameters_are_fine():
    p = torch.nn.Parameter(torch.ones(3))
    e = tensors.from_torch("p", p)
    assert tensors.to_numpy(e).tolist() == [1, 1, 1]


def test_unsupported_tensors_raise_typed_errors():
    with pytest.raises(VcgaConversionError, match="to_dense"):
        tensors.from_torch("s", torch.eye(3).to_sparse())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized tensors are deprecated in torch 2.13, still made
        q = torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8)
    with pytest.raises(VcgaConversionError, match="int_repr"):
        tensors.from_torch("q", q)
    with pytest.raises(VcgaConversionError, match="meta"):
        tensors.from_torch("m", torch.empty(2, device="meta"))
    with pytest.raises(dtypes.UnknownDTypeError):
        tensors.from_torch("f", torch.zeros(2, dtype=torch.uint4))  # torch's sub-byte ints: no format holds them
    with pytest.raises(dtypes.UnknownDTypeError):
        tensors.from_numpy("o", np.array(["a"], dtype=object))
    with pytest.raises(VcgaConversionError, match="expected a torch.Tensor"):
        tensors.from_any("l", [1, 2])
    with pytest.raises(VcgaConversionError, match="metadata"):
        tensors.from_numpy("m", np.zeros(1), {"k": 1})


def test_device_tensors_go_through_the_plugin_hook_fake_device(monkeypatch):
    """A non-CPU tensor is handed to the plugin manager's tensor_to_host; with no plugin for its
    device, a typed error. Fake: no accelerator here, so a meta tensor claims to be on cuda:0."""
    from vcga.errors import VcgaPluginError
    from vcga.plugin_manager import get_plugin_manager

    seen = []
    calls = get_plugin_manager()

    def to_host(t):
        seen.append(t)
        return torch.arange(3, dtype=torch.int32)

    monkeypatch.setattr(calls, "tensor_to_host", to_host)
    t = torch.empty(3, dtype=torch.int32, device="meta")
    monkeypatch.setattr(torch.Tensor, "device", property(lambda self: torch.device("cuda", 0)), raising=False)
    try:
        e = tensors.from_torch("d", t)
    finally:
        monkeypatch.undo()
    assert seen and tensors.to_numpy(e).tolist() == [0, 1, 2]
    from vcga.plugin_manager import VcgaPluginManager

    pm = VcgaPluginManager(builtins=("vcga.plugins.gloo",), env={})

    class NotCpu:
        class device:
            type = "npu"

    with pytest.raises(VcgaPluginError, match="no loaded plugin can bring a 'npu' tensor"):
        pm.tensor_to_host(NotCpu())


def test_check_entry_and_checksums():
    e = TensorEntry("x", "float32", (2,), b"\0" * 7)
    with pytest.raises(VcgaConversionError, match="7 data bytes") as info:
        tensors.check_entry(e, target="vendor-bin")
    assert (info.value.tensor, info.value.dtype, info.value.target) == ("x", "float32", "vendor-bin")
    with pytest.raises(VcgaConversionError, match="unknown dtype"):
        tensors.check_entry(TensorEntry("x", "float128", (1,), b"\0" * 16))
    with pytest.raises(VcgaConversionError, match="no data"):
        tensors.check_entry(TensorEntry("x", "float32", (1,), None))
    with pytest.raises(VcgaConversionError, match="shape \\[2\\] is not a tuple"):
        tensors.check_entry(TensorEntry("x", "float32", [2], b"\0" * 8))
    with pytest.raises(VcgaConversionError, match="tensor 'x': a non-contiguous"):
        tensors.check_entry(TensorEntry("x", "uint8", (2,), memoryview(b"abcd")[::2]))
    good = TensorEntry("x", "uint8", (3,), b"abc", checksum=tensors.checksum(b"abc"))
    tensors.verify_checksum(good)
    with pytest.raises(VcgaChecksumError, match="checksum mismatch"):
        tensors.verify_checksum(TensorEntry("x", "uint8", (3,), b"abd", checksum=good.checksum))
    assert tensors.parse_checksum(good.checksum) == xxhash.xxh3_64_intdigest(b"abc")
    for bad in ("xxh3_64:ABC", "sha256:" + "0" * 16, "xxh3_64:" + "G" * 16, None, "xxh3_64:" + "A" * 16):
        with pytest.raises(ValueError):
            tensors.parse_checksum(bad)


def test_byte_view_of_empty_and_zero_d():
    assert tensors.byte_view(np.zeros((0, 3))).nbytes == 0
    assert bytes(tensors.byte_view(np.float32(1.0))) == np.float32(1.0).tobytes()
    with pytest.raises(VcgaConversionError, match="non-contiguous"):
        tensors.byte_view(memoryview(np.zeros((4, 4)))[::2])


def test_torch_tensors_keep_their_buffer_exported():
    """torch.frombuffer gives the buffer export back at once; ours hold a private view so the
    memory (a file mapping, a bytearray) cannot be freed or moved under the tensor."""
    buf = bytearray(np.arange(1024, dtype=np.float32).tobytes())
    mv = memoryview(buf)
    t = tensors.to_torch(TensorEntry("x", "float32", (1024,), mv))
    mv.release()  # the caller's view is gone ...
    with pytest.raises(BufferError):
        buf.extend(b"0")  # ... but the tensor's export still pins the memory
    assert t[1023].item() == 1023
    raw = tensors.raw_bytes(memoryview(buf), "pt")
    assert tensors.typed_view(raw, 4, 8, "float32", (2,)).tolist() == [1.0, 2.0]
    del t, raw
    gc.collect()
    buf.extend(b"0")  # nothing exported any more
