"""`hotggml train-demo` (issue 9 item 5): the command in CI, under its bars (both final losses below 10% of
the initial ones, the step-wise drift between the fused and the chain arm within DRIFT_TOL, the arena
ratio printed), its exit status when the bars are missed, its output and JSON; the model and the task
checked against float64 NumPy written from the module's description, independently of ggml."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from hotggml import paths, train_demo
from hotggml.errors import InputError
from hotggml.train_demo import DRIFT_TOL, LOSS_RATIO_BAR, DemoConfig


def _hotggml(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "hotggml", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(paths.REPO_ROOT)})


def test_train_demo_meets_its_bars(lib, tmp_path):
    """The command as CI runs it (defaults, two threads): exit 0, the table, the drift, both arenas and their
    ratio, and a JSON record that says the same."""
    out = tmp_path / "demo.json"
    run = _hotggml("train-demo", "--json", str(out))
    print(run.stdout)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for text in ("step", "fused", "chain", "|gap|", "drift  max step-wise |gap|", "arena  fused", "ratio",
                 f"PASS  drift <= {DRIFT_TOL} nats", "PASS  fused: final < 10% of initial",
                 "PASS  chain: final < 10% of initial"):
        assert text in run.stdout, text
    rec = json.loads(out.read_text())
    cfg = rec["config"]
    assert rec["passed"] and all(rec["checks"].values())
    f, c = rec["arms"]["fused"], rec["arms"]["chain"]
    for arm in (f, c):
        assert len(arm["losses"]) == cfg["steps"] >= 100
        assert arm["final_loss"] < LOSS_RATIO_BAR * arm["initial_loss"]
        assert arm["initial_loss"] > 0.5 * math.log(cfg["symbols"] + 1)  # it started untrained
        assert arm["compute_bytes"] > 0
    gaps = np.abs(np.array(f["losses"]) - np.array(c["losses"]))
    assert rec["drift"] == pytest.approx(gaps.max()) and rec["drift"] <= DRIFT_TOL
    assert gaps[0] < 1e-5  # same weights, same first batches: the arms differ by f32 rounding only
    assert rec["arena_ratio"] == pytest.approx(f["compute_bytes"] / c["compute_bytes"])
    assert rec["arena_ratio"] < 1  # the fused arm keeps no [S, S, Nh, B] softmax
    assert f"ratio {rec['arena_ratio']:.3f}" in run.stdout


def test_missed_bars_exit_1(lib, tmp_path):
    """11 steps cannot bring the loss to 10% of the initial: the check fails, exit status 1, FAIL printed."""
    run = _hotggml("train-demo", "--steps", "11", "--every", "5")
    assert run.returncode == 1, run.stdout[-2000:] + run.stderr[-2000:]
    assert "FAIL  fused: final < 10% of initial" in run.stdout and "FAIL  chain" in run.stdout


def test_plot_needs_matplotlib(lib, tmp_path):
    """With matplotlib (the `plot` extra) a plot is written; without it, one error line and exit 2 before
    any training."""
    target = tmp_path / "curves.png"
    if importlib.util.find_spec("matplotlib") is None:
        run = _hotggml("train-demo", "--plot", str(target))
        assert run.returncode == 2 and "pip install matplotlib" in run.stderr and not target.exists()
        assert "Traceback" not in run.stderr
        return
    run = _hotggml("train-demo", "--steps", "20", "--plot", str(target))
    assert run.returncode in (0, 1) and target.stat().st_size > 0


def test_usage_errors():
    assert _hotggml("train-demo", "--every", "0").returncode == 2
    for steps in ("5", "0"):  # one bound, one message, whether below 1 or within the final window
        run = _hotggml("train-demo", "--steps", steps)
        assert run.returncode == 2 and f"steps must be an int >= 11, got {steps}" in run.stderr
    run = _hotggml("train-demo", "--seed", "-1")  # one error line before any training, not NumPy's traceback
    assert run.returncode == 2 and "seed must be" in run.stderr and "Traceback" not in run.stderr
    with pytest.raises(InputError, match="multiple"):
        DemoConfig(heads=4, kv_heads=3)
    with pytest.raises(InputError, match="length"):
        DemoConfig(length=1)


# -- float64 NumPy, written from the module docstring ------------------------------------------------------
def test_the_task_is_a_reversal():
    cfg = DemoConfig(symbols=5, length=4, batch=3)
    ids, labels = train_demo.make_batch(np.random.default_rng(0), cfg)
    L, S, V = cfg.length, cfg.seq, cfg.vocab
    assert ids.shape == (3, S) and labels.shape == (3 * S, V)
    lab = labels.reshape(3, S, V)
    for b in range(3):
        x = ids[b, :L]
        assert ids[b, L] == cfg.symbols and list(ids[b, L + 1:]) == list(x[::-1][:L - 1])
        assert not lab[b, :L].any()  # the random half is not scored
        assert list(lab[b, L:].argmax(-1)) == list(x[::-1]) and (lab[b, L:].sum(-1) == 1).all()


def _numpy_loss(cfg: DemoConfig, params, ids, labels) -> float:
    """The model of the module docstring in float64: cross-entropy per scored token."""
    P = {k: v.astype(np.float64) for k, v in params.items()}
    B, S, Nh, Nkv, D = cfg.batch, cfg.seq, cfg.heads, cfg.kv_heads, cfg.head_dim

    def rms(t, gain):
        return t / np.sqrt((t * t).mean(-1, keepdims=True) + 1e-5) * gain

    h = P["tok_emb"][ids] + P["pos_emb"]                                  # (B, S, E)
    x = rms(h, P["g1"])
    q = (x @ P["wq"].T).reshape(B, S, Nh, D).transpose(0, 2, 1, 3)        # (B, Nh, S, D)
    k = (x @ P["wk"].T).reshape(B, S, Nkv, D).transpose(0, 2, 1, 3)
    v = (x @ P["wv"].T).reshape(B, S, Nkv, D).transpose(0, 2, 1, 3)
    k, v = np.repeat(k, Nh // Nkv, axis=1), np.repeat(v, Nh // Nkv, axis=1)  # head h reads kv head h // (Nh/Nkv)
    s = q @ k.swapaxes(-1, -2) / math.sqrt(D) + np.triu(np.full((S, S), -np.inf), 1)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    o = (p @ v).transpose(0, 2, 1, 3).reshape(B, S, Nh * D)
    logits = rms(h + o @ P["wo"].T, P["g2"]) @ P["head"].T               # (B, S, V)
    z = logits - logits.max(-1, keepdims=True)
    logp = (z - np.log(np.exp(z).sum(-1, keepdims=True))).reshape(B * S, -1)
    return float(-(labels * logp).sum() / (B * S) * S / cfg.length)


@pytest.mark.parametrize("arm", ["fused", "chain"])
def test_first_loss_equals_the_numpy_model(lib, arm):
    """Step 1's loss (before any update) of each arm equals the float64 model on the same weights and
    batches within 1e-5: both arms are the model the docstring describes (causal, GQA h // (Nh/Nkv))."""
    cfg = DemoConfig(steps=11, length=5, symbols=6, batch=4)
    run = train_demo.train_arm(cfg, arm)
    params = train_demo.init_params(cfg)
    data = np.random.default_rng([cfg.seed, 1])
    want = np.mean([_numpy_loss(cfg, params, *train_demo.make_batch(data, cfg)) for _ in range(cfg.opt_period)])
    print(f"{arm}: step-1 loss {run.losses[0]:.7f}, float64 {want:.7f}")
    assert abs(run.losses[0] - want) < 1e-5 * max(1.0, want)
    assert run.losses[-1] < run.losses[0]  # and it trains


def test_the_arms_run_different_attention(lib):
    """The fused arm's graph holds FLASH_ATTN_TRAIN and no softmax; the chain's a SOFT_MAX and no fused op."""
    from hotggml import ops
    from hotggml.graph import Backend, Graph

    cfg = DemoConfig(length=3, symbols=3, batch=2)
    params = train_demo.init_params(cfg)
    with Backend("CPU") as be:
        for arm, present, absent in (("fused", "FLASH_ATTN_TRAIN", "SOFT_MAX"), ("chain", "SOFT_MAX", "FLASH_ATTN_TRAIN")):
            with Graph(be) as g:
                _, logits = train_demo.build_model(g, cfg, params, arm)
                g.build([logits])
                assert g.find_nodes(ops.op_id(present)) and not g.find_nodes(ops.op_id(absent)), arm


def test_24_blocks_at_the_dit_head_layout_train_with_both_arms(lib):
    """ggml-opt at a real model's depth: 24 blocks at the DiT geometry's head layout (Nh 16, Nkv 8, D 128),
    with a small width and S so that it runs on two cores. Its graphs are over ggml's default 2048 nodes
    (patch opt-graph-size sizes them); both arms train from the same weights and batches, their losses agree
    step by step within the demo's drift bar, and the loss falls."""
    from hotggml.graph import Backend, Graph
    from hotggml.opt import GRAPH_SIZE, Optimizer

    cfg = DemoConfig(symbols=8, length=4, heads=16, kv_heads=8, head_dim=128, layers=24, width=32, batch=2,
                     opt_period=1, steps=12, alpha=3e-3)
    with Backend("CPU", n_threads=2) as be, Graph(be) as g:
        ids, logits = train_demo.build_model(g, cfg, train_demo.init_params(cfg), "fused")
        with Optimizer(g, ids, logits, loss="cross_entropy") as opt:
            assert opt.graph_size > GRAPH_SIZE
    runs = {arm: train_demo.train_arm(cfg, arm) for arm in train_demo.ARMS}
    fused, chain = runs["fused"].losses, runs["chain"].losses
    assert len(fused) == len(chain) == cfg.steps and all(map(math.isfinite, fused + chain))
    drift = max(abs(a - b) for a, b in zip(fused, chain))
    assert drift <= DRIFT_TOL, f"fused and chain differ by {drift:.3g} nats"
    for arm, run in runs.items():
        assert run.final < run.initial, f"{arm}: the loss did not fall ({run.initial:.4f} -> {run.final:.4f})"
