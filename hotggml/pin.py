"""The pinned upstream ggml: where its source comes from, and proof that it is the pin.

The pin is ggml v0.15.3. These machines reach PyPI but not GitHub, so besides an
initialized submodule the source may be the ggml-python 0.0.45 sdist, which carries
the same tree under vendor/ggml/. Whatever the source, the tree is accepted only when
the git tree hashes of src, include, cmake, tests and CMakeLists.txt equal upstream's, and the
whole tree's hash is the one fetch commits from the pin's source (or HEAD is upstream's commit).

A tree materialized from the sdist is committed with a fixed identity, date and
message, so its commit id is the same on every machine (patch commits on top are then
reproducible too). The pin commit is marked with refs/tags/hotggml-pin.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import lzma
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import git

from hotggml import gitutil, paths, procs
from hotggml.errors import PinError
from hotggml.pin_record import (  # noqa: F401 (the pin's constants live there; re-exported)
    RECORD, SDIST_ENV, SDIST_FILE, SDIST_PIN_COMMIT, SDIST_PREFIX, SDIST_REQUIREMENT, SDIST_SHA256, TAG, TREE, TREES,
    UPSTREAM_COMMIT, pin_message,
)

PIN_REF = "refs/hotggml/pin"  # private: `git push --tags` does not publish it
LEGACY_PIN_REF = "refs/tags/hotggml-pin"  # what older versions marked the pin with (a tag): moved on sight


def pin_ref(repo: git.Repo) -> str | None:
    """The commit PIN_REF marks in repo; a legacy tag is moved to PIN_REF (and deleted) on the way."""
    sha = gitutil.rev_parse(repo, PIN_REF)
    if sha is None:
        sha = gitutil.rev_parse(repo, LEGACY_PIN_REF)
        if sha is not None:
            gitutil.set_ref(repo, PIN_REF, sha)
            gitutil.run(repo, "update-ref", "-d", LEGACY_PIN_REF)
    return sha
PIN_BRANCH = "pin"
PIN_IDENTITY = gitutil.Identity("hotggml", "hotggml@invalid", "2025-01-01 00:00:00 +0000")
PIN_MESSAGE = pin_message(RECORD)

_TMP_PREFIX = ".{name}.tmp-"
_PIP_TIMEOUT_S = 600


@dataclass(frozen=True)
class FetchResult:
    """What fetch() did: the pin tree, its commit, where it came from, whether it changed."""

    path: Path
    commit: str
    source: str  # "existing", or "tarball <path>", or "pip"
    changed: bool


def verify(path: Path | str | None = None) -> str:
    """Check that `path` (default vendor/ggml) is the pinned ggml, clean; return its HEAD commit.

    Raises PinError when `path` is not a git repository, when a pinned tree differs
    (naming the tree, e.g. 'src'), or when the tree has uncommitted changes or
    untracked files (naming them).
    """
    path = Path(path) if path else paths.VENDOR_DIR
    repo = _open(path)
    _check_trees(repo, str(path), _FIX_FORCE)
    _check_clean(repo, path)
    return gitutil.rev_parse(repo, "HEAD")


# -- the checkout's gitlink -----------------------------------------------------------------

GITLINK_PATH = "vendor/ggml"  # the submodule's path in the checkout


def gitlink(root: Path | str = paths.REPO_ROOT) -> str | None:
    """The commit the checkout at root records for vendor/ggml in its index (the submodule's gitlink, what
    `git submodule update` checks out), or None when root is not a git checkout (an installed package).
    """
    if not Path(root, ".git").exists():
        return None
    run = _git_index(root, "ls-files", "--stage", "--", GITLINK_PATH)
    fields = run.stdout.split()
    if not (len(fields) >= 2 and fields[0] == "160000"):
        raise PinError(f"{root}: {GITLINK_PATH} is not a submodule gitlink in the index ({run.stdout.strip() or 'absent'}): "
                       "the checkout records the pin as a gitlink at upstream's commit")
    return fields[1]


def _git_index(root: Path | str, *args: str) -> subprocess.CompletedProcess:
    """git -C root ARGS on the checkout's index; PinError with git's own message when git cannot run it."""
    try:
        run = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True)
    except FileNotFoundError:
        raise PinError("git is not installed (the checkout's gitlink is read with it)") from None
    if run.returncode != 0:
        unsafe = gitutil.dubious_ownership(run.stderr, root)
        if unsafe is not None:
            raise unsafe
        why = (run.stderr.strip().splitlines() or ["no message"])[0]
        raise PinError(f"git {args[0]} in {root} failed: {why}")
    return run


def check_gitlink(record: dict = RECORD, root: Path | str = paths.REPO_ROOT) -> None:
    """Raise PinError unless the checkout's gitlink for vendor/ggml is the record's upstream_commit (the
    commit upstream has: a clone's `git submodule update --init` must find it there). Nothing to check
    outside a git checkout.
    """
    sha = gitlink(root)
    if sha is not None and sha != record["upstream_commit"]:
        raise PinError(f"the {GITLINK_PATH} gitlink is {sha[:12]}, but hotggml/pin.json records upstream "
                       f"{record['upstream_commit'][:12]} ({record['tag']}): a clone's `git submodule update` "
                       f"would look for a commit upstream does not have. Fix: git update-index --cacheinfo "
                       f"160000,{record['upstream_commit']},{GITLINK_PATH} and commit it")


def set_gitlink(sha: str, root: Path | str = paths.REPO_ROOT) -> None:
    """Stage `sha` as the checkout's gitlink for vendor/ggml (the user commits it with the record)."""
    _git_index(root, "update-index", "--add", "--cacheinfo", f"160000,{sha},{GITLINK_PATH}")
    protect_gitlink(root)


def protect_gitlink(root: Path | str = paths.REPO_ROOT) -> None:
    """Mark the checkout's vendor/ggml gitlink assume-unchanged (a flag of the local index, never committed):
    a vendor/ggml materialized from the sdist has another commit than upstream's, and `git commit -a` would
    record that commit as the gitlink (.gitmodules' `ignore = all` hides it from status, not from commit -a).
    Nothing outside a git checkout. Best effort: where git cannot write the index (a lock, another owner) it
    says so on stderr and goes on (the flag guards against a mistake that `patches check` also catches)."""
    try:
        if gitlink(root) is not None:
            _git_index(root, "update-index", "--assume-unchanged", GITLINK_PATH)
    except PinError as exc:
        print(f"hotggml: warning: vendor/ggml's gitlink is not protected from `git commit -a`: {exc}", file=sys.stderr)


def pin_commit(path: Path | str | None = None) -> str:
    """Return the commit id of the verified pin at `path` (default vendor/ggml).

    Raises PinError as verify() does.
    """
    return verify(path)


def fetch(sdist: Path | str | None = None, *, dest: Path | str | None = None,
          cache_dir: Path | str | None = None, use_pip: bool = True, force: bool = False,
          record: dict | None = None) -> FetchResult:
    """Materialize the pristine pin into `dest` (default vendor/ggml) and return what happened.

    Sources, first that works: `dest` already the verified pin (nothing to do); the
    tarball `sdist`, else $HOTGGML_GGML_SDIST, else <cache>/ggml_python-0.0.45.tar.gz;
    else `pip download` of ggml-python==0.0.45 into the cache (when use_pip).
    The tarball's sha256 is checked before extraction; the new tree replaces `dest`
    only once verified, so an interrupted fetch leaves the previous state as it was.
    `force` replaces a committed tree that is not the pin (never one with uncommitted work).

    Raises PinError: dirty or foreign tree at `dest`, no reachable source, wrong
    checksum, or an sdist whose trees do not match the pin.
    """
    record = record or RECORD
    dest = Path(dest) if dest else paths.VENDOR_DIR
    cache = Path(cache_dir) if cache_dir else paths.cache_dir()
    if dest.resolve() == paths.VENDOR_DIR.resolve():
        protect_gitlink()
    if sdist is not None:  # named on purpose: checked even when the tree is the pin already (no silent "verified")
        if not Path(sdist).is_file():
            raise PinError(f"{str(sdist) or repr(sdist)}: {_not_a_file(Path(sdist))} (the sdist tarball {record['source']['file']})")
        got = sha256_of(Path(sdist))
        if got != record["source"]["sha256"]:
            raise PinError(f"{sdist} is not the pin's sdist {record['source']['file']} (sha256 {got}, expected "
                           f"{record['source']['sha256']})")
    existing = _existing_pin(dest, force, record)
    if existing:
        return FetchResult(dest, existing, "existing", changed=False)
    tarball, source = _find_tarball(sdist, cache, use_pip, record)
    _check_sha256(tarball, record)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with paths.lock(dest):
        _remove_stale_temps(dest)
        commit = _materialize(tarball, dest, record)
    return FetchResult(dest, commit, source, changed=True)


def restore(record: dict, head: str | None, dest: Path | str | None = None) -> None:
    """Put back the pin of ``record`` at ``dest`` (default vendor/ggml), whose HEAD was ``head``, after a
    replacement by fetch was interrupted or done (``hotggml pin set --abort``): the previous tree itself where
    fetch's swap left it beside ``dest``, else the tree re-made from the record's source (the same commit: fetch's
    is fixed by the source); fetch's temporary trees go either way. Nothing to do when ``dest`` is that pin."""
    dest = Path(dest) if dest else paths.VENDOR_DIR
    head_of = lambda path: (gitutil.rev_parse(r, "HEAD") if (r := gitutil.open_repo(path)) is not None else None)
    with paths.lock(dest):
        old = dest.with_name(f".{dest.name}.old")
        if head is not None and head_of(dest) != head and old.is_dir() and head_of(old) == head:
            if dest.exists():
                aside = dest.with_name(f".{dest.name}.tmp-restore")
                procs.remove_tree(aside)
                os.rename(dest, aside)
            os.rename(old, dest)
        _remove_stale_temps(dest)
    if head is None or head_of(dest) != head:
        fetch(force=True, record=record, dest=dest)


# -- verification -------------------------------------------------------------------------

def _open(path: Path) -> git.Repo:
    repo = gitutil.open_repo(path)
    if repo is None:
        raise PinError(f"{path} is not a git repository holding the pinned ggml: run `hotggml fetch`")
    return repo


_FIX_FORCE = "this is not the pin; run `hotggml fetch --force` to replace it with the pristine pin"


def _fix_source(record: dict) -> str:
    source = record["source"]
    again = f"fetch {source['requirement']} again" if source.get("requirement") else f"get {source['file']} again"
    return f"this source does not carry ggml {record['tag']}; delete it and {again}"


def _check_trees(repo: git.Repo, where: str, fix: str, record: dict | None = None) -> None:
    """The committed tree at HEAD is the pin's: the named trees first (the clearer message), then the whole tree
    (record["tree"], every path: `patches apply` clones all of it into the work tree that is built), unless HEAD
    is upstream's own commit (a submodule checkout of upstream: its tree is upstream's by definition)."""
    record = record or RECORD
    head = gitutil.rev_parse(repo, "HEAD")
    if head is None:
        raise PinError(f"{where} has no commit: {fix}")
    found = gitutil.tree_entries(repo, "HEAD", list(record["trees"]))
    for name, expected in record["trees"].items():
        actual = found.get(name)
        if actual != expected:
            raise PinError(f"pinned ggml tree {name!r} is {actual or 'missing'}, expected {expected} "
                           f"(ggml {record['tag']}) in {where}: {fix}")
    tree = gitutil.rev_parse(repo, "HEAD^{tree}")
    if head != record["upstream_commit"] and tree != record["tree"]:
        raise PinError(f"pinned ggml's whole tree is {tree}, expected {record['tree']} (ggml {record['tag']}) in "
                       f"{where}: {_tree_difference(repo, record['tree'], tree)}; {fix}")


def _tree_difference(repo: git.Repo, expected: str, actual: str) -> str:
    """The paths that differ between two root trees, in words (the expected tree may be absent from repo)."""
    try:
        changed = gitutil.run(repo, "diff-tree", "-r", "--name-only", "--no-renames", "-z", expected, actual).split("\0")
    except git.exc.GitCommandError:
        top = [n for n in gitutil.run(repo, "ls-tree", "--name-only", "-z", actual).split("\0") if n]
        return f"other files than the pin's (top level: {', '.join(top[:12])})"
    changed = [name for name in changed if name]
    return "changed: " + ", ".join(changed[:10]) + (f" (+{len(changed) - 10} more)" if len(changed) > 10 else "")


def _check_clean(repo: git.Repo, path: Path) -> None:
    # Ignored files inside the pinned trees count as dirty: they would be built.
    dirty = gitutil.dirty_files(repo, ignored_in=list(TREES))
    if dirty:
        shown = ", ".join(dirty[:10]) + (f" (+{len(dirty) - 10} more)" if len(dirty) > 10 else "")
        raise PinError(
            f"pinned ggml tree {path} is dirty: {shown}; the pin is never edited in place: "
            f"discard these changes (git -C {path} checkout -- . && git -C {path} clean -fdx) "
            f"and make changes as patches in the work tree instead"
        )


def _existing_pin(dest: Path, force: bool, record: dict | None = None) -> str | None:
    """Return the commit when `dest` already is the verified pin; None when it may be replaced."""
    if not dest.exists() or not any(dest.iterdir()):
        return None
    repo = gitutil.open_repo(dest)
    if repo is None:
        if force:
            return None
        raise PinError(f"{dest} exists but is not a git repository: move it away, "
                       f"or run `hotggml fetch --force` to replace it")
    _check_clean(repo, dest)  # never throw away uncommitted work, even with force
    try:
        _check_trees(repo, str(dest), _FIX_FORCE, record)
    except PinError:
        if force:
            return None
        raise
    commit = gitutil.rev_parse(repo, "HEAD")
    if pin_ref(repo) != commit:
        gitutil.set_ref(repo, PIN_REF, commit)
    return commit


# -- sources ------------------------------------------------------------------------------

def _find_tarball(sdist: Path | str | None, cache: Path, use_pip: bool, record: dict) -> tuple[Path, str]:
    name = record["source"]["file"]
    explicit = sdist or os.environ.get(SDIST_ENV)
    if explicit:
        tarball = Path(explicit).expanduser()
        if not tarball.is_file():
            origin = "--sdist" if sdist else SDIST_ENV
            raise PinError(f"the ggml sdist given by {origin} ({tarball}): {_not_a_file(tarball)}; point it at "
                           f"{name}, or unset it to use {cache / name} or pip")
        # $HOTGGML_GGML_SDIST names one source; after `hotggml pin set` the pin may have another (in the cache)
        if sdist or sha256_of(tarball) == record["source"]["sha256"]:
            return tarball, f"tarball {tarball}"
        print(f"hotggml: {SDIST_ENV}={explicit} is not the pin's source {name} (its sha256 differs): looking in "
              f"{cache} and pip instead", file=sys.stderr, flush=True)
    cached = cache / name
    if cached.is_file():
        return cached, f"tarball {cached}"
    if not use_pip or not record["source"].get("requirement"):
        raise _no_source(cache, "pip is disabled" if not use_pip else "the pin's source is a tarball", record)
    return _pip_download(cache, record), "pip"


def _not_a_file(path: Path) -> str:
    """Why `path`, which is not a regular file, cannot be read as a tarball, in words."""
    if not str(path).strip() or str(path) == ".":  # Path("") is "."
        return "an empty name, not the tarball"
    return "a directory, not the tarball" if path.is_dir() else "not a regular file" if path.exists() else "no such file"


def _no_source(cache: Path, why: str, record: dict) -> PinError:
    source = record["source"]
    pip = (f", or check that pip's configured index serves {source['requirement']} (`{sys.executable} -m pip "
           f"download --no-deps --no-binary :all: {source['requirement']}`)" if source.get("requirement") else "")
    return PinError(f"no source for the pinned ggml ({why}): put {source['file']} in {cache} or set {SDIST_ENV} "
                    f"to its path{pip}")


def _pip_download(cache: Path, record: dict) -> Path:
    # Through pip, by name: the index is whatever pip is configured with, never ours to choose.
    source = record["source"]
    cache.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               source["requirement"], "-d", str(cache)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=_PIP_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise _no_source(cache, f"pip download failed: {exc}", record) from exc
    tarball = cache / source["file"]
    if done.returncode != 0 or not tarball.is_file():
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise _no_source(cache, "pip download failed: " + " | ".join(tail), record)
    return tarball


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _check_sha256(tarball: Path, record: dict | None = None) -> None:
    source = (record or RECORD)["source"]
    got = sha256_of(tarball)
    if got != source["sha256"]:
        raise PinError(f"{tarball} has sha256 {got}, expected {source['sha256']} "
                       f"({source['file']}): delete it and run `hotggml fetch` again")


# -- materialization ----------------------------------------------------------------------

def _remove_stale_temps(dest: Path) -> None:
    # Left by an interrupted fetch; we hold the lock, so no live fetch owns them (a killed fetch's git
    # children may still be writing into them: procs.remove_tree ends those first)
    for stale in dest.parent.glob(_TMP_PREFIX.format(name=dest.name) + "*"):
        procs.remove_tree(stale)
    procs.remove_tree(dest.with_name(f".{dest.name}.old"))


def _materialize(tarball: Path, dest: Path, record: dict | None = None) -> str:
    record = record or RECORD
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=_TMP_PREFIX.format(name=dest.name)))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the tree is not
    try:
        extract_vendor_tree(tarball, tmp, record["source"]["prefix"])
        repo = gitutil.init_repo(tmp, initial_branch=PIN_BRANCH)
        commit = gitutil.commit_all(repo, pin_message(record), PIN_IDENTITY)
        _check_trees(repo, str(tarball), _fix_source(record), record)
        gitutil.set_ref(repo, PIN_REF, commit)
        repo.close()
        _swap_into_place(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return commit


@contextlib.contextmanager
def open_tarball(tarball: Path | str) -> Iterator[tarfile.TarFile]:
    """tarfile.open(tarball) for reading, any compression; PinError naming the file when it is not a tarball,
    is empty, or ends early (also while its members are read inside the with-block)."""
    try:
        with tarfile.open(tarball, "r:*") as archive:
            yield archive
    except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile, lzma.LZMAError) as exc:
        if Path(tarball).stat().st_size == 0:
            why = "it is empty"
        elif isinstance(exc, (EOFError, zlib.error)) or "unexpected end" in str(exc):
            why = "it ends early: a truncated download or copy"
        else:
            why = "it is not a tar archive (plain, gz, bz2 or xz)"
        raise PinError(f"{tarball} is not a readable tarball: {why}; give the ggml sdist (.tar.gz) or a tarball "
                       "of a ggml tree") from None


def extract_vendor_tree(tarball: Path | str, out: Path | str, prefix: str = SDIST_PREFIX) -> int:
    """Extract the members under `prefix` of `tarball` into `out`; return the file count.

    Only regular files and folders are taken; a member that would land outside
    `out` (absolute path, '..') or is a link is refused with PinError. The executable
    bit is kept (git records it), other mode bits are not.
    """
    out = Path(out)
    count = 0
    with open_tarball(tarball) as archive:
        for member in archive:
            if not member.name.startswith(prefix):
                continue
            relative = _safe_relative(member.name[len(prefix):], member.name)
            if relative is None:
                continue
            target = out / relative
            if member.isdir():
                target.mkdir(parents=True, exist_ok=True)
            elif member.isfile():
                _extract_file(archive, member, target)
                count += 1
            else:
                raise PinError(f"{tarball}: member {member.name} is a link or device; refusing to extract it")
    if count == 0:
        raise PinError(f"{tarball} has no members under {prefix}: it does not carry the pinned ggml tree")
    return count


def _safe_relative(name: str, full: str) -> PurePosixPath | None:
    relative = PurePosixPath(name)
    if not name or name == "/":
        return None
    if relative.is_absolute() or ".." in relative.parts:
        raise PinError(f"sdist member {full!r} escapes the extraction folder; refusing the tarball")
    return relative


def _extract_file(archive: tarfile.TarFile, member: tarfile.TarInfo, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    source = archive.extractfile(member)
    with open(target, "wb") as handle:
        shutil.copyfileobj(source, handle)
    os.chmod(target, 0o755 if member.mode & 0o111 else 0o644)


def _swap_into_place(tmp: Path, dest: Path) -> None:
    # rename(2) replaces a missing or empty folder atomically (the submodule placeholder).
    if dest.exists() and any(dest.iterdir()):
        # Only reached with force (a committed foreign tree): keep it until the new one is in.
        old = dest.with_name(f".{dest.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(dest, old)
        os.rename(tmp, dest)
        shutil.rmtree(old, ignore_errors=True)
        return
    os.rename(tmp, dest)
