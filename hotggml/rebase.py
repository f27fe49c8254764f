"""Moving the fork onto a new pin: ``hotggml pin set SOURCE``, ``--continue``, ``--abort``.

SOURCE is a tarball holding a ggml tree (an sdist with ``<name>/vendor/ggml/``, or a plain source tarball
with one top folder) or a commit of the repository at vendor/ggml. The new tree is committed with the fixed
identity fetch uses (so its commit is the same on every machine), its tree hashes computed, and the series
re-applied onto it in the work repo by ``git rebase`` (a 3-way merge per patch). On a conflict the rebase
stops, naming the patch and the files, and the work repo is left as git leaves it: resolve with ordinary git
(edit, ``git add``), then ``hotggml pin set --continue``; or ``hotggml pin set --abort``, which restores the
previous pin record, series and work repo byte for byte (builds are keyed by pin and series and never
touched). Only when the rebase ends well are patches/ re-exported, the pin's record (hotggml/pin.json)
rewritten and vendor/ggml replaced by the new pin. The new pin's upstream head is marked in the work repo by
the private ref PIN_REF (``refs/hotggml/...``: ``git push --tags`` does not publish it).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import git

from hotggml import gitutil, patches, paths, pin, pin_record, procs
from hotggml.errors import PatchError, PinError
from hotggml.series import conflict_markers

NEW_PIN_REF = "refs/hotggml/new-pin"
STATE_NAME = "pin-set"
CACHE_ADDED = "cache-added"  # in the state folder: the tarball this pin set copied into the cache


@dataclass(frozen=True)
class Outcome:
    """What pin set did: 'done' (record, series and vendor/ggml moved) or 'conflict' (stopped)."""

    status: str
    record: dict
    patch: str | None = None       # the patch whose commit stopped the rebase
    files: tuple[str, ...] = ()    # its conflicting files
    dropped: tuple[str, ...] = ()  # done: patches of the old series the rebase left out (emptied, or skipped)


def state_dir() -> Path:
    """The folder holding a pin set in progress: state.json and the series as it was."""
    return paths.state_dir() / STATE_NAME


def in_progress() -> bool:
    """Whether a pin set was started and neither finished nor aborted (stopped at a conflict, or killed)."""
    return (state_dir() / "state.json").is_file()


def refuse_if_in_progress(command: str) -> None:
    """Raise PinError naming the pin set in progress: `command` would change or use the pin, series or work repo
    it holds half-moved (fetch, patches apply / export / check, build)."""
    if not in_progress():
        return
    try:
        tag = _read_state()["record"]["tag"]
    except (PinError, KeyError, ValueError):
        tag = "a new pin"
    raise PinError(f"a `hotggml pin set` to ggml {tag} is in progress (stopped at a conflict, or interrupted): "
                   f"`hotggml {command}` would work on its half-moved pin, series or work repo; finish it with "
                   "`hotggml pin set --continue` or undo it with `hotggml pin set --abort` first")


# -- the new pin ----------------------------------------------------------------------------

def _tree_prefix(tarball: Path) -> str:
    """The folder of the ggml tree inside tarball: ``<x>/vendor/ggml/`` (an sdist) or ``<top>/``."""
    with pin.open_tarball(tarball) as archive:
        names = archive.getnames()
    for name in names:
        if name.endswith("/vendor/ggml/CMakeLists.txt"):
            return name[: -len("CMakeLists.txt")]
    tops = {n.split("/", 1)[0] for n in names}
    if len(tops) == 1:
        top = tops.pop()
        if f"{top}/CMakeLists.txt" in names and any(n.startswith(f"{top}/src/") for n in names):
            return f"{top}/"
    raise PinError(f"{tarball} holds no ggml tree (neither <name>/vendor/ggml/ nor one top folder with "
                   "CMakeLists.txt and src/)")


def _record_for_tarball(tarball: Path, tag: str | None, upstream: str | None) -> tuple[dict, Path]:
    """The new pin's record, and a repository holding its commit (made exactly as fetch will make it)."""
    prefix = _tree_prefix(tarball)
    scratch = procs.scratch_dir("hotggml-new-pin-")
    try:
        return _record_in(scratch, tarball, prefix, tag, upstream), scratch
    except BaseException:  # a bad tree, a failed git or Ctrl-C: the scratch copy (tens of MB) goes with it
        shutil.rmtree(scratch, ignore_errors=True)
        raise


def _record_in(scratch: Path, tarball: Path, prefix: str, tag: str | None, upstream: str | None) -> dict:
    """_record_for_tarball's record, the tree extracted and committed in scratch."""
    pin.extract_vendor_tree(tarball, scratch, prefix)
    repo = gitutil.init_repo(scratch, initial_branch=pin.PIN_BRANCH)
    gitutil.run(repo, "add", "-A")
    root_tree = gitutil.run(repo, "write-tree")
    missing = [name for name in pin_record.TREE_NAMES if not (scratch / name).exists()]
    if missing:  # as a commit source lacking them is told (git's rev-parse error named no cause)
        raise PinError(f"{tarball} lacks {', '.join(missing)}: not a ggml tree")
    trees = {name: gitutil.run(repo, "rev-parse", f"{root_tree}:{name}") for name in pin_record.TREE_NAMES}
    record = {
        "tag": tag or Path(tarball).name.removesuffix(".tar.gz").removesuffix(".tgz"),
        "upstream_commit": upstream or root_tree,  # without upstream's id, the tree's own (hex, stable)
        "trees": trees,
        "tree": root_tree,
        "source": {"kind": "tarball", "file": Path(tarball).name, "sha256": pin.sha256_of(tarball), "prefix": prefix},
        "pin_commit": "",
    }
    record["pin_commit"] = gitutil.commit_all(repo, pin_record.pin_message(record), pin.PIN_IDENTITY)
    repo.close()
    return record


def _record_for_commit(commit: str, tag: str | None) -> tuple[dict, Path]:
    """The new pin from a commit of vendor/ggml's repository (upstream history fetched there)."""
    repo = gitutil.open_repo(paths.VENDOR_DIR)
    sha = gitutil.rev_parse(repo, commit) if repo is not None else None
    if sha is None:
        raise PinError(f"{commit} is neither a tarball nor a commit of {paths.VENDOR_DIR}: fetch upstream there "
                       "first (git -C vendor/ggml fetch ...), or give a source tarball")
    trees = gitutil.tree_entries(repo, sha, list(pin_record.TREE_NAMES))
    missing = [n for n in pin_record.TREE_NAMES if n not in trees]
    if missing:
        raise PinError(f"commit {sha[:12]} lacks {', '.join(missing)}: not a ggml tree")
    record = {"tag": tag or sha[:12], "upstream_commit": sha, "trees": trees,
              "tree": gitutil.run(repo, "rev-parse", f"{sha}^{{tree}}"),
              "source": {"kind": "commit", "file": "", "sha256": "", "prefix": ""}, "pin_commit": sha}
    return record, paths.VENDOR_DIR


# -- the rebase -----------------------------------------------------------------------------

def start(source: str, *, tag: str | None = None, upstream: str | None = None) -> Outcome:
    """Rebase the series onto the pin made from source (a tarball path, or a commit of vendor/ggml).

    A source whose tree is the current pin's (its own sdist, the vendor tree's HEAD, upstream's commit) changes
    nothing: Outcome 'same'. Otherwise the pin set is a transaction: state.json (written before the rebase
    starts) holds what --abort needs to put back the record, patches/, vendor/ggml (and its gitlink) and the
    work repo as they were, from any point, a kill -9 included; --continue finishes from any point of _finish.

    Raises PinError (a bad source, a rebase already in progress) and PatchError (a work repo with
    uncommitted changes or commits not exported, which the rebase would carry or lose).
    """
    if in_progress():
        raise PinError("a `hotggml pin set` is in progress: finish it with --continue or undo it with --abort")
    upstream = upstream.lower() if upstream is not None else None  # git writes ids in lower case
    if upstream is not None and not re.fullmatch(r"[0-9a-f]{40}", upstream):  # stored in the record and the gitlink
        raise PinError(f"--upstream-commit must be a full 40-hex-digit commit id, got {upstream!r}")
    tree = patches.default_tree()
    repo = _clean_work_repo(tree)
    old_pin = pin.pin_ref(repo)
    is_tarball = Path(source).is_file()
    record, origin = (_record_for_tarball(Path(source), tag, upstream) if is_tarball
                      else _record_for_commit(source, tag))
    try:
        same = _stage_new_pin(repo, source, record, origin, is_tarball)
    finally:  # the tarball's scratch repository, whatever happened (its commit is fetched by then, or not needed)
        if is_tarball:
            shutil.rmtree(origin, ignore_errors=True)
    if same is not None:
        return same
    vendor = gitutil.open_repo(paths.VENDOR_DIR)
    _write_state({"record": record, "old_pin": old_pin, "old_head": gitutil.rev_parse(repo, "HEAD"),
                  "old_config": {key: gitutil.config_get(repo, key)
                                 for key in (patches.CONFIG_SERIES, patches.CONFIG_PIN, patches.CONFIG_HEAD)},
                  "old_record": pin_record.RECORD_FILE.read_text(), "old_gitlink": pin.gitlink(),
                  "old_vendor_head": gitutil.rev_parse(vendor, "HEAD") if vendor is not None else None})
    return _rebase(repo, ["rebase", "--committer-date-is-author-date", "--onto", NEW_PIN_REF, old_pin,
                          patches.WORK_BRANCH], record)


def _stage_new_pin(repo, source: str, record: dict, origin: Path, is_tarball: bool) -> Outcome | None:
    """Outcome 'same' for the current pin's tree; else the state folder made and the new pin's commit fetched
    into the work repo (NEW_PIN_REF) from origin: None."""
    current = pin_record.read()
    # the same tree, or (a commit source) upstream's own commit of the current pin, whose tree is the pin's
    same_commit = not is_tarball and record["upstream_commit"] == current["upstream_commit"]
    if record["tree"] == current["tree"] or same_commit:
        return Outcome("same", current)  # never a record of the same tree under an invented identity
    cached = paths.cache_dir() / record["source"]["file"]
    if is_tarball and cached.is_file() and pin.sha256_of(cached) != record["source"]["sha256"]:
        # (the current pin's own sdist, say: overwritten, no fetch could make the old pin again, offline)
        raise PinError(f"the cache holds another {cached.name} ({cached}): a source of its own name is another "
                       "pin's; rename the tarball and run `hotggml pin set` again")
    state = state_dir()
    if state.exists():
        shutil.rmtree(state)
    state.mkdir(parents=True)
    shutil.copytree(paths.PATCHES_DIR, state / "patches")  # the series as it was: --abort puts it back
    if is_tarball:
        cached = paths.cache_dir() / record["source"]["file"]
        cached.parent.mkdir(parents=True, exist_ok=True)
        if not cached.is_file():
            shutil.copyfile(source, cached)  # fetch finds the new pin's source here from now on
            (state / CACHE_ADDED).write_text(cached.name)  # --abort takes it out again: no pin's source then
    want = f"refs/heads/{pin.PIN_BRANCH}" if is_tarball else record["pin_commit"]
    gitutil.run(repo, "fetch", "--quiet", "--no-tags", str(origin), f"+{want}:{NEW_PIN_REF}",
                config={"uploadpack.allowAnySHA1InWant": "true"})
    return None


def resume() -> Outcome:
    """--continue: carry on after the conflicts were resolved and `git add`ed in the work repo."""
    state = _read_state()
    repo = gitutil.open_repo(patches.default_tree())
    if repo is None:
        raise PinError(f"{patches.default_tree()} is gone: run `hotggml pin set --abort`")
    unmerged = gitutil.run(repo, "diff", "--name-only", "--diff-filter=U")
    if unmerged:
        raise PatchError(f"still unresolved in {patches.default_tree()}: {', '.join(unmerged.split())}; edit them, "
                         "`git add` them, then `hotggml pin set --continue`")
    marked = _files_with_conflict_markers(gitutil.run(repo, "diff", "--cached", "-U0"))
    if marked:  # `git add`ed unresolved: git takes it, and the series would carry the markers
        raise PatchError(f"conflict markers are still in what is staged in {patches.default_tree()} "
                         f"({', '.join(marked)}): resolve them, `git add` again, then `hotggml pin set --continue`")
    if not (Path(repo.git_dir) / "rebase-merge").is_dir():
        return _finish(repo, state["record"])
    return _rebase(repo, ["rebase", "--continue"], state["record"])


def abort() -> dict:
    """--abort: the previous pin record (and the gitlink), series, vendor/ggml and work repo, byte for byte, from
    wherever the pin set stopped (a conflict, or a kill at any point: every step here can be redone, and the
    state goes last). Returns the restored record."""
    state = _read_state()
    repo = gitutil.open_repo(patches.default_tree())
    if repo is not None:
        git_dir = Path(repo.git_dir)
        if (git_dir / "rebase-merge").is_dir() or (git_dir / "rebase-apply").is_dir():
            try:
                gitutil.run(repo, "rebase", "--abort")
            except git.exc.GitCommandError:  # a rebase killed mid-step: its leftovers go, the checkout below resets
                shutil.rmtree(git_dir / "rebase-merge", ignore_errors=True)
                shutil.rmtree(git_dir / "rebase-apply", ignore_errors=True)
        gitutil.run(repo, "checkout", "--quiet", "--force", "-B", patches.WORK_BRANCH, state["old_head"])
        gitutil.set_ref(repo, pin.PIN_REF, state["old_pin"])
        gitutil.run(repo, "update-ref", "-d", NEW_PIN_REF)
        for key, value in state.get("old_config", {}).items():
            if value is not None:
                gitutil.config_set(repo, {key: value})
            elif gitutil.config_get(repo, key) is not None:
                gitutil.run(repo, "config", "--local", "--unset-all", key)
        repo.close()
    _restore_patches(state_dir() / "patches")
    old_record = pin_record.RECORD
    if "old_record" in state:
        if pin_record.RECORD_FILE.read_text() != state["old_record"]:
            _write_text_atomic(pin_record.RECORD_FILE, state["old_record"])
        old_record = json.loads(state["old_record"])
        if state.get("old_gitlink") and pin.gitlink() != state["old_gitlink"]:
            pin.set_gitlink(state["old_gitlink"])
        pin.restore(old_record, state.get("old_vendor_head"))
    added = state_dir() / CACHE_ADDED
    if added.is_file():  # a corrected tarball of the same name is then another pin set's, not refused
        (paths.cache_dir() / added.read_text().strip()).unlink(missing_ok=True)
    (state_dir() / "state.json").unlink()
    shutil.rmtree(state_dir(), ignore_errors=True)
    return pin_record.read()


def _rebase(repo: git.Repo, args: list[str], record: dict) -> Outcome:
    env = {**pin.PIN_IDENTITY.committer_env(with_date=False), "GIT_EDITOR": "true"}
    try:
        gitutil.run(repo, *args, env=env)
    except git.exc.GitCommandError:
        stopped = Path(repo.git_dir) / "rebase-merge" / "stopped-sha"
        if not (Path(repo.git_dir) / "rebase-merge").is_dir():
            raise
        sha = stopped.read_text().strip() if stopped.is_file() else gitutil.rev_parse(repo, "REBASE_HEAD")
        name = _patch_name(repo, sha)
        files = tuple(gitutil.run(repo, "diff", "--name-only", "--diff-filter=U").split())
        return Outcome("conflict", record, name, files)
    return _finish(repo, record)


def _finish(repo: git.Repo, record: dict) -> Outcome:
    """The rebase ended well: the work repo's pin ref moves, patches/ is re-exported, the record rewritten,
    vendor/ggml replaced by the new pin; the state goes, last. Every step can be redone: a _finish killed at any
    point is finished by --continue (or undone by --abort)."""
    gitutil.set_ref(repo, pin.PIN_REF, record["pin_commit"])
    patches.export(tree=patches.default_tree(), force=True)  # patches/ may already hold this export (--continue)
    # git drops a commit a resolution emptied (or one `git rebase --skip`ped) without a word: said by name
    before = patches.series_entries(state_dir() / "patches") if (state_dir() / "patches").is_dir() else []
    dropped = tuple(name for name in before if name not in patches.series_entries())
    series = patches.series_hash()
    gitutil.config_set(repo, {patches.CONFIG_SERIES: series, patches.CONFIG_PIN: record["pin_commit"],
                              patches.CONFIG_HEAD: gitutil.rev_parse(repo, "HEAD")})
    repo.close()
    pin_record.write(record)
    if pin.gitlink() is not None:  # staged beside the record: the user commits both
        try:
            pin.set_gitlink(record["upstream_commit"])
        except PinError as exc:  # the state stays: `pin set --continue` finishes again
            raise PinError(f"{exc}; the rebase is done and patches/ and hotggml/pin.json are written: fix that, "
                           "then `hotggml pin set --continue` stages the gitlink") from None
    if record["source"]["kind"] != "commit":
        pin.fetch(force=True, record=record)
    work = gitutil.open_repo(patches.default_tree())
    gitutil.run(work, "update-ref", "-d", NEW_PIN_REF)
    work.close()
    (state_dir() / "state.json").unlink()
    shutil.rmtree(state_dir(), ignore_errors=True)
    return Outcome("done", record, dropped=dropped)


def _patch_name(repo: git.Repo, sha: str) -> str:
    for line in gitutil.commit_message(repo, sha).splitlines():
        if line.startswith("Patch-Name:"):
            return line.split(":", 1)[1].strip()
    return sha[:12]


def _files_with_conflict_markers(diff: str) -> list[str]:
    """The files of a diff whose added lines hold merge conflict markers."""
    files = []
    for section in re.split(r"^diff --git ", diff, flags=re.M)[1:]:
        target = re.search(r"^\+\+\+ (?:b/)?(.+)$", section, re.M)
        if target and conflict_markers(section):
            files.append(target.group(1))
    return files


def _clean_work_repo(tree: Path) -> git.Repo:
    repo = gitutil.open_repo(tree)
    if repo is None or pin.pin_ref(repo) is None:
        raise PatchError(f"{tree} is not a patched work tree: run `hotggml patches apply` first")
    dirty = gitutil.dirty_files(repo)
    if dirty:
        raise PatchError(f"work tree {tree} has uncommitted changes ({', '.join(dirty[:10])}): commit and export "
                         "them, or discard them, before moving the pin")
    if patches.export(dry_run=True, tree=tree):
        raise PatchError(f"work tree {tree} and patches/ differ: `hotggml patches export` first if the work tree has "
                         "the newer commits, `hotggml patches apply` if patches/ was edited since the tree was made")
    return repo


def _restore_patches(saved: Path) -> None:
    for path in paths.PATCHES_DIR.iterdir():
        if path.is_file() and not (saved / path.name).exists():
            path.unlink()
    for path in saved.iterdir():
        target = paths.PATCHES_DIR / path.name
        if not target.is_file() or target.read_bytes() != path.read_bytes():
            _write_bytes_atomic(target, path.read_bytes())


def _write_bytes_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(data)
    tmp.replace(path)


def _write_state(state: dict) -> None:
    _write_text_atomic(state_dir() / "state.json", json.dumps(state, indent=1) + "\n")


def _write_text_atomic(path: Path, text: str) -> None:
    """path's new text, whole or not at all (a temporary file beside it, renamed over it)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    tmp.replace(path)


STATE_KEYS = ("record", "old_pin", "old_head")  # what --continue and --abort cannot do without


def _read_state() -> dict:
    path = state_dir() / "state.json"
    try:
        state = json.loads(path.read_text())
    except FileNotFoundError:
        raise PinError("no `hotggml pin set` in progress") from None
    except (ValueError, UnicodeDecodeError) as exc:
        state = exc
    if not isinstance(state, dict) or any(key not in state for key in STATE_KEYS):
        raise PinError(f"{path} is damaged (not the state a pin set writes): --continue and --abort cannot use it; "
                       f"delete {state_dir()}, then `hotggml patches apply --force` rebuilds the work repo from "
                       "patches/ (check `git status` of patches/ and hotggml/pin.json first: a pin set may have "
                       "rewritten them)")
    return state
