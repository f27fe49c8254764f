"""Helpers the backend test files share: which devices the loaded build registers, and the check that an
absent backend fails loudly."""

from __future__ import annotations

import sys

import pytest


def registry_devices(prefix: str) -> list[str]:
    """Device names in the loaded build's registry that start with ``prefix`` ('CUDA', 'Vulkan')."""
    from hotggml.graph import devices
    return [name for name, _ in devices() if name.startswith(prefix)]


def assert_absent_backend_fails_loudly(prefix: str, cli_backend: str) -> None:
    """Where the build has no ``prefix`` device: opening ``<prefix>0`` raises BackendError naming it, and
    ``hotggml parity --backend cli_backend`` exits 2 naming it, without a traceback."""
    import subprocess

    from hotggml.errors import BackendError
    from hotggml.graph import Backend
    if registry_devices(prefix):
        pytest.skip(f"this build has a {prefix} device: absence cannot be tested here")
    with pytest.raises(BackendError, match=f"{prefix}0"):
        Backend(f"{prefix}0")
    run = subprocess.run([sys.executable, "-m", "hotggml", "parity", "--backend", cli_backend, "-p", "^tiny$"],
                         capture_output=True, text=True)
    assert run.returncode == 2, run.stdout + run.stderr
    assert f"{prefix}0" in run.stderr and "Traceback" not in run.stderr


def first_device_or_skip(prefix: str, why_absent: str) -> str:
    """The loaded build's first ``prefix`` device ('CUDA0', 'Vulkan0'); the test is skipped with ``why_absent`` where
    there is none."""
    found = registry_devices(prefix)
    if not found:
        pytest.skip(f"no {prefix} device in the loaded build's registry ({why_absent})")
    return found[0]
