"""ggml-opt from Python: AdamW training of a Graph's parameters through ggml_backend_sched.

ggml-opt (ggml-opt.h) is ggml's optimizer loop. It takes the model as one ``inputs`` and one ``outputs``
tensor of a compute context, builds its own loss on ``outputs`` (mean, sum, cross-entropy against labels,
or mean squared error against labels), the backward graph, gradient accumulators and AdamW's momenta,
and runs each graph through a ``ggml_backend_sched``. ``opt_period`` = k accumulates the gradients of k
micro-batches and takes one optimizer step on their sum (the per-datapoint losses are scaled by 1/k, so
k micro-batches of b equal one batch of k*b).

Usage (shapes in ggml order; NumPy shapes are their reverse)::

    with Backend("CPU") as be, Graph(be) as g:
        x = g.input(np.zeros((N, Din), np.float32))            # the inputs: [Din, N]
        w = g.param(w0)                                        # [Din, Dout] (NumPy (Dout, Din))
        y = g.mul_mat(w, x)                                    # the outputs: [Dout, N]
        with Optimizer(g, x, y, loss="mse", adamw=AdamW(alpha=1e-2), opt_period=2) as opt:
            for xb, yb in batches:
                loss = opt.step(xb, yb)                        # one micro-batch; AdamW every 2nd call
            w_now = opt.read(w)

ggml-opt asserts (and kills the interpreter) on bad hyperparameters, a graph larger than its fixed graph
size, outputs of the wrong rank for its cross-entropy, and out-of-range token ids; every one of these is
checked here first and raised as an exception of hotggml's family (hotggml.errors).

The hyperparameters reach ggml-opt through its ``get_opt_pars`` callback. The callback used is ggml's own
``ggml_opt_get_constant_optimizer_params`` with a ``struct ggml_opt_optimizer_params`` owned by the
Optimizer as its userdata, not a Python (cffi) callback: ggml calls it inside ``ggml_opt_eval``, and a
Python callback that raised there would hand ggml a zeroed struct (alpha = 0), which ggml-opt asserts
on. Setting ``Optimizer.adamw`` validates the new values in Python and then writes that struct (a
learning-rate schedule is one assignment per step).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import numpy as np

from hotggml import autodiff
from hotggml.errors import InputError, InputTypeError, OutOfMemoryError, UsageError
from hotggml.ffi import ffi, load
from hotggml.graph import (BACKWARD_GROWTH, FLAG_PARAM, Graph, Tensor, check_attention_mask_values, ggml_shape, lost_among,
                           interrupts_deferred, leaf_array, walk)

GRAPH_SIZE = 2048  # GGML_DEFAULT_GRAPH_SIZE: the smallest static graphs ggml_opt_init is asked for (patch
                   # opt-graph-size: ggml_opt_params.graph_size; a larger model gets graphs of its own size)
LOSS_NODES = 6  # nodes ggml-opt adds for its loss (MSE: sub, sqr, sum, scale; cross-entropy: loss, scale, argmaxes, count)
FLAG_LOSS = 8  # enum ggml_tensor_flag GGML_TENSOR_FLAG_LOSS
OPT_PERIOD_MAX = 2**31 - 1  # int32_t in struct ggml_opt_params

# enum ggml_opt_loss_type
LOSSES = {"mean": 0, "sum": 1, "cross_entropy": 2, "mse": 3}
LABELLED = {"cross_entropy", "mse"}  # losses compared against labels shaped like the outputs
PER_DATAPOINT = {"mean", "cross_entropy", "mse"}  # losses ggml-opt scales by 1/opt_period


def _real(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise InputTypeError(f"AdamW {name} must be a real number, got {type(value).__name__}")
    try:
        value = float(value)
    except OverflowError:  # an int beyond any float (10**400)
        raise InputError(f"AdamW {name} must be finite as a float32, got an int of {len(str(abs(value)))} digits") from None
    with np.errstate(over="ignore"):
        f32 = float(np.float32(value))
    if not math.isfinite(value) or not math.isfinite(f32):
        raise InputError(f"AdamW {name} must be finite as a float32, got {value!r}")
    return f32


@dataclass(frozen=True)
class AdamW:
    """AdamW's hyperparameters, checked on construction (ggml-opt asserts on bad ones mid-training).

    ggml's update (``ggml_compute_forward_opt_step_adamw_f32``), at optimizer step t = 1, 2, ..:
    ``m = beta1*m + (1-beta1)*g``, ``v = beta2*v + (1-beta2)*g^2``,
    ``w = w*(1 - alpha*wd) - alpha * (m/(1-beta1^t)) / (sqrt(v/(1-beta2^t)) + eps)`` (decoupled weight decay).

    Ranges, checked on the float32 values ggml will use: 0 < alpha (finite), 0 <= beta1, beta2 < 1
    (beta = 1 divides by zero in the bias correction), eps > 0, 0 <= wd <= 1 (ggml-opt's own bound).
    Raises InputTypeError for a non-number, InputError for a value out of range.
    """

    alpha: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    wd: float = 0.0

    def __post_init__(self):
        alpha, beta1, beta2, eps, wd = (_real(n, getattr(self, n)) for n in ("alpha", "beta1", "beta2", "eps", "wd"))
        if not alpha > 0:
            raise InputError(f"AdamW alpha (learning rate) must be > 0 as a float32, got {self.alpha!r}")
        for name, beta in (("beta1", beta1), ("beta2", beta2)):
            if not 0 <= beta < 1:
                raise InputError(f"AdamW {name} must be in [0, 1) as a float32 (1 divides by zero in the bias "
                                 f"correction), got {getattr(self, name)!r}")
        if not eps > 0:
            raise InputError(f"AdamW eps must be > 0 as a float32, got {self.eps!r}")
        if not 0 <= wd <= 1:
            raise InputError(f"AdamW wd (decoupled weight decay) must be in [0, 1], got {self.wd!r}")

    def as_float32(self) -> tuple[float, float, float, float, float]:
        """(alpha, beta1, beta2, eps, wd) rounded to float32, as ggml uses them."""
        return tuple(float(np.float32(x)) for x in (self.alpha, self.beta1, self.beta2, self.eps, self.wd))


class _Native:
    """What an Optimizer owns in C, freed by free() (from close(), or by the collector): ggml-opt's
    context first (its static buffer holds the gradient accumulators, momenta, labels and loss), then the
    scheduler (its buffers hold the compute nodes). The Graph whose context holds the model's nodes and the
    graphs ggml-opt built is kept alive until both are gone."""

    def __init__(self, lib, graph):
        self.lib, self.graph = lib, graph
        self._opt_free = lib.ggml_opt_free  # looked up now: free() may run inside a cffi call (hotggml.graph._Native)
        self.opt = None
        self.sched = None
        self.pars = None

    def free(self) -> None:
        if self.opt is not None:
            self._opt_free(self.opt)
            self.opt = None
        if self.sched is not None:
            self.sched.close()
            self.sched = None
        self.pars = self.graph = None


def _same(a, b) -> bool:
    return int(ffi.cast("uintptr_t", a)) == int(ffi.cast("uintptr_t", b))


class Optimizer:
    """ggml-opt's AdamW loop over a Graph's parameters, through a ggml_backend_sched on the Graph's backend.

    graph: a hotggml Graph that is not built (``build()`` not called): its ``param()`` leaves are trained,
    its ``input()`` leaves keep the values given (constants such as a mask), and the Optimizer takes the
    Graph over (its ``build``/``compute``/``input`` raise UsageError from now on).
    inputs: one ``input()`` leaf of the graph (any dtype the Graph takes), written by every ``step``.
    outputs: an f32, contiguous node of the graph computed from ``inputs`` and at least one parameter;
    for ``loss="cross_entropy"`` a matrix [C, N] (ggml-opt's argmax asserts rank 2).
    loss: ``"mse"`` (mean squared error against labels shaped like outputs), ``"cross_entropy"`` (softmax over
    ne[0] against label distributions shaped like outputs, averaged over the N rows), ``"mean"`` or ``"sum"``
    of the outputs (no labels).
    adamw: an AdamW (validated); opt_period: micro-batches per optimizer step (int >= 1).
    The scheduler runs over [the Graph's backend, CPU] (the CPU alone for a CPU Graph); give the CPU backend its
    threads with ``Backend("CPU", n_threads=...)``. An Optimizer never closed is freed when collected.

    Raises InputTypeError / InputError for any argument ggml-opt would assert on (including a forward graph
    too large for the Graph's context with ggml-opt's graphs (sized to the model, at least 2048 nodes), or without room for
    them, or an op without a backward case in ggml on the way from a parameter to the outputs), UsageError
    for a closed or built Graph or Backend.
    """

    def __init__(self, graph: Graph, inputs: Tensor, outputs: Tensor, loss: str = "mse",
                 adamw: AdamW | None = None, opt_period: int = 1):
        if not isinstance(graph, Graph):
            raise InputTypeError(f"graph must be a hotggml Graph, got {type(graph).__name__}")
        if graph.ctx is None:
            raise UsageError("this Graph is closed")
        if graph.gf is not None:
            raise UsageError("the Graph was already built: give the Optimizer an unbuilt Graph (ggml-opt builds "
                             "the forward, backward and optimizer graphs itself)")
        if getattr(graph, "_owner", None) is not None:
            raise UsageError(f"this Graph is already trained by {graph._owner}")
        for name, t in (("inputs", inputs), ("outputs", outputs)):
            if not isinstance(t, Tensor):
                raise InputTypeError(f"{name} must be a hotggml Tensor, got {type(t).__name__}")
        graph.own(inputs, outputs)
        if not isinstance(loss, str) or loss not in LOSSES:
            raise InputError(f"loss must be one of {sorted(LOSSES)}, got {loss!r}")
        adamw = AdamW() if adamw is None else adamw
        if not isinstance(adamw, AdamW):
            raise InputTypeError(f"adamw must be a hotggml.opt.AdamW, got {type(adamw).__name__}")
        if isinstance(opt_period, bool) or not isinstance(opt_period, (int, np.integer)):
            raise InputTypeError(f"opt_period must be an int, got {type(opt_period).__name__}")
        if not 1 <= int(opt_period) <= OPT_PERIOD_MAX:
            raise InputError(f"opt_period (micro-batches per optimizer step) must be in [1, {OPT_PERIOD_MAX}], "
                             f"got {opt_period}")
        graph.backend.need_open()
        if graph.backend.is_meta:
            # ggml-opt computes its static graphs (forward + backward, and the optimizer's) in turn over nodes it
            # allocates once; the meta backend keeps a node's per-device tensors in one of two compute containers
            # that it clears in rotation at each new graph (ggml-backend-meta.cpp, ggml_backend_meta_buffer_context),
            # so the third graph finds none and aborts (GGML_ASSERT(bcj.nodes[i]) in its graph_compute)
            raise UsageError(f"ggml-opt cannot train on {graph.backend.device_name} at this pin (the meta backend "
                             "forgets the per-device tensors of nodes allocated for an earlier graph): build the "
                             "forward, backward and ggml_opt_step_adamw nodes in one Graph(backend, scheduled=True)")
        self.graph_size = self._check_model(graph, inputs, outputs, loss)

        lib = self.lib = load()
        self.graph, self.inputs, self.outputs, self.loss = graph, inputs, outputs, loss
        self.opt_period = int(opt_period)
        self.params = [t for t in graph._leaves if int(t.ptr.flags) & FLAG_PARAM]
        self.n_micro = 0  # micro-batches evaluated
        self._native = _Native(lib, graph)
        self._finalizer = weakref.finalize(self, self._native.free)
        self._remote = graph.backend.endpoint is not None  # ggml_opt_eval gives no status: an RPC server is asked
        self._native.pars = ffi.new("struct ggml_opt_optimizer_params *")
        self.adamw = adamw

        from hotggml.sched import Scheduler

        # checked before the Graph is frozen, so that a refusal leaves it usable: constant ids on the values
        # freeze() is about to upload
        self._index_checks = self._find_index_checks()
        for t, values in graph._pending:
            self._check_ids(t.ptr, values)
        graph.freeze("an Optimizer")  # inputs and params allocated and uploaded; the Graph is ours now
        # ggml_opt's graphs hold up to graph_size nodes and graph_size leafs: the scheduler's hash set
        # must take both (ggml_backend_sched asserts it)
        self._native.sched = Scheduler(graph.backend, graph_size=2 * self.graph_size)
        params = lib.ggml_opt_default_params(self._native.sched._ptr, LOSSES[loss])
        params.graph_size = self.graph_size
        params.ctx_compute = graph.ctx
        params.inputs = inputs.ptr
        params.outputs = outputs.ptr
        params.opt_period = self.opt_period
        params.get_opt_pars = ffi.addressof(lib, "ggml_opt_get_constant_optimizer_params")
        params.get_opt_pars_ud = self._native.pars
        params.optimizer = lib.GGML_OPT_OPTIMIZER_TYPE_ADAMW
        with graph.backend.lock:  # its static buffers: commands on an RPC endpoint's one connection
            self._native.opt = lib.ggml_opt_init(params)

    # -- checks ------------------------------------------------------------------------------------
    @staticmethod
    def _check_model(graph: Graph, inputs: Tensor, outputs: Tensor, loss: str) -> int:
        """Refuse (InputError, InputTypeError) what ggml-opt would assert on; return the size of its static
        graphs: what the forward, the backward and the optimizer steps need, at least GRAPH_SIZE."""
        lib = graph.lib
        if not any(_same(inputs.ptr, t.ptr) for t in graph._leaves) or int(inputs.ptr.flags) & FLAG_PARAM:
            raise InputError("inputs must be an input() leaf of the graph (not a param, not a computed node)")
        if inputs.type_name not in ("f32", "f16", "i32"):  # step() writes NumPy values as they are: no cache types
            raise InputTypeError(f"inputs must be an f32, f16 or i32 input() leaf (step() writes NumPy arrays into "
                                 f"it), got a {inputs.type_name} cache")
        if int(outputs.ptr.op) == 0:
            raise InputError("outputs must be a computed node of the graph, not a leaf")
        if outputs.dtype != np.float32:
            raise InputTypeError(f"outputs must be float32 (ggml-opt's losses are f32), got {outputs.dtype}")
        if not outputs.is_contiguous():
            raise InputError("outputs must be contiguous: cont() it first")
        if loss == "cross_entropy" and (outputs.ne[2] != 1 or outputs.ne[3] != 1):
            raise InputError(f"cross_entropy needs outputs [C, N] (a matrix: ggml-opt's argmax asserts it), got "
                             f"{outputs.ne}: reshape the logits to [C, N] first")
        nodes, leafs = walk([outputs.ptr])
        if any(int(n.flags) & FLAG_LOSS for n in nodes):
            raise InputError("a node of the graph is already marked as a loss (ggml_set_loss): ggml-opt builds the "
                             "loss itself and asserts there is no other")
        if not any(_same(p, inputs.ptr) for p in leafs):
            raise InputError("outputs do not depend on inputs")
        autodiff.check([outputs.ptr])
        n_params = sum(1 for n in nodes if int(n.flags) & FLAG_PARAM)
        if n_params == 0:
            raise InputError("outputs depend on no param(): nothing to train (declare weights with Graph.param)")
        # gf holds the forward and the loss; gb_grad and gb_opt, the same size, add the backward (at most
        # BACKWARD_GROWTH nodes per forward node) and one optimizer step per parameter
        need = (len(nodes) + LOSS_NODES) * (1 + BACKWARD_GROWTH) + n_params
        graph_size = max(GRAPH_SIZE, need, len(leafs) + 2)
        # ggml-opt makes three graphs of graph_size (with gradients) and the backward's tensors in the Graph's
        # context: ggml_init'ed with a fixed size, it aborts when full
        room = graph._mem - lib.ggml_used_mem(graph.ctx)
        want = 3 * lib.ggml_graph_overhead_custom(graph_size, True) + lib.ggml_tensor_overhead() * (need + 16)
        if want > room:
            raise InputError(f"the model has {len(nodes)} forward nodes: with the backward and the optimizer steps "
                             f"up to {need}, in graphs of {graph_size} nodes; the Graph's context has {room} bytes "
                             f"left, ggml-opt needs up to {want}: make the Graph with a larger max_nodes "
                             f"(now {graph.max_nodes})")
        return graph_size

    def _find_index_checks(self) -> list[tuple[object, int]]:
        """(leaf pointer, rows) for the row ids of every GET_ROWS, followed back to the leaf they come from
        through ops that move values without changing them (reshape, view, permute, transpose, cont, cpy):
        ggml asserts each id is in [0, rows) and aborts otherwise. Ids from ``inputs`` are checked at each
        step, ids from a constant input() now and at each ``write``; ids computed by the graph cannot be
        checked before ggml reads them, so they are refused (InputError)."""
        lib = self.lib
        get_rows = int(lib.GGML_OP_GET_ROWS)
        moves = {int(getattr(lib, f"GGML_OP_{name}")) for name in ("RESHAPE", "VIEW", "PERMUTE", "TRANSPOSE", "CONT", "CPY", "DUP")}
        nodes, _ = walk([self.outputs.ptr])
        checks = []
        for n in nodes:
            if int(n.op) != get_rows:
                continue
            ids = n.src[1]
            while int(ids.op) in moves:
                ids = ids.src[0]
            if int(ids.op) != 0:
                raise InputError(f"the row ids of a get_rows are computed by the graph ({autodiff.op_name(lib, ids)}): "
                                 "they cannot be checked before ggml asserts on them; feed them from the inputs "
                                 "or an input()")
            checks.append((ids, int(n.src[0].ne[1])))
        return checks

    def _check_ids(self, leaf, values: np.ndarray) -> None:
        for ptr, rows in self._index_checks:
            if _same(ptr, leaf) and values.size and (values.min() < 0 or values.max() >= rows):
                raise InputError(f"ids that feed a get_rows of {rows} rows must lie in [0, {rows}), got "
                                 f"[{values.min()}, {values.max()}]")

    def _need_open(self) -> None:
        if self._native.opt is None:
            raise UsageError("this Optimizer is closed")
        if self.graph.ctx is None:
            raise UsageError("the Optimizer's Graph was closed: its nodes are freed (close the Optimizer first)")
        self.graph.backend.need_open()

    def _array_for(self, t: Tensor, array, what: str) -> np.ndarray:
        """``array`` as the bytes of tensor t (contiguous, t's dtype), or InputError / InputTypeError: values
        that are not finite refused (one step on them makes every weight NaN, and no later step recovers), but
        -INF in a leaf an attention mask is made of (Graph.mark_mask), which hides entries."""
        if isinstance(array, Tensor) or array is None:
            raise InputTypeError(f"{what} must be a NumPy array, got {type(array).__name__}")
        array = np.asarray(array)
        if ggml_shape(array.shape) != t.ne:
            want = tuple(reversed([n for n in t.ne]))
            raise InputError(f"{what} has NumPy shape {array.shape}; the tensor is {t.ne} in ggml order, NumPy "
                             f"{want} (leading 1s may be dropped)")
        if t.dtype == np.int32 and array.dtype.kind not in "iu":
            raise InputTypeError(f"{what} must hold integers for an int32 tensor, got {array.dtype}")
        if array.dtype.kind not in "fiu":
            raise InputTypeError(f"{what} must be a real array for a {t.dtype} tensor, got {array.dtype}")
        data = leaf_array(array, t.dtype, what)
        if data.dtype.kind == "f":
            if t.ptr in self.graph.attention_masks:
                check_attention_mask_values(data, what)
            elif not np.isfinite(data).all():
                raise InputError(f"{what} must be finite: one optimizer step on NaN or inf makes the weights NaN")
        return data

    # -- training --------------------------------------------------------------------------------------
    @property
    def adamw(self) -> AdamW:
        """The hyperparameters the next optimizer step uses; assign an AdamW to change them (validated)."""
        return self._adamw

    @adamw.setter
    def adamw(self, value: AdamW) -> None:
        if not isinstance(value, AdamW):
            raise InputTypeError(f"adamw must be a hotggml.opt.AdamW, got {type(value).__name__}")
        if self._native.pars is None:
            raise UsageError("this Optimizer is closed")
        p = self._native.pars
        p.adamw.alpha, p.adamw.beta1, p.adamw.beta2, p.adamw.eps, p.adamw.wd = value.as_float32()
        p.sgd.alpha, p.sgd.wd = value.as_float32()[0], value.as_float32()[4]
        self._adamw = value

    @property
    def steps(self) -> int:
        """Optimizer steps taken (one per opt_period micro-batches)."""
        return self.n_micro // self.opt_period

    def step(self, inputs: np.ndarray, labels: np.ndarray | None = None) -> float:
        """Forward + backward of one micro-batch; every opt_period-th call also takes the AdamW step.

        inputs: NumPy array shaped and typed like the inputs tensor (NumPy shape = ggml ne reversed; floats
        for f32/f16, integers within int32 for int32; ids feeding a get_rows must lie in [0, rows)).
        labels: for "mse" and "cross_entropy", an array shaped like outputs (f32; for cross_entropy each row a
        distribution over ne[0], e.g. one-hot: ggml's gradient is (softmax - labels) / rows, so an all-zero row adds no
        loss but still the gradient softmax / rows); None for "mean"/"sum".
        Returns this micro-batch's loss (for the per-datapoint losses, undone from ggml-opt's 1/opt_period
        scaling: the loss of the micro-batch alone). Raises OutOfMemoryError when ggml cannot allocate the
        training graph (nothing is computed; the Optimizer stays usable), ConnectionLostError on an RPC backend
        whose server is gone (ggml-opt reports no status: the server is asked after the step), InputError / InputTypeError for bad arrays (values
        that are not finite among them: one step on NaN or inf makes every weight NaN), UsageError when closed.
        """
        self._need_open()
        x = self._array_for(self.inputs, inputs, "inputs")
        self._check_ids(self.inputs.ptr, x)
        if self.loss in LABELLED:
            if labels is None:
                raise InputError(f"loss {self.loss!r} needs labels shaped like outputs {self.outputs.ne}")
            y = self._array_for(self.outputs, labels, "labels")
        elif labels is not None:
            raise InputError(f"loss {self.loss!r} takes no labels")
        lib, opt = self.lib, self._native.opt
        with self.graph.backend.lock, interrupts_deferred():  # one graph at a time on a backend (hotggml.graph.Backend)
            if not lib.ggml_opt_alloc(opt, True):  # (patch opt-alloc-status) a graph ggml could not allocate
                raise lost_among(self._native.sched.backends, "the training graph's allocation") or OutOfMemoryError(
                    "the training graph could not be allocated on "
                                       + ", ".join(b.device_name for b in self._native.sched.backends)
                                       + ": make the model or batch smaller (nothing was computed)")
            lib.ggml_backend_tensor_set(self.inputs.ptr, ffi.from_buffer(x), 0, x.nbytes)
            if self.loss in LABELLED:
                lib.ggml_backend_tensor_set(lib.ggml_opt_labels(opt), ffi.from_buffer(y), 0, y.nbytes)
            lib.ggml_opt_eval(opt, ffi.NULL)  # (returns no status: an RPC server gone leaves NaN weights)
            out = ffi.new("float[1]")
            lib.ggml_backend_tensor_get(lib.ggml_opt_loss(opt), out, 0, 4)
            # a failed compute or get leaves a NaN loss (0xFF bytes): then the server is asked whether it is gone
            lost = self._remote and math.isnan(out[0]) and lost_among(self._native.sched.backends, "the optimizer step")
            if lost:
                raise lost
            self.n_micro += 1  # before a deferred interrupt is raised: the step was taken
        loss = float(out[0])
        if self.loss in PER_DATAPOINT:
            loss *= self.opt_period
        return loss

    def read(self, t: Tensor) -> np.ndarray:
        """The current values of a param() or input() leaf of the graph (the params as trained so far), in
        NumPy shape. Raises InputError for a computed node (ggml-opt reuses their memory), UsageError when
        closed, ConnectionLostError on an RPC backend whose server is gone."""
        self._need_open()
        self.graph.own(t, room=False)
        if not any(_same(t.ptr, leaf.ptr) for leaf in self.graph._leaves):
            raise InputError("only param() and input() leaves keep their memory between steps: read those")
        out = np.empty(tuple(reversed(t.ne)), dtype=t.dtype)
        with self.graph.backend.lock:  # an RPC backend's commands share one connection with a step in another thread
            self.lib.ggml_backend_tensor_get(t.ptr, ffi.from_buffer(out), 0, out.nbytes)
            raw = out.view(np.uint8)  # a failed get gives 0xFF bytes (rpc-lost-server): then the server is asked
            if self._remote and raw.size and raw.min() == 0xFF and self.graph.backend.lost():
                raise self.graph.backend.connection_lost("read()")
        return out

    def write(self, t: Tensor, array: np.ndarray) -> None:
        """Overwrite a param() or input() leaf (e.g. a new constant, or parameters to restart from).
        Raises as ``read`` does, and InputError / InputTypeError for an array of another shape or kind, or with
        values that are not finite (-INF allowed in a leaf an attention mask is made of: Graph.mark_mask)."""
        self._need_open()
        self.graph.own(t, room=False)
        if not any(_same(t.ptr, leaf.ptr) for leaf in self.graph._leaves):
            raise InputError("only param() and input() leaves can be written")
        a = self._array_for(t, array, "array")
        self._check_ids(t.ptr, a)
        with self.graph.backend.lock, interrupts_deferred():  # a meta device asks the split callback (interrupts_deferred)
            self.lib.ggml_backend_tensor_set(t.ptr, ffi.from_buffer(a), 0, a.nbytes)

    def compute_bytes(self) -> int:
        """Bytes of the scheduler's compute buffer on the Graph's backend: the arena of the largest graph
        ggml-opt allocated so far (forward + backward + optimizer step), 0 before the first ``step``. The
        inputs/params buffer and ggml-opt's static buffer (gradient accumulators, momenta) are not in it."""
        self._need_open()
        sched = self._native.sched
        return int(self.lib.ggml_backend_sched_get_buffer_size(sched._ptr, self.graph.backend._ptr))

    def close(self) -> None:
        """Free ggml-opt's context, then the scheduler (once); every later call raises UsageError. Waits for a
        step on its Backend in another thread to end (Backend.lock)."""
        with self.graph.backend.lock:
            self._finalizer()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
