"""Builds under concurrency and kill -9 (issue: builds survive interruption and concurrency).

A fake `cmake` on PATH stands in for CMake, so that these run in seconds: its `--build` step starts a
child working in the build folder (as ninja and the compilers do) and sleeps, then writes what a
finished build leaves. The preparation (fetch + apply) is replaced by a fixed tree, pin and series.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hotggml import build, paths, procs

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups read from /proc")

FAKE_CMAKE = """#!/usr/bin/env bash
if [ "$1" = "--build" ]; then
    dir=$2
    # FAKE_DETACH: the child in a process group of its own (same session), as ninja starts each compiler
    if [ -n "${FAKE_DETACH:-}" ]; then
        (cd "$dir" && exec python3 -c 'import os, sys; os.setpgid(0, 0); os.execvp("sleep", ["sleep", sys.argv[1]])' "$FAKE_BUILD_SECONDS") &
    else
        (cd "$dir" && exec sleep "$FAKE_BUILD_SECONDS") &
    fi
    sleep "$FAKE_BUILD_SECONDS"
    wait
    mkdir -p "$dir/lib" && echo '{}' > "$dir/lib/hotggml-build.json" && : > "$dir/lib/libggml.so"
fi
"""

DRIVER = """
import sys
from pathlib import Path
from hotggml import build, prepare
prepare.prepare = lambda: prepare.Prepared(Path(sys.argv[1]), "a" * 40, "b" * 64)
info = build.build("cpu")
print("built" if info.rebuilt else "reused", info.build_dir, flush=True)
"""


@pytest.fixture
def env(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "cmake").write_text(FAKE_CMAKE)
    (bin_dir / "cmake").chmod(0o755)
    monkeypatch.setenv(paths.STATE_ENV, str(tmp_path / "state"))
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", paths.STATE_ENV: str(tmp_path / "state"),
            "PYTHONPATH": str(paths.REPO_ROOT), "FAKE_BUILD_SECONDS": "2"}


def _driver(env, tmp_path, seconds: str = "2", **extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", DRIVER, str(tmp_path)], env={**env, "FAKE_BUILD_SECONDS": seconds, **extra},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_build_step(bdir: Path) -> int:
    """The process group of the fake build once its --build step runs."""
    record = bdir / build._PGID_FILE
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # configure writes the record first
        if record.is_file():
            pgid = int(record.read_text())
            if any("--build" in Path(f"/proc/{p}/cmdline").read_text(errors="replace") for p in procs.group_members(pgid)):
                return pgid
        time.sleep(0.05)
    pytest.fail("the fake build never started")


def _bdir() -> Path:
    return build.build_dir_for("cpu", "a" * 40, "b" * 64, build.cmake_defines("cpu"))


def test_two_builds_at_once_one_builds_the_other_waits(env, tmp_path):
    first = _driver(env, tmp_path)
    time.sleep(0.5)
    second = _driver(env, tmp_path)
    out1, err1 = first.communicate(timeout=60)
    out2, err2 = second.communicate(timeout=60)
    assert first.returncode == 0 and second.returncode == 0, err1 + err2
    assert out1.split()[0] == "built" and out2.split()[0] == "reused", (out1, out2)
    assert "waiting for the build in" in err2 and f"pid {first.pid}" in err2
    assert (_bdir() / ".complete").is_file() and not (_bdir() / build._PGID_FILE).exists()


def test_checkouts_sharing_a_build_root_wait_for_each_other(env, tmp_path):
    # two state folders (two checkouts), one build root: one builds, the other waits and reuses it (it killed the
    # first one's build as an interrupted one while the locks lived in each state folder)
    shared = {**env, paths.BUILD_ROOT_ENV: str(tmp_path / "shared")}
    first = _driver(shared, tmp_path)
    time.sleep(0.5)
    second = _driver({**shared, paths.STATE_ENV: str(tmp_path / "state2")}, tmp_path)
    out1, err1 = first.communicate(timeout=60)
    out2, err2 = second.communicate(timeout=60)
    assert first.returncode == 0 and second.returncode == 0, err1 + err2
    assert out1.split()[0] == "built" and out2.split()[0] == "reused", (out1, out2)
    assert "waiting for the build in" in err2 and "ending the processes" not in err2


def test_kill_9_leaves_no_orphans_and_no_false_built(env, tmp_path):
    victim = _driver(env, tmp_path, seconds="60")
    record = _bdir() / build._PGID_FILE
    deadline = time.monotonic() + 30
    pgid = None
    while time.monotonic() < deadline:  # wait for the --build step (configure writes the record first)
        if record.is_file():
            pgid = int(record.read_text())
            if any("--build" in Path(f"/proc/{p}/cmdline").read_text(errors="replace") for p in procs.group_members(pgid)):
                break
        time.sleep(0.05)
    else:
        pytest.fail("the fake build never started")
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    assert procs.group_members(pgid), "the orphans this test is about are not there"
    assert not (_bdir() / ".complete").exists()  # a killed build is not a finished one

    again = _driver(env, tmp_path, seconds="1")
    out, err = again.communicate(timeout=60)
    assert again.returncode == 0, err
    assert "ending the processes of an interrupted build" in err
    assert out.split()[0] == "built"
    assert procs.group_members(pgid) == []  # no leftover process of the killed build
    assert (_bdir() / ".complete").is_file()


@pytest.mark.parametrize("how", [signal.SIGINT, signal.SIGKILL])
def test_an_interrupted_build_leaves_no_compiler_of_a_group_of_its_own(env, tmp_path, how):
    """Ctrl-C (SIGINT: the build ends what it started) and kill -9 (the next build does): the compilers ninja
    starts in process groups of their own (here the fake's detached child) are ended too, not left writing;
    a process the build did not start (a shell or a pager in the build folder: here a sleep) is left alone."""
    victim = _driver(env, tmp_path, seconds="60", FAKE_DETACH="1")
    _wait_for_build_step(_bdir())
    bystander = subprocess.Popen(["sleep", "61"], cwd=_bdir())
    deadline = time.monotonic() + 10
    while not [p for p in procs.working_in(_bdir()) if "sleep" in Path(f"/proc/{p}/cmdline").read_text(errors="replace")]:
        assert time.monotonic() < deadline, "the detached child this test is about never started"
        time.sleep(0.05)
    victim.send_signal(how)
    victim.communicate(timeout=60)
    if how == signal.SIGKILL:
        assert procs.working_in(_bdir()), "the orphans this test is about are not there"
        again = _driver(env, tmp_path, seconds="1")
        out, err = again.communicate(timeout=60)
        assert again.returncode == 0 and out.split()[0] == "built", err
    deadline = time.monotonic() + 10
    while any("sleep\x0060" in Path(f"/proc/{p}/cmdline").read_text(errors="replace")
              for p in procs.working_in(_bdir()) if procs.alive(p)):
        assert time.monotonic() < deadline, "a compiler of the interrupted build is still running"
        time.sleep(0.05)
    try:
        assert bystander.poll() is None, "a process the build did not start was killed"
    finally:
        bystander.kill()
        bystander.wait()


def test_a_build_folder_without_its_library_or_record_is_rebuilt(env, tmp_path):
    # an empty .complete (a write a full disk cut short) or a deleted library: not "up to date" (the advice to
    # rebuild then changed nothing)
    for damage in ("record", "library"):
        first = _driver(env, tmp_path, seconds="0")
        first.communicate(timeout=60)
        (_bdir() / ".complete").write_text("") if damage == "record" else (_bdir() / "lib" / "libggml.so").unlink()
        again = _driver(env, tmp_path, seconds="0")
        out, err = again.communicate(timeout=60)
        assert again.returncode == 0 and out.split()[0] == "built", (damage, out, err)


def test_a_recorded_group_that_is_not_a_build_is_left_alone(env, tmp_path):
    """Process ids are reused: a record naming a group whose processes do not work in the build folder
    (here: this test's own sleeper) must not be killed."""
    bdir = _bdir()
    bdir.mkdir(parents=True)
    sleeper = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        (bdir / build._PGID_FILE).write_text(f"{sleeper.pid}\n")
        build._end_stale_group(bdir)
        assert sleeper.poll() is None and not (bdir / build._PGID_FILE).exists()
    finally:
        sleeper.kill()
        sleeper.wait()


def test_progress_lines_are_recognised():
    assert build._progress("[12/345] Building C object ggml/src/ggml.c.o") == "12/345"
    assert build._progress("[ 45%] Building CXX object foo.o") == "45%"
    assert build._progress("-- Configuring done") is None


def test_build_prints_its_progress(env, tmp_path):
    """The steps of the build reach stderr (the fake generator prints ninja-style [n/m] lines)."""
    fake = Path(env["PATH"].split(":")[0]) / "cmake"
    fake.write_text(FAKE_CMAKE.replace('    sleep "$FAKE_BUILD_SECONDS"\n',
                                       '    for i in 1 2 3; do echo "[$i/3] Building C object x$i.o"; done\n'))
    run = _driver(env, tmp_path, seconds="0")
    out, err = run.communicate(timeout=60)
    assert run.returncode == 0, err
    assert "hotggml: configure ..." in err and "hotggml: compile and link 3/3" in err
    assert "[1/3] Building C object x1.o" in (_bdir() / "build.log").read_text()
