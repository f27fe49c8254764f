"""Where hotggml keeps things: the repository, the pin, the series and the state folder.

The state folder (cached sdist, patched work tree, keyed builds) defaults to
REPO_ROOT/.hotggml and moves with HOTGGML_STATE_DIR. The names STATE_DIR, CACHE_DIR,
WORK_DIR and BUILD_ROOT (which $HOTGGML_BUILD_ROOT moves on its own) are computed on every access (module __getattr__), so a
change of the environment after import is honoured; prefer the functions in code
that may run under a monkeypatched environment (tests).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PATCHES_DIR = REPO_ROOT / "patches"
VENDOR_DIR = REPO_ROOT / "vendor" / "ggml"

STATE_ENV = "HOTGGML_STATE_DIR"


def is_checkout() -> bool:
    """Whether the package runs from a hotggml checkout (its patches/series and pyproject.toml beside
    it), not from an installed copy in site-packages."""
    return (REPO_ROOT / "patches" / "series").is_file() and (REPO_ROOT / "pyproject.toml").is_file()


def require_checkout(command: str) -> None:
    """Raise CheckoutError unless this is a checkout: `command` works on its patches/ and vendor/ggml,
    which an installed package does not have (and must not create under site-packages)."""
    if not is_checkout():
        from hotggml.errors import CheckoutError

        if (REPO_ROOT / ".git").exists() and (REPO_ROOT / "pyproject.toml").is_file():  # a clone that lost the file
            raise CheckoutError(f"`hotggml {command}` needs {REPO_ROOT / 'patches' / 'series'}, which this checkout "
                                f"lacks: restore it (`git checkout -- patches/series`)")
        raise CheckoutError(f"`hotggml {command}` works on a hotggml checkout (patches/series, vendor/ggml); "
                            f"this is an installed package at {REPO_ROOT}: run it in a clone of the repository")


def _env_folder(name: str) -> Path | None:
    """The folder environment variable `name` names (~ expanded), or None where it is unset or empty.

    Raises SettingError, naming the variable, for a relative path (another folder from each working directory:
    a second state folder or build root beside the first) and for a path to something that is not a folder."""
    value = os.environ.get(name)
    if not value:
        return None
    from hotggml.errors import SettingError

    try:
        path = Path(value).expanduser()
    except RuntimeError as exc:  # ~user of no such user
        raise SettingError(f"{name}={value}: {exc} (give an absolute path, or unset {name})") from None
    if not path.is_absolute():
        raise SettingError(f"{name}={value} is a relative path, which names another folder from each working "
                           f"directory: give an absolute one (or unset {name})")
    try:
        if path.exists() and not path.is_dir():
            raise SettingError(f"{name}={value} is not a folder: give the folder hotggml may use (or unset {name})")
        resolved = path.resolve()
        if resolved == VENDOR_DIR.resolve() or VENDOR_DIR.resolve() in resolved.parents:
            raise SettingError(f"{name}={value} is inside the pinned tree {VENDOR_DIR}, which is never written to: "
                               "give a folder outside it")
        return resolved
    except (OSError, RuntimeError) as exc:  # a symbolic link loop (RuntimeError before Python 3.13)
        raise SettingError(f"{name}={value} cannot be used as a folder: {exc}") from None


def setting_behind(filename: str | os.PathLike | None) -> str | None:
    """`NAME=value` of the environment variable whose folder holds `filename` (an OSError's), else None: an error
    about a file there then says which setting put it there."""
    for name in (STATE_ENV, BUILD_ROOT_ENV):
        value = os.environ.get(name)
        try:
            if filename and value and Path(value).expanduser().is_absolute():
                folder = Path(value).expanduser().resolve()
                if Path(os.path.abspath(filename)) == folder or folder in Path(os.path.abspath(filename)).parents:
                    return f"{name}={value}"
        except (OSError, RuntimeError):
            return f"{name}={value}"
    return None


def state_dir() -> Path:
    """Return the state folder (not created): $HOTGGML_STATE_DIR; else REPO_ROOT/.hotggml in a checkout;
    else, for an installed package, the user's cache folder ($XDG_CACHE_HOME or ~/.cache, /hotggml):
    never a folder inside site-packages. Raises SettingError for a relative or non-folder $HOTGGML_STATE_DIR."""
    override = _env_folder(STATE_ENV)
    if override:
        return override
    if is_checkout():
        return REPO_ROOT / ".hotggml"
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache).expanduser().resolve() / "hotggml"


def cache_dir() -> Path:
    """Return the folder holding downloaded sources (the ggml sdist)."""
    return state_dir() / "cache"


def work_dir() -> Path:
    """Return the folder holding patched trees (WORK_DIR/ggml is the default one)."""
    return state_dir() / "work"


BUILD_ROOT_ENV = "HOTGGML_BUILD_ROOT"


def build_root() -> Path:
    """Return the folder under which builds keyed by pin + series hash live: $HOTGGML_BUILD_ROOT, else
    <state>/build. Checkouts that share one (CI's autocrlf clone and its parent) share every build whose key
    matches: same pin, same code in the series, same options and recipe. Raises SettingError as state_dir()."""
    override = _env_folder(BUILD_ROOT_ENV)
    if override:
        return override
    return state_dir() / "build"


_LAZY = {"STATE_DIR": state_dir, "CACHE_DIR": cache_dir, "WORK_DIR": work_dir, "BUILD_ROOT": build_root}


def __getattr__(name: str) -> Path:
    # PEP 562: keep the documented constant names while reading the environment late.
    if name in _LAZY:
        return _LAZY[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@contextlib.contextmanager
def lock(target: Path, what: str | None = None, lock_dir: Path | None = None) -> Iterator[None]:
    """Hold an exclusive lock on `target` (a tree we are about to replace) while the block runs.

    The lock file lives in `lock_dir` (default: the state folder's locks/; a build's, in its build root,
    which checkouts with state folders of their own may share), keyed by the target's absolute path,
    so that locking never leaves files next to the target (vendor/ is in the superproject).
    It names its holder (pid and command line): a second process says who it waits for on
    stderr, then blocks until the holder is done (or dead: the kernel drops a dead holder's lock).
    """
    key = hashlib.sha1(str(Path(target).resolve()).encode()).hexdigest()[:16]
    lock_dir = lock_dir or state_dir() / "locks"
    lock_dir.mkdir(parents=True, exist_ok=True)
    with open(lock_dir / f"{key}.lock", "a+") as handle:  # a+: never truncate the holder's line unlocked
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another hotggml process"
            print(f"hotggml: waiting for {what or target}: held by {holder}", file=sys.stderr, flush=True)
            fcntl.flock(handle, fcntl.LOCK_EX)
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} ({' '.join(sys.argv)[:200]})\n")
        handle.flush()
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
