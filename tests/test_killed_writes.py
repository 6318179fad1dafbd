"""A `vcga convert` killed at any moment leaves the source and at most a valid destination: nothing else.

The kill is made exact by the kernel, not by timing: the converting process runs with
RLIMIT_FSIZE = N and SIGXFSZ at its default action (CPython ignores it at startup; we restore it),
so the first write that would grow any file past N bytes kills the process on the spot -- no
handler, no ``finally``, exactly like ``kill -9`` at that byte. Each target format is killed at
several N: its first byte, a third, two thirds, and one byte short of its largest file.

The killed processes are forked from this one and run the CLI's ``main`` (a fresh interpreter per
kill would spend the test's time importing torch); one test runs the real ``vcga`` command the
same way, to show the two agree.
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from ckpt_helpers import conversion_sources, float32_layers, read_all

from vcga.convert import format_by_name

# The launcher: SIGXFSZ back to its default action (terminate), then the real CLI.
LAUNCH = "import signal; signal.signal(signal.SIGXFSZ, signal.SIG_DFL); from vcga.cli import main; main()"

TARGETS = [  # (target file name, format, extra convert arguments)
    ("out.vbin", "vendor-bin", []),
    ("out.h5", "hdf5", []),
    ("out.ckpt", "mindspore-ckpt", []),
    ("out.mindrecord", "mindrecord", []),
    ("out.pt", "torch", []),
    ("out.safetensors", "safetensors", []),
    # multi-file outputs: shards plus an index / a .db beside each shard
    ("sharded.vbin", "vendor-bin", ["--shard-size", "300KiB"]),
    ("sharded.safetensors", "safetensors", ["--shard-size", "300KiB"]),
    ("sharded.mindrecord", "mindrecord", ["--shard-size", "300KiB"]),
]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    # ~1 MiB in all, so that a third of a file is many writes into it
    return conversion_sources(tmp_path_factory.mktemp("sources"), float32_layers(15, 8, 32768))


def _convert_forked(src: Path, dst: Path, args: list[str], limit: int | None) -> int:
    """`vcga convert` in a forked child under the limit; its wait status as returncode (-signal)."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 70
        try:
            signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            if limit is not None:
                resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
            from vcga.cli import main

            try:
                main(["convert", str(src), str(dst), *args])
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def _convert(src: Path, dst: Path, args: list[str], limit: int | None) -> subprocess.CompletedProcess:
    def limits() -> None:
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if limit is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    env = {k: v for k, v in os.environ.items() if not k.startswith("VCGA_")}
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # no .pyc written under the limit
    return subprocess.run([sys.executable, "-c", LAUNCH, "convert", str(src), str(dst), *args],
                          capture_output=True, text=True, env=env, timeout=300, preexec_fn=limits,
                          stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("target,fmt,args", TARGETS, ids=[t[0] + (" sharded" if t[2] else "") for t in TARGETS])
def test_a_killed_convert_leaves_nothing_behind(tmp_path, sources, target, fmt, args):
    src_dir, expected = sources
    if fmt == "torch":
        import torch  # noqa: F401 - imported once here; every forked child would import it again
    source = "src.h5" if fmt == "safetensors" else "src.safetensors"
    # the full conversion first: it tells how large the outputs are
    full = tmp_path / "full"
    full.mkdir()
    (full / source).write_bytes((src_dir / source).read_bytes())
    assert _convert_forked(full / source, full / target, args, None) == 0
    outputs = sorted(p.name for p in full.iterdir() if p.name != source)
    assert len(outputs) > (1 if args else 0), outputs
    largest = max((full / n).stat().st_size for n in outputs)
    source_bytes = (full / source).read_bytes()
    for limit in sorted({1, largest // 3, 2 * largest // 3, largest - 1}):
        work = tmp_path / f"kill-at-{limit}"
        work.mkdir()
        (work / source).write_bytes(source_bytes)
        assert _convert_forked(work / source, work / target, args, limit) == -signal.SIGXFSZ, limit
        # what a user finds after the kill: the source, untouched, and nothing else
        left = sorted(p.name for p in work.iterdir())
        assert left == [source], (limit, left)
        assert (work / source).read_bytes() == source_bytes
    # and the complete one is valid
    _, got = read_all(format_by_name(fmt), full / target)
    assert {k: v[2] for k, v in got.items()} == expected


def test_the_real_command_killed_mid_write_leaves_nothing(tmp_path, sources):
    src_dir, _ = sources
    (tmp_path / "src.safetensors").write_bytes((src_dir / "src.safetensors").read_bytes())
    r = _convert(tmp_path / "src.safetensors", tmp_path / "out.vbin", ["--shard-size", "300KiB"], 200_000)
    assert r.returncode == -signal.SIGXFSZ, r.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src.safetensors"]


def test_stale_temporaries_of_dead_writers_are_removed_by_the_next_write(tmp_path, sources):
    """Where a name must exist while a writer is alive (no O_TMPFILE; the instant between naming and
    renaming over an existing destination; a staging folder under --verify), the name carries the
    writer's pid: the next writer in that folder removes it once that writer is dead."""
    from vcga.atomic import remove_stale, temp_name

    src_dir, _ = sources
    (tmp_path / "src.safetensors").write_bytes((src_dir / "src.safetensors").read_bytes())
    dead = subprocess.Popen([sys.executable, "-c", "import os; print(os.getpid())"], stdout=subprocess.PIPE, text=True)
    dead_pid = int(dead.communicate()[0])
    mine = temp_name(tmp_path / "a.vbin")  # this (live) process
    theirs = Path(str(temp_name(tmp_path / "b.vbin")).replace(f"-tmp-{os.getpid()}-", f"-tmp-{dead_pid}-"))
    staging = Path(str(temp_name(tmp_path / "c.vbin")).replace(f"-tmp-{os.getpid()}-", f"-tmp-{dead_pid}-"))
    staging.mkdir()
    (staging / "c.vbin").write_bytes(b"x" * 100)
    other_host = tmp_path / f".d.vbin.vcga-tmp-{dead_pid}-00000000-00000000-0badf00d"
    for p in (mine, theirs, other_host):
        p.write_bytes(b"partial")
    r = _convert(tmp_path / "src.safetensors", tmp_path / "out.vbin", [], None)
    assert r.returncode == 0, r.stderr
    left = sorted(p.name for p in tmp_path.iterdir())
    # the dead writer's file and staging folder are gone; a live writer's and another host's are kept
    assert left == sorted(["src.safetensors", "out.vbin", mine.name, other_host.name]), left
    assert remove_stale(tmp_path) == []  # this process is alive: its own temporary stays


@pytest.mark.parametrize("target,args", [("out.h5", []), ("sharded.mindrecord", ["--shard-size", "300KiB"])])
def test_without_anonymous_files_the_next_write_removes_a_killed_writers_temporaries(tmp_path, sources, monkeypatch,
                                                                                      target, args):
    """Where O_TMPFILE is refused, a killed writer leaves its pid-stamped temporaries; the next
    conversion into that folder removes them, and only the source and a valid destination remain."""
    import vcga.atomic

    monkeypatch.setattr(vcga.atomic, "_open_anonymous", lambda directory: None)  # inherited by the fork
    src_dir, expected = sources
    (tmp_path / "src.safetensors").write_bytes((src_dir / "src.safetensors").read_bytes())
    assert _convert_forked(tmp_path / "src.safetensors", tmp_path / target, args, 400_000) == -signal.SIGXFSZ
    left = sorted(p.name for p in tmp_path.iterdir() if p.name != "src.safetensors")
    assert left and all(".vcga-tmp-" in n and f"-{os.getpid()}-" not in n for n in left), left
    assert _convert_forked(tmp_path / "src.safetensors", tmp_path / target, args, None) == 0
    left = sorted(p.name for p in tmp_path.iterdir())
    assert not [n for n in left if ".vcga-tmp-" in n], left
    _, got = read_all(format_by_name(target.split(".")[1] if "mindrecord" in target else "hdf5"), tmp_path / target)
    assert {k: v[2] for k, v in got.items()} == expected
