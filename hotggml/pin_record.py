"""The pin's record: which upstream ggml this fork is built on, where its source comes from, and the git tree
hashes that prove a tree is it. Data, in ``hotggml/pin.json``: ``hotggml pin set`` rewrites it when a rebase
onto a new pin ends well, and nothing else does. Read without git (the binding checks its library's stamp
against the commit here).

Record fields: ``tag`` (a label), ``upstream_commit`` (upstream's commit id, or the materialized commit for a
pin without one), ``trees`` (git tree hashes of src, include, cmake, tests, CMakeLists.txt), ``tree`` (the git
tree hash of the whole tree fetch commits from the source: every path, so a change anywhere is seen), ``source``
(``kind`` "sdist" or "tarball", ``file``, ``sha256``, ``prefix`` of the ggml tree inside it, and for an sdist
the pip ``requirement`` that fetches it), ``pin_commit`` (the commit fetch makes from the source: fixed
identity, date and message, so the same on every machine).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from hotggml.errors import PinError

RECORD_FILE = Path(__file__).with_name("pin.json")
SDIST_ENV = "HOTGGML_GGML_SDIST"  # a path to the pin's source tarball, used before the cache and pip
TREE_NAMES = ("src", "include", "cmake", "tests", "CMakeLists.txt")


def read(path: Path | str = RECORD_FILE) -> dict:
    """The record at path (default the package's pin.json), checked for its fields."""
    record = json.loads(Path(path).read_text())
    missing = [k for k in ("tag", "upstream_commit", "trees", "tree", "source", "pin_commit") if k not in record]
    missing += [f"source.{k}" for k in ("kind", "file", "sha256", "prefix") if k not in record.get("source", {})]
    missing += [f"trees.{k}" for k in TREE_NAMES if k not in record.get("trees", {})]
    if missing:
        raise PinError(f"{path}: the pin record lacks {', '.join(missing)}")
    return record


def write(record: dict, path: Path | str = RECORD_FILE) -> None:
    """Replace the record at path atomically (a reader sees the old record or the new one, never half)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    tmp.replace(path)


def pin_message(record: dict) -> str:
    """The message of the commit fetch makes from the record's source (part of what fixes its id)."""
    source = record["source"]
    return (f"ggml {record['tag']} (upstream {record['upstream_commit']})\n\n"
            f"Materialized by hotggml from {source['file']} (sha256 {source['sha256']}),\n"
            f"members {source['prefix']}. Trees src, include, cmake, tests and CMakeLists.txt\n"
            f"match upstream {record['tag']} byte for byte.\n")


_RECORD = read()
RECORD: dict = _RECORD
TAG: str = _RECORD["tag"]
UPSTREAM_COMMIT: str = _RECORD["upstream_commit"]
TREES: dict[str, str] = dict(_RECORD["trees"])
TREE: str = _RECORD["tree"]
SDIST_REQUIREMENT: str | None = _RECORD["source"].get("requirement")
SDIST_FILE: str = _RECORD["source"]["file"]
SDIST_SHA256: str = _RECORD["source"]["sha256"]
SDIST_PREFIX: str = _RECORD["source"]["prefix"]
SDIST_PIN_COMMIT: str = _RECORD["pin_commit"]
