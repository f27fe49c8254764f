"""Misuses of the binding that used to kill the interpreter (SIGSEGV / SIGABRT) or return memory the
allocator reused: each runs in a subprocess (a regression would take pytest down with it otherwise) and
must raise a Python exception of hotggml's family (HotggmlError, with ValueError / TypeError /
RuntimeError / MemoryError as co-bases) naming the problem, after which the interpreter carries on.
Each case names the GGML_ASSERT the Python check stands in front of."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from _misuse import run_child

from hotggml import paths

PRELUDE = """
import numpy as np
from hotggml import kvcache, ops
from hotggml.graph import Backend, Graph
be = Backend("CPU")
"""


def _run(body: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return run_child(PRELUDE, body, env)


CASES = {
    "tensor after close": """
        g = Graph(be); q = g.input(np.zeros((1, 1, 4, 8), np.float32)); k = g.input(np.zeros((1, 1, 4, 8), np.float32))
        fwd = ops.flash_attn_train(g, q, k, k, None, 0.5); g.close()
        expect(RuntimeError, "Graph is closed", lambda: q.ne)
        expect(RuntimeError, "Graph is closed", lambda: ops.get_o(fwd))
        expect(RuntimeError, "Graph is closed", lambda: g.input(np.zeros(3, np.float32)))
        expect(RuntimeError, "Graph is closed", lambda: be.supports_op(fwd))
    """,
    "loss without params": """
        g = Graph(be); x = g.input(np.ones((2, 3), np.float32))
        expect(ValueError, "needs a param()", lambda: g.build([x], g.sum(x)))
        p = g.param(np.ones((2, 3), np.float32))  # refused before anything was built: still usable
        g.build([p], g.sum(p)); g.compute()
        assert (g.grad(p) == 1).all()
    """,
    "read of a tensor that is not kept": """
        g = Graph(be); x = g.param(np.arange(6, dtype=np.float32).reshape(2, 3))
        y = g.mul(x, x); z = g.sum(y)
        g.build([z], z); g.compute()
        expect(ValueError, "not an input, a parameter, an output or a gradient", lambda: g.read(y))
        assert float(g.read(z).ravel()[0]) == 55.0 and g.read(x).shape[-2:] == (2, 3)
    """,
    "backend closed under a graph": """
        g = Graph(be); x = g.param(np.ones(3, np.float32)); g.build([x], g.sum(x))
        be.close()
        expect(RuntimeError, "backend CPU is closed", g.compute)
    """,
    "grad of a graph built without a loss": """
        g = Graph(be); x = g.param(np.ones(3, np.float32)); y = g.mul(x, x); g.build([y]); g.compute()
        expect(RuntimeError, "built without a loss", lambda: g.grad(x))
        expect(RuntimeError, "not in this build's registry", lambda: Backend("CUDA7"))  # BackendError is one too
    """,
    "grad of another graph's tensor": """
        g1 = Graph(be); x = g1.param(np.ones(3, np.float32)); g1.build([x], g1.sum(x)); g1.compute()
        g2 = Graph(be); y = g2.param(np.ones(3, np.float32)); g2.build([y], g2.sum(y)); g2.compute()
        expect(TypeError, "another Graph", lambda: g2.grad(x))
    """,
    # ggml: GGML_ASSERT(cgraph->n_nodes < cgraph->size) in ggml_visit_parents
    "more nodes than max_nodes": """
        g = Graph(be, max_nodes=64); x = g.input(np.ones(3, np.float32)); y = x
        for _ in range(80):
            y = g.add(y, x)
        expect(ValueError, "make the Graph with max_nodes >= 80", lambda: g.build([y]))
        g2 = Graph(be, max_nodes=64); p = g2.param(np.ones(3, np.float32)); z = p
        for _ in range(10):  # 10 forward nodes fit 64, but not with their backward
            z = g2.mul(z, p)
        expect(ValueError, "with their backward", lambda: g2.build([z], g2.sum(z)))
        g3 = Graph(be, max_nodes=1024); p = g3.param(np.ones(3, np.float32)); z = p
        for _ in range(10):
            z = g3.mul(z, p)
        g3.build([z], g3.sum(z)); g3.compute()
        assert np.allclose(g3.grad(p), 11.0)  # d/dp p^11 at 1
    """,
    # ggml: GGML_ASSERT(obj_new->offs + obj_new->size <= ctx->mem_size) in ggml_new_object ("not enough space")
    "more tensors than the context holds": """
        g = Graph(be, max_nodes=16); x = g.input(np.ones(3, np.float32)); y = x
        def grow():
            global y
            for _ in range(1000):
                y = g.add(y, x)
        expect(ValueError, "context is full", grow)
    """,
    # ggml-cpu: the thread pool holds at most GGML_MAX_N_THREADS; 0 threads divides by zero
    "thread counts out of range": """
        expect(ValueError, "n_threads must be in [1, 512]", lambda: Backend("CPU", n_threads=0))
        expect(ValueError, "n_threads must be in [1, 512]", lambda: Backend("CPU", n_threads=100000))
        expect(TypeError, "n_threads must be an int", lambda: Backend("CPU", n_threads=2.5))
        expect(TypeError, "device_name must be a str", lambda: Backend(0))
        expect(ValueError, "max_nodes must be an int in [16", lambda: Graph(be, max_nodes=1 << 40))
    """,
    # ggml: GGML_ASSERT(!ggml_is_transposed(a)) in ggml_mul_mat; the CPU kernels' GGML_ASSERT(nb00 == type size)
    # (ggml-cpu.c mul_mat, binary-ops.cpp, ops.cpp repeat); ggml_compute_forward_sum, which assumes it: 30 for 66
    "operands whose rows are not contiguous": """
        g = Graph(be); a = g.input(np.ones((4, 4), np.float32)); b = g.input(np.ones((3, 4), np.float32))
        x = g.input(np.arange(24, dtype=np.float32).reshape(2, 3, 4)); like = g.input(np.ones((2, 4, 6), np.float32))
        expect(ValueError, "contiguous rows", lambda: g.mul_mat(g.permute(a, 1, 0, 2, 3), b))
        expect(ValueError, "mul_mat: b", lambda: g.mul_mat(a, g.permute(a, 1, 0, 2, 3)))
        expect(ValueError, "mul_mat: a", lambda: g.mul_mat(g.permute(x, 2, 0, 1, 3), g.input(np.ones((4, 5, 3), np.float32))))
        expect(ValueError, "mul: a", lambda: g.mul(g.permute(a, 1, 0, 2, 3), a))
        expect(ValueError, "add: a", lambda: g.add(g.permute(a, 1, 0, 2, 3), a))
        expect(ValueError, "repeat: t", lambda: g.repeat(g.permute(x, 1, 0, 2, 3), like))
        expect(ValueError, "sum: a", lambda: g.sum(g.permute(x, 1, 0, 2, 3)))
        y = g.mul(a, g.permute(a, 1, 0, 2, 3)); s = g.sum(g.permute(x, 0, 2, 1, 3))  # what the kernels do take
        g.build([y, s]); g.compute()
        assert (g.read(y) == 1).all() and g.read(s).item() == 276.0
    """,
    # ggml-cpu ops.cpp: repeat has no q8_0 kernel (fatal error); a q8_0 row of a partial block: cont() SIGSEGV
    "q8_0 tensors keep their blocks whole": """
        g = Graph(be); c8 = g.cache(np.ones((2, 4, 64), np.float32), "q8_0"); like = g.input(np.ones((2, 8, 64), np.float32))
        expect(TypeError, "not q8_0 blocks", lambda: g.repeat(c8, like))
        expect(ValueError, "whole blocks of 32", lambda: g.reshape(c8, (16, 32, 1, 1)))
        expect(ValueError, "axis 0 stays", lambda: g.permute(c8, 1, 0, 2, 3))
        g.cont(g.reshape(c8, (128, 4, 1, 1)))  # whole blocks: taken
    """,
    # ggml.c: GGML_ASSERT in ggml_compute_backward, "no gradient for a K or V in a stored type"
    "a stored K/V that depends on a param": """
        g = Graph(be); q = g.param(np.ones((1, 4, 2, 32), np.float32)); w = g.param(np.ones((1, 2, 6, 32), np.float32))
        k16 = g.add(g.cache(np.ones((1, 2, 6, 32), np.float32), "f16"), w)
        fwd = ops.flash_attn_train(g, q, k16, k16, None, 0.25)
        expect(ValueError, "f16 k of flash_attn_train", lambda: g.build([fwd], g.sum(fwd)))
    """,
    # ggml-backend.cpp: GGML_ASSERT(*cur_backend_id != -1) when no backend of the scheduler supports a node
    "a node no scheduled backend runs": """
        g = Graph(be, scheduled=True); a = g.input(np.ones((5, 32), np.float16)); b = g.input(np.ones((5, 3), np.float32))
        y = g.wrap(g.lib.ggml_out_prod(g.ctx, a.ptr, b.ptr))  # OUT_PROD with an f16 operand: no backend here
        g.build([y])
        expect(RuntimeError, "does not support: OUT_PROD", g.plan)
        expect(RuntimeError, "does not support: OUT_PROD", g.compute)
    """,
    # values ggml would have taken as something else without a word
    "values a conversion would change": """
        g = Graph(be)
        expect(ValueError, "beyond float16's range", lambda: g.input(np.array([1e6], np.float32), dtype=np.float16))
        expect(ValueError, "beyond float32's range", lambda: g.input(np.array([1e39]), dtype=np.float32))
        expect(TypeError, "cannot take float32", lambda: g.input(np.array([1.7], np.float32), dtype=np.int32))
        expect(ValueError, "out of the int32 range", lambda: g.input(np.array([3e9], np.int64), dtype=np.int32))
        expect(ValueError, "f16 cannot hold the finite value", lambda: g.cache(np.full((2, 8), 1e6, np.float32), "f16"))
        expect(ValueError, "bf16 cannot hold the finite value", lambda: g.cache(np.full((2, 8), 3.4e38, np.float32), "bf16"))
        big = np.ones((2, 32), np.float32); big[1, 3] = 1e7  # its block's scale 1e7 / 127 is inf as an f16: 32 NaN
        expect(ValueError, "q8_0 cannot hold the finite value", lambda: g.cache(big, "q8_0"))
        c8 = g.cache(np.ones((2, 32), np.float32), "q8_0")
        expect(ValueError, "q8_0 cannot hold the finite value", lambda: g.set(c8, big))
        for kind in ("f32", "f16", "bf16", "q8_0"):  # float64 values finite only before the conversion
            expect(ValueError, f"{kind} cannot hold the finite value 1e+300", lambda: g.cache(np.full((2, 32), 1e300), kind))
        expect(ValueError, "bf16 cannot hold the finite value 1e+300", lambda: g.set(g.cache(np.ones((2, 32)), "bf16"), np.full((2, 32), 1e300)))
        lone = np.ones((2, 32), np.float32); lone[0, 3] = np.nan  # ggml's quantizer makes it 0.0, its block finite
        expect(ValueError, "non-finite value nan at (0, 3)", lambda: g.cache(lone, "q8_0"))
        inf = np.ones((2, 64), np.float32); inf[1, 37] = np.inf  # its block's scale is inf: 32 NaN, named by the inf
        expect(ValueError, "q8_0 cannot hold the non-finite value inf at (1, 37)", lambda: g.cache(inf, "q8_0"))
        expect(ValueError, "at least one value", lambda: kvcache.stored(np.zeros((3, 0), np.float32), "q8_0"))
        expect(TypeError, "raw must be a uint8 array", lambda: kvcache.decode(np.full((2, 68), 300.0), "q8_0", 64))
        expect(TypeError, "made of f16 or f32 values, got a q8_0", lambda: g.mark_mask(g.cache(np.ones((2, 32)), "q8_0"), "m"))
        expect(ValueError, "at least one value", lambda: kvcache.row_bytes("f16", -3))
        expect(TypeError, "name must be a str", lambda: g.input(np.ones(2, np.float32), name=5))
        expect(TypeError, "name must be a str", lambda: g.new_tensor((2,), name=5))
        from hotggml.opt import AdamW
        expect(ValueError, "must be finite as a float32", lambda: AdamW(alpha=10**400))
        expect(ValueError, "without NUL", lambda: Backend("CPU" + chr(0) + "junk"))
        expect(ValueError, "without NUL", lambda: Backend("CPU" + chr(0xDCFF)))
        expect(ValueError, "finite as float32", lambda: g.dot_loss([(g.input(np.ones(2, np.float32)), np.full(2, 1e300))]))
        expect(ValueError, "non-empty list", lambda: g.dot_loss([]))
        expect(TypeError, "pairs", lambda: g.dot_loss([g.input(np.ones(2, np.float32))]))
        expect(TypeError, "hotggml Tensor", lambda: g.dot_loss([(np.ones(2), np.ones(2))]))
        expect(ValueError, "of 0..3 (ints)", lambda: g.permute(g.input(np.ones((2, 2), np.float32)), 1.0, 0.0, 2.0, 3.0))
        from hotggml import rpc
        expect(ValueError, "start_timeout", lambda: rpc.Server("CPU", start_timeout="5"))
        expect(ValueError, "n_threads must be an int in [1, 512]", lambda: rpc.Server("CPU", n_threads=100000))
        huge = np.broadcast_to(np.float32(1), (2**20, 2**20, 2**10))  # 4 PiB as a view: refused before any copy
        expect(ValueError, "is over", lambda: g.input(huge)); expect(ValueError, "is over", lambda: g.param(huge))
        expect(ValueError, "is over", lambda: g.cache(huge, "q8_0")); expect(ValueError, "is over", lambda: g.cache(huge, "f32"))
        expect(TypeError, "is not a dtype", lambda: g.input(np.ones(2), dtype="bogus"))
        expect(TypeError, "is not a dtype", lambda: g.new_tensor((2,), dtype="bogus"))
        expect(TypeError, "is not a dtype", lambda: g.input(np.ones(2), dtype=("f4", -1)))
        expect(TypeError, "masked array filled first", lambda: g.input(np.ma.masked_array([1.0, 2.0], mask=[0, 1])))
        expect(TypeError, "masked array filled first", lambda: g.cache(np.ma.masked_array(np.ones(32), mask=0), "f16"))
        expect(TypeError, "scheduled must be a bool", lambda: Graph(be, scheduled="no"))
        expect(TypeError, "get_prec needs a flash_attn_train", lambda: ops.get_prec(None))
        expect(TypeError, "get_implicit_mask needs a flash_attn_train", lambda: ops.get_implicit_mask(None))
        raw = kvcache.encode(np.ones((2, 32), np.float32), "f16")
        expect(TypeError, "an int number of values", lambda: kvcache.decode(raw, "f16", 2.0))
        expect(TypeError, "an int number of values", lambda: kvcache.row_bytes("f16", "2"))
        expect(TypeError, "an int number of values", lambda: kvcache.check_row("f16", None))
        expect(ValueError, "one row of bytes per row of values", lambda: kvcache.check_held(np.ones((3, 32)), raw, "f16", "c"))
        qq = g.input(np.ones((1, 4, 2, 32), np.float32)); kk = g.input(np.ones((1, 2, 6, 32), np.float32))
        expect(TypeError, "mask must be f16, got bf16", lambda: ops.flash_attn_train(g, qq, kk, kk, g.cache(np.zeros((4, 6)), "bf16"), 0.25))
        g.input(np.array([65519.0]), dtype=np.float16); g.input(np.array([65505]), dtype=np.float16)  # round to 65504
        g.cache(np.full((2, 8), 65519.0), "f16")
        expect(ValueError, "at least one element", lambda: g.cache(np.ones((0, 2, 8), np.float32), "f16"))
        q = g.input(np.ones((1, 4, 2, 32), np.float32)); k = g.input(np.ones((1, 2, 6, 32), np.float32))
        expect(ValueError, "finite as a float32", lambda: ops.flash_attn_train(g, q, k, k, None, 1e39))
        expect(ValueError, "finite as a float32", lambda: g.soft_max_ext(q, None, -1e39))
        expect(TypeError, "scale must be a real number", lambda: g.soft_max_ext(q, None, "x"))
        expect(ValueError, "finite as a float32", lambda: g.soft_max_ext(q, None, 2**200))
        expect(ValueError, "finite as a float32", lambda: g.soft_max_ext(q, None, 10**400))
        expect(ValueError, "is 0 as a float32", lambda: ops.flash_attn_train(g, q, k, k, None, 1e-50))
        expect(TypeError, "a list of output tensors", lambda: g.build(q))
    """,
    # SPEC section 4: +INF or NaN in a mask makes every O, dQ of its rows NaN, with no error
    "mask values checked through caches and views": """
        g = Graph(be); q = g.input(np.ones((1, 4, 2, 32), np.float32)); k = g.input(np.ones((1, 2, 6, 32), np.float32))
        bad = np.zeros((4, 6), np.float32); bad[1, 2] = np.inf
        expect(ValueError, "finite values or -inf only", lambda: ops.flash_attn_train(g, q, k, k, g.cache(bad, "f16"), 0.25))
        flat = g.input(bad.astype(np.float16).reshape(-1))
        expect(ValueError, "finite values or -inf only", lambda: ops.flash_attn_train(g, q, k, k, g.reshape(flat, (6, 4, 1, 1)), 0.25))
        flat = g.input(np.zeros(24, np.float16))
        ops.flash_attn_train(g, q, k, k, g.reshape(flat, (6, 4, 1, 1)), 0.25)
        expect(ValueError, "finite values or -inf only", lambda: g.set(flat, bad.astype(np.float16).reshape(-1)))
        leaf = g.input(bad.T.astype(np.float16))  # a mask made by cont() of a transposed leaf
        expect(ValueError, "finite values or -inf only", lambda: ops.flash_attn_train(g, q, k, k, g.cont(g.permute(leaf, 1, 0, 2, 3)), 0.25))
        s32 = g.input(np.zeros((2, 6), np.float32)); m32 = g.input(np.where(np.arange(12).reshape(2, 6) == 7, np.inf, 0).astype(np.float32))
        expect(ValueError, "finite values or -inf only", lambda: g.soft_max_ext(s32, m32, 1.0))
    """,
    # ggml: GGML_ASSERT(mask->ne[0] == a->ne[0]) and the other mask asserts in ggml_soft_max_impl
    "soft_max_ext with a mask that does not fit": """
        g = Graph(be); a = g.input(np.ones((4, 8), np.float32))
        m = g.input(np.zeros((4, 5), np.float16))
        expect(ValueError, "does not fit", lambda: g.soft_max_ext(a, m, 1.0))
        expect(ValueError, "contiguous a", lambda: g.soft_max_ext(g.permute(a, 1, 0, 2, 3), None, 1.0))
        expect(ValueError, "must be finite", lambda: g.soft_max_ext(a, None, float("nan")))
    """,
    # ggml: GGML_ASSERT(tensor->type == GGML_TYPE_F32) in ggml_set_loss
    "f16 loss": """
        g = Graph(be); p = g.param(np.ones(3, np.float32)); l16 = g.input(np.ones(1, np.float16))
        expect(ValueError, "loss must be an f32 scalar", lambda: g.build([p], l16))
    """,
    "tensor sizes out of range": """
        g = Graph(be)
        expect(ValueError, "over", lambda: g.new_tensor((1 << 30, 1 << 30, 1 << 10)))
        expect(ValueError, "positive int dims", lambda: g.new_tensor((4, 0)))
        expect(ValueError, "positive int dims", lambda: g.new_tensor((4.5,)))
    """,
    "plan and placement after the Backend closed (the scheduler held its freed C object: SIGSEGV)": """
        b2 = Backend("CPU"); g = Graph(b2, scheduled=True); x = g.param(np.ones(4, np.float32)); y = g.sum(x)
        g.build([y], y); g.compute(); b2.close()
        expect(RuntimeError, "is closed", g.plan)
        expect(RuntimeError, "is closed", g.placement)
    """,
    "poison of a leaf or of a view outside the built graph (ggml-backend.cpp: tensor not allocated)": """
        g = Graph(be); x = g.param(np.ones((2, 3), np.float32)); y = g.sum(x); g.build([y], y)
        xv = g.permute(x, 1, 0, 2, 3)
        expect(ValueError, "input or parameter", lambda: g.compute(poison=[x]))
        expect(ValueError, "input or parameter", lambda: g.compute(poison=[xv]))
        s = g.sum(g.mul(x, x))  # made after build(): never placed
        expect(ValueError, "not in the built graph", lambda: g.compute(poison=[s]))
        g.compute(); assert (g.read(x) == 1.0).all()  # x still holds the caller's values
    """,
    "param refuses what input refuses, before converting": """
        g = Graph(be)
        expect(ValueError, "would become inf", lambda: g.param(np.array([1e39, 1.0])))
        expect(TypeError, "as a NumPy array (a masked array filled first), got NoneType", lambda: g.param(None))
        expect(TypeError, "cannot take complex", lambda: g.param(np.array([1 + 2j])))
        expect(TypeError, "cannot take <U3", lambda: g.param(np.array(["1.5"])))
    """,
    "a cache leaf as an Optimizer's inputs (every step raised)": """
        from hotggml.opt import Optimizer
        g = Graph(be); kc = g.cache(np.ones((4, 32), np.float32), "q8_0"); w = g.param(np.ones((4, 32), np.float32))
        o = g.mul(w, w)  # refused for the inputs' type first, whatever the outputs
        expect(TypeError, "q8_0 cache", lambda: Optimizer(g, kc, o, "sum"))
    """,
    # checked before any C call, with the type and message that name the problem
    "arguments named before C sees them": """
        assert not hasattr(ops, "OP_NOT_AN_OP") and getattr(ops, "OP_NOT_AN_OP", 7) == 7
        g = Graph(be); q = g.input(np.ones((1, 4, 2, 32), np.float32)); k = g.input(np.ones((1, 2, 6, 32), np.float32))
        expect(TypeError, "precision must be a str", lambda: ops.flash_attn_train(g, q, k, k, None, 0.5, prec=[]))
        expect(ValueError, "precision must be one of", lambda: ops.flash_attn_train(g, q, k, k, None, 0.5, prec="f64"))
        s = g.sum(q); g.close()
        expect(RuntimeError, "closed", lambda: g.build([s]))
        b2 = Backend("CPU"); g2 = Graph(b2); s2 = g2.sum(g2.input(np.ones(3, np.float32))); b2.close()
        for _ in range(2):  # the refused build() left no graph behind: the same answer again
            expect(RuntimeError, "closed", lambda: g2.build([s2]))
    """,
    # ggml-alloc.c: a failed reservation left a NULL buffer that the next alloc wrote through (SIGSEGV): the retry
    # after a caught OutOfMemoryError, and the scheduler's own retry (patch alloc-failed-reserve)
    "a graph too big for memory, computed twice": """
        for scheduled in (False, True):
            g = Graph(be, scheduled=scheduled); x = g.param(np.ones((1, 1), np.float32))
            s = g.sum(g.repeat(x, g.new_tensor((1 << 20, 1 << 20))))  # a 4 TiB intermediate
            g.build([s], s)
            for _ in range(2):
                expect(MemoryError, "graph allocation failed", g.compute)
            g.close()
    """,
    # ggml-opt.cpp: ggml_opt_alloc ignored the scheduler's failure and evaluated the unallocated graph (SIGSEGV);
    # it reports it now (patch opt-alloc-status)
    "an Optimizer whose training graph does not fit": """
        from hotggml.opt import Optimizer
        for period in (1, 2):  # opt_period 2: ggml-opt resets the gradient graph at the first micro-batch
            g = Graph(be); x = g.input(np.ones((1, 1), np.float32)); w = g.param(np.ones((1, 1), np.float32))
            y = g.repeat(g.mul(w, x), g.new_tensor((1 << 20, 1 << 20)))
            opt = Optimizer(g, x, y, "sum", opt_period=period)
            for _ in range(3):
                expect(MemoryError, "training graph could not be allocated", lambda: opt.step(np.ones((1, 1), np.float32)))
            assert opt.n_micro == 0
            opt.close()
    """,
    # ggml-impl.h: the scheduler's hash set holds the graph's tensors; assignments of tensors outside the built
    # graph, re-applied at every run, overflowed it (fatal error)
    "assign() of tensors the built graph does not hold": """
        g = Graph(be, max_nodes=16, scheduled=True)
        xs = [g.input(np.full(2, i, np.float32)) for i in range(40)]
        for x in xs:
            g.assign(x, "CPU")
        s = g.sum(xs[0]); g.build([s]); g.compute()
        assert float(g.read(s).reshape(-1)[0]) == 0.0
        expect(ValueError, "no backend", lambda: g.assign(xs[1], "Vulkan0"))
        expect(TypeError, "device_name must be a str", lambda: g.assign(xs[1], 0))
    """,
    # ggml-backend-meta.cpp: a meta buffer gets and sets whole tensors of its own (GGML_ASSERT is_meta(buffer)):
    # read() and poison of views, placed or not, go through the view's root
    "views read and poisoned on a meta backend": """
        mb = Backend.meta(["CPU", "CPU"]); g = Graph(mb, scheduled=True)
        a = np.arange(64, dtype=np.float32).reshape(1, 4, 2, 8)
        x = g.input(a); y = g.add(x, x); g.build([y]); g.compute()  # mirrored: views made after build()
        assert np.array_equal(g.read(g.reshape(x, (8, 4, 2, 1))), a.reshape(1, 2, 4, 8))
        assert np.array_equal(g.read(g.permute(y, 0, 2, 1, 3)), np.transpose(2 * a, (0, 2, 1, 3)))
        g.compute(poison=[g.reshape(y, (64, 1, 1, 1))]); assert np.array_equal(g.read(y), 2 * a)
        expect(ValueError, "cannot poison", lambda: g.compute(poison=[g.reshape(x, (64, 1, 1, 1))]))
        g = Graph(mb, scheduled=True); x = g.input(a); g.split(x, 2)  # a permuted view of a split leaf, an output
        y = g.permute(x, 0, 2, 1, 3); g.build([y]); g.compute()
        assert np.array_equal(g.read(y), np.transpose(a, (0, 2, 1, 3)))
    """,
    # ggml-backend-meta.cpp: a CPU kernel read a meta buffer's tensor through its placeholder address (SIGSEGV);
    # a leaf split on axis 3 reached GGML_ABORT in the meta buffer's set_tensor
    "meta graphs: assign() to CPU, a split on axis 3": """
        mb = Backend.meta(["CPU", "CPU"]); g = Graph(mb, scheduled=True)
        x = g.input(np.ones((2, 1, 1, 4), np.float32)); y = g.add(x, x)
        expect(ValueError, "split on another axis", lambda: g.split(x, 3))
        g.build([y])
        expect(ValueError, "assign() to " + mb.device_name + " only", lambda: g.assign(y, "CPU"))
        g.assign(y, mb.device_name.lower()); g.compute(); assert (g.read(y) == 2).all()  # names as the scheduler's
    """,
    # an OutOfMemoryError from build() (the leaves' buffer) left a built Graph whose leaves had no memory:
    # compute() returned zeros and set() never reached the device; now compute() uploads them first (or raises)
    "build() out of memory for the leaves, then computed": """
        import resource
        # a meta backend: its static allocation asserted that each device's buffer was made (patch meta-alloc-failure)
        for backend, scheduled in ((be, False), (Backend.meta(["CPU", "CPU"]), True)):
            g = Graph(backend, scheduled=scheduled); x = g.input(np.full(4, 3.0, np.float32))
            g.input(np.zeros((256, 1024, 1024), np.float32)); y = g.add(x, x)
            vm = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) * 1024
            soft, hard = resource.getrlimit(resource.RLIMIT_AS)
            resource.setrlimit(resource.RLIMIT_AS, (vm + (256 << 20), hard))
            expect(MemoryError, "input buffer allocation failed", lambda: g.build([y]))
            expect(MemoryError, "input buffer allocation failed", g.compute)
            expect(MemoryError, "input buffer allocation failed", g.arena_bytes)  # (it measured the leaves as arena)
            g.set(x, np.ones(4, np.float32))
            resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
            g.compute(); assert (g.read(y) == 2).all(), g.read(y)
            g.set(x, np.full(4, 5.0, np.float32)); g.compute(); assert (g.read(y) == 10).all(), g.read(y)
            g.close()
    """,
    # ggml.c: ggml_hash_set_new aborts when it cannot allocate a scheduler's hash set
    "a scheduler of absurd size": """
        from hotggml.sched import Scheduler
        expect(ValueError, "graph_size must be an int in [1, ", lambda: Scheduler(be, 2**40))
        expect(ValueError, "graph_size must be an int", lambda: Scheduler(be, 0))
        expect(TypeError, "must be a hotggml Backend", lambda: Scheduler("CPU", 10))
        b2 = Backend("CPU"); b2.close()
        expect(RuntimeError, "is closed", lambda: Scheduler(b2, 10))
    """,
    # ggml.c:1771 GGML_ASSERT(obj_new): the packed nodes' view getters made a tensor object without asking for room
    "views of packed nodes in a full context": """
        rng = np.random.default_rng(0)
        g = Graph(be, max_nodes=16)
        q, k, v = (g.param(rng.standard_normal((1, 2, 4, 32), dtype=np.float32)) for _ in range(3))
        f = ops.flash_attn_train(g, q, k, v, None, 0.1)
        def views():
            for _ in range(100):
                ops.get_o(f); ops.get_lse(f)
        expect(ValueError, "context is full", views)
    """,
    # ggml.c GGML_ASSERT(obj_new) in ggml_new_graph_custom: tensors never built filled the room of the graph object
    "build() where unbuilt tensors took the graph's room": """
        g = Graph(be); x = g.param(np.ones((2, 3), np.float32)); y = g.cont(x); L = g.sum(y)
        G, ov = g.lib.ggml_graph_overhead_custom(g.max_nodes, True), g.lib.ggml_tensor_overhead()
        while g.lib.ggml_used_mem(g.ctx) + ov <= g._mem - G:
            g.cont(x)
        expect(ValueError, "no room left for the graph", lambda: g.build([y], L))
        g.read  # the Graph is not built: a bigger one is the way out
        expect(RuntimeError, "call build() first", g.compute)
    """,
    # free(): corrupted lists / SIGSEGV: close() freed the backend (the graph) under a compute in another thread
    "close() while another thread computes": """
        import threading, time
        rng = np.random.default_rng(0)
        for which in ("backend", "graph"):
            b = Backend("CPU", n_threads=2); g = Graph(b)  # a compute of ~0.1 s or more
            q, k, v = (g.param(rng.standard_normal((1, 8, 1024, 64), dtype=np.float32)) for _ in range(3))
            o = ops.get_o(ops.flash_attn_train(g, q, k, v, None, 0.125, causal=True))
            g.build([o], g.dot_loss([(o, rng.standard_normal((1, 1024, 8, 64)).astype(np.float32))]))
            started, errors = threading.Event(), []
            def run():
                try:
                    for _ in range(5):
                        started.set(); g.compute()
                except RuntimeError as e:  # closed under it: UsageError, between two computes
                    errors.append(str(e))
            th = threading.Thread(target=run); th.start(); started.wait(); time.sleep(0.05)
            (b if which == "backend" else g).close(); th.join()
            assert all("closed" in e for e in errors), errors
        print("raised", "nothing: close() waited")
    """,
}


@pytest.mark.parametrize("name", list(CASES))
def test_misuse_raises_and_the_interpreter_survives(lib, name):
    run = _run(CASES[name])
    assert run.returncode == 0, f"exit {run.returncode}\n{run.stdout}\n{run.stderr[-2000:]}"
    assert run.stdout.strip().endswith("alive") and "raised" in run.stdout


def test_lib_dir_that_does_not_hold_the_library_is_an_error(lib, tmp_path):
    run = _run("", env={"HOTGGML_LIB_DIR": str(tmp_path / "nowhere")})
    assert run.returncode != 0 and "alive" not in run.stdout
    assert f"HOTGGML_LIB_DIR={tmp_path / 'nowhere'} holds no libggml" in run.stderr



def test_graphs_and_backends_never_closed_are_freed_when_collected(lib):
    """A Graph or Backend that is never closed is freed when the collector takes it (each Graph holds
    ~20 MiB of ggml context: leaked, a loop of graphs grew the process by that much per graph)."""
    import gc

    import numpy as np

    from hotggml.graph import Backend, Graph

    def unclosed_graph(be):
        g = Graph(be)
        x = g.param(np.ones((64, 64), np.float32))
        g.build([x], g.sum(x))
        g.compute()
        return g._finalizer, g._native

    be = Backend("CPU")
    made = [unclosed_graph(be) for _ in range(20)]
    backends = [Backend("CPU")._finalizer for _ in range(5)]
    gc.collect()
    assert not any(fin.alive for fin, _ in made) and not any(fin.alive for fin in backends)
    assert all(native.ctx is None and native.ctx_in is None for _, native in made)  # ggml_free ran
    g = Graph(be)
    g.close()
    g.close()  # closing twice frees once
    be.close()
    with pytest.raises(RuntimeError, match="backend CPU is closed"):
        Graph(be)


def test_backward_growth_bound_holds_for_every_op_the_binding_builds(lib):
    """build() refuses a forward of more than max_nodes / (1 + BACKWARD_GROWTH) nodes when a loss is given,
    because ggml aborts on a graph that overflows while it adds the backward: the bound must hold for every
    op the binding builds, measured here as nodes added by the backward per forward node."""
    import numpy as np

    from hotggml import ops
    from hotggml.graph import BACKWARD_GROWTH, Backend, Graph

    rng = np.random.default_rng(0)

    def chain(g):  # the exact chain's ops: mul_mat, soft_max_ext with a mask, permute, cont, repeat, reshape
        q = g.param(rng.standard_normal((1, 4, 6, 8)).astype(np.float32))
        k = g.param(rng.standard_normal((1, 2, 5, 8)).astype(np.float32))
        kr = g.repeat(k, g.new_tensor((8, 5, 4, 1)))
        s = g.mul_mat(kr, q)
        m = g.input(np.zeros((6, 5), np.float16))
        p = g.soft_max_ext(s, m, 0.3)
        r = g.reshape(g.cont(g.permute(p, 1, 0, 2, 3)), (6, 5, 4, 1))
        return g.mul(r, r)

    def fused(g):  # the fused pair with the LSE in the loss (d packed)
        q = g.param(rng.standard_normal((1, 4, 6, 8)).astype(np.float32))
        k = g.param(rng.standard_normal((1, 2, 5, 8)).astype(np.float32))
        v = g.param(rng.standard_normal((1, 2, 5, 8)).astype(np.float32))
        fwd = ops.flash_attn_train(g, q, k, v, None, 0.3, causal=True)
        return g.add(g.sum(ops.get_o(fwd)), g.sum(ops.get_lse(fwd)))

    with Backend("CPU") as be:
        for make in (chain, fused):
            with Graph(be) as g:
                out = make(g)
                loss = out if out.ne == (1, 1, 1, 1) else g.sum(out)
                n_fwd, _ = g._count_forward([loss])
                g.build([out], loss)
                added = g.lib.ggml_graph_n_nodes(g.gf) - n_fwd
                assert added > 0
                assert added <= BACKWARD_GROWTH * n_fwd, f"{make.__name__}: {added} nodes for {n_fwd} forward"


def _dummy_library(folder, name: str) -> None:
    """An empty shared library with ggml's soname `name` (what a stale or foreign ggml looks like to ld.so)."""
    import shutil

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("needs a C compiler to make the shadowing library")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "empty.c").write_text("int hotggml_test_dummy(void) { return 0; }\n")
    subprocess.run([cc, "-shared", "-fPIC", f"-Wl,-soname,{name}", "-o", str(folder / name), str(folder / "empty.c")],
                   check=True, capture_output=True)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LD_LIBRARY_PATH and /proc/self/maps are Linux's")
def test_ld_library_path_cannot_shadow_the_patched_libraries(lib, tmp_path):
    """LD_LIBRARY_PATH overrides the RUNPATH the build links with: a libggml-base.so found there used to be
    loaded in place of ours (undefined symbols, and advice to rebuild, which cannot help). The binding loads
    its dependencies by absolute path first, so the shadow is never used."""
    _dummy_library(tmp_path, "libggml-base.so")
    _dummy_library(tmp_path, "libggml-cpu.so")
    run = _run("""
        from hotggml import ffi
        assert all(p.parent == ffi.find_lib_dir() for p in ffi._mapped_ggml_libraries()), ffi._mapped_ggml_libraries()
        g = Graph(be); x = g.param(np.ones(3, np.float32)); g.build([x], g.sum(x)); g.compute()
        assert (g.grad(x) == 1).all()
    """, env={"LD_LIBRARY_PATH": str(tmp_path)})
    assert run.returncode == 0 and run.stdout.strip().endswith("alive"), run.stderr[-2000:]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/maps is Linux's")
def test_another_ggml_loaded_first_is_named(lib, tmp_path):
    """A ggml loaded into the process before hotggml (another binding) would be bound to our library's
    symbols: refused with a message that says so, not advice to rebuild."""
    _dummy_library(tmp_path, "libggml-base.so")
    code = (f"import ctypes; ctypes.CDLL({str(tmp_path / 'libggml-base.so')!r}, ctypes.RTLD_GLOBAL)\n"
            "from hotggml import ffi\n"
            "from hotggml.errors import LibraryError\n"
            "try:\n    ffi.load()\nexcept LibraryError as e:\n    print('refused:', e)\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(paths.REPO_ROOT)})
    assert run.returncode == 0, run.stderr[-2000:]
    assert "refused:" in run.stdout and "another ggml was loaded into this process first" in run.stdout
    assert "rebuild" not in run.stdout.split("refused:")[1].split(";")[0]


def test_loading_the_binding_imports_no_git_tooling(lib):
    """The binding checks the library's stamp against this checkout's series (hotggml.series, hotggml.pin_record)
    without GitPython or the patch tooling: a trainer's process loads neither."""
    run = _run("""
        import sys
        from hotggml import ffi
        ffi.load()
        loaded = [m for m in ("git", "hotggml.patches", "hotggml.pin", "hotggml.gitutil") if m in sys.modules]
        assert not loaded, loaded
    """)
    assert run.returncode == 0 and run.stdout.strip().endswith("alive"), run.stderr[-2000:]


def test_inputs_are_not_held_twice(lib):
    """build() uploads every input into the backend's input buffer and drops the NumPy copy: a 32 MB f32 copy
    of a float64 input is freed at build(), not held beside the buffer for the Graph's life."""
    import gc
    import tracemalloc

    import numpy as np

    from hotggml.graph import Backend, Graph

    with Backend("CPU") as be, Graph(be) as g:
        big = np.full((1024, 1024, 8), 0.5)  # float64: input() makes a float32 copy (32 MiB)
        tracemalloc.start()  # NumPy reports its allocations to tracemalloc
        try:
            x = g.param(big)
            del big
            gc.collect()
            before = tracemalloc.get_traced_memory()[0]
            g.build([x], g.sum(x))
            gc.collect()
            freed = before - tracemalloc.get_traced_memory()[0]
        finally:
            tracemalloc.stop()
        g.compute()
        assert float(g.read(x).ravel()[12345]) == 0.5 and float(g.grad(x).ravel()[-1]) == 1.0
    assert freed >= 30 * 2**20, f"build() freed {freed} bytes of NumPy data"


GC_IN_CFFI = """
import gc
import cffi
import numpy as np
from hotggml.ffi import ffi
from hotggml.graph import Backend, Graph
from hotggml.opt import Optimizer
be = Backend("CPU")
class Cycle:  # held only by a reference cycle: freed at the cyclic collector's next run
    pass
c = Cycle(); c.self = c; c.g = Graph(be); c.g.input(np.ones(3, np.float32))
g = Graph(be); x = g.input(np.zeros((4, 3), np.float32)); w = g.param(np.full((2, 3), .1, np.float32))
c.opt = Optimizer(g, x, g.mul_mat(w, x), loss="mse")
del c, g, x, w
real = cffi.api.FFI._typeof_locked
def typeof_locked(self, cdecl):  # the collector's run inside cffi's locked parse of a new type
    gc.collect()
    return real(self, cdecl)
cffi.api.FFI._typeof_locked = typeof_locked
ffi.new("char[7]")
print("alive")
"""


def test_the_collector_freeing_a_graph_inside_a_cffi_call_does_not_hang(lib):
    """A Graph or Optimizer collected while cffi parsed a new type (cffi's lock held) looked up ggml_free /
    ggml_opt_free for the first time, which takes that lock: the process hung for good (an RPC test's
    Optimizer.step did, on a ffi.new)."""
    run = subprocess.run([sys.executable, "-c", GC_IN_CFFI], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(paths.REPO_ROOT)})
    assert run.returncode == 0 and run.stdout.strip() == "alive", run.stderr[-2000:]
