"""Shared fixtures for the binding tests: the patched CPU library (built once) and a CPU backend.

``hotggml.build.build("cpu")`` is idempotent: it materializes the pin, applies the series and
runs CMake only when no good build exists for this pin + series, so a fresh clone can run
``pytest`` directly (about 20 s the first time).
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest

# A run started in the background by a non-interactive shell (`cmd &`, nohup) has SIGINT ignored, and Python then
# raises no KeyboardInterrupt, here or in the children the interrupt tests start (an ignored signal stays ignored
# across exec): those tests would see nothing to test. Delivered as Python's default, it is caught again.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# `pytest` (not only `python -m pytest`) from a fresh clone: the package is the repository root
_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)


@pytest.fixture(scope="session")
def cpu_build():
    """The BuildInfo of the patched CPU build (built on first use)."""
    from hotggml import build

    return build.build("cpu")


@pytest.fixture(scope="session")
def lib(request):
    """The loaded cffi library (stamp checked against this checkout): the one $HOTGGML_LIB_DIR names, else
    this checkout's CPU build (built on first use)."""
    import os

    from hotggml import ffi

    if not os.environ.get("HOTGGML_LIB_DIR"):
        request.getfixturevalue("cpu_build")
        ffi.load.cache_clear()  # a library loaded before the build above would be the wrong one
    return ffi.load()


@pytest.fixture()
def cpu(lib):
    """A fresh CPU backend with 2 threads."""
    from hotggml.graph import Backend

    with Backend("CPU", n_threads=2) as be:
        yield be

