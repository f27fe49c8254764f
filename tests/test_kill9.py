"""kill -9 in the middle of `fetch` and `patches apply`, then a normal run: it recovers, with no manual
cleanup, and leaves no temporary tree behind. The kill lands at several moments of the operation (the
moments are not chosen by hooks in the code: a real SIGKILL, from outside, at increasing delays)."""

from __future__ import annotations

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
