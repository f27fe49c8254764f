"""ggml's meta backend over two instances of the CPU device (issue 23, items 3 and 4; patches meta-device-name,
meta-buffer-memset, meta-segmented-results, flash-attn-train-meta).

- the device is made over named devices and names them (it was "Meta()", and in no registry);
- parity smoke through it: the fused arm split by heads in whole GQA groups where Nkv divides by 2 (else the
  mirrored rule), every output bitwise equal to the fused arm on one CPU, and the oracle's bars met;
- the head split is real: each device's compute buffer holds half of what the mirrored rule puts there;
- a one-block model's forward + backward + AdamW step through it (ggml-opt, hotggml.opt) equals the single-CPU
  step bit for bit (the model mirrored: at this pin the meta backend cannot split the projections' gradients);
- what the meta backend would abort on is refused in Python first, and the interpreter lives on.
"""

from __future__ import annotations

import numpy as np
import pytest

from hotggml import meta, ops, parity
from hotggml.cases import SMOKE
from hotggml.errors import BackendError, InputError, InputTypeError, UsageError
from hotggml.ffi import ffi
from hotggml.graph import Backend, Graph

META = "Meta(CPU,CPU)"


def test_meta_device_names_its_devices(lib):
    with Backend.meta(["CPU", "CPU"]) as be:
        assert be.device_name == META  # "Meta()" before meta-device-name
        assert be.description != "Meta()" and be.description.startswith("Meta(")
        assert be.is_meta and be.n_devices == 2 and be.meta_devices == ("CPU", "CPU")
    with Backend(" meta( CPU , CPU ) ", n_threads=1) as be:  # the name as parity --backend takes it
        assert be.device_name == META and be.n_threads == 1
    with Backend("CPU") as be:
        assert not be.is_meta and be.n_devices == 1


@pytest.mark.parametrize("make, error, words", [
    (lambda: Backend("Meta(CPU,NOPE)"), BackendError, "'NOPE' is not in this build's registry"),
    (lambda: Backend("Meta()"), InputError, "lists its devices"),
    (lambda: Backend("Meta(CPU,(CPU))"), InputError, "lists its devices"),
    (lambda: Backend("Meta(CPU,"), InputError, "lists its devices in parentheses"),
    (lambda: Backend.meta("CPU"), InputTypeError, "a list of registry device names"),
    (lambda: Backend.meta([]), InputError, "must list registry device names"),
    (lambda: Backend.meta(["CPU", "CPU,CPU"]), InputError, "must list registry device names"),
    (lambda: Backend.meta(["CPU"] * 17), InputError, "at most 16 devices"),
])
def test_meta_device_refusals(lib, make, error, words):
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        make()


@pytest.mark.parametrize("case", SMOKE, ids=lambda c: c.id)
def test_parity_smoke_through_meta(lib, case):
    res = parity.run_case(case, META, with_chain=False)
    assert res.passed, res.failures
    assert res.checks["bitwise_vs_one_device"] and res.checks["bitwise_across_runs"]
    assert set(res.placement.values()) == {META}
    assert res.split.startswith("heads" if case.Nkv % 2 == 0 else "mirrored"), res.split


def _attention_graph(be, split: bool, Nh=4, Nkv=2, S=24, D=16):
    """Fused fwd + back on be with q, k, v (and dO) split by heads or mirrored; (graph, outputs)."""
    rng = np.random.default_rng(3)
    g = Graph(be, scheduled=True)
    q, k, v = (g.input(rng.standard_normal((1, n, S, D), dtype=np.float32), name)
               for name, n in (("q", Nh), ("k", Nkv), ("v", Nkv)))
    do = g.input(rng.standard_normal((1, S, Nh, D), dtype=np.float32), "dO")
    if split:
        for t in (q, k, v):
            g.split(t, 2)
        g.split(do, 1)
    fwd = ops.flash_attn_train(g, q, k, v, None, 0.25, "f32", causal=True)
    back = ops.flash_attn_train_back(g, fwd, do, "qkv")
    outs = [ops.get_o(fwd), ops.get_lse(fwd), ops.get_dq(back), ops.get_dk(back), ops.get_dv(back)]
    g.build(outs)
    return g, outs


def test_head_split_halves_each_devices_results(lib):
    """Split by heads, each device holds its heads' part of q, k, v, dO only (the leaves' buffer of each device is
    half the mirrored one's: ggml sizes a meta static buffer by its devices' slices), and every result read back
    whole (O, LSE, dQ, dK, dV through the segments of the packed results) is the mirrored graph's, bit for bit:
    with half of the heads on each device, a result assembled from the wrong parts could not be."""
    sizes, values = {}, {}
    with Backend.meta(["CPU", "CPU"]) as be:
        for split in (False, True):
            g, outs = _attention_graph(be, split)
            with g:
                g.compute()
                values[split] = [g.read(t) for t in outs]
                sizes[split] = int(g.lib.ggml_backend_buffer_get_size(g._in_buf))
    assert all(a.tobytes() == b.tobytes() for a, b in zip(values[False], values[True]))
    assert sizes[True] <= sizes[False] // 2 + 64, sizes


def test_meta_refusals_keep_the_interpreter(lib):
    """Everything the meta backend would abort on at this pin is an exception first."""
    rng = np.random.default_rng(0)
    x = {name: rng.standard_normal((1, n, 8, 16), dtype=np.float32) for name, n in (("q", 4), ("k", 2), ("v", 2))}
    with Backend("CPU") as cpu, Graph(cpu) as g:
        with pytest.raises(UsageError, match="needs a Graph on a meta backend"):
            g.split(g.input(x["q"]), 2)
    with Backend.meta(["CPU", "CPU"]) as be:
        with Graph(be) as g:  # unscheduled: ggml's meta backend asserts on a graph with gradients
            q, k, v = (g.param(x[n], n) for n in "qkv")
            o = ops.get_o(ops.flash_attn_train(g, q, k, v, None, 0.25))
            g.build([o], g.dot_loss([(o, np.ones((1, 8, 4, 16), np.float32))]))
            with pytest.raises(UsageError, match="computes through the scheduler"):
                g.compute()
        with Graph(be, scheduled=True) as g:
            q, k, v = (g.input(x[n], n) for n in "qkv")
            g.split(q, 2)
            with pytest.raises(InputError, match="q axis 2 \\[2, 2\\], k mirrored"):
                ops.flash_attn_train(g, q, k, v, None, 0.25)
            with pytest.raises(InputError, match="do not add up"):
                g.split(k, 2, [1, 2])
            for parts in ([1.5, 1.5], ["1", "2"], 3):  # 1.5 was taken as 1
                with pytest.raises(InputTypeError, match="parts must be ints"):
                    g.split(k, 2, parts)
            with pytest.raises(InputError, match="does not split into 2 equal parts"):
                g.split(g.input(np.zeros((1, 3, 8, 16), np.float32)), 2)
            g.split(k, 2, [2, 0])  # whole groups? q has 2 heads per device, k 2 and 0: not G = 2 per kv head
            g.split(v, 2, [2, 0])
            with pytest.raises(InputError, match="whole GQA groups"):
                ops.flash_attn_train(g, q, k, v, None, 0.25)
        with Graph(be, scheduled=True) as g:
            q, k, v = (g.param(x[n], n) for n in "qkv")
            for t in (q, k, v):
                g.split(t, 2)
            fwd = ops.flash_attn_train(g, q, k, v, None, 0.25)
            o = ops.get_o(fwd)
            with pytest.raises(InputError, match="cannot split MUL at this pin"):  # the loss's reduction
                g.build([o], g.dot_loss([(o, np.ones((1, 8, 4, 16), np.float32))]))
            with pytest.raises(InputError, match="split by the forward's heads"):
                ops.flash_attn_train_back(g, fwd, g.input(np.ones((1, 8, 4, 16), np.float32)), "qkv")
        with Graph(be, scheduled=True) as g:  # a strided read: the meta buffer reads whole tensors of its own, so
            a = g.input(x["q"])               # a view is read through its root (ggml asserted on the view itself)
            t = g.permute(a, 0, 2, 1, 3)
            g.build([t])
            g.compute()
            assert np.array_equal(g.read(t), np.transpose(x["q"], (0, 2, 1, 3)))
            assert np.array_equal(g.read(a), x["q"])


def _step(backend_name: str):
    """One training step of the demo's one-block model (fused attention) on ``backend_name``, as one scheduled
    graph: forward, cross-entropy, ggml's autodiff backward, and ggml_opt_step_adamw on every param (its
    moments zero, step 1). Returns (loss, params after, params before)."""
    from hotggml.graph import FLAG_PARAM, walk
    from hotggml.train_demo import DemoConfig, build_model, init_params, make_batch

    cfg = DemoConfig(batch=4, steps=11, seed=5)
    params = init_params(cfg)
    ids_v, labels_v = make_batch(np.random.default_rng([cfg.seed, 1]), cfg)
    b1, b2 = 0.9, 0.999
    hyper = np.array([1e-2, b1, b2, 1e-8, 0.0, 1 / (1 - b1), 1 / (1 - b2)], np.float32)  # alpha .. beta2h
    with Backend(backend_name, n_threads=2) as be, Graph(be, scheduled=True) as g:
        ids, logits = build_model(g, cfg, params, "fused")
        assert ops.op_id("FLASH_ATTN_TRAIN") in {int(p.op) for p in walk([logits.ptr])[0]}
        g.set(ids, ids_v)
        labels = g.input(labels_v, "labels")
        adamw = g.input(hyper, "adamw params")
        ps = [t for t in g._leaves if int(t.ptr.flags) & FLAG_PARAM]
        moments = {t.ptr: (g.input(np.zeros(tuple(reversed(t.ne)), np.float32)),
                           g.input(np.zeros(tuple(reversed(t.ne)), np.float32))) for t in ps}
        loss = g.wrap(g.lib.ggml_cross_entropy_loss(g.ctx, logits.ptr, labels.ptr))
        g.build([logits], loss)
        for t in ps:  # the AdamW step after the backward, on the same graph
            m, v = moments[t.ptr]
            step = g.lib.ggml_opt_step_adamw(g.ctx, t.ptr, g.lib.ggml_graph_get_grad(g.gf, t.ptr), m.ptr, v.ptr, adamw.ptr)
            g.lib.ggml_build_forward_expand(g.gf, step)
        g.compute()
        after = {ffi.string(t.ptr.name).decode(): g.read(t) for t in ps}
        return float(g.read(loss).reshape(-1)[0]), after, params


def test_model_step_through_meta_equals_one_cpu(lib):
    """Forward + backward + AdamW step of the one-block model (the fused op inside) on Meta(CPU,CPU) is the
    single-CPU step bit for bit (the model mirrored: at this pin the meta backend cannot split the projections'
    gradients, OUT_PROD, nor reduce the loss; hotggml.meta)."""
    loss_cpu, after_cpu, before = _step("CPU")
    loss_meta, after_meta, _ = _step(META)
    assert np.isfinite(loss_cpu) and loss_meta == loss_cpu
    assert after_meta.keys() == after_cpu.keys() == before.keys()
    for name in before:
        assert after_meta[name].tobytes() == after_cpu[name].tobytes(), name
        assert not np.array_equal(after_cpu[name], before[name]), f"{name} did not move: the step is vacuous"


def test_optimizer_on_meta_is_refused(lib):
    """ggml-opt's graphs in turn lose their nodes' per-device tensors on the meta backend (it aborted): refused."""
    from hotggml.opt import Optimizer

    with Backend.meta(["CPU", "CPU"]) as be, Graph(be) as g:
        x = g.input(np.zeros((2, 3), np.float32))
        w = g.param(np.ones((4, 3), np.float32))
        with pytest.raises(UsageError, match="ggml-opt cannot train on Meta\\(CPU,CPU\\) at this pin"):
            Optimizer(g, x, g.mul_mat(w, x), loss="mse")


def test_an_interrupt_inside_the_split_callback_is_delivered_after_the_call(lib):
    """SIGINT landing inside the meta device's split callback (set() of a split leaf after build asks it) used to
    be swallowed by cffi, its fallback answer (mirrored) given to ggml, which aborted on the write; now the
    interrupt is held until the call ends, the write is whole, and a compute after it gives the right values."""
    from _misuse import run_child

    run = run_child("import numpy as np\nfrom hotggml import meta, ops\nfrom hotggml.graph import Backend, Graph\n", """
        import signal
        rng = np.random.default_rng(0)
        Q, K, V = (rng.standard_normal((2, n, 8), dtype=np.float32) for n in (4, 6, 6))
        g = Graph(Backend.meta(["CPU", "CPU"]), scheduled=True)
        q, k, v = g.input(Q), g.input(K), g.input(V)
        for t in (q, k, v):
            g.split(t, 2)
        o = ops.get_o(ops.flash_attn_train(g, q, k, v, None, 0.3))
        g.build([o]); g.set(q, 2 * Q); g.compute(); want = g.read(o)
        armed = [True]
        class Trap(dict):
            def get(self, key, default=None):
                if armed[0]:
                    armed[0] = False
                    signal.raise_signal(signal.SIGINT)
                return dict.get(self, key, default)
        meta._SPLITS = Trap(meta._SPLITS)
        try:
            g.set(q, 2 * Q)
        except KeyboardInterrupt:
            print("interrupted after the write")
        assert not armed[0], "the callback was not asked"
        g.compute()
        assert np.array_equal(g.read(o), want)
    """)
    assert run.returncode == 0, run.stdout + run.stderr[-2000:]
    assert "interrupted after the write" in run.stdout and run.stdout.strip().endswith("alive")
