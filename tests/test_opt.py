"""ggml-opt from Python (hotggml.opt, issue 9 item 4): AdamW steps through ggml_opt_eval against a float64
NumPy AdamW written from ggml's update formula, gradient accumulation (opt_period = k over micro-batches of
b) against one step on k*b, and every argument ggml-opt would assert on refused with an exception of
hotggml's family, in a subprocess (a regression would abort the interpreter)."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
from _misuse import run_child

from hotggml.errors import HotggmlError, InputError, InputTypeError, UsageError
from hotggml.graph import Backend, Graph
from hotggml.opt import AdamW, Optimizer

Din, Dout = 6, 4


def _data(n: int, seed: int = 1):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, Din)).astype(np.float32),
            rng.standard_normal((n, Dout)).astype(np.float32))


def _init(seed: int = 0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((Dout, Din)).astype(np.float32) * 0.5,
            rng.standard_normal((1, Dout)).astype(np.float32) * 0.5)


def _linear(g: Graph, n: int, w0, b0):
    """y = W x + b: x [Din, n], W [Din, Dout] (NumPy (Dout, Din)), b [Dout, 1] broadcast over the n columns."""
    x = g.input(np.zeros((n, Din), np.float32), "x")
    w, b = g.param(w0, "w"), g.param(b0, "b")
    y = g.wrap(g.lib.ggml_add(g.ctx, g.mul_mat(w, x).ptr, b.ptr))
    return x, w, b, y


def _train(batches, opt_period: int, hp: AdamW, loss: str = "mse", n_threads: int = 2):
    """Run ggml-opt over the micro-batches; returns (W, b, losses, opt)."""
    w0, b0 = _init()
    n = batches[0][0].shape[0]
    with Backend("CPU", n_threads=n_threads) as be, Graph(be) as g:
        x, w, b, y = _linear(g, n, w0, b0)
        with Optimizer(g, x, y, loss=loss, adamw=hp, opt_period=opt_period) as opt:
            losses = [opt.step(xb, yb) for xb, yb in batches]
            assert opt.steps == len(batches) // opt_period
            assert opt.compute_bytes() > 0
            return opt.read(w).reshape(Dout, Din), opt.read(b).reshape(1, Dout), losses


# -- float64 oracle: independent of hotggml ---------------------------------------------------------------
def _grads(w, b, xb, yb, loss: str, scale_rows: int):
    """dL/dW, dL/db and L in float64 for y = x W^T + b; mse: mean over all outputs of one batch of
    scale_rows rows; cross_entropy: -sum(labels * log_softmax(y)) / rows."""
    x, t = xb.astype(np.float64), yb.astype(np.float64)
    y = x @ w.T + b
    if loss == "mse":
        dy = 2 * (y - t) / (scale_rows * Dout)
        value = ((y - t) ** 2).sum() / (scale_rows * Dout)
    else:
        z = y - y.max(1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(1, keepdims=True))
        dy = (np.exp(logp) * t.sum(1, keepdims=True) - t) / scale_rows
        value = -(t * logp).sum() / scale_rows
    return dy.T @ x, dy.sum(0, keepdims=True), value


def _adamw_numpy(batches_per_step, hp: AdamW, loss: str = "mse"):
    """ggml's AdamW (ggml_compute_forward_opt_step_adamw_f32) in float64; each optimizer step gets the mean
    loss over the rows of all its micro-batches."""
    alpha, beta1, beta2, eps, wd = hp.as_float32()
    w0, b0 = _init()
    params = [w0.astype(np.float64), b0.astype(np.float64)]
    m = [np.zeros_like(p) for p in params]
    v = [np.zeros_like(p) for p in params]
    for t, micro in enumerate(batches_per_step, start=1):
        xb = np.concatenate([mb[0] for mb in micro])
        yb = np.concatenate([mb[1] for mb in micro])
        gw, gb, _ = _grads(params[0], params[1], xb, yb, loss, len(xb))
        for i, g in enumerate((gw, gb)):
            m[i] = beta1 * m[i] + (1 - beta1) * g
            v[i] = beta2 * v[i] + (1 - beta2) * g * g
            mh = m[i] / (1 - beta1 ** t)
            vh = np.sqrt(v[i] / (1 - beta2 ** t)) + eps
            params[i] = params[i] * (1 - alpha * wd) - alpha * mh / vh
    return params


HP = AdamW(alpha=2e-2, beta1=0.8, beta2=0.95, eps=1e-7, wd=0.05)


@pytest.mark.parametrize("loss", ["mse", "cross_entropy"])
def test_adamw_steps_match_numpy(lib, loss):
    """5 AdamW steps (weight decay on, beta1/beta2 away from the defaults so the bias correction matters)
    equal the float64 oracle's within 1e-5; the parameters moved by far more than that and the first
    gradients are far from zero (a step that did nothing, or a zero gradient, cannot pass)."""
    steps = 5
    batches = [_data(8, seed=s) for s in range(steps)]
    if loss == "cross_entropy":  # label rows: distributions (one-hot) over the Dout classes
        batches = [(xb, np.eye(Dout, dtype=np.float32)[np.argmax(yb, 1)]) for xb, yb in batches]
    w, b, losses = _train(batches, 1, HP, loss)
    want_w, want_b = _adamw_numpy([[mb] for mb in batches], HP, loss)
    err = max(np.abs(w - want_w).max(), np.abs(b - want_b).max())
    w0, b0 = _init()
    moved = min(np.abs(want_w - w0).min(), np.abs(want_b - b0).min())
    g0 = _grads(w0.astype(np.float64), b0.astype(np.float64), *batches[0], loss, 8)
    print(f"{loss}: AdamW max error after {steps} steps {err:.2e}; smallest parameter move {moved:.2e}; "
          f"|grad| min {min(np.abs(g0[0]).min(), np.abs(g0[1]).min()):.2e}")
    assert moved > 1e-3 and np.abs(g0[0]).min() > 1e-4 and np.abs(g0[1]).min() > 1e-4
    assert err < 1e-5
    # the loss ggml-opt reports for the first step is the oracle's (before any update)
    assert abs(losses[0] - g0[2]) < 1e-5 * max(1.0, abs(g0[2]))


def test_accumulation_equals_one_large_batch(lib):
    """opt_period = k over micro-batches of b rows equals one step on the k*b rows, within 1e-5, for three
    optimizer steps; both equal the float64 oracle."""
    k, b_rows, steps = 4, 3, 3
    micro = [_data(b_rows, seed=10 + i) for i in range(k * steps)]
    big = [(np.concatenate([mb[0] for mb in micro[s * k:(s + 1) * k]]),
            np.concatenate([mb[1] for mb in micro[s * k:(s + 1) * k]])) for s in range(steps)]
    w_acc, b_acc, losses = _train(micro, k, HP)
    w_big, b_big, _ = _train(big, 1, HP)
    err = max(np.abs(w_acc - w_big).max(), np.abs(b_acc - b_big).max())
    want_w, want_b = _adamw_numpy([micro[s * k:(s + 1) * k] for s in range(steps)], HP)
    err_oracle = max(np.abs(w_acc - want_w).max(), np.abs(b_acc - want_b).max())
    w0, _ = _init()
    print(f"accumulation k={k} x b={b_rows} vs one batch of {k * b_rows}: max difference {err:.2e}; "
          f"vs the oracle {err_oracle:.2e}; moved {np.abs(w_big - w0).max():.2e}")
    assert np.abs(w_big - w0).min() > 1e-3
    assert err < 1e-5 and err_oracle < 1e-5
    # each micro-batch's loss is its own mean (ggml-opt's 1/k scaling undone)
    w0, b0 = _init()
    first = _grads(w0.astype(np.float64), b0.astype(np.float64), *micro[0], "mse", b_rows)[2]
    assert abs(losses[0] - first) < 1e-5 * max(1.0, first)


def test_learning_rate_can_change_between_steps(lib):
    """A schedule is an assignment of Optimizer.adamw: validated, then used from the next step on."""
    batches = [_data(8, seed=s) for s in range(2)]
    w0, b0 = _init()
    with Backend("CPU", n_threads=2) as be, Graph(be) as g:
        x, w, b, y = _linear(g, 8, w0, b0)
        with Optimizer(g, x, y, adamw=HP) as opt:
            opt.step(*batches[0])
            with pytest.raises(InputError, match="alpha"):
                opt.adamw = AdamW(alpha=-1.0)  # refused at construction: the Optimizer keeps the old values
            assert opt.adamw == HP
            opt.adamw = AdamW(alpha=1e-9, beta1=HP.beta1, beta2=HP.beta2, eps=HP.eps, wd=HP.wd)
            before = opt.read(w)
            opt.step(*batches[1])
            assert np.abs(opt.read(w) - before).max() < 1e-6  # alpha 1e-9: the second step barely moves


def test_ownership_and_use_after_close(lib):
    w0, b0 = _init()
    be = Backend("CPU", n_threads=2)
    g = Graph(be)
    x, w, b, y = _linear(g, 8, w0, b0)
    opt = Optimizer(g, x, y, adamw=HP)
    with pytest.raises(UsageError, match="trained by an Optimizer"):
        g.build([y])
    with pytest.raises(UsageError, match="trained by an Optimizer"):
        g.input(np.zeros(3, np.float32))
    with pytest.raises(UsageError, match="trained by an Optimizer"):
        g.compute()
    with pytest.raises(UsageError, match="already trained"):
        Optimizer(g, x, y)
    with pytest.raises(InputError, match="only param"):
        opt.read(y)
    opt.write(w, np.zeros((Dout, Din), np.float32))
    assert not opt.read(w).any()
    opt.close()
    opt.close()  # once only
    for call in (lambda: opt.step(*_data(8)), lambda: opt.read(w), opt.compute_bytes):
        with pytest.raises(UsageError, match="closed"):
            call()
    with pytest.raises(UsageError, match="closed"):
        opt.adamw = HP
    g.close()
    be.close()


def test_graph_closed_under_the_optimizer(lib):
    w0, b0 = _init()
    with Backend("CPU") as be:
        g = Graph(be)
        x, w, b, y = _linear(g, 8, w0, b0)
        opt = Optimizer(g, x, y, adamw=HP)
        g.close()
        with pytest.raises(UsageError, match="Graph was closed"):
            opt.step(*_data(8))
        opt.close()


@pytest.mark.parametrize("kw, exc, text", [
    (dict(alpha=0.0), InputError, "alpha"),
    (dict(alpha=1e-50), InputError, "alpha"),  # > 0 in Python, 0 as the float32 ggml asserts on
    (dict(alpha=float("nan")), InputError, "finite"),
    (dict(alpha=1e39), InputError, "finite"),  # inf as a float32
    (dict(beta1=1.0), InputError, "beta1"),
    (dict(beta1=-0.1), InputError, "beta1"),
    (dict(beta2=0.99999999999), InputError, "beta2"),  # rounds to 1.0f
    (dict(eps=0.0), InputError, "eps"),
    (dict(wd=-0.1), InputError, "wd"),
    (dict(wd=1.5), InputError, "wd"),
    (dict(alpha="0.1"), InputTypeError, "real number"),
    (dict(beta1=True), InputTypeError, "real number"),
])
def test_adamw_ranges(kw, exc, text):
    with pytest.raises(exc, match=text) as info:
        AdamW(**kw)
    assert isinstance(info.value, HotggmlError)


PRELUDE = """
import numpy as np
from hotggml.errors import InputError, InputTypeError, UsageError
from hotggml.graph import Backend, Graph
from hotggml.opt import AdamW, Optimizer
be = Backend("CPU")
def linear(n=8):
    g = Graph(be)
    x = g.input(np.zeros((n, 6), np.float32))
    w = g.param(np.ones((4, 6), np.float32))
    return g, x, w, g.mul_mat(w, x)
"""


def _run(body: str) -> subprocess.CompletedProcess:
    return run_child(PRELUDE, body)


def test_bad_arguments_raise_instead_of_aborting(lib):
    """Each line stands in front of a GGML_ASSERT of ggml-opt (or of an op it runs): one interpreter runs
    them all and must still be alive after the last."""
    run = _run("""
        g, x, w, y = linear()
        expect(InputError, "opt_period", lambda: Optimizer(g, x, y, opt_period=0))          # ggml_opt_init
        expect(InputTypeError, "opt_period", lambda: Optimizer(g, x, y, opt_period=2.0))
        expect(InputError, "loss must be", lambda: Optimizer(g, x, y, loss="hinge"))
        expect(InputTypeError, "AdamW", lambda: Optimizer(g, x, y, adamw={"alpha": 1}))
        expect(InputError, "inputs must be an input", lambda: Optimizer(g, w, y))
        expect(InputError, "computed node", lambda: Optimizer(g, x, x))
        expect(InputTypeError, "Tensor", lambda: Optimizer(g, np.zeros(3), y))
        g2, x2, w2, y2 = linear()
        expect(InputTypeError, "another Graph", lambda: Optimizer(g, x2, y))
        # cross-entropy: ggml-opt's argmax asserts a matrix
        y3 = g.wrap(g.lib.ggml_reshape_3d(g.ctx, y.ptr, 4, 4, 2))
        expect(InputError, "matrix", lambda: Optimizer(g, x, y3, loss="cross_entropy"))
        # outputs that do not depend on inputs / on any param
        c = g.input(np.ones((8, 4), np.float32))
        expect(InputError, "do not depend on inputs", lambda: Optimizer(g, x, g.mul_mat(w, g.input(np.ones((8, 6), np.float32)))))
        expect(InputError, "no param", lambda: Optimizer(g, x, g.mul_mat(g.input(np.ones((4, 6), np.float32)), x)))
        expect(InputError, "contiguous", lambda: Optimizer(g, x, g.permute(y, 1, 0, 2, 3)))
        # an op without a backward case between a param and the outputs: ggml_compute_backward aborts
        lib, ctx = g.lib, g.ctx
        expect(InputError, "no backward for NORM", lambda: Optimizer(g, x, g.wrap(lib.ggml_norm(ctx, y.ptr, 1e-5))))
        expect(InputError, "UNARY TANH", lambda: Optimizer(g, x, g.wrap(lib.ggml_tanh(ctx, y.ptr))))
        # ... but one on a constant branch needs no gradient: accepted (in a Graph of its own)
        ga, xa, wa, ya = linear()
        const = ga.wrap(ga.lib.ggml_tanh(ga.ctx, ga.input(np.ones((8, 4), np.float32)).ptr))
        Optimizer(ga, xa, ga.add(ya, const)).close()
        # a loss node already in the graph: ggml_opt_build asserts
        l = g.sum(y); g.lib.ggml_set_loss(l.ptr)
        expect(InputError, "marked as a loss", lambda: Optimizer(g, x, g.wrap(g.lib.ggml_add(g.ctx, g.add(y, c).ptr, l.ptr))))
        # larger than ggml's default 2048-node graphs with their backward: graphs of the model's own size
        # (patch opt-graph-size), in a Graph with room for them
        g4 = Graph(be, max_nodes=1 << 16)
        x4 = g4.input(np.zeros((8, 6), np.float32)); w4 = g4.param(np.ones((6, 6), np.float32))
        h = x4
        for _ in range(300):
            h = g4.mul_mat(w4, h)
        with Optimizer(g4, x4, h) as big:
            assert big.graph_size > 2048
        # a Graph context too small for ggml-opt's three graphs
        g5 = Graph(be, max_nodes=64)
        x5 = g5.input(np.zeros((8, 6), np.float32)); w5 = g5.param(np.ones((4, 6), np.float32))
        expect(InputError, "max_nodes", lambda: Optimizer(g5, x5, g5.mul_mat(w5, x5)))
        # a built Graph
        g6, x6, w6, y6 = linear(); g6.build([y6])
        expect(UsageError, "already built", lambda: Optimizer(g6, x6, y6))

        # per step: shapes, dtypes, labels
        g, x, w, y = linear()
        opt = Optimizer(g, x, y, loss="mse", adamw=AdamW(alpha=1e-3))
        X, Y = np.zeros((8, 6), np.float32), np.zeros((8, 4), np.float32)
        expect(InputError, "shape", lambda: opt.step(np.zeros((7, 6), np.float32), Y))
        expect(InputError, "shape", lambda: opt.step(X, np.zeros((4, 8), np.float32)))
        expect(InputError, "needs labels", lambda: opt.step(X))
        expect(InputError, "finite", lambda: opt.step(X, Y + np.nan))
        expect(InputTypeError, "real array", lambda: opt.step(X.astype(str), Y))
        expect(InputTypeError, "NumPy array", lambda: opt.step(None, Y))
        print("loss", opt.step(X, Y))
        opt.close()
        g, x, w, y = linear()
        opt = Optimizer(g, x, y, loss="sum")
        expect(InputError, "takes no labels", lambda: opt.step(X, Y))
        opt.step(X)

        # token ids feeding get_rows: ggml asserts every id is in range
        g = Graph(be)
        ids = g.input(np.zeros(5, np.int32))
        emb = g.param(np.ones((10, 3), np.float32))   # 10 rows of 3
        rows = g.wrap(g.lib.ggml_get_rows(g.ctx, emb.ptr, g.reshape(ids, (5, 1, 1, 1)).ptr))
        opt = Optimizer(g, ids, rows, loss="mse")
        T = np.zeros((5, 3), np.float32)
        expect(InputError, "[0, 10)", lambda: opt.step(np.array([0, 1, 10, 2, 3]), T))
        expect(InputError, "[0, 10)", lambda: opt.step(np.array([0, -1, 1, 2, 3]), T))
        expect(InputTypeError, "integers", lambda: opt.step(np.zeros(5, np.float32), T))
        expect(InputError, "out of the int32 range", lambda: opt.step(np.array([0, 1, 2, 3, 2**40]), T))
        opt.step(np.array([0, 1, 9, 2, 3]), T)
        # ... followed back through permute + cont, and ids held in a constant input(): checked too
        g = Graph(be)
        tab = g.param(np.ones((10, 4), np.float32))
        ids2 = g.input(np.zeros((2, 3), np.int32))
        flat = g.reshape(g.cont(g.permute(ids2, 1, 0, 2, 3)), (6, 1, 1, 1))
        opt = Optimizer(g, ids2, g.wrap(g.lib.ggml_get_rows(g.ctx, tab.ptr, flat.ptr)), loss="sum")
        expect(InputError, "[0, 10)", lambda: opt.step(np.full((2, 3), 99, np.int32)))
        opt.step(np.full((2, 3), 9, np.int32))
        g = Graph(be)
        tab = g.param(np.ones((10, 4), np.float32)); xin = g.input(np.ones((6, 4), np.float32))
        bad = g.input(np.full(6, 99, np.int32))
        expect(InputError, "[0, 10)", lambda: Optimizer(g, xin, g.mul(g.wrap(g.lib.ggml_get_rows(g.ctx, tab.ptr, bad.ptr)), xin), loss="sum"))
        cid = g.input(np.arange(6, dtype=np.int32))  # the refusal above left the Graph usable
        opt = Optimizer(g, xin, g.mul(g.wrap(g.lib.ggml_get_rows(g.ctx, tab.ptr, cid.ptr)), xin), loss="sum")
        expect(InputError, "[0, 10)", lambda: opt.write(cid, np.full(6, 99, np.int32)))
        opt.step(np.ones((6, 4), np.float32))
        # ids computed by the graph cannot be checked before ggml reads them: refused
        g = Graph(be)
        tab = g.param(np.ones((10, 4), np.float32)); xin = g.input(np.ones((10, 6), np.float32))
        am = g.wrap(g.lib.ggml_argmax(g.ctx, xin.ptr))
        expect(InputError, "computed by the graph", lambda: Optimizer(g, xin, g.wrap(g.lib.ggml_get_rows(g.ctx, tab.ptr, am.ptr)), loss="sum"))
    """)
    assert "alive" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]
    assert run.returncode == 0, run.stderr[-3000:]  # the Optimizers left open are freed at exit, cleanly
    print(run.stdout)


def test_non_finite_data_is_refused_before_a_step_and_the_weights_survive(lib):
    """One step on NaN or inf (or on finite values beyond float32, which become inf) makes every weight NaN and no
    later step recovers: step() and write() refuse them first, -INF only in what a mask is made of, and the next
    good step trains as before."""
    w0, b0 = _init()
    xb, yb = _data(8)
    at5 = np.arange(xb.size).reshape(xb.shape) == 5
    with Backend("CPU", n_threads=2) as be, Graph(be) as g:
        x, w, b, y = _linear(g, 8, w0, b0)
        with Optimizer(g, x, y, adamw=HP) as opt:
            opt.step(xb, yb)
            before = opt.read(w)
            for bad in (np.where(at5, np.nan, xb), np.where(at5, np.inf, xb), np.where(at5, -np.inf, xb),
                        xb.astype(np.float64) * 1e39):
                with pytest.raises(InputError, match="must be finite|beyond float32"):
                    opt.step(bad, yb)
            for value in (np.nan, np.inf, -np.inf):
                with pytest.raises(InputError, match="must be finite"):
                    opt.write(w, np.full((Dout, Din), value, np.float32))
            assert np.array_equal(opt.read(w), before) and opt.steps == 1
            opt.step(xb, yb)
            assert np.isfinite(opt.read(w)).all() and not np.array_equal(opt.read(w), before)


def test_a_mask_leaf_takes_minus_inf_and_refuses_plus_inf_through_the_optimizer(lib):
    """The leaf a soft_max_ext mask is made of (here through cont(permute(.))) takes -INF, which hides entries,
    and refuses +INF and NaN, which would make the rows NaN."""
    rng = np.random.default_rng(3)
    with Backend("CPU", n_threads=2) as be, Graph(be) as g:
        x = g.input(np.zeros((4, 6), np.float32), "x")
        w = g.param(rng.standard_normal((6, 6)).astype(np.float32), "w")
        leaf = g.input(np.zeros((4, 6), np.float32), "mask leaf")
        mask = g.cont(g.permute(g.permute(leaf, 1, 0, 2, 3), 1, 0, 2, 3))
        y = g.soft_max_ext(g.mul_mat(w, x), mask, 1.0)
        with Optimizer(g, x, y, adamw=HP) as opt:
            hide = np.zeros((4, 6), np.float32)
            hide[:, 0] = -np.inf
            opt.write(leaf, hide)
            opt.step(rng.standard_normal((4, 6)).astype(np.float32), np.full((4, 6), 0.2, np.float32))
            for value in (np.inf, np.nan):
                with pytest.raises(InputError, match="finite values or -inf only"):
                    opt.write(leaf, np.where(hide == 0, value, hide).astype(np.float32))
            assert np.isfinite(opt.read(w)).all()
