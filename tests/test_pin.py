"""The pin: materialized deterministically, verified by tree hash, refused when tampered or dirty."""

from __future__ import annotations

import io
import re
import subprocess
import tarfile
from pathlib import Path

import pytest

from hotggml import gitutil, patches, paths, pin
from hotggml.errors import PinError

LOCAL_SDIST = Path("/tmp/dl") / pin.SDIST_FILE


def _sdist() -> Path | None:
    """The sdist to build the session pin from: a local copy, the cache, else None (pip)."""
    for candidate in (LOCAL_SDIST, paths.cache_dir() / pin.SDIST_FILE):
        if candidate.is_file():
            return candidate
    return None


@pytest.fixture(scope="session")
def pristine(tmp_path_factory) -> Path:
    """The pin materialized once per session (pip downloads into the real cache on first use)."""
    dest = tmp_path_factory.getbasetemp() / "pin" / "ggml"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(paths.STATE_ENV, str(tmp_path_factory.getbasetemp() / "session-state"))
        patch.delenv(pin.SDIST_ENV, raising=False)
        pin.fetch(_sdist(), dest=dest, cache_dir=paths.REPO_ROOT / ".hotggml" / "cache")
    return dest


@pytest.fixture(scope="session")
def sdist(pristine) -> Path:
    """The sdist the session pin came from: the local copy, or the one pip cached in the repository's
    .hotggml/cache (looked up there, not under a test's isolated state folder, where it never is)."""
    for candidate in (LOCAL_SDIST, paths.REPO_ROOT / ".hotggml" / "cache" / pin.SDIST_FILE):
        if candidate.is_file():
            return candidate
    raise AssertionError("the session pin was materialized, yet no sdist is where fetch caches it")


@pytest.fixture(autouse=True)
def isolated_state(tmp_path, monkeypatch):
    """Keep each test's locks and work trees out of the repository's .hotggml."""
    monkeypatch.setenv(paths.STATE_ENV, str(tmp_path / "state"))
    monkeypatch.delenv(pin.SDIST_ENV, raising=False)


def clone(source: Path, dest: Path) -> Path:
    """A cheap working copy of a pin (hard-linked objects), checked out."""
    repo = gitutil.clone_local(source, dest)
    gitutil.checkout_branch(repo, "pin", "HEAD")
    return dest


def commit_all(tree: Path) -> None:
    gitutil.commit_all(gitutil.open_repo(tree), "tamper", pin.PIN_IDENTITY)


def test_pin_from_sdist_is_deterministic(pristine):
    assert pin.verify(pristine) == pin.SDIST_PIN_COMMIT
    repo = gitutil.open_repo(pristine)
    assert gitutil.rev_parse(repo, pin.PIN_REF) == pin.SDIST_PIN_COMMIT
    for name, expected in pin.TREES.items():
        assert gitutil.tree_hash(repo, "HEAD", name) == expected


def test_fetch_over_verified_pin_does_nothing_offline(pristine):
    result = pin.fetch(dest=pristine, use_pip=False)
    assert (result.changed, result.source, result.commit) == (False, "existing", pin.SDIST_PIN_COMMIT)


def test_fetch_from_env_tarball_into_placeholder(sdist, tmp_path, monkeypatch):
    dest = tmp_path / "vendor" / "ggml"
    dest.mkdir(parents=True)  # an uninitialized submodule is an empty folder
    monkeypatch.setenv(pin.SDIST_ENV, str(sdist))
    result = pin.fetch(dest=dest, cache_dir=tmp_path / "empty-cache", use_pip=False)
    assert result.changed and result.commit == pin.SDIST_PIN_COMMIT
    assert not list(dest.parent.glob(".ggml.tmp-*"))


@pytest.mark.parametrize("path, tree", [("src/ggml.c", "src"), ("CMakeLists.txt", "CMakeLists.txt"),
                                        ("include/ggml.h", "include")])
def test_tampered_tree_is_refused_naming_the_tree(pristine, tmp_path, path, tree):
    copy = clone(pristine, tmp_path / "ggml")
    with open(copy / path, "a") as handle:
        handle.write("\n// tampered\n")
    commit_all(copy)
    with pytest.raises(PinError, match=f"pinned ggml tree '{tree}' is [0-9a-f]{{40}}, expected {pin.TREES[tree]}"):
        pin.verify(copy)


@pytest.mark.parametrize("path", ["ggml.pc.in", "examples/CMakeLists.txt", "scripts/release.sh", "docs/new-file.md"])
def test_a_committed_change_outside_the_named_trees_is_refused_naming_the_path(pristine, tmp_path, path):
    """The whole tree is verified: `patches apply` clones every path of vendor/ggml into the tree that is built, so
    a top-level file, examples/, scripts/ or a new file changed by a commit is no pin (it was 'verified' before)."""
    copy = clone(pristine, tmp_path / "ggml")
    with open(copy / path, "a") as handle:
        handle.write("\n# tampered\n")
    commit_all(copy)
    with pytest.raises(PinError, match=f"pinned ggml's whole tree is [0-9a-f]{{40}}, expected {pin.TREE} .*changed: "
                                       f"{re.escape(path)}; .*--force"):
        pin.verify(copy)
    with pytest.raises(PinError, match="whole tree"):
        pin.fetch(dest=copy, use_pip=False)
    with pytest.raises(PinError, match="whole tree"):
        patches.apply(tmp_path / "work" / "ggml", pin_dir=copy)


def test_the_whole_tree_hash_is_the_stock_sdists(pristine):
    """pin.json's whole-tree hash is the tree fetch commits from the pinned sdist (the session pin was made so)."""
    assert gitutil.rev_parse(gitutil.open_repo(pristine), "HEAD^{tree}") == pin.TREE


def test_tampered_tree_is_replaced_only_with_force(pristine, sdist, tmp_path):
    copy = clone(pristine, tmp_path / "ggml")
    (copy / "src" / "ggml.c").write_text("tampered\n")
    commit_all(copy)
    with pytest.raises(PinError, match="'src'.*--force"):
        pin.fetch(dest=copy, use_pip=False)
    result = pin.fetch(sdist, dest=copy, use_pip=False, force=True)
    assert result.changed and pin.verify(copy) == pin.SDIST_PIN_COMMIT


def test_dirty_tree_is_refused_naming_files(pristine, tmp_path):
    copy = clone(pristine, tmp_path / "ggml")
    with open(copy / "src" / "ggml-alloc.c", "a") as handle:
        handle.write("// local edit\n")
    (copy / "src" / "extra.c").write_text("int x;\n")
    with pytest.raises(PinError, match=r"dirty: src/extra.c, src/ggml-alloc.c"):
        pin.verify(copy)
    with pytest.raises(PinError, match="dirty"):  # never replaced over uncommitted work
        pin.fetch(dest=copy, use_pip=False, force=True)


def test_ignored_file_in_pinned_tree_is_dirty(pristine, tmp_path):
    copy = clone(pristine, tmp_path / "ggml")
    (copy / "src" / "arm_neon.h").write_text("/* ignored by ggml's .gitignore */\n")
    with pytest.raises(PinError, match="src/arm_neon.h"):
        pin.verify(copy)


def test_missing_env_tarball_fails_clearly(tmp_path, monkeypatch):
    monkeypatch.setenv(pin.SDIST_ENV, str(tmp_path / "nope.tar.gz"))
    with pytest.raises(PinError, match=f"{pin.SDIST_ENV}.*: no such file"):
        pin.fetch(dest=tmp_path / "ggml", cache_dir=tmp_path / "cache", use_pip=False)


def test_a_directory_given_as_the_sdist_is_called_one(tmp_path, monkeypatch):
    # a folder is not "missing": the message says what it is (--sdist, and the environment variable)
    with pytest.raises(PinError, match="a directory, not the tarball"):
        pin.fetch(tmp_path, dest=tmp_path / "ggml", cache_dir=tmp_path / "cache", use_pip=False)
    monkeypatch.setenv(pin.SDIST_ENV, str(tmp_path))
    with pytest.raises(PinError, match=f"{pin.SDIST_ENV}.*a directory, not the tarball"):
        pin.fetch(dest=tmp_path / "ggml", cache_dir=tmp_path / "cache", use_pip=False)
    assert not (tmp_path / "ggml").exists()


def test_no_source_says_where_to_put_the_tarball(tmp_path):
    with pytest.raises(PinError, match=f"put {pin.SDIST_FILE} in .*cache or set {pin.SDIST_ENV}.*pip"):
        pin.fetch(dest=tmp_path / "ggml", cache_dir=tmp_path / "cache", use_pip=False)
    assert not (tmp_path / "ggml").exists()


def test_wrong_checksum_is_refused(tmp_path):
    fake = tmp_path / pin.SDIST_FILE
    fake.write_bytes(b"not the sdist")
    with pytest.raises(PinError, match="sha256 .* expected " + pin.SDIST_SHA256):
        pin.fetch(fake, dest=tmp_path / "ggml", use_pip=False)


def test_interrupted_fetch_leaves_previous_state(sdist, tmp_path, monkeypatch):
    dest = tmp_path / "ggml"
    dest.mkdir()

    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(gitutil, "commit_all", boom)
    with pytest.raises(KeyboardInterrupt):
        pin.fetch(sdist, dest=dest, use_pip=False)
    assert dest.is_dir() and not any(dest.iterdir())
    assert not list(tmp_path.glob(".ggml.tmp-*"))


def _tar_with(tmp_path: Path, name: str) -> Path:
    path = tmp_path / "evil.tar.gz"
    with tarfile.open(path, "w:gz") as archive:
        info = tarfile.TarInfo(name)
        info.size = 4
        archive.addfile(info, io.BytesIO(b"evil"))
    return path


def test_extraction_refuses_path_traversal(tmp_path):
    evil = _tar_with(tmp_path, pin.SDIST_PREFIX + "../../../escape.txt")
    with pytest.raises(PinError, match="escapes"):
        pin.extract_vendor_tree(evil, tmp_path / "out")
    assert not (tmp_path / "escape.txt").exists()


def test_not_a_repository_is_refused(tmp_path):
    (tmp_path / "ggml").mkdir()
    with pytest.raises(PinError, match="not a git repository.*hotggml fetch"):
        pin.verify(tmp_path / "ggml")


def test_gitlink_is_the_records_upstream_commit():
    """vendor/ggml's gitlink (what a clone's `git submodule update --init` checks out) is upstream's commit for the
    pin as the record names it, never the commit fetch makes locally from the sdist."""
    sha = pin.gitlink()
    if sha is None:
        pytest.skip("not a git checkout (an installed package has no gitlink)")
    assert sha == pin.UPSTREAM_COMMIT, f"gitlink {sha} != pin.json upstream_commit {pin.UPSTREAM_COMMIT}"
    assert sha != pin.SDIST_PIN_COMMIT


def test_a_wrong_gitlink_is_refused_naming_both_commits(tmp_path):
    root = tmp_path / "checkout"
    subprocess.run(["git", "init", "--quiet", str(root)], check=True)
    local = pin.SDIST_PIN_COMMIT  # the locally made commit: the mistake the check exists for
    pin.set_gitlink(local, root)
    with pytest.raises(PinError) as err:
        pin.check_gitlink(pin.RECORD, root)
    assert local[:12] in str(err.value) and pin.UPSTREAM_COMMIT[:12] in str(err.value)
    pin.set_gitlink(pin.UPSTREAM_COMMIT, root)
    pin.check_gitlink(pin.RECORD, root)
    assert pin.gitlink(root) == pin.UPSTREAM_COMMIT
    assert pin.gitlink(tmp_path / "not-a-checkout") is None


def test_commit_all_keeps_the_gitlink(tmp_path):
    """A vendor/ggml whose commit is the locally made one (what fetch materializes) is not recorded by
    `git commit -a`: the gitlink stays upstream's (the trap that moved it once)."""
    root = tmp_path / "checkout"
    git = lambda *a: subprocess.run(["git", "-C", str(root), *a], check=True, capture_output=True, text=True).stdout
    subprocess.run(["git", "init", "--quiet", str(root)], check=True)
    vendor = root / "vendor" / "ggml"
    vendor.mkdir(parents=True)
    subprocess.run(["git", "init", "--quiet", str(vendor)], check=True)
    (vendor / "f").write_text("x")
    ident = ["-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "-C", str(vendor), *ident, "add", "f"], check=True)
    subprocess.run(["git", "-C", str(vendor), *ident, "commit", "--quiet", "-m", "local"], check=True)
    pin.set_gitlink(pin.UPSTREAM_COMMIT, root)  # stages it and protects it
    (root / "README").write_text("r")
    git("add", "README")
    subprocess.run(["git", "-C", str(root), *ident, "commit", "--quiet", "-am", "a commit -a"], check=True)
    assert git("ls-tree", "HEAD", "vendor/ggml").split()[2] == pin.UPSTREAM_COMMIT


def test_a_checkout_git_cannot_read_is_an_error_not_a_pass(tmp_path):
    """A .git that git refuses (here: not a repository at all) must not read as 'no gitlink, nothing to check'."""
    root = tmp_path / "broken"
    (root / ".git").mkdir(parents=True)
    with pytest.raises(PinError, match="git ls-files"):
        pin.check_gitlink(pin.RECORD, root)
