"""probe: the device's supports_op is asked at the real shapes, and a refusal is a named error."""

from __future__ import annotations

import pytest

from hotggml import cases
from hotggml.errors import UnsupportedOpError
from hotggml.graph import Backend
from hotggml.probe import probe


def test_field_shapes_probe_without_allocating(cpu):
    """The 27B chunk (Skv 75520, D 256) probes in a no-alloc context: nothing is allocated."""
    chunk = next(c for c in cases.FIELD if c.id.startswith("chunk-27b"))
    probe(chunk, cpu)
    for case in cases.FIELD:
        probe(case, cpu, "f32")


def test_refusal_names_the_node_and_device(cpu, monkeypatch):
    seen = []

    def refuse_backward(self, node):
        seen.append(node.op_name)
        return node.op_name != "FLASH_ATTN_TRAIN_BACK"

    monkeypatch.setattr(Backend, "supports_op", refuse_backward)
    with pytest.raises(UnsupportedOpError, match=r"CPU supports_op is false for FLASH_ATTN_TRAIN_BACK at tiny"):
        probe(cases.SMOKE[0], cpu)
    assert seen == ["FLASH_ATTN_TRAIN", "FLASH_ATTN_TRAIN_BACK"]
