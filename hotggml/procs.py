"""Processes a killed hotggml command leaves behind (Linux /proc; elsewhere these find nothing), and the
delivery of an interrupt (deliver_interrupt).

`kill -9` of hotggml ends Python, not the processes it started: git (fetch, apply) or cmake, ninja and
the compilers (build) go on writing into the folder the next run is about to reuse or remove. The next
run, holding that folder's lock, ends them first.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from pathlib import Path
from hotggml.errors import HotggmlError


def deliver_interrupt(signum: int, frame=None) -> None:
    """Hand signum (SIGINT; SIGTERM or SIGHUP, which the CLI ends a command with as with Ctrl-C) to SIGINT's
    handler now: KeyboardInterrupt, or a block that defers it (hotggml.graph.interrupts_deferred). Where SIGINT is
    ignored, as a non-interactive shell starts its background jobs, a SIGINT is dropped but a termination still
    raises KeyboardInterrupt (``kill`` and ``timeout`` would end nothing)."""
    handler = signal.getsignal(signal.SIGINT)
    if callable(handler):
        handler(signum, frame)
    elif signum != signal.SIGINT or handler != signal.SIG_IGN:
        raise KeyboardInterrupt


def _stat_fields(pid: int) -> list[str]:
    """Fields of /proc/<pid>/stat after "(comm)": state, ppid, pgrp, ...; [] when gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return []
    return stat[stat.rindex(")") + 2:].split()


def alive(pid: int) -> bool:
    """Running or sleeping (a zombie is not: it only waits to be reaped)."""
    fields = _stat_fields(pid)
    return bool(fields) and fields[0] != "Z"


def _members(field: int, value: int) -> list[int]:
    """Live processes whose /proc stat field (after "(comm)": 2 pgrp, 3 session) is value."""
    members = []
    for entry in Path("/proc").glob("[0-9]*"):
        fields = _stat_fields(int(entry.name))
        if len(fields) > field and fields[field] == str(value) and fields[0] != "Z":
            members.append(int(entry.name))
    return members


def group_members(pgid: int) -> list[int]:
    """Live processes of process group pgid."""
    return _members(2, pgid)


def session_members(sid: int) -> list[int]:
    """Live processes of session sid: what a command started with start_new_session left, whatever process
    groups they moved to (ninja starts each compiler in a group of its own, in its session)."""
    return _members(3, sid)


def works_in(pid: int, folder: Path) -> bool:
    """Whether process pid works in folder: its working folder is in it, or its command line names it."""
    folder = str(folder)
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        cwd = os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return False
    return folder in cmdline or cwd == folder or cwd.startswith(folder + os.sep)


def working_in(folder: Path) -> list[int]:
    """Live processes (other than this one) working in folder."""
    return [int(e.name) for e in Path("/proc").glob("[0-9]*")
            if int(e.name) != os.getpid() and alive(int(e.name)) and works_in(int(e.name), folder)]


def end(pids: list[int], timeout: float = 30.0) -> None:
    """SIGKILL pids and wait until none is alive; HotggmlError after timeout seconds."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout
    while any(alive(pid) for pid in pids):
        if time.monotonic() > deadline:
            raise HotggmlError(f"processes {pids} did not end")
        time.sleep(0.02)


def _is_git(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip().startswith("git")
    except OSError:
        return False


def scratch_dir(prefix: str) -> Path:
    """A new private folder in the system's temporary folder, named prefix + this pid (the caller removes it).
    The folders of the same prefix whose process is gone are removed first: a `kill -9` runs no cleanup, and
    each left tens of MB (a patched tree, a pin's extracted tarball) for good."""
    root = Path(tempfile.gettempdir())
    for stale in root.glob(f"{prefix}*"):
        owner = stale.name[len(prefix):].split("-", 1)[0]
        if owner.isdigit() and int(owner) != os.getpid() and not alive(int(owner)) and stale.is_dir():
            remove_tree(stale)
    return Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-"))


def remove_tree(folder: Path) -> None:
    """Remove a folder an interrupted run left, after ending the git processes (a killed fetch's or apply's)
    still working in it: removing it under them would leave a half-recreated folder behind. Nothing else is
    ended: a shell or an editor open in the folder is the user's."""
    end([pid for pid in working_in(folder) if _is_git(pid)])
    shutil.rmtree(folder, ignore_errors=True)
