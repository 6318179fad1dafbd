"""A full disk during `vcga convert` is a typed error naming the destination, the space needed and free.

A real full filesystem: a small tmpfs mounted by the test (needs root and mount(2); skipped
otherwise), unmounted in ``finally``.
"""

from __future__ import annotations

import errno
import os
import subprocess
import uuid

import numpy as np
import pytest
from ckpt_helpers import write_all
from conftest import run_vcga

from vcga.contract import TensorEntry
from vcga.convert import convert, format_by_name
from vcga.errors import VcgaDiskFullError

TENSOR_BYTES = 256 << 10


@pytest.fixture
def small_disk(tmp_path):
    """A 192 KiB tmpfs at tmp_path/disk, 64 KiB of it taken by a file that is not ours."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=192k", f"vcga-test-{uuid.uuid4().hex[:8]}", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        (mnt / "someone-elses.bin").write_bytes(b"\0" * (64 << 10))
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    d = tmp_path_factory.mktemp("src")
    a = np.arange(TENSOR_BYTES // 4, dtype=np.float32)
    e = [TensorEntry("w", "float32", a.shape, memoryview(a.tobytes()), {})]
    write_all(format_by_name("safetensors"), d / "src.safetensors", e)
    write_all(format_by_name("hdf5"), d / "src.h5", e)
    return d


@pytest.mark.parametrize("target", ["out.vbin", "out.h5", "out.ckpt", "out.mindrecord", "out.pt", "out.safetensors"])
def test_disk_full_names_destination_needed_and_free(small_disk, sources, target):
    src = sources / ("src.h5" if target.endswith(".safetensors") else "src.safetensors")
    st = os.statvfs(small_disk)
    free = st.f_bavail * st.f_frsize
    with pytest.raises(VcgaDiskFullError) as info:
        convert(src, small_disk / target)
    e = info.value
    assert e.errno == errno.ENOSPC and isinstance(e, OSError)
    assert (e.destination, e.needed, e.free, e.mount) == (str(small_disk / target), TENSOR_BYTES, free,
                                                         str(small_disk))
    assert e.missing == TENSOR_BYTES - free > 0
    assert f"free at least {e.missing // 1024}.0 KiB ({e.missing} bytes) more" in str(e)
    assert sorted(os.listdir(small_disk)) == ["someone-elses.bin"]  # nothing of ours left


def test_the_cli_says_it_in_one_line(small_disk, sources):
    r = run_vcga("convert", str(sources / "src.safetensors"), str(small_disk / "out.vbin"))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    line = r.stderr.strip()
    assert "\n" not in line and line.startswith(f"vcga: error: no space left on device writing {small_disk}/out.vbin: "
                                                f"it needs at least 256.0 KiB (262144 bytes), ")
    assert f"are free on {small_disk}; free at least" in line


def test_the_disk_full_error_survives_pickling():
    """DCP hands a rank's exception to the others pickled: the message, errno and fields must survive."""
    import pickle

    from vcga.errors import VcgaDiskFullError

    for quota in (False, True):
        err = VcgaDiskFullError("/data/out.vbin", 100 << 20, 10 << 20, "/data", quota=quota)
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is VcgaDiskFullError and str(back) == str(err)
        assert (back.errno, back.filename, back.missing) == (errno.EDQUOT if quota else errno.ENOSPC,
                                                            "/data/out.vbin", 90 << 20)
