"""Misuse cases run in a child interpreter: a GGML_ASSERT that a bad call reaches kills the process, so it
fails the test that made the call instead of ending the test session. ``expect(exc, text, fn)`` in the
child asserts that fn raises exc (of hotggml's exception family) with text in its message."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from hotggml import paths

EXPECT = """
from hotggml.errors import HotggmlError
def expect(exc, text, fn):
    try:
        fn()
    except exc as e:
        assert text in str(e), f"{type(e).__name__}: {e}"
        assert isinstance(e, HotggmlError), f"{type(e).__name__} is not of hotggml's exception family"
        print("raised", type(e).__name__, "-", e)
    else:
        raise SystemExit("no exception for: " + text)
"""


def run_child(prelude: str, body: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run prelude, EXPECT, then body (dedented) in a fresh interpreter on this checkout; the child prints
    'alive' last when it got through."""
    code = textwrap.dedent(prelude) + EXPECT + textwrap.dedent(body) + "\nprint('alive')\n"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(paths.REPO_ROOT), **(env or {})})
