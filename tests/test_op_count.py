"""Every compile-time check of the op count in the patched tree agrees with the enum.

ggml checks GGML_OP_COUNT in more than one place (the name and symbol tables in ggml.c, and
ggml-rpc.h, which only compiles with -DGGML_RPC=ON): a patch that adds ops must update all
of them, or some build configuration breaks. The count comes from the patched enum itself.
"""

from __future__ import annotations

import re

import pytest

_COUNT_CHECK = re.compile(r"GGML_OP_COUNT\s*==\s*(\d+)")


@pytest.fixture(scope="module")
def tree(cpu_build):
    from hotggml import patches

    return patches.default_tree()


def _enum_ops(ggml_h: str) -> list[str]:
    body = re.search(r"enum ggml_op \{(.*?)\};", ggml_h, re.S).group(1)
    body = re.sub(r"//[^\n]*", "", body)
    return [name.strip() for name in body.split(",") if name.strip()]


def test_new_ops_are_at_the_end_of_the_enum(tree):
    ops = _enum_ops((tree / "include" / "ggml.h").read_text())
    assert ops[-3:] == ["GGML_OP_FLASH_ATTN_TRAIN", "GGML_OP_FLASH_ATTN_TRAIN_BACK", "GGML_OP_COUNT"]


def test_every_op_count_check_agrees_with_the_enum(tree):
    count = len(_enum_ops((tree / "include" / "ggml.h").read_text())) - 1  # minus GGML_OP_COUNT itself
    found = {}
    for path in list((tree / "src").rglob("*")) + list((tree / "include").rglob("*")):
        if path.suffix in {".c", ".cpp", ".h", ".cu", ".cuh", ".m"} and path.is_file():
            for m in _COUNT_CHECK.finditer(path.read_text(errors="replace")):
                found.setdefault(str(path.relative_to(tree)), []).append(int(m.group(1)))
    assert {"src/ggml.c", "include/ggml-rpc.h"} <= set(found), found
    wrong = {p: v for p, v in found.items() if any(n != count for n in v)}
    assert not wrong, f"op count is {count}, these checks disagree: {wrong}"


def test_name_tables_cover_the_new_ops(lib):
    from hotggml.ffi import ffi

    # the ids from the built headers' enum (the generated declarations), the names from ggml.c's tables
    assert ffi.string(lib.ggml_op_name(lib.GGML_OP_FLASH_ATTN_TRAIN)) == b"FLASH_ATTN_TRAIN"
    assert ffi.string(lib.ggml_op_name(lib.GGML_OP_FLASH_ATTN_TRAIN_BACK)) == b"FLASH_ATTN_TRAIN_BACK"
