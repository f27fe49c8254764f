"""kill -9 in the middle of `fetch` and `patches apply`, then a normal run: it recovers, with no manual
cleanup, and leaves no temporary tree behind. The kill lands at several moments of the operation (the
moments are not chosen by hooks in the code: a real SIGKILL, from outside, at increasing delays)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hotggml import gitutil, patches, paths, pin
from hotggml.errors import PinError

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL")
DELAYS = (0.3, 0.8, 1.5)  # seconds after the start: early extraction, mid-way, late (commit / rename)


@pytest.fixture(scope="module")
def sdist() -> Path:
    """The sdist a session fetch cached in the repository (test_pin and CI's main job put it there)."""
    for candidate in (Path("/tmp/dl") / pin.SDIST_FILE, paths.REPO_ROOT / ".hotggml" / "cache" / pin.SDIST_FILE):
        if candidate.is_file():
            return candidate
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(paths.STATE_ENV, str(paths.REPO_ROOT / ".hotggml"))
        pin.fetch(dest=Path(os.environ.get("TMPDIR", "/tmp")) / "hotggml-kill9-pin" / "ggml",
                  cache_dir=paths.REPO_ROOT / ".hotggml" / "cache")
    return paths.REPO_ROOT / ".hotggml" / "cache" / pin.SDIST_FILE


def _killed_after(code: str, delay: float, env: dict) -> None:
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(delay)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def _env(tmp_path: Path) -> dict:
    return {**os.environ, paths.STATE_ENV: str(tmp_path / "state"), "PYTHONPATH": str(paths.REPO_ROOT)}


@pytest.mark.parametrize("delay", DELAYS)
def test_fetch_recovers_after_kill_9(sdist, tmp_path, monkeypatch, delay):
    dest = tmp_path / "vendor" / "ggml"
    dest.mkdir(parents=True)  # an uninitialized submodule
    code = f"from hotggml import pin; pin.fetch({str(sdist)!r}, dest={str(dest)!r}, use_pip=False)"
    _killed_after(code, delay, _env(tmp_path))
    monkeypatch.setenv(paths.STATE_ENV, str(tmp_path / "state"))
    if delay == DELAYS[0]:  # the kill landed before the end: there is something to recover from
        with pytest.raises(PinError):
            pin.verify(dest)
    result = pin.fetch(sdist, dest=dest, use_pip=False)
    assert result.commit == pin.SDIST_PIN_COMMIT and pin.verify(dest) == pin.SDIST_PIN_COMMIT
    assert not list(dest.parent.glob(".ggml.tmp-*"))


@pytest.fixture(scope="module")
def pristine(sdist, tmp_path_factory) -> Path:
    dest = tmp_path_factory.mktemp("kill9-pin") / "ggml"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(paths.STATE_ENV, str(dest.parent / "state"))
        pin.fetch(sdist, dest=dest, use_pip=False)
    return dest


@pytest.mark.parametrize("delay", DELAYS)
def test_apply_recovers_after_kill_9(pristine, tmp_path, monkeypatch, delay):
    dest = tmp_path / "work" / "ggml"
    code = f"from hotggml import patches; patches.apply({str(dest)!r}, pin_dir={str(pristine)!r})"
    _killed_after(code, delay, _env(tmp_path))
    monkeypatch.setenv(paths.STATE_ENV, str(tmp_path / "state"))
    if delay == DELAYS[0]:  # the kill landed before the new tree was renamed into place
        assert not (dest / ".git").exists()
    result = patches.apply(dest, pin_dir=pristine)
    assert [name for name, _ in result.commits] == [e[: -len(patches.SUFFIX)] for e in patches.series_entries()] \
        or result.already_applied  # the killed run may have finished just before the signal
    assert patches.apply(dest, pin_dir=pristine).already_applied
    assert all(present for entry in patches.status(tree=dest) for _, present in entry.markers)
    assert gitutil.dirty_files(gitutil.open_repo(dest)) == []
    assert not [p for p in dest.parent.iterdir() if p.name != "ggml"]  # no half-built tree beside it


# -- pin set ------------------------------------------------------------------------------------

def _kill_when(command: list[str], cwd: Path, env: dict, moment, after: float = 0.0) -> bool:
    """Run command; SIGKILL it `after` seconds past the first poll at which moment() is true (polled every 5 ms).
    True when it was killed, False when it ended first."""
    proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while proc.poll() is None and not moment():
        time.sleep(0.005)
    time.sleep(after)
    if proc.poll() is not None:
        return False
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return True


@pytest.mark.slow  # about 45 s on 2 cores: four pin sets killed, each aborted, one continued
def test_pin_set_killed_anywhere_aborts_to_the_old_pin_or_continues_to_the_new(sdist, tmp_path, cpu_build):
    """`pin set` killed with SIGKILL at moments through the rebase and _finish (seen from outside: the state
    appears, the series is re-exported, the record is rewritten, the new vendor tree is being made), then
    `pin set --abort`: the record, patches/, vendor/ggml and the work repo are as they were, `git status` is
    clean, no vendor/.ggml.tmp-* is left, fetch, patches apply and build work (the record was left new, the vendor
    tree old before; build finds the old pin's build). Killed once more in _finish, `--continue` finishes the move."""
    from test_rebase import _clone, _hotggml, _new_pin_tarball, _shift_above_hunk, _snapshot

    repo, env = _clone(tmp_path, sdist)
    shared_builds = {**env, paths.BUILD_ROOT_ENV: str(cpu_build.build_dir.parent)}  # the session's CPU build
    state = tmp_path / "state"
    before = _snapshot(repo, state)
    tarball = _new_pin_tarball(repo, tmp_path / "ggml-next.tar.gz", _shift_above_hunk)
    record, alloc = repo / "hotggml" / "pin.json", repo / "patches" / "alloc-free-blocks.patch"
    temps = lambda: list((repo / "vendor").glob(".ggml.tmp-*"))
    moments = {
        "the rebase starts": (lambda: (state / "pin-set" / "state.json").is_file(), 0.0),
        "the series is re-exported": (lambda: alloc.read_bytes() != before["patches"][alloc.name], 0.0),
        "the record is rewritten": (lambda: record.read_bytes() != before["record"], 0.0),
        "the new vendor tree is half made": (lambda: bool(temps()), 1.0),
    }
    command = [sys.executable, "-m", "hotggml", "pin", "set", str(tarball), "--tag", "next"]
    for name, (moment, after) in moments.items():
        assert _kill_when(command, repo, env, moment, after), f"pin set ended before {name}"
        assert (state / "pin-set" / "state.json").is_file(), name
        if name == "the rebase starts":  # a pin set in progress is named, nothing done (test_rebase: every command)
            run = _hotggml(repo, env, "patches", "apply", "--force")
            assert run.returncode == 2 and "a `hotggml pin set` to ggml next is in progress" in run.stderr, name
        _hotggml(repo, env, "pin", "set", "--abort", check=True)
        assert _snapshot(repo, state) == before, name
        assert subprocess.run(["git", "-C", str(repo), "status", "--porcelain"], capture_output=True, text=True,
                              check=True).stdout == "", name
        assert not temps(), name
        assert "verified" in _hotggml(repo, env, "fetch", check=True).stdout, name
        assert "already applied" in _hotggml(repo, env, "patches", "apply", check=True).stdout, name
        # and build: the old pin and series give the old build key, so the session's own build is taken as it is
        built = _hotggml(repo, shared_builds, "build", "--backend", "cpu", check=True).stdout
        assert "up to date, not rebuilt" in built, (name, built)

    assert _kill_when(command, repo, env, moments["the record is rewritten"][0])
    _hotggml(repo, env, "pin", "set", "--continue", check=True)
    assert json.loads(record.read_text())["tag"] == "next" and not (state / "pin-set").exists()
    assert "three lines inserted" in (repo / "vendor" / "ggml" / "src" / "ggml-alloc.c").read_text()
    _hotggml(repo, env, "fetch", check=True)
    _hotggml(repo, env, "patches", "check", check=True)


def test_scratch_folders_of_killed_runs_are_removed_by_the_next(tmp_path, monkeypatch):
    """`kill -9` of `patches check` or `pin set` left its scratch tree (tens of MB) in the temporary folder for
    good: the next run's scratch_dir removes those whose process is gone, never a live one's."""
    import tempfile

    from hotggml import procs

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    left = tmp_path / f"hotggml-check-{dead.pid}-abc"
    (left / "ggml").mkdir(parents=True)
    live = tmp_path / f"hotggml-check-{os.getppid()}-def"
    live.mkdir()
    other = tmp_path / f"hotggml-new-pin-{dead.pid}-ghi"
    other.mkdir()
    made = procs.scratch_dir("hotggml-check-")
    assert made.is_dir() and made.name.startswith(f"hotggml-check-{os.getpid()}-")
    assert not left.exists() and live.is_dir() and other.is_dir()  # another prefix is another command's
