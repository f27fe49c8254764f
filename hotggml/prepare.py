"""Fetch the pin and apply the series: the patched ggml tree a build starts from.

Used by ``hotggml build`` and, through ``python -m hotggml prepare --json``, by CMakeLists.txt
when ``pip install .`` builds the package (scikit-build-core).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hotggml import patches, paths, pin, series


@dataclass(frozen=True)
class Prepared:
    """A patched tree ready to build: where it is, the upstream pin commit, and the series' code hash
    (hotggml.series.code_hash: what the build consumes of the patches; named series_hash in the build's
    records and stamp)."""

    source_dir: Path
    pin: str
    series_hash: str


def prepare() -> Prepared:
    """Materialize + verify the pin (hotggml.pin.fetch), then apply the series (hotggml.patches.apply).

    Raises CheckoutError outside a checkout, PinError / PatchError with messages that say what to do.
    """
    paths.require_checkout("prepare")
    pin.fetch()
    applied = patches.apply()
    return Prepared(applied.tree, pin.UPSTREAM_COMMIT, series.code_hash())
