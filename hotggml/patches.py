"""The patch series: load it, apply it onto the pin as commits, check it, export it back.

patches/series names the patches in order (one file a line, `#` comments allowed).
Each patch is `git format-patch` output whose commit message carries trailers:

    Patch-Name: <name>            equal to the file's stem
    Upstream-Status: submit       where the patch is bound: `submit` (ggml upstream) or `fork-only`
    Marker: <path>: <string>      <string> must be in <path> once this patch is applied

The patched work tree (WORK_DIR/ggml by default) is a clone of the pin with one
commit per patch on branch `hotggml`; refs/hotggml/pin marks the pin. Commit
ids are deterministic (fixed committer, committer date = author date), and export
uses fixed format-patch flags, so apply-then-export reproduces the files byte for byte.

git's exit status is never taken as proof: after every patch the new commit must
change the files the patch names, and its markers must be present.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import git

from hotggml import gitutil, paths, pin, procs
from hotggml.errors import PatchError
from hotggml.series import (SERIES_FILE, check_lf, conflict_markers, patch_break, read_utf8, series_entries,  # noqa: F401
                            series_hash, series_hash_v1)  # (re-exported)

SUFFIX = ".patch"
WORK_BRANCH = "hotggml"
COMMITTER = gitutil.Identity("hotggml", "hotggml@invalid", "")  # date: the patch's author date
CONFIG_SERIES = "hotggml.serieshash"
CONFIG_PIN = "hotggml.pin"
CONFIG_HEAD = "hotggml.head"
CONFIG_EXPORTING = "hotggml.exporting"  # the HEAD an export is writing into patches/ (unset when it is done)

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_TRAILER_RE = re.compile(r"^(Patch-Name|Marker|Upstream-Status):[ \t]*(.*?)\s*$")
UPSTREAM_STATUSES = ("submit", "fork-only")
# How `git am` names the file a hunk failed on (LC_ALL=C messages).
_FAILED_RES = (re.compile(r"^error: patch failed: (.+):\d+$"),
               re.compile(r"^error: (.+): (?:patch does not apply|does not exist in index|already exists "
                          r"in (?:index|working directory)|No such file or directory)$"))

APPLIED, NOT_APPLIED, STALE, NOT_IN_SERIES = "applied", "not applied", "stale", "not in series"


@dataclass(frozen=True)
class Marker:
    """A string that must exist in a file of the patched tree."""

    path: str
    text: str

    def __str__(self) -> str:
        return f"{self.path}: {self.text}"


@dataclass(frozen=True)
class Patch:
    """One entry of the series, parsed from its file."""

    name: str
    path: Path
    subject: str
    markers: tuple[Marker, ...]
    sha256: str
    upstream: str = "submit"  # Upstream-Status: submit or fork-only


@dataclass(frozen=True)
class ApplyResult:
    """A patched tree: where, on which pin, from which series, and the commit of each patch."""

    tree: Path
    pin_commit: str
    series_hash: str
    commits: tuple[tuple[str, str], ...]  # (patch name, commit id), in series order
    already_applied: bool


@dataclass(frozen=True)
class PatchStatus:
    """State of one patch in a work tree: applied / not applied / stale / not in series."""

    name: str
    state: str
    markers: tuple[tuple[Marker, bool], ...]

    @property
    def markers_ok(self) -> bool:
        """True when every marker of the patch is present in the work tree."""
        return all(present for _, present in self.markers)


def default_tree() -> Path:
    """Return the default patched work tree, WORK_DIR/ggml."""
    return paths.work_dir() / "ggml"


# -- the series -------------------------------------------------------------------------

def load_series(patches_dir: Path | str | None = None) -> list[Patch]:
    """Parse every patch named by the series, in order.

    Raises PatchError naming the file when one is missing, has CRLF, is not format-patch
    output, has no or a wrong Patch-Name trailer, or declares no Marker.
    """
    patches_dir = Path(patches_dir or paths.PATCHES_DIR)
    return [parse_patch(patches_dir / entry) for entry in series_entries(patches_dir)]


def parse_patch(path: Path | str) -> Patch:
    """Parse one format-patch file into a Patch (see load_series for the errors raised)."""
    path = Path(path)
    if path.suffix != SUFFIX or not path.is_file():
        raise PatchError(f"{path}: listed in the series but there is no such {SUFFIX} file")
    check_lf(path)
    data = path.read_bytes()
    text = read_utf8(path)
    if not text.startswith("From "):
        raise PatchError(f"{path} is not `git format-patch` output: re-export it with `hotggml patches export`")
    markers_left = conflict_markers(text)
    if markers_left:
        raise PatchError(f"{path} adds a merge conflict marker (line {markers_left[0]}): a conflict was committed "
                         "unresolved; resolve it in the work tree, commit, and export again")
    subject, body = _split_message(text)
    name, markers, upstream = _trailers(body, path.name)
    if name != path.stem:
        raise PatchError(f"{path}: Patch-Name is {name!r} but the file is {path.name}: "
                         f"they must match (rename the file or fix the trailer)")
    return Patch(name, path, subject, markers, hashlib.sha256(data).hexdigest(), upstream)


def _split_message(text: str) -> tuple[str, list[str]]:
    """Return (subject, body lines) of an mbox patch; the body stops where the diff starts."""
    lines = text.split("\n")
    subject, index = [], 1
    while index < len(lines) and lines[index]:
        line = lines[index]
        if line.startswith("Subject:"):
            subject = [line[len("Subject:"):].strip()]
        elif subject and line[:1] in (" ", "\t"):  # folded header line
            subject.append(line.strip())
        index += 1
    body = []
    for line in lines[index + 1:]:
        if line == "---" or line.startswith("diff --git "):
            break
        body.append(line)
    return " ".join(subject), body


def _trailers(body: list[str], where: str) -> tuple[str, tuple[Marker, ...], str]:
    name, markers, upstream = None, [], None
    for line in body:
        match = _TRAILER_RE.match(line)
        if not match:
            continue
        key, value = match.groups()
        if key == "Patch-Name":
            if name is not None:
                raise PatchError(f"{where} has two Patch-Name trailers: keep one")
            name = value
        elif key == "Upstream-Status":
            if upstream is not None:
                raise PatchError(f"{where} has two Upstream-Status trailers: keep one")
            upstream = value
        else:
            markers.append(_parse_marker(value, where))
    if not name:
        raise PatchError(f"{where} has no `Patch-Name: <name>` trailer: add one to the commit message")
    if not _NAME_RE.match(name):
        raise PatchError(f"{where}: Patch-Name {name!r} is not a plain file stem (letters, digits, . _ -, starting with a letter or digit)")
    if not markers:
        raise PatchError(f"{where} declares no `Marker: <path>: <string>` trailer: add at least one "
                         f"string the patch puts in the tree, so CI can tell it is applied")
    if upstream not in UPSTREAM_STATUSES:
        raise PatchError(f"{where}: `Upstream-Status: {upstream or ''}` must say where the patch is bound: "
                         f"one of {', '.join(UPSTREAM_STATUSES)}")
    return name, tuple(markers), upstream


def _parse_marker(value: str, where: str) -> Marker:
    path, sep, text = value.partition(": ")
    path = path.strip()
    if not sep or not path or not text:
        raise PatchError(f"{where}: marker {value!r} is not `Marker: <path>: <string>`")
    if path.startswith("/") or ".." in path.split("/"):
        raise PatchError(f"{where}: marker path {path!r} must be relative to the ggml tree")
    return Marker(path, text)


# -- applying ---------------------------------------------------------------------------

def apply_series(tree: Path | str, series: list[Patch]) -> list[tuple[str, str]]:
    """Apply `series` as commits on top of HEAD of the repository at `tree`; return (name, sha) pairs.

    The repository must be rooted at `tree` (git run in a folder without its own .git
    would patch the parent repository or skip every hunk). Before each patch its target
    files are checked for CRLF; after it, the new commit must change the files the patch
    names and every marker must be present. Raises PatchError naming the patch file and
    the target file or marker at fault; the repository is left at the last good commit.
    """
    tree = Path(tree)
    repo = gitutil.open_repo(tree)
    if repo is None:
        raise PatchError(f"{tree} is not the root of a git repository: refusing to apply patches there")
    applied = []
    for patch in series:
        applied.append((patch.name, _apply_one(repo, tree, patch)))
    return applied


def _apply_one(repo: git.Repo, tree: Path, patch: Patch) -> str:
    text = read_utf8(patch.path)
    _check_targets_lf(tree, patch, text)
    before = gitutil.rev_parse(repo, "HEAD")
    try:
        after = gitutil.am(repo, patch.path, COMMITTER)
    except git.exc.GitCommandError as exc:
        raise _does_not_apply(patch, exc) from None
    if after == before or gitutil.parents(repo, after) != [before]:
        raise PatchError(f"{patch.path.name}: git am made no commit: the patch is empty or already applied")
    untouched = set(gitutil.paths_in_patch(text, new_files=True)) - set(gitutil.changed_files(repo, after))
    if untouched:
        raise PatchError(f"{patch.path.name}: applied but left {', '.join(sorted(untouched))} unchanged: "
                         f"regenerate the patch from the work tree")
    _check_markers(tree, patch)
    return after


def _check_targets_lf(tree: Path, patch: Patch, text: str) -> None:
    for target in gitutil.paths_in_patch(text):
        path = tree / target
        if path.is_file() and b"\r" in path.read_bytes():
            raise PatchError(f"{patch.path.name}: target file {target} has CRLF line endings in {tree}: "
                             f"the pinned tree must be LF; re-fetch the pin (`hotggml fetch`) and make sure "
                             f"nothing converts line endings (core.autocrlf)")


def _does_not_apply(patch: Patch, exc: git.exc.GitCommandError) -> PatchError:
    stderr = exc.stderr if isinstance(exc.stderr, str) else str(exc.stderr)
    lines = [line.strip() for line in stderr.splitlines() if line.strip().startswith("error:")]
    files = []
    for line in lines:
        for regex in _FAILED_RES:
            match = regex.match(line)
            if match and match.group(1) not in files:
                files.append(match.group(1))
    where = f" to {', '.join(files)}" if files else ""
    detail = "; ".join(lines[:4]) or stderr.strip()[-400:] or "it changes no file: a message without a diff?"
    return PatchError(f"{patch.path.name} does not apply{where} ({detail}): rebuild it on the pin in the "
                      f"work tree (`hotggml patches apply`, fix, commit) and `hotggml patches export`")


def _marker_present(tree: Path, marker: Marker) -> bool:
    path = tree / marker.path
    return path.is_file() and marker.text.encode("utf-8") in path.read_bytes()


def _check_markers(tree: Path, patch: Patch) -> None:
    for marker in patch.markers:
        if not _marker_present(tree, marker):
            where = marker.path if (tree / marker.path).is_file() else f"{marker.path} (no such file)"
            raise PatchError(f"{patch.path.name}: marker {marker.text!r} not found in {where} after "
                             f"applying it: the patch did not land, or the Marker trailer is wrong")


def apply(dest: Path | str | None = None, *, patches_dir: Path | str | None = None,
          pin_dir: Path | str | None = None, force: bool = False) -> ApplyResult:
    """Produce the patched work tree at `dest` (default WORK_DIR/ggml) and return it.

    The tree is a clone of the verified pristine pin (`pin_dir`, default vendor/ggml)
    with one commit per patch on branch `hotggml`. When `dest` already holds this pin
    with this series hash at the recorded head, nothing is done (already_applied=True).
    The new tree is built beside `dest` and renamed into place, so an interrupted or
    failed apply leaves the previous tree usable. An existing tree with uncommitted
    changes or unexported commits is kept unless `force`.

    Raises PinError for a missing/dirty/foreign pin and PatchError for a bad series,
    a patch that does not apply, a missing marker, or a work tree that would lose work.
    """
    series = load_series(patches_dir)
    shash = series_hash(patches_dir)
    pin_path = Path(pin_dir) if pin_dir else paths.VENDOR_DIR
    pin_sha = pin.verify(pin_path)
    dest = Path(dest) if dest else default_tree()
    dest.parent.mkdir(parents=True, exist_ok=True)
    with paths.lock(dest):
        _recover(dest)
        done = _already_applied(dest, pin_sha, shash, patches_dir)
        if done is not None:
            return done
        _check_replaceable(dest, patches_dir, force)
        return _build_tree(dest, series, shash, pin_path, pin_sha)


def _build_tree(dest: Path, series: list[Patch], shash: str, pin_path: Path, pin_sha: str) -> ApplyResult:
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}.tmp-"))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the tree is not
    try:
        repo = gitutil.clone_local(pin_path, tmp)
        gitutil.checkout_branch(repo, WORK_BRANCH, pin_sha)
        gitutil.set_ref(repo, pin.PIN_REF, pin_sha)
        commits = apply_series(tmp, series)
        head = gitutil.rev_parse(repo, "HEAD")
        gitutil.config_set(repo, {CONFIG_SERIES: shash, CONFIG_PIN: pin_sha, CONFIG_HEAD: head})
        repo.close()
        _swap_into_place(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return ApplyResult(dest, pin_sha, shash, tuple(commits), already_applied=False)


def _old(dest: Path) -> Path:
    return dest.with_name(f".{dest.name}.old")


def _swap_into_place(tmp: Path, dest: Path) -> None:
    # Two renames; _recover() puts the old tree back if we die between them.
    if dest.exists():
        shutil.rmtree(_old(dest), ignore_errors=True)
        os.rename(dest, _old(dest))
    os.rename(tmp, dest)
    shutil.rmtree(_old(dest), ignore_errors=True)


def _recover(dest: Path) -> None:
    """Undo what an interrupted apply left: restore the previous tree, drop temp folders."""
    if not dest.exists() and _old(dest).exists():
        os.rename(_old(dest), dest)
    for stale in dest.parent.glob(f".{dest.name}.tmp-*"):
        procs.remove_tree(stale)  # ends a killed apply's git children still writing there first
    procs.remove_tree(_old(dest))


def recorded_series(repo: git.Repo, patches_dir: Path | str | None = None) -> str | None:
    """The series hash the work repo records (None: none): a value of the former formula (series_hash_v1, a
    repo made before) that is patches_dir's own reads as today's series_hash, so that an upgrade strands no
    work repo (its unexported commits refused by apply, and export taking the series for hand-edited)."""
    recorded = gitutil.config_get(repo, CONFIG_SERIES)
    try:
        if recorded is not None and recorded == series_hash_v1(patches_dir):
            return series_hash(patches_dir)
    except (PatchError, OSError):
        pass
    return recorded


def _already_applied(dest: Path, pin_sha: str, shash: str, patches_dir: Path | str | None) -> ApplyResult | None:
    repo = gitutil.open_repo(dest)
    if repo is None:
        return None
    head = gitutil.rev_parse(repo, "HEAD")
    recorded = (recorded_series(repo, patches_dir), gitutil.config_get(repo, CONFIG_PIN),
                gitutil.config_get(repo, CONFIG_HEAD))
    if recorded != (shash, pin_sha, head) or gitutil.is_dirty(repo):
        return None
    return ApplyResult(dest, pin_sha, shash, tuple(_series_commits(repo, strict=False)), already_applied=True)


def _check_replaceable(dest: Path, patches_dir: Path | str | None, force: bool) -> None:
    """Refuse to replace a work tree that holds work not in patches/ (unless force)."""
    if force or not dest.exists():
        return
    repo = gitutil.open_repo(dest)
    if repo is None:
        if any(dest.iterdir()):
            raise PatchError(f"{dest} exists but is not a patched work tree: move it away, or apply with --force")
        return
    dirty = gitutil.dirty_files(repo)
    if dirty:
        raise PatchError(f"work tree {dest} has uncommitted changes ({', '.join(dirty[:10])}): commit them "
                         f"with Patch-Name/Marker trailers and `hotggml patches export`, or apply --force "
                         f"to discard them")
    kept = _work_outside_the_series(repo)
    if kept:
        raise PatchError(f"work tree {dest} holds {'; '.join(kept)}, which replacing the tree would delete: move "
                         f"them out (`git stash pop`, push or rebase the branch onto {WORK_BRANCH}), or apply "
                         f"--force to discard them")
    if gitutil.rev_parse(repo, "HEAD") == gitutil.config_get(repo, CONFIG_HEAD):
        return  # made by apply and untouched since: nothing of value to lose
    try:
        unexported = export(patches_dir, dry_run=True, tree=dest)
    except PatchError as exc:
        raise PatchError(f"work tree {dest} has commits that cannot be exported ({exc}); fix them and "
                         f"export, or apply --force to discard them") from None
    if unexported:
        names = ", ".join(path.name for path in unexported)
        raise PatchError(f"work tree {dest} has commits not exported to patches/ ({names} would change): "
                         f"run `hotggml patches export` first, or apply --force to discard them")


def _work_outside_the_series(repo: git.Repo) -> list[str]:
    """Stashes, and branches with commits that neither the series branch nor the pin holds."""
    kept = []
    stashes = gitutil.run(repo, "stash", "list").splitlines()
    if stashes:
        kept.append(f"{len(stashes)} stash entr{'y' if len(stashes) == 1 else 'ies'}")
    others = [head.name for head in repo.heads if head.name not in (WORK_BRANCH, "pin")]
    ahead = [name for name in others
             if gitutil.run(repo, "rev-list", "-n", "1", name, "--not", WORK_BRANCH, pin.PIN_REF).strip()]
    if ahead:
        kept.append(f"branch{'es' if len(ahead) > 1 else ''} {', '.join(ahead)} with commits of {'their' if len(ahead) > 1 else 'its'} own")
    return kept


# -- reading a work tree ----------------------------------------------------------------

def _series_commits(repo: git.Repo, strict: bool = True) -> list[tuple[str, str]]:
    """Return (Patch-Name, sha) for the commits above the pin ref, oldest first.

    strict: a commit without a valid Patch-Name trailer or with Markers missing raises
    PatchError; otherwise such commits are reported under their short id.
    """
    base = pin.pin_ref(repo)
    if base is None:
        raise PatchError(f"{repo.working_tree_dir} has no {pin.PIN_REF} ref: it is not a patched work "
                         f"tree; run `hotggml patches apply`")
    found = []
    for sha in gitutil.rev_list(repo, base):
        where = f"commit {sha[:12]} in {repo.working_tree_dir}"
        if len(gitutil.parents(repo, sha)) != 1:
            raise PatchError(f"{where} is a merge: the series must be linear; rebase it")
        try:
            name, _, _ = _trailers(gitutil.commit_message(repo, sha).split("\n"), where)
        except PatchError:
            if strict:
                raise
            name = sha[:12]
        found.append((name, sha))
    return found


def status(*, patches_dir: Path | str | None = None, tree: Path | str | None = None) -> list[PatchStatus]:
    """Report each series entry in the work tree (default WORK_DIR/ggml), then extra commits.

    States: "applied" (its commit is in the tree, built from this series hash),
    "stale" (its commit is there but the tree was built from another series hash),
    "not applied", and "not in series" for tree commits the series does not list.
    Markers are looked up in the tree's files. Raises PatchError for a bad series.
    """
    series = load_series(patches_dir)
    shash = series_hash(patches_dir)
    tree = Path(tree) if tree else default_tree()
    repo = gitutil.open_repo(tree)
    in_tree: list[tuple[str, str]] = []
    recorded = None
    if repo is not None and pin.pin_ref(repo):
        in_tree = _series_commits(repo, strict=False)
        recorded = recorded_series(repo, patches_dir)
    names = {name for name, _ in in_tree}
    report = []
    for patch in series:
        state = NOT_APPLIED if patch.name not in names else APPLIED if recorded == shash else STALE
        markers = tuple((marker, repo is not None and _marker_present(tree, marker)) for marker in patch.markers)
        report.append(PatchStatus(patch.name, state, markers))
    listed = {patch.name for patch in series}
    report += [PatchStatus(name, NOT_IN_SERIES, ()) for name, _ in in_tree if name not in listed]
    return report


def check(*, patches_dir: Path | str | None = None, pin_dir: Path | str | None = None) -> ApplyResult:
    """CI gate: apply the series to the pristine pin in a scratch folder and verify it.

    Checks every patch is LF, named, listed, applies, and leaves its markers; then that
    re-exporting the commits gives files byte-identical to the ones in patches_dir. Checks
    first that the checkout's vendor/ggml gitlink is the record's upstream commit.
    Returns the scratch apply's result (its tree is deleted). Raises PatchError naming
    the patch file (and the marker/file) at fault, PinError when the pin is not usable.
    """
    pin.check_gitlink()
    patches_dir = Path(patches_dir or paths.PATCHES_DIR)
    series = load_series(patches_dir)
    _check_unlisted(patches_dir, series)
    shash = series_hash(patches_dir)
    pin_path = Path(pin_dir) if pin_dir else paths.VENDOR_DIR
    pin_sha = pin.verify(pin_path)
    scratch = procs.scratch_dir("hotggml-check-")
    try:
        result = _build_tree(scratch / "ggml", series, shash, pin_path, pin_sha)
        for patch in series:  # a marker the pristine pin holds already proves nothing about its patch
            found = [marker for marker in patch.markers if _marker_present(pin_path, marker)]
            if found:
                raise PatchError(f"{patch.path.name}: marker {found[0].text!r} is in {found[0].path} of the pristine "
                                 f"pin already: it cannot tell the patch is applied (pick a string the patch adds)")
        for patch in series:  # each was there after its own patch; a later one may have taken it out
            lost = [marker for marker in patch.markers if not _marker_present(result.tree, marker)]
            if lost:
                raise PatchError(f"{patch.path.name}: marker {lost[0].text!r} in {lost[0].path} is gone from the "
                                 f"fully patched tree: a later patch removed it (fix that patch or the Marker)")
        differs = export(patches_dir, dry_run=True, tree=result.tree)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if differs:
        raise PatchError(f"export is not canonical: re-exporting the applied series changes "
                         f"{', '.join(path.name for path in differs)}: run `hotggml patches apply` then "
                         f"`hotggml patches export` and commit the result")
    return result


def _check_unlisted(patches_dir: Path, series: list[Patch]) -> None:
    listed = {patch.path.name for patch in series}
    unlisted = sorted(path.name for path in patches_dir.glob(f"*{SUFFIX}") if path.name not in listed)
    if unlisted:
        raise PatchError(f"{', '.join(unlisted)} in {patches_dir} not listed in {SERIES_FILE}: "
                         f"add it to the series or delete it")


# -- exporting --------------------------------------------------------------------------

def export(out_dir: Path | str | None = None, dry_run: bool = False, *,
           tree: Path | str | None = None, force: bool = False) -> list[Path]:
    """Write one patch per commit above the pin in `tree` (default WORK_DIR/ggml) and the series.

    Files are named from each commit's Patch-Name trailer and produced with fixed
    format-patch flags (gitutil.FORMAT_PATCH_ARGS), LF only; patches no longer in the
    tree are deleted; the series keeps its comments where its entries stay the same, else its leading
    comment block. Returns the files
    that changed (dry_run: that would change; CI treats a non-empty list as stale).
    Raises PatchError: no work tree, uncommitted changes, a commit without Patch-Name
    or Markers, a merge, a duplicate name, or CR in a commit; and, writing, a git operation in
    progress, HEAD off the series branch, or (unless force) the checkout's patches/ changed since
    the tree was made or last exported from it (its files would be overwritten or deleted).
    """
    out_dir = Path(out_dir or paths.PATCHES_DIR)
    tree = Path(tree) if tree else default_tree()
    repo = gitutil.open_repo(tree)
    if repo is None:
        raise PatchError(f"{tree} is not a patched work tree: run `hotggml patches apply` first")
    dirty = gitutil.dirty_files(repo)
    if dirty:
        raise PatchError(f"work tree {tree} has uncommitted changes ({', '.join(dirty[:10])}): commit them "
                         f"(with Patch-Name and Marker trailers) before exporting")
    if not dry_run:
        _check_exportable(repo, tree, out_dir, force)
    outputs = _render(repo, _series_commits(repo, strict=True))
    filenames = list(outputs)
    outputs[SERIES_FILE] = _series_text(out_dir / SERIES_FILE, filenames).encode()
    changed = [out_dir / name for name, data in outputs.items() if _read(out_dir / name) != data]
    removed = [out_dir / name for name in _old_entries(out_dir) if name not in outputs and (out_dir / name).exists()]
    ours = out_dir.resolve() == paths.PATCHES_DIR.resolve()
    if ours and gitutil.config_get(repo, CONFIG_EXPORTING) == gitutil.rev_parse(repo, "HEAD"):
        # finishing a cut-off export: the series may be written already, and the patches it dropped still there
        removed += [path for path in sorted(out_dir.glob(f"*{SUFFIX}")) if path.name not in outputs and path not in removed]
    if not dry_run:
        if ours:  # a cut-off export is finished by the next, not taken for a hand edit of patches/
            gitutil.config_set(repo, {CONFIG_EXPORTING: gitutil.rev_parse(repo, "HEAD")})
        _write_all(out_dir, outputs, changed, removed)
        _record_export(repo, out_dir)
        if ours:
            gitutil.run(repo, "config", "--local", "--unset-all", CONFIG_EXPORTING)
    return changed + removed


def _check_exportable(repo: git.Repo, tree: Path, out_dir: Path, force: bool) -> None:
    git_dir = Path(repo.git_dir)
    busy = [what for what, mark in (("a rebase", "rebase-merge"), ("a rebase or am", "rebase-apply"),
                                    ("a cherry-pick", "CHERRY_PICK_HEAD"), ("a merge", "MERGE_HEAD"),
                                    ("a revert", "REVERT_HEAD")) if (git_dir / mark).exists()]
    if busy:
        raise PatchError(f"{busy[0]} is in progress in {tree}: finish or abort it before exporting (the commits "
                         f"above HEAD would be left out of {out_dir})")
    if repo.head.is_detached or repo.active_branch.name != WORK_BRANCH:
        where = "a detached HEAD" if repo.head.is_detached else f"branch {repo.active_branch.name}"
        raise PatchError(f"{tree} is at {where}: export writes the series from branch {WORK_BRANCH} "
                         f"(`git checkout {WORK_BRANCH}`)")
    if force or out_dir.resolve() != paths.PATCHES_DIR.resolve():
        return  # the recorded hash is of the checkout's patches/ (another folder is the caller's to fill)
    recorded = recorded_series(repo, out_dir)
    try:
        current = series_hash(out_dir)
    except PatchError:
        current = None
    if gitutil.config_get(repo, CONFIG_EXPORTING) == gitutil.rev_parse(repo, "HEAD"):
        return  # an export of these very commits was cut off while writing: this one finishes it
    if recorded and current != recorded:
        raise PatchError(f"{out_dir} changed since the work tree {tree} was made or exported from it: exporting "
                         f"would overwrite or delete those changes. `hotggml patches apply` brings the tree up to "
                         f"date (it refuses a tree with unexported commits); `export --force` writes the tree's "
                         f"commits over {out_dir}")


def _render(repo: git.Repo, commits: list[tuple[str, str]]) -> dict[str, bytes]:
    outputs: dict[str, bytes] = {}
    for name, sha in commits:
        filename = name + SUFFIX
        if filename in outputs:
            raise PatchError(f"two commits in {repo.working_tree_dir} are named {name!r}: "
                             f"give each a unique Patch-Name")
        if not gitutil.changed_files(repo, sha):  # format-patch writes nothing for it: a 0-byte file apply refuses
            raise PatchError(f"commit {sha[:12]} ({filename}) changes no file: drop it or give it its change")
        breaks = [line for line in gitutil.commit_message(repo, sha).split("\n")[1:] if patch_break(line.encode())]
        if breaks:
            raise PatchError(f"commit {sha[:12]} ({filename}) has a line {breaks[0]!r} in its message: `git am` "
                             f"ends the message at a line like it (`---`, `diff -`, `Index: `), so its trailers would "
                             f"be lost; reword that line")
        data = gitutil.format_patch(repo, sha)
        if b"\r" in data:
            raise PatchError(f"commit {sha[:12]} ({filename}) contains CR characters: convert the files "
                             f"it touches to LF and amend it")
        outputs[filename] = data
    return outputs


def _series_text(series_path: Path, filenames: list[str]) -> str:
    """The series file for filenames, the existing file's lines kept (its comments wherever they are, an
    entry's own): entries no longer exported dropped, new ones after the entry before them (the first, after
    the leading comment block). Where the kept entries' order changed: the leading comment block, then the
    names."""
    lines = read_utf8(series_path).splitlines() if series_path.is_file() else []  # (not UTF-8: named, nothing lost)
    kept, seen = [], []
    for line in lines:
        entry = line.split("#", 1)[0].strip()
        if entry and entry not in filenames:
            continue
        kept.append(line)
        seen += [entry] if entry else []
    if seen != [name for name in filenames if name in seen]:  # reordered (or listed twice): canonical
        header = []
        for line in lines:
            if line.strip() and not line.lstrip().startswith("#"):
                break
            header.append(line)
        return "".join(line + "\n" for line in header + filenames)
    new_after: dict[str | None, list[str]] = {}
    previous = None
    for name in filenames:
        if name in seen:
            previous = name
        else:
            new_after.setdefault(previous, []).append(name)
    out = []
    for line in kept:
        entry = line.split("#", 1)[0].strip()
        if entry and entry == seen[0]:
            out += new_after.pop(None, [])
        out.append(line)
        out += new_after.pop(entry, []) if entry else []
    out += new_after.pop(None, [])  # no entry kept at all
    return "".join(line + "\n" for line in out)


def _old_entries(out_dir: Path) -> list[str]:
    try:
        return series_entries(out_dir)
    except PatchError:
        return []


def _read(path: Path) -> bytes | None:
    return path.read_bytes() if path.is_file() else None


def _write_all(out_dir: Path, outputs: dict[str, bytes], changed: list[Path], removed: list[Path]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    # Patches first and the series last: a reader never sees a series naming a missing file.
    for path in sorted(changed, key=lambda p: p.name == SERIES_FILE):
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_bytes(outputs[path.name])
        os.replace(tmp, path)
    for path in removed:
        path.unlink()


def _record_export(repo: git.Repo, out_dir: Path) -> None:
    # The tree now matches the files exactly: mark it applied for this series so that
    # `apply` says "already applied" instead of rebuilding over the maintainer's commits.
    head = gitutil.rev_parse(repo, "HEAD")
    gitutil.config_set(repo, {CONFIG_SERIES: series_hash(out_dir), CONFIG_HEAD: head})


def export_upstream(out_dir: Path | str, patches_dir: Path | str | None = None) -> list[Path]:
    """Write the `Upstream-Status: submit` patches as mail-ready files for ggml upstream, in series order
    (``0001-<name>.patch`` ...), without the project's trailers (Patch-Name, Marker, Upstream-Status):
    `git am` takes them onto the pristine pin. Returns the files written; out_dir must be empty or absent.

    Raises PatchError (the series' own errors, or a non-empty out_dir).
    """
    if not str(out_dir).strip():  # Path("") is ".": the patches would land wherever the command ran
        raise PatchError("the folder for the upstream patches is named by an empty string: give a folder")
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise PatchError(f"{out_dir} is not empty: give an empty or new folder for the upstream patches")
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for patch in (p for p in load_series(patches_dir) if p.upstream == "submit"):
        path = out_dir / f"{len(written) + 1:04d}-{patch.name}{SUFFIX}"
        path.write_bytes(strip_trailers(read_utf8(patch.path)).encode("utf-8"))
        written.append(path)
    return written


def strip_trailers(text: str) -> str:
    """A format-patch text without the project's trailer lines in its message (the diff is untouched),
    and without the blank lines they leave at the message's end."""
    lines = text.split("\n")
    diff = next((i for i, line in enumerate(lines) if line == "---" or line.startswith("diff --git ")), len(lines))
    message = [line for line in lines[:diff] if not _TRAILER_RE.match(line)]
    while len(message) > 1 and message[-1] == "" and message[-2] == "":
        message.pop()
    return "\n".join(message + lines[diff:])
