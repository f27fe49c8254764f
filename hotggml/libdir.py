"""Where this checkout's built libraries are: the pointers hotggml.build writes (``current-<backend>.json``
and each build's ``.complete`` record under paths.build_root()), read here without the build tooling, so the
binding (hotggml.ffi) finds a library importing neither hotggml.build nor the patch modules.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from hotggml import paths

BACKENDS = ("cuda", "vulkan", "cpu")  # looked at in this order when no backend is named


def _record(path: Path) -> dict | None:
    """A build record's JSON object, or None where the file is missing, unreadable or not one (a full disk, an
    edit): the build it describes is then not taken, as if it had not finished."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def current_lib_dir(backend: str | None = None, series_hash: str | None = None,
                    defines_of: Callable[[str], dict] | None = None) -> Path | None:
    """Library folder of the newest good build of ``backend`` (else cuda, vulkan, then cpu), or None.

    With ``series_hash`` (hotggml.series.code_hash), a build of that code is preferred over any other (a CUDA
    build of old code must not shadow a fresh CPU build), then an older complete build of it (a patch edit
    reverted) whose CMake options are ``defines_of(backend)`` (None: any options); without a match the newest
    build is returned and the binding's stamp check reports it stale.
    """
    names = [backend] if backend else list(BACKENDS)
    found = []
    for name in names:
        pointer = paths.build_root() / f"current-{name}.json"
        record = _record(pointer)
        if record and isinstance(record.get("lib_dir"), str):
            lib_dir = Path(record["lib_dir"])
            if (lib_dir / "hotggml-build.json").is_file():
                found.append((record.get("series_hash"), lib_dir))
    for series, lib_dir in found:
        if series_hash is None or series == series_hash:
            return lib_dir
    for name in names:
        done = sorted(paths.build_root().glob(f"{name}-*/.complete"), key=lambda p: p.stat().st_mtime, reverse=True)
        for marker in done:
            record = _record(marker)
            if record is None or not isinstance(record.get("defines", {}), dict):
                continue
            defines = {k: v for k, v in record.get("defines", {}).items() if k != "HOTGGML_BUILD_TESTS"}
            if record.get("series_hash") == series_hash and (defines_of is None or defines == defines_of(name)):
                return marker.parent / "lib"
    return found[0][1] if found else None
