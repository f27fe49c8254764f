"""Probe: does a device take the fused nodes at a run's REAL shapes? (SPEC §5, §6)

``ggml_backend_supports_op == false`` is not an error in ggml: a scheduler silently runs the
node on the CPU. Before a run claims a device result, build the fused forward and backward
nodes at the run's shapes in a no-alloc context (nothing is allocated: the 27B chunk probes
on any machine), ask the device, and let ggml's scheduler over [device, CPU] place the graph
(split only, no allocation); refuse with UnsupportedOpError unless both nodes land on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hotggml import ops
from hotggml.cases import Case
from hotggml.errors import UnsupportedOpError
from hotggml.graph import Backend, Graph


@dataclass(frozen=True)
class KernelPath:
    """What the fused nodes of a case run on a device, as the library reports it: the resolved precision
    ('tf32' or 'f32') and the kernel's name (Backend.fa_train_kernel: family, instance, shared-memory class)."""

    precision: str
    kernel: str

    def __str__(self) -> str:
        return self.kernel


def _kv_tensor(g: Graph, type_name: str, ne: tuple[int, ...], name: str):
    """K or V of ggml shape ne in its stored type, without data (a reserve-only Graph's cache)."""
    if type_name == "f32":
        return g.new_tensor(ne, name=name)
    return g.cache(np.broadcast_to(np.float32(0), tuple(reversed(ne))), type_name, name)


def probe(case: Case, backend: Backend, prec: str = "default") -> KernelPath:
    """Raise UnsupportedOpError unless ``backend`` supports the fwd and bwd nodes of ``case``;
    return the precision and kernel they run there (KernelPath, as the library reports them).

    Shapes in ggml order: q [D, S, Nh, B], k [D, Skv, Nkv, B], v [Dv, Skv, Nkv, B],
    mask [Skv, S, 1, 1 or B] f16 when the case has one; d is the packed gradient of the forward.
    """
    # reserve only: the caches of a stored-type case are made in their types without data
    with Graph(backend, scheduled=True, reserve_only=True) as g:
        q = g.new_tensor((case.D, case.S, case.Nh, case.B))
        k, v = (_kv_tensor(g, getattr(case, f"{name}_type"), (d, case.Skv, case.Nkv, case.B), name)
                for name, d in (("k", case.D), ("v", case.dv)))
        mask = None
        if case.has_mask():
            bm = case.B if (case.mask_per_batch or case.mask == "padding") else 1
            mask = g.new_tensor((case.Skv, case.S, 1, bm), np.float16)
        fwd = ops.flash_attn_train(g, q, k, v, mask, case.scale, prec, causal=case.causal, window=case.window)
        # the gradients a trainer's autodiff asks: a cache in a stored type takes none (nor a frozen f32 K/V)
        grads = "q" + "".join(name for name in "kv" if case.kv_trained(name))
        back = ops.flash_attn_train_back(g, fwd, g.new_tensor(fwd.ne), grads)
        for node in (fwd, back):
            if not backend.supports_op(node):
                why = backend.fa_train_refusal(node)
                raise UnsupportedOpError(
                    f"{backend.device_name} supports_op is false for {node.op_name} at {case.id} ({case.shape}, "
                    f"prec {prec}){f' ({why})' if why else ''}: ggml would run it on the CPU instead; this run "
                    f"cannot claim a {backend.device_name} result")
        views = {"q": ops.get_dq, "k": ops.get_dk, "v": ops.get_dv}
        g.build([ops.get_o(fwd), ops.get_lse(fwd)] + [views[name](back) for name in grads])
        g.plan()
        placed = {t.ptr: device for t, device in g.placement()}
        for node in (fwd, back):
            if placed.get(node.ptr) != backend.device_name:
                raise UnsupportedOpError(f"ggml's scheduler placed {node.op_name} of {case.id} on "
                                         f"{placed.get(node.ptr)}, not {backend.device_name}")
        kernels = {backend.fa_train_kernel(node) for node in (fwd, back)}
        if len(kernels) != 1:
            raise UnsupportedOpError(f"{backend.device_name}: forward and backward of {case.id} run different "
                                     f"kernels {sorted(kernels)}")
        return KernelPath(backend.fa_train_path(fwd), kernels.pop())
