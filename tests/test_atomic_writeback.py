"""AtomicFile.writeback: background flushing while a writer keeps writing, then a normal commit/abort."""

from __future__ import annotations

import os

import pytest

from vcga.atomic import AtomicFile


def test_writeback_then_commit(tmp_path):
    dest = tmp_path / "out.bin"
    af = AtomicFile(dest)
    chunks = [bytes([i]) * (1 << 20) for i in range(8)]
    for c in chunks:
        af.write(c)
        af.writeback()  # at most one flush in flight; extra calls return at once
    assert not dest.exists()
    af.commit()
    assert dest.read_bytes() == b"".join(chunks)
    assert os.listdir(tmp_path) == ["out.bin"]
    with pytest.raises(ValueError, match="already committed"):
        af.writeback()


def test_writeback_then_abort_leaves_nothing(tmp_path):
    dest = tmp_path / "out.bin"
    dest.write_bytes(b"original")
    af = AtomicFile(dest)
    af.write(b"x" * (4 << 20))
    af.writeback()
    af.abort()  # joins the flush before closing the descriptor
    assert af._flusher is None
    assert os.listdir(tmp_path) == ["out.bin"] and dest.read_bytes() == b"original"


def test_anonymous_until_commit_then_replace_or_refuse(tmp_path):
    """The data has no name until commit; commit replaces an existing file (link + rename, no
    temporary left) or, with overwrite=False, refuses and leaves both the old file and nothing else."""
    from vcga.atomic import AtomicFile, anonymous_files_supported

    dest = tmp_path / "out.bin"
    dest.write_bytes(b"old")
    af = AtomicFile(dest)
    af.write(b"new")
    if anonymous_files_supported(tmp_path):
        assert af.anonymous and os.listdir(tmp_path) == ["out.bin"]
    af.commit()
    assert os.listdir(tmp_path) == ["out.bin"] and dest.read_bytes() == b"new"
    mode = dest.stat().st_mode & 0o777
    umask = os.umask(0)
    os.umask(umask)
    assert mode == 0o666 & ~umask  # like open(): what the umask allows
    refused = AtomicFile(dest, overwrite=False)
    refused.write(b"newer")
    with pytest.raises(FileExistsError):
        refused.commit()
    assert os.listdir(tmp_path) == ["out.bin"] and dest.read_bytes() == b"new"
