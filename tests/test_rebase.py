"""`hotggml pin set` against real upstream motion, in a scratch clone of this repository (its own state
folder, so this checkout's pin, series and builds are never touched):

- a new pin whose src/ggml-alloc.c has lines inserted just above the alloc-free-blocks hunk: the 3-way
  rebase is clean, the series is re-exported, the record rewritten, `patches check` passes and a CPU build
  of the new pin passes parity smoke;
- a new pin that rewrites the hunk's own line: the rebase stops naming the patch and the file; --abort
  restores the record, the series, the work repo and vendor/ggml byte for byte; resolving the conflict with
  git and --continue finishes the move.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from hotggml import paths, pin

HUNK_LINE = "#define MAX_FREE_BLOCKS 256"


@pytest.fixture(scope="module")
def sdist(cpu_build) -> Path:
    """The pinned sdist this checkout fetched (the session's build did)."""
    for candidate in (os.environ.get(pin.SDIST_ENV), paths.cache_dir() / pin.SDIST_FILE):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    pytest.skip("no cached pinned sdist")


def _clone(tmp: Path, sdist: Path) -> tuple[Path, dict]:
    repo = tmp / "repo"
    subprocess.run(["git", "clone", "--quiet", str(paths.REPO_ROOT), str(repo)], check=True)
    env = {**os.environ, "PYTHONPATH": str(repo), paths.STATE_ENV: str(tmp / "state"), pin.SDIST_ENV: str(sdist)}
    for args in (["fetch"], ["patches", "apply"]):
        _hotggml(repo, env, *args, check=True)
    return repo, env


def _hotggml(repo: Path, env: dict, *args: str, check: bool = False) -> subprocess.CompletedProcess:
    run = subprocess.run([sys.executable, "-m", "hotggml", *args], cwd=repo, env=env, capture_output=True, text=True,
                         timeout=1200)
    if check:
        assert run.returncode == 0, f"hotggml {' '.join(args)}: {run.stdout[-2000:]}\n{run.stderr[-3000:]}"
    return run


def _new_pin_tarball(repo: Path, out: Path, edit, drop: str = "") -> Path:
    """A ggml source tarball (one top folder) of the clone's pinned tree with `edit` applied to ggml-alloc.c
    (and the files under `drop`, a folder, left out)."""
    vendor = repo / "vendor" / "ggml"
    files = subprocess.run(["git", "-C", str(vendor), "ls-files", "-z"], capture_output=True, check=True).stdout
    with tarfile.open(out, "w:gz") as archive:
        for rel in filter(None, files.decode().split("\0")):
            if drop and rel.startswith(drop):
                continue
            data = (vendor / rel).read_bytes()
            if rel == "src/ggml-alloc.c":
                data = edit(data.decode()).encode()
            info = tarfile.TarInfo(f"ggml-next/{rel}")
            info.size, info.mode = len(data), (vendor / rel).stat().st_mode & 0o755
            archive.addfile(info, io.BytesIO(data))
    return out


def _shift_above_hunk(text: str) -> str:
    """Three lines inserted five lines above the hunk's line: outside its context, so the merge is clean."""
    lines = text.split("\n")
    at = lines.index(HUNK_LINE) - 5
    return "\n".join(lines[:at] + ["// upstream moved on: three lines inserted above the hunk", "//", "//"] + lines[at:])


def _rewrite_hunk(text: str) -> str:
    assert HUNK_LINE in text
    return text.replace(HUNK_LINE, "#define MAX_FREE_BLOCKS 512")


def _snapshot(repo: Path, state: Path) -> dict:
    work = state / "work" / "ggml"
    git = lambda where, *a: subprocess.run(["git", "-C", str(where), *a], capture_output=True, text=True).stdout
    return {
        "record": (repo / "hotggml" / "pin.json").read_bytes(),
        "patches": {p.name: p.read_bytes() for p in sorted((repo / "patches").iterdir())},
        "work": (git(work, "rev-parse", "HEAD", "refs/hotggml/pin"), git(work, "status", "--porcelain"),
                 git(work, "for-each-ref")),
        "vendor": git(repo / "vendor" / "ggml", "rev-parse", "HEAD"),
    }


@pytest.mark.slow  # builds the rebased tree
def test_a_clean_rebase_moves_the_pin_and_the_new_pin_passes_parity(tmp_path, sdist):
    repo, env = _clone(tmp_path, sdist)
    old = json.loads((repo / "hotggml" / "pin.json").read_text())
    tarball = _new_pin_tarball(repo, tmp_path / "ggml-next.tar.gz", _shift_above_hunk)
    run = _hotggml(repo, env, "pin", "set", str(tarball), "--tag", "next-shifted")
    assert run.returncode == 0, run.stderr[-3000:]
    new = json.loads((repo / "hotggml" / "pin.json").read_text())
    assert new["tag"] == "next-shifted" and new["source"]["kind"] == "tarball"
    gitlink = subprocess.run(["git", "-C", str(repo), "ls-files", "--stage", "--", "vendor/ggml"], capture_output=True,
                             text=True, check=True).stdout.split()
    assert gitlink[:2] == ["160000", new["upstream_commit"]] and new["upstream_commit"] != old["upstream_commit"]
    assert new["trees"]["src"] != old["trees"]["src"] and new["trees"]["include"] == old["trees"]["include"]
    exported = (repo / "patches" / "alloc-free-blocks.patch").read_text()
    assert "MAX_FREE_BLOCKS 1024" in exported and exported != (paths.PATCHES_DIR / "alloc-free-blocks.patch").read_text()
    vendor_alloc = (repo / "vendor" / "ggml" / "src" / "ggml-alloc.c").read_text()
    assert "three lines inserted above the hunk" in vendor_alloc and HUNK_LINE in vendor_alloc  # the new pin
    work = tmp_path / "state" / "work" / "ggml"
    refs = subprocess.run(["git", "-C", str(work), "for-each-ref", "--format=%(refname)"], capture_output=True,
                          text=True).stdout.split()
    assert "refs/hotggml/pin" in refs and not any(r.startswith("refs/tags/") for r in refs)  # never a tag
    _hotggml(repo, env, "patches", "check", check=True)
    _hotggml(repo, env, "build", "--backend", "cpu", check=True)
    run = _hotggml(repo, env, "parity", "--set", "smoke", check=True)
    assert " 0 failed" in run.stdout


def test_a_conflict_stops_names_the_patch_and_abort_restores_everything(tmp_path, sdist):
    repo, env = _clone(tmp_path, sdist)
    before = _snapshot(repo, tmp_path / "state")
    tarball = _new_pin_tarball(repo, tmp_path / "ggml-next.tar.gz", _rewrite_hunk)
    run = _hotggml(repo, env, "pin", "set", str(tarball))
    assert run.returncode == 1, run.stderr[-3000:]
    assert "patch alloc-free-blocks conflicts" in run.stderr and "src/ggml-alloc.c" in run.stderr
    assert "Traceback" not in run.stderr
    assert _hotggml(repo, env, "pin", "set", str(tarball)).returncode == 2  # one at a time
    # what would disturb the pin set in progress refuses in one line naming it (--force discarded the rebase before)
    for args in (["patches", "apply", "--force"], ["patches", "export"], ["patches", "check"], ["build"]):
        run = _hotggml(repo, env, *args)
        lines = run.stderr.strip().splitlines()
        assert run.returncode == 2 and len(lines) == 1, (args, run.stderr[-2000:])
        assert lines[0].startswith("hotggml: error: a `hotggml pin set` to ggml ggml-next is in progress"), args
    run = _hotggml(repo, env, "pin", "set", "--abort", check=True)
    assert _snapshot(repo, tmp_path / "state") == before
    _hotggml(repo, env, "patches", "check", check=True)

    # the same conflict, resolved with ordinary git: our side of the hunk, then --continue
    assert _hotggml(repo, env, "pin", "set", str(tarball)).returncode == 1
    work = tmp_path / "state" / "work" / "ggml"
    # `git add`ed with its conflict markers: refused (the series carried them, and `patches check` passed)
    subprocess.run(["git", "-C", str(work), "add", "src/ggml-alloc.c"], check=True)
    run = _hotggml(repo, env, "pin", "set", "--continue")
    assert run.returncode == 2 and "conflict markers are still in what is staged" in run.stderr, run.stderr[-2000:]
    assert "src/ggml-alloc.c" in run.stderr
    text = (work / "src" / "ggml-alloc.c").read_text()
    start, end = text.index("<<<<<<<"), text.index(">>>>>>>")
    end = text.index("\n", end) + 1
    (work / "src" / "ggml-alloc.c").write_text(text[:start] + "#define MAX_FREE_BLOCKS 1024\n" + text[end:])
    subprocess.run(["git", "-C", str(work), "add", "src/ggml-alloc.c"], check=True)
    run = _hotggml(repo, env, "pin", "set", "--continue", check=True)
    assert "is the tarball's tree hash, not an upstream commit" in run.stderr, run.stderr  # no --upstream-commit
    exported = (repo / "patches" / "alloc-free-blocks.patch").read_text()
    assert "-#define MAX_FREE_BLOCKS 512" in exported and "+#define MAX_FREE_BLOCKS 1024" in exported
    _hotggml(repo, env, "patches", "check", check=True)


def test_files_that_are_no_tarball_are_one_error_line_and_change_nothing(tmp_path, sdist):
    """pin set of a text file, an empty file, a truncated sdist: one `hotggml: error:` line, exit 2, no traceback,
    the pin record, patches, vendor tree and work repo as they were. The pin's own sdist, or HEAD of vendor/ggml:
    nothing to move, a no-op that says so (it was rewritten as a new pin: tag ggml_python-0.0.45, upstream_commit
    a local commit, the pip requirement dropped)."""
    repo, env = _clone(tmp_path, sdist)
    before = _snapshot(repo, tmp_path / "state")
    for source in (str(sdist), "HEAD"):
        run = _hotggml(repo, env, "pin", "set", source, check=True)
        assert "holds the tree of the current pin" in run.stdout and "nothing changed" in run.stdout
        assert _snapshot(repo, tmp_path / "state") == before and not (tmp_path / "state" / "pin-set").exists()
    text, empty, truncated = tmp_path / "passwd", tmp_path / "empty.tar.gz", tmp_path / "cut.tar.gz"
    text.write_text("root:x:0:0:root:/root:/bin/sh\n")
    empty.write_bytes(b"")
    truncated.write_bytes(sdist.read_bytes()[: sdist.stat().st_size // 3])
    for source, why in ((text, "it is not a tar archive"), (empty, "it is empty"), (truncated, "it ends early")):
        run = _hotggml(repo, env, "pin", "set", str(source))
        lines = run.stderr.strip().splitlines()
        assert run.returncode == 2 and len(lines) == 1 and lines[0].startswith("hotggml: error:"), run.stderr[-2000:]
        assert f"{source} is not a readable tarball: {why}" in lines[0]
        assert _snapshot(repo, tmp_path / "state") == before
    # a bad --upstream-commit was stored, rebased on, and left a --continue that could never succeed
    run = _hotggml(repo, env, "pin", "set", str(sdist), "--upstream-commit", "notasha")
    assert run.returncode == 2 and "must be a full 40-hex-digit commit id, got 'notasha'" in run.stderr, run.stderr[-2000:]
    assert _snapshot(repo, tmp_path / "state") == before and not (tmp_path / "state" / "pin-set").exists()
    # a tree without include/ is named (git's raw rev-parse error was), and no run leaves its scratch copy of the
    # tree (tens of MB) in the temporary folder: failed, refused or a no-op
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env_tmp = {**env, "TMPDIR": str(scratch)}
    bad = _new_pin_tarball(repo, tmp_path / "no-include.tar.gz", lambda text: text, drop="include/")
    run = _hotggml(repo, env_tmp, "pin", "set", str(bad))
    assert run.returncode == 2 and "lacks include: not a ggml tree" in run.stderr, run.stderr[-2000:]
    _hotggml(repo, env_tmp, "pin", "set", str(sdist), check=True)
    assert not list(scratch.glob("hotggml-new-pin-*")) and _snapshot(repo, tmp_path / "state") == before



def test_patches_check_exits_1_when_the_series_fails_it(tmp_path, sdist):
    """`patches check` is the series' gate: a failing check exits 1 (the help's "a check failed"), not 2 (which
    says the command could not run); one error line naming the patch."""
    repo, env = _clone(tmp_path, sdist)
    first = repo / "patches" / "alloc-free-blocks.patch"
    first.write_bytes(first.read_bytes().replace(b"\n", b"\r\n"))
    run = _hotggml(repo, env, "patches", "check")
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 1 and len(lines) == 1 and "alloc-free-blocks.patch has CRLF" in lines[0], run.stderr


def test_pin_set_waits_for_another_and_refuses_what_would_lose_or_mislead(tmp_path, sdist):
    """A second `pin set` waits for the first (two at once rebased one work repo over each other and left a state
    neither --continue nor --abort took); --continue / --abort with a SOURCE, --tag or --upstream-commit are
    refused (they were dropped without a word); a damaged state.json is one line naming the way out (it was a
    traceback); a tarball named like a cached sdist with other bytes is refused, the cache untouched (it
    overwrote the current pin's sdist: no offline fetch could make the pin again)."""
    import fcntl
    import hashlib

    repo, env = _clone(tmp_path, sdist)
    state = tmp_path / "state"
    tarball = _new_pin_tarball(repo, tmp_path / "ggml-next.tar.gz", _shift_above_hunk)
    conflicting = _new_pin_tarball(repo, tmp_path / "ggml-conf.tar.gz", _rewrite_hunk)  # of the first pin's tree
    for args in (["pin", "set", str(tarball), "--continue"], ["pin", "set", "--abort", "--tag", "x"],
                 ["pin", "set", "--continue", "--upstream-commit", "0" * 40]):
        run = _hotggml(repo, env, *args)
        assert run.returncode == 2 and "go with a new `pin set SOURCE`" in run.stderr, (args, run.stderr[-2000:])
    # a pin set stopped and aborted takes the tarball it copied into the cache out again: a corrected one of the
    # same name is no other pin's source (it was refused)
    assert _hotggml(repo, env, "pin", "set", str(conflicting)).returncode == 1
    assert (state / "cache" / conflicting.name).is_file()
    _hotggml(repo, env, "pin", "set", "--abort", check=True)
    assert not (state / "cache" / conflicting.name).exists()
    # the lock a running pin set holds (hotggml.paths.lock's file for the pin-set folder), taken here
    key = hashlib.sha1(str((state / "pin-set").resolve()).encode()).hexdigest()[:16]
    (state / "locks").mkdir(parents=True, exist_ok=True)
    with open(state / "locks" / f"{key}.lock", "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        proc = subprocess.Popen([sys.executable, "-m", "hotggml", "pin", "set", str(tarball)], cwd=repo, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        first = proc.stderr.readline()
        assert "waiting for the `hotggml pin set` in progress" in first, first
        assert proc.poll() is None
        fcntl.flock(held, fcntl.LOCK_UN)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0 and "pin set: ggml" in out, err[-2000:]
    _hotggml(repo, env, "patches", "check", check=True)

    # a conflict resolved with upstream's side empties the patch: git drops it, and the pin set says so now
    assert _hotggml(repo, env, "pin", "set", str(conflicting)).returncode == 1
    work = state / "work" / "ggml"
    subprocess.run(["git", "-C", str(work), "checkout", "--ours", "src/ggml-alloc.c"], check=True)
    subprocess.run(["git", "-C", str(work), "add", "src/ggml-alloc.c"], check=True)
    run = _hotggml(repo, env, "pin", "set", "--continue", check=True)
    assert "the rebase left out alloc-free-blocks.patch" in run.stderr, run.stderr[-2000:]
    assert "alloc-free-blocks.patch" not in (repo / "patches" / "series").read_text()

    cached = state / "cache" / tarball.name  # the current pin's source now
    before = hashlib.sha256(cached.read_bytes()).hexdigest()
    impostor = tmp_path / "other" / tarball.name
    impostor.parent.mkdir()
    _new_pin_tarball(repo, impostor, lambda text: text + "// other bytes\n")
    run = _hotggml(repo, env, "pin", "set", str(impostor))
    assert run.returncode == 2 and f"the cache holds another {tarball.name}" in run.stderr, run.stderr[-2000:]
    assert hashlib.sha256(cached.read_bytes()).hexdigest() == before
    assert not (state / "pin-set").exists()

    (state / "pin-set").mkdir()
    (state / "pin-set" / "state.json").write_text("")
    for flag in ("--abort", "--continue"):
        run = _hotggml(repo, env, "pin", "set", flag)
        lines = run.stderr.strip().splitlines()
        assert run.returncode == 2 and len(lines) == 1 and "state.json is damaged" in lines[0], run.stderr[-2000:]
        assert f"delete {state / 'pin-set'}" in lines[0]
