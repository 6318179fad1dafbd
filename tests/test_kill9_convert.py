"""kill -9 of `vcga convert` at every step of its work, for every target format.

The moments (tests/kill_points.py): before the first tensor is written, halfway through the tensors,
and before each kind of change the conversion makes to the destination's directory -- making its
staging folder, naming the first and the last file there, renaming the first and the last into
place, removing the folder. The converting
process stops itself there; the test kills it with SIGKILL and looks at the directory.

What a user finds, at any of these moments: the source, untouched; at most a complete, valid
destination; and otherwise only the dead writer's stamped temporaries (``.*.vcga-tmp-<pid>-...``),
which exist only in the microseconds of publication (between naming a file and moving it into
place). Whatever is there once the next VCGA writer has run in that directory
(:func:`vcga.atomic.remove_stale`, which every writer calls first) is the source and at most a
valid destination, nothing else: a multi-file output interrupted between two renames is
removed, not left half there. While the tensors are being written -- nearly all of a conversion's
time -- nothing but the source is there even right after the kill.

The converting processes are forked from this one and run the CLI's ``main`` (a fresh interpreter
per kill would spend the test's time importing); one test kills the real ``vcga`` command, started
as a new interpreter, the same way. (tests/test_killed_writes.py kills at exact bytes written.)
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import kill_points
import pytest
from ckpt_helpers import conversion_sources, float32_layers, read_all

from vcga.atomic import remove_stale
from vcga.convert import format_by_name

TESTS = str(Path(__file__).resolve().parent)
TARGETS = [  # (target file name, format, extra convert arguments)
    ("out.vbin", "vendor-bin", []),
    ("out.h5", "hdf5", []),
    ("out.ckpt", "mindspore-ckpt", []),
    ("out.mindrecord", "mindrecord", []),  # two files: the data and its .db
    ("out.safetensors", "safetensors", []),
    ("out.pt", "torch", []),
    ("sharded.vbin", "vendor-bin", ["--shard-size", "200KiB"]),
    ("sharded.safetensors", "safetensors", ["--shard-size", "200KiB"]),
]
WAIT_S = 120  # a conversion of 1 MiB; generous for a busy machine


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    return conversion_sources(tmp_path_factory.mktemp("sources"), float32_layers(9, 6, 16384))


def _wait(pid: int, flags: int = 0) -> int:
    """waitpid with a deadline (the test kills the child when it passes)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        done, status = os.waitpid(pid, flags | os.WNOHANG)
        if done:
            return status
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail(f"the conversion did not reach its moment within {WAIT_S} s")
        time.sleep(0.002)


def _kill_at(work: Path, src: Path, dst: Path, args: list[str], stop_at: int | None) -> tuple[int, list[str]]:
    """Fork a `vcga convert`, kill -9 it at moment ``stop_at`` (None: let it finish).
    Returns (its exit code, -9 when killed; the moments it reached)."""
    r, w = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 70
        try:
            os.close(r)
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            kill_points.install(str(work), stop_at, w)
            from vcga.cli import main

            try:
                main(["convert", str(src), str(dst), *args])
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
        finally:
            os._exit(code)
    os.close(w)
    status = _wait(pid, os.WUNTRACED)
    if os.WIFSTOPPED(status):
        os.kill(pid, signal.SIGKILL)  # kill -9, from outside, while it stands at the moment
        status = _wait(pid)
    with os.fdopen(r) as f:
        moments = f.read().splitlines()
    return os.waitstatus_to_exitcode(status), moments


def _kinds(moments: list[str]) -> list[str]:
    return [m.split()[0] for m in moments]  # the stamped names differ from run to run


def _check_left(work: Path, source: str, source_bytes: bytes, outputs: list[str], fmt: str, target: str,
                expected: dict[str, bytes], moment: str) -> None:
    """The directory after a kill: the source; named files only of the output set; stamped temporaries;
    after the next writer's clean-up: the source and at most the valid output."""
    assert (work / source).read_bytes() == source_bytes, moment
    left = {p.name for p in work.iterdir()} - {source}
    named = {n for n in left if ".vcga-tmp-" not in n}
    assert named <= set(outputs), (moment, sorted(left))
    if moment == "tensor":  # while writing: nothing at all, even before any clean-up
        assert not left, (moment, sorted(left))
    remove_stale(work)  # what the next VCGA writer in this directory does first
    left = sorted(p.name for p in work.iterdir() if p.name != source)
    assert left in ([], outputs), (moment, left)
    if left:
        _, got = read_all(format_by_name(fmt), work / target)
        assert {k: v[2] for k, v in got.items()} == expected, moment


@pytest.mark.parametrize("target,fmt,args", TARGETS, ids=[t[0] for t in TARGETS])
def test_kill_9_at_every_step_leaves_the_source_and_at_most_a_valid_destination(tmp_path, sources, target,
                                                                                 fmt, args):
    src_dir, expected = sources
    if fmt == "torch":
        import torch  # noqa: F401 - once here, not in every forked child
    source = "src.h5" if fmt == "safetensors" else "src.safetensors"
    source_bytes = (src_dir / source).read_bytes()
    full = tmp_path / "full"
    full.mkdir()
    (full / source).write_bytes(source_bytes)
    code, moments = _kill_at(full, full / source, full / target, args, None)
    assert code == 0
    outputs = sorted(p.name for p in full.iterdir() if p.name != source)
    assert len(outputs) >= (2 if args or fmt == "mindrecord" else 1), outputs
    tensors = [i for i, m in enumerate(moments) if m == "tensor"]
    changes = [i for i, m in enumerate(moments) if m != "tensor"]
    assert len(tensors) == len(expected) and changes and changes[0] > tensors[-1], moments
    # renames into place (a rename's moment names its destination)
    renames = [i for i in changes if moments[i].startswith("os.rename") and ".vcga-tmp-" not in moments[i]]
    assert len(renames) == len(outputs) and renames[-1] + 1 in changes, moments
    links = [i for i in changes if moments[i].startswith("os.link")]
    # every kind of step; of a run of several alike (naming or moving each file) the first and the last
    stops = sorted({tensors[0], tensors[len(tensors) // 2], changes[0], *links[:1], *links[-1:], renames[0],
                    renames[-1], renames[-1] + 1})
    for stop in stops:
        work = tmp_path / f"kill-{stop}"
        work.mkdir()
        (work / source).write_bytes(source_bytes)
        code, reached = _kill_at(work, work / source, work / target, args, stop)
        assert code == -signal.SIGKILL and _kinds(reached) == _kinds(moments[:stop + 1]), (stop, code, reached)
        _check_left(work, source, source_bytes, outputs, fmt, target, expected, moments[stop])
    _check_left(full, source, source_bytes, outputs, fmt, target, expected, "finished")


def test_the_real_command_killed_between_two_renames(tmp_path, sources):
    """The `vcga` CLI in a fresh interpreter, killed -9 between renaming a MindRecord file and its .db."""
    src_dir, expected = sources
    source_bytes = (src_dir / "src.safetensors").read_bytes()
    (tmp_path / "src.safetensors").write_bytes(source_bytes)
    env = {k: v for k, v in os.environ.items() if not k.startswith("VCGA_")}
    r, w = os.pipe()
    # moments of a MindRecord conversion of this source: 6 tensors, mkdir, 2 links, then the renames
    stop = 6 + 1 + 2 + 1
    code = kill_points.launcher(TESTS, str(tmp_path), stop, w)
    proc = subprocess.Popen([sys.executable, "-c", code, "convert", str(tmp_path / "src.safetensors"),
                             str(tmp_path / "out.mindrecord")], env=env, pass_fds=(w,), stdin=subprocess.DEVNULL,
                            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_CORE, (0, 0)))
    os.close(w)
    try:
        assert os.WIFSTOPPED(_wait(proc.pid, os.WUNTRACED))
        os.kill(proc.pid, signal.SIGKILL)
        assert os.waitstatus_to_exitcode(_wait(proc.pid)) == -signal.SIGKILL
    finally:
        proc.returncode = -9  # reaped above; Popen must not wait for it again
    with os.fdopen(r) as f:
        moments = f.read().splitlines()
    assert moments[-1].startswith("os.rename") and moments[-2].startswith("os.rename"), moments
    left = sorted(p.name for p in tmp_path.iterdir())
    # one of the two files is in place, the other still in the dead writer's staging folder
    assert len(left) == 3 and "src.safetensors" in left and sum(".vcga-tmp-" in n for n in left) == 1, left
    _check_left(tmp_path, "src.safetensors", source_bytes, ["out.mindrecord", "out.mindrecord.db"], "mindrecord",
                "out.mindrecord", expected, "between the renames")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src.safetensors"]
