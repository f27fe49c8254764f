"""Generic git helpers on top of GitPython; no hotggml project logic lives here.

Every command runs with the user's global and system git config switched off
(GIT_CONFIG_GLOBAL=/dev/null, GIT_CONFIG_NOSYSTEM=1): settings such as
diff.noprefix, format.signature, core.autocrlf or commit.gpgsign would otherwise
change commit ids and exported bytes from one machine to the next. Line endings are
pinned per repository (core.autocrlf=false, core.eol=lf).

Errors from git surface as git.exc.GitCommandError; callers translate them into
hotggml errors with a message that says what to do. One is translated here, for every
caller: git's refusal of a repository owned by another user ("dubious ownership") is
UnsafeDirectoryError, naming the folder and how to allow it; the safe.directory entries
of the user's global and system config are passed to every command (-c), since the
isolation above would otherwise hide them.
"""

from __future__ import annotations

import codecs
import contextlib
import functools
import os
import re
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import git

from hotggml.errors import UnsafeDirectoryError

ISOLATED_ENV = {"GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull, "GIT_TERMINAL_PROMPT": "0"}
LF_CONFIG = {"core.autocrlf": "false", "core.eol": "lf"}
# Canonical diff output regardless of repository-local settings.
DIFF_CONFIG = {"diff.noprefix": "false", "diff.mnemonicPrefix": "false", "diff.algorithm": "myers",
               "diff.relative": "false", "diff.suppressBlankEmpty": "false"}


@dataclass(frozen=True)
class Identity:
    """A git identity with a fixed date, so commits made with it are reproducible."""

    name: str
    email: str
    date: str  # any format git accepts, e.g. "2025-01-01 00:00:00 +0000"

    def author_env(self) -> dict[str, str]:
        """Return GIT_AUTHOR_* variables for this identity."""
        return {"GIT_AUTHOR_NAME": self.name, "GIT_AUTHOR_EMAIL": self.email, "GIT_AUTHOR_DATE": self.date}

    def committer_env(self, with_date: bool = True) -> dict[str, str]:
        """Return GIT_COMMITTER_* variables; without the date when git takes it from elsewhere."""
        env = {"GIT_COMMITTER_NAME": self.name, "GIT_COMMITTER_EMAIL": self.email}
        if with_date:
            env["GIT_COMMITTER_DATE"] = self.date
        return env


_DUBIOUS_RE = re.compile(r"detected dubious ownership in repository at '([^']*)'")


@functools.lru_cache(maxsize=1)
def user_safe_directories() -> tuple[str, ...]:
    """The safe.directory values of the user's global and system git config (read once, as the user's own git
    reads them): the folders the user allows git to work in although another user owns them."""
    found: list[str] = []
    for scope in ("--system", "--global"):
        try:
            done = subprocess.run(["git", "config", scope, "--get-all", "safe.directory"], capture_output=True,
                                 text=True, cwd=os.path.abspath(os.sep), timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if done.returncode == 0:
            found += [line for line in done.stdout.splitlines() if line]
    return tuple(found)


def dubious_ownership(stderr: str, where: Path | str) -> UnsafeDirectoryError | None:
    """The UnsafeDirectoryError for git's safe.directory refusal in ``stderr`` (None when it is not that one):
    the folder git names (else ``where``) and the command that allows it."""
    if "dubious ownership" not in stderr:
        return None
    match = _DUBIOUS_RE.search(stderr)
    folder = match.group(1) if match else str(where)
    return UnsafeDirectoryError(
        f"git refuses to work in {folder}: it is owned by another user than the one running hotggml (git's "
        f"safe.directory check, 'dubious ownership'); if you trust it, allow it with `git config --global --add "
        f"safe.directory {folder}` and run this again, or run hotggml as the folder's owner")


def safe_directory_args() -> list[str]:
    """``-c safe.directory=...`` for each of user_safe_directories(): a git command run here honours them."""
    return [arg for value in user_safe_directories() for arg in ("-c", f"safe.directory={value}")]


def run(repo: git.Repo | Path | str, *args: str, env: Mapping[str, str] | None = None,
        config: Mapping[str, str] | None = None, as_bytes: bool = False) -> str | bytes:
    """Run `git [-c k=v ...] args...` in a repository or folder and return its stdout.

    Text output loses its final newline; bytes output (as_bytes) is returned untouched.
    Raises UnsafeDirectoryError when git refuses the repository for its owner (dubious_ownership),
    git.exc.GitCommandError when git exits non-zero otherwise.
    """
    cwd = repo.working_tree_dir if isinstance(repo, git.Repo) else str(repo)
    command = ["git", *safe_directory_args()]
    for key, value in (config or {}).items():
        command += ["-c", f"{key}={value}"]
    command += list(args)
    full_env = dict(ISOLATED_ENV)
    full_env.update(env or {})
    runner = git.Git(cwd)
    try:
        if as_bytes:
            return runner.execute(command, env=full_env, stdout_as_string=False, strip_newline_in_stdout=False)
        return runner.execute(command, env=full_env)
    except git.exc.GitCommandError as exc:
        stderr = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else str(exc.stderr or "")
        unsafe = dubious_ownership(stderr, cwd)
        if unsafe is not None:
            raise unsafe from None
        raise


def open_repo(path: Path | str) -> git.Repo | None:
    """Return the repository whose work tree root is exactly `path`, or None.

    A folder inside another repository (vendor/ggml inside the superproject) is not
    that repository: git commands run there would act on the parent.
    """
    path = Path(path)
    if not (path / ".git").exists():
        return None
    try:
        repo = git.Repo(path)
    except (git.exc.InvalidGitRepositoryError, git.exc.NoSuchPathError):
        return None
    if repo.working_tree_dir is None or Path(repo.working_tree_dir).resolve() != path.resolve():
        return None
    return repo


def set_lf(repo: git.Repo) -> None:
    """Pin line-ending handling in the repository's own config (no CRLF conversion, LF eol)."""
    for key, value in LF_CONFIG.items():
        run(repo, "config", key, value)


def init_repo(path: Path | str, initial_branch: str = "main") -> git.Repo:
    """Create a repository in `path` (created if missing) with LF-only config; return it."""
    Path(path).mkdir(parents=True, exist_ok=True)
    run(path, "init", "-q", f"--initial-branch={initial_branch}")
    repo = git.Repo(path)
    set_lf(repo)
    return repo


def clone_local(source: Path | str, dest: Path | str) -> git.Repo:
    """Clone a local repository into `dest` (missing or empty) with hard-linked objects.

    --local (not --shared) so the clone stays valid when the source is replaced later.
    """
    run(Path(dest).parent, "clone", "-q", "--local", "--no-checkout", str(source), str(dest))
    repo = git.Repo(dest)
    set_lf(repo)
    return repo


def checkout_branch(repo: git.Repo, branch: str, rev: str) -> None:
    """Create or reset `branch` at `rev` and check it out (work tree forced to match)."""
    run(repo, "checkout", "-q", "-f", "-B", branch, rev, config=LF_CONFIG)


def commit_all(repo: git.Repo, message: str, identity: Identity) -> str:
    """Stage every file (ignored ones included) and commit it as `identity`; return the sha.

    Ignored files are forced in: a .gitignore inside the imported tree must not drop
    files from it.
    """
    run(repo, "add", "-A", "--force", ".", config=LF_CONFIG)
    env = {**identity.author_env(), **identity.committer_env()}
    run(repo, "commit", "-q", "--no-verify", "--no-gpg-sign", "-m", message, env=env, config=LF_CONFIG)
    return rev_parse(repo, "HEAD")


def rev_parse(repo: git.Repo, rev: str) -> str | None:
    """Return the object id `rev` names, or None when it names nothing."""
    try:
        return run(repo, "rev-parse", "--verify", "-q", rev).strip() or None
    except git.exc.GitCommandError:
        return None


def tree_entries(repo: git.Repo, rev: str, paths: Sequence[str]) -> dict[str, str]:
    """Return {path: object id} for top-level `paths` at `rev`; missing paths are left out."""
    out = run(repo, "ls-tree", "-z", rev, "--", *paths)
    entries = {}
    for record in out.split("\0"):
        if record:
            meta, name = record.split("\t", 1)
            entries[name] = meta.split()[2]
    return entries


def tree_hash(repo: git.Repo, rev: str, path: str) -> str | None:
    """Return the tree/blob id of `path` at `rev`, or None if it does not exist there."""
    return rev_parse(repo, f"{rev}:{path}")


def _porcelain_paths(output: str) -> list[str]:
    # porcelain v1 -z: "XY path\0"; renames are off, so one path per record.
    return [record[3:] for record in output.split("\0") if record]


def dirty_files(repo: git.Repo, ignored_in: Sequence[str] = ()) -> list[str]:
    """Return paths with uncommitted changes or untracked files (empty list when clean).

    `ignored_in` lists paths under which ignored files count as dirty too.
    """
    base = ["status", "--porcelain=v1", "-z", "--untracked-files=all", "--no-renames"]
    found = _porcelain_paths(run(repo, *base, config=LF_CONFIG))
    if ignored_in:
        found += _porcelain_paths(run(repo, *base, "--ignored=matching", "--", *ignored_in, config=LF_CONFIG))
    return sorted(set(found))


def is_dirty(repo: git.Repo, ignored_in: Sequence[str] = ()) -> bool:
    """Return True when the work tree differs from HEAD (see dirty_files)."""
    return bool(dirty_files(repo, ignored_in))


def set_ref(repo: git.Repo, ref: str, sha: str) -> None:
    """Point `ref` (full name, e.g. refs/tags/x) at `sha`, creating or moving it."""
    run(repo, "update-ref", ref, sha)


def config_get(repo: git.Repo, key: str) -> str | None:
    """Return the repository-local value of `key`, or None when unset."""
    try:
        return run(repo, "config", "--local", "--get", key).strip()
    except git.exc.GitCommandError:
        return None


def config_set(repo: git.Repo, values: Mapping[str, str]) -> None:
    """Set repository-local config values."""
    for key, value in values.items():
        run(repo, "config", "--local", key, value)


def rev_list(repo: git.Repo, base: str, head: str = "HEAD") -> list[str]:
    """Return the commits in base..head, oldest first."""
    out = run(repo, "rev-list", "--reverse", "--topo-order", f"{base}..{head}")
    return out.split()


def parents(repo: git.Repo, sha: str) -> list[str]:
    """Return the parent ids of a commit."""
    return run(repo, "rev-list", "--parents", "-n", "1", sha).split()[1:]


def commit_message(repo: git.Repo, sha: str) -> str:
    """Return the raw commit message of `sha`."""
    return run(repo, "log", "-1", "--format=%B", sha)


def changed_files(repo: git.Repo, sha: str) -> list[str]:
    """Return the paths a (non-merge) commit changes relative to its parent."""
    out = run(repo, "diff-tree", "--no-commit-id", "--name-only", "-r", "-z", "--no-renames", sha)
    return [name for name in out.split("\0") if name]


def am(repo: git.Repo, patch: Path | str, committer: Identity, extra_env: Mapping[str, str] | None = None) -> str:
    """Apply one mbox patch with `git am` as a commit and return the new HEAD.

    The committer is `committer` and the committer date is the patch's author date,
    so the same patch on the same base always gives the same commit id. The subject
    is kept verbatim (-k) and no scissors line is honoured, so export round-trips.
    On failure the am session is aborted (the repository is left at its old HEAD)
    and git's GitCommandError propagates.
    """
    env = {**committer.committer_env(with_date=False), **(extra_env or {})}
    args = ["am", "-q", "-k", "--no-scissors", "--no-3way", "--committer-date-is-author-date", str(patch)]
    try:
        run(repo, *args, env=env, config=LF_CONFIG)
    except git.exc.GitCommandError:
        if Path(repo.git_dir, "rebase-apply").exists():
            # git wants a committer identity even to abort; the am error is the one to report.
            with contextlib.suppress(git.exc.GitCommandError):
                run(repo, "am", "--abort", env=env)
        raise
    return rev_parse(repo, "HEAD")


FORMAT_PATCH_ARGS = ("--stdout", "--no-numbered", "--no-signature", "--zero-commit", "--full-index",
                     "--keep-subject", "--no-stat", "--no-renames", "--no-encode-email-headers", "--abbrev=40")


def format_patch(repo: git.Repo, sha: str) -> bytes:
    """Return `git format-patch -1 <sha>` output with canonical flags, as bytes."""
    return run(repo, "format-patch", "-1", sha, *FORMAT_PATCH_ARGS, config=DIFF_CONFIG, as_bytes=True)


def paths_in_patch(text: str, new_files: bool = False) -> list[str]:
    """Return the paths a git diff touches, in order of appearance.

    By default only pre-images (`--- a/<path>`: files that must exist before the
    patch); with new_files, post-images (`+++ b/<path>`) too. Only header lines
    (between `diff --git` and the first `@@`) are read, so a removed line whose text
    starts with "-- a/" is not taken for a path.
    """
    sides = ("--- ", "+++ ") if new_files else ("--- ",)
    found: list[str] = []
    in_header = False
    for line in text.splitlines():
        if line.startswith("diff --git "):
            in_header = True
        elif line.startswith("@@"):
            in_header = False
        elif in_header and line.startswith(sides):
            path = _diff_header_path(line[4:].rstrip("\r"))
            if path is not None and path[:2] == ("a/" if line[0] == "-" else "b/") and path[2:] not in found:
                found.append(path[2:])
    return found


def _diff_header_path(name: str) -> str | None:
    """The path of a ---/+++ line's name as git writes it (diff.c): a tab after a name with a space in it,
    C-quoted ("a/caf\\303\\251") where it holds a quote, a backslash, a control or non-ASCII byte; None for
    /dev/null."""
    name = name[:-1] if name.endswith("\t") else name
    if len(name) > 1 and name[0] == name[-1] == '"':
        name = codecs.escape_decode(name[1:-1].encode())[0].decode("utf-8", "surrogateescape")
    return None if name == "/dev/null" else name


def iter_lines_with_cr(data: bytes) -> Iterable[int]:
    """Yield the 1-based line numbers of lines that contain a carriage return."""
    for number, line in enumerate(data.split(b"\n"), start=1):
        if b"\r" in line:
            yield number
