"""The series file and its hashes: series_hash (entries and patch bytes: what the work repo was applied from) and
code_hash (the patches' diffs: what keys builds and stamps a library).

Kept apart from hotggml.patches (which drives git) so that the binding can check a library's stamp
against this checkout without importing GitPython or the patch tooling.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from hotggml import paths
from hotggml.errors import PatchError

SERIES_FILE = "series"


def check_lf(path: Path | str) -> None:
    """Refuse a file containing a carriage return (CRLF line endings).

    Raises PatchError naming the file and the first offending line.
    """
    data = Path(path).read_bytes()
    lines = [n for n, line in enumerate(data.split(b"\n"), start=1) if b"\r" in line]
    if lines:
        raise PatchError(f"{path} has CRLF line endings (first at line {lines[0]}): patches are LF only; "
                         f"convert it (e.g. `sed -i 's/\\r$//' {path}`) and check your editor/git autocrlf setting")


def conflict_markers(diff: str) -> list[int]:
    """Line numbers (from 1) of a diff's added lines that are merge conflict markers (``<<<<<<< `` or
    ``>>>>>>> `` at the start: a conflict `git add`ed unresolved)."""
    return [n for n, line in enumerate(diff.split("\n"), start=1) if line.startswith(("+<<<<<<< ", "+>>>>>>> "))]


def read_utf8(path: Path | str) -> str:
    """The text of a series or patch file; PatchError (not a traceback) for bytes that are not UTF-8."""
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise PatchError(f"{path} is not UTF-8 (byte {data[exc.start]:#04x} at line {line}): patches and the "
                         f"series are UTF-8 text; re-export the patch or fix the line") from None


def series_entries(patches_dir: Path | str | None = None) -> list[str]:
    """Return the file names listed in <patches_dir>/series, in order.

    Raises PatchError when the series file is missing, has CRLF, or lists a name twice.
    """
    series = Path(patches_dir or paths.PATCHES_DIR) / SERIES_FILE
    if not series.is_file():
        raise PatchError(f"{series} does not exist: create it with one patch file name a line")
    check_lf(series)
    text = read_utf8(series)
    if text.startswith("\ufeff"):  # invisible in an editor: the first name would not be found
        raise PatchError(f"{series} starts with a UTF-8 byte order mark (an editor's): save it without one")
    entries = []
    for line in text.splitlines():
        entry = line.split("#", 1)[0].strip()
        if not entry:
            continue
        if "/" in entry or "\\" in entry or entry in (".", ".."):  # export removes and writes what it names
            raise PatchError(f"{series} lists {entry!r}: an entry is a file name in {series.parent}, not a path")
        if entry in entries:
            raise PatchError(f"{series} lists {entry} twice: keep one line per patch")
        entries.append(entry)
    return entries


def series_hash(patches_dir: Path | str | None = None) -> str:
    """Return the sha256 (hex) over the series' entries, in order, and every listed patch's bytes.

    What the work repo was applied from: any byte change in a listed patch, or a change to which
    patches are listed or their order, gives a new hash; the series file's comments, blank lines
    and spacing do not (they change nothing ``git am`` applies). Raises PatchError as
    series_entries does, or when a listed file is missing.
    """
    patches_dir = Path(patches_dir or paths.PATCHES_DIR)
    entries = series_entries(patches_dir)
    digest = hashlib.sha256(b"hotggml series v2")
    for entry in entries:
        path = patches_dir / entry
        if not path.is_file():
            raise PatchError(f"{path}: listed in the series but there is no such file")
        data = path.read_bytes()
        # Length-prefixed so that moving bytes between files changes the hash.
        digest.update(f"\0{entry}\0{len(data)}\0".encode())
        digest.update(data)
    return digest.hexdigest()


def patch_break(line: bytes) -> bool:
    """Whether a line ends a mail's message, as git's mailinfo.c (patchbreak) decides: "diff -", "Index: ", a
    "---" line with only whitespace after it, or "--- " before a file name (``git am`` starts the diff there)."""
    return (line.startswith((b"diff -", b"Index: ")) or (line.startswith(b"---") and not line[3:].strip())
            or (line.startswith(b"--- ") and len(line) > 4 and not line[4:5].isspace()))


def series_hash_v1(patches_dir: Path | str | None = None) -> str:
    """series_hash as hotggml computed it before the series file's comments and layout stopped counting (every
    byte of the file): what work repos made then record. Raises PatchError as series_hash does."""
    patches_dir = Path(patches_dir or paths.PATCHES_DIR)
    entries = series_entries(patches_dir)
    digest = hashlib.sha256((patches_dir / SERIES_FILE).read_bytes())
    for entry in entries:
        data = (patches_dir / entry).read_bytes()
        digest.update(f"\0{entry}\0{len(data)}\0".encode())
        digest.update(data)
    return digest.hexdigest()


def _patch_start(data: bytes) -> int:
    """Offset of the first line that ends a mail's message (patch_break); 0 where there is none (the whole
    file counts)."""
    at = 0
    for line in data.splitlines(keepends=True):
        if patch_break(line):
            return at
        at += len(line)
    return 0


def code_hash(patches_dir: Path | str | None = None) -> str:
    """Return the sha256 (hex) over what a build consumes of the series: each listed patch's diff part, in
    series order, from the line where ``git am`` (which ``hotggml patches apply`` runs) ends the message
    (_patch_start, git's mailinfo rule); the whole file where no line starts a patch.

    A patch's message and trailers (Patch-Name, Marker, Upstream-Status) and its file name are not part of it:
    editing them changes series_hash (the work repo re-applies) but not this, so a built library stays
    current (the series file's comments change neither); any change to what the patches change gives a new
    hash. It keys
    builds and is stamped into the library. Raises PatchError as series_entries does, or for a missing file.
    """
    patches_dir = Path(patches_dir or paths.PATCHES_DIR)
    digest = hashlib.sha256(b"hotggml code of the series v1")
    for entry in series_entries(patches_dir):
        path = patches_dir / entry
        if not path.is_file():
            raise PatchError(f"{path}: listed in the series but there is no such file")
        data = path.read_bytes()
        diff = data[_patch_start(data):]
        digest.update(f"\0{len(diff)}\0".encode())  # length-prefixed: moving bytes between patches changes it
        digest.update(diff)
    return digest.hexdigest()
