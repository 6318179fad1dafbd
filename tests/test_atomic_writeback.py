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
