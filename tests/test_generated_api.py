"""The whole ggml API from Python: declarations generated from the patched headers at build time
(hotggml.cdefgen, hotggml-cdef.h beside the libraries), the struct layout checked against the library at
load, and ops the binding has no method for reached through them."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from hotggml import cdefgen, ops
from hotggml import ffi as hffi
from hotggml.errors import LibraryError
from hotggml.graph import Backend, Graph


def test_the_build_generated_the_declarations_and_the_binding_uses_them(lib):
    # the declarations of the library this process loaded (find_lib_dir() again could name another build: CI's
    # Vulkan lane finishes its build in the same build root while these tests run, and a newer build is preferred)
    generated = Path(hffi._declared)
    assert generated.name == cdefgen.FILE_NAME and generated.is_file()
    assert (generated.parent / hffi._lib_file_name()).is_file() and (generated.parent / "hotggml-build.json").is_file()
    text = generated.read_text()
    for name in ("ggml_soft_max_ext_back", "ggml_rms_norm_back", "ggml_opt_init", "ggml_backend_sched_new",
                 "ggml_backend_rpc_add_server", "ggml_flash_attn_train_back", "ggml_add_inplace"):
        assert f" {name}(" in text or f"*{name}(" in text, name


def test_op_ids_come_from_the_generated_enum(lib):
    """The training ops are appended to enum ggml_op: their ids are the built tree's, and ggml's own
    op-name table agrees with the names the binding looks them up by."""
    for name in ("FLASH_ATTN_TRAIN", "FLASH_ATTN_TRAIN_BACK", "SOFT_MAX_BACK", "MUL_MAT"):
        assert hffi.ffi.string(lib.ggml_op_name(ops.op_id(name))).decode() == name
    assert ops.op_id("FLASH_ATTN_TRAIN_BACK") == lib.GGML_OP_COUNT - 1 == ops.OP_FLASH_ATTN_TRAIN_BACK


def test_soft_max_ext_back_through_the_generated_api(lib):
    """dx = y * (dy - sum(dy * y)) for y = softmax(a): against float64 NumPy (the values of issue 9's
    example; y is kept as an output, so the allocator cannot put dx over it)."""
    a = np.array([0.1, 0.5, -0.3, 1.2], np.float32)
    dy = np.array([1.0, -2.0, 0.5, 3.0], np.float32)
    with Backend("CPU") as be, Graph(be) as g:
        x, d = g.input(a), g.input(dy)
        y = g.soft_max_ext(x, None, 1.0)
        dx = g.wrap(g.lib.ggml_soft_max_ext_back(g.ctx, d.ptr, y.ptr, 1.0, 0.0))
        assert dx.op == ops.op_id("SOFT_MAX_BACK")
        g.build([dx, y])
        g.compute()
        got = g.read(dx)
    y64 = np.exp(a.astype(np.float64) - a.max())
    y64 /= y64.sum()
    want = y64 * (dy - np.dot(dy, y64))
    assert np.allclose(want, [-0.031499, -0.772785, -0.075468, 0.879752], atol=1e-6)
    assert np.abs(got - want).max() < 1e-6


def test_a_ggml_opt_function_through_the_generated_api(lib):
    ds = lib.ggml_opt_dataset_init(lib.GGML_TYPE_F32, lib.GGML_TYPE_F32, 3, 2, 10, 1)
    try:
        data, labels = lib.ggml_opt_dataset_data(ds), lib.ggml_opt_dataset_labels(ds)
        assert list(data.ne)[:2] == [3, 10] and list(labels.ne)[:2] == [2, 10]
        assert lib.ggml_opt_dataset_ndata(ds) == 10
    finally:
        lib.ggml_opt_dataset_free(ds)
    params = lib.ggml_opt_get_default_optimizer_params(hffi.ffi.NULL)
    assert params.adamw.alpha == pytest.approx(0.001) and params.adamw.beta1 == pytest.approx(0.9)


def test_wrap_refuses_what_is_not_a_tensor(lib):
    with Backend("CPU") as be, Graph(be) as g:
        with pytest.raises(TypeError, match="struct ggml_tensor"):
            g.wrap(3)
        with pytest.raises(ValueError, match="NULL"):
            g.wrap(hffi.ffi.cast("struct ggml_tensor *", 0))


def test_the_struct_layout_is_checked_against_the_library(lib, monkeypatch):
    """A declaration whose offsets disagree with the library (an edited header, a foreign cdef) is refused
    by name: reading ne or op through a wrong offset would give garbage, not an error."""
    assert hffi.layout_mismatches(lib) == []
    real_offsetof = hffi.ffi.offsetof
    monkeypatch.setattr(hffi.ffi, "offsetof", lambda t, f: real_offsetof(t, f) + (4 if f == "op_params" else 0),
                        raising=False)
    assert hffi.layout_mismatches(lib) == [
        f"ggml_tensor.op_params: binding {real_offsetof('struct ggml_tensor', 'op_params') + 4}, "
        f"library {real_offsetof('struct ggml_tensor', 'op_params')}"]
    with pytest.raises(LibraryError, match="ggml_tensor.op_params: binding"):
        hffi.check_layout(lib, hffi.find_lib_dir())


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
def test_the_generator_gives_declarations_cffi_reads(tmp_path):
    """hotggml.cdefgen over the patched tree's headers, as the build runs it: cffi parses the result."""
    import cffi

    from hotggml import paths

    include = paths.work_dir() / "ggml" / "include"
    if not include.is_dir():
        pytest.skip("no patched work tree (hotggml patches apply)")
    out = cdefgen.write(include, tmp_path / cdefgen.FILE_NAME)
    f = cffi.FFI()
    f.cdef(out.read_text())
    assert f.sizeof("struct ggml_tensor") > 0 and f.typeof("ggml_backend_sched_t")
