"""Graphs on a named backend: tensors to and from NumPy, autodiff, allocator arenas, compute.

Shapes are in ggml order (``ne[0]`` fastest): a NumPy array of shape (B, Nh, S, D) is the ggml
tensor [D, S, Nh, B]. Inputs and parameters live in their own context and backend buffer (as in
ggml-opt: they are owned by the caller); every node of the graph is placed by the graph
allocator (gallocr) in one arena, whose size is the compute memory the graph needs.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
import weakref
from dataclasses import dataclass

import numpy as np

from hotggml.errors import (BackendError, ConnectionLostError, HotggmlError, InputError, InputTypeError, OutOfMemoryError,
                            UsageError)
from hotggml.ffi import backend_proc, ffi, load
from hotggml.procs import deliver_interrupt

GGML_MAX_DIMS = 4
GGML_MAX_N_THREADS = 512  # ggml.h: a CPU thread pool holds at most this many threads
MAX_TENSOR_BYTES = 1 << 48  # a tensor larger than this is a mistake (and near size_t overflow in ggml's sizes)
TENSORS_PER_CALL = 8  # the most tensor objects one binding call creates (an op and its views)
BACKWARD_GROWTH = 8  # nodes ggml_build_backward_expand may add per forward node (tests/test_binding_safety.py
                     # measures it over every op the binding builds)
FLAG_INPUT, FLAG_OUTPUT, FLAG_PARAM = 1, 2, 4  # enum ggml_tensor_flag
_GGML_TYPES = {np.dtype(np.float32): 0, np.dtype(np.float16): 1, np.dtype(np.int32): 26}  # enum ggml_type
_NP_TYPES = {v: k for k, v in _GGML_TYPES.items()}


def devices() -> list[tuple[str, str]]:
    """(registry device name, description) of every device the loaded library offers, e.g. ('CPU', ...)."""
    lib = load()
    out = []
    for i in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(i)
        out.append((ffi.string(lib.ggml_backend_dev_name(dev)).decode(),
                    ffi.string(lib.ggml_backend_dev_description(dev)).decode()))
    return out


def _registry_device(lib, device_name: str):
    """The registry's device called device_name; BackendError naming what the registry has otherwise."""
    dev = lib.ggml_backend_dev_by_name(device_name.encode())
    if dev == ffi.NULL:
        names = ", ".join(name for name, _ in devices())
        raise BackendError(f"backend device {device_name!r} is not in this build's registry (have: {names}); "
                           "build ggml with that backend on a machine that has the device "
                           "(for CUDA: `hotggml build --backend cuda`)")
    return dev


class Backend:
    """A ggml backend opened by its registry device name ('CPU', 'CUDA0', 'Vulkan0', ...), or ggml's meta
    device over several of them ('Meta(CPU,CPU)', Backend.meta).

    Raises BackendError when the name is not in the registry: a missing backend is a hard
    failure, never a silent CPU fallback. n_threads applies to the CPU backend only.

    ``'RPC[host:port]'`` opens the first device of the RPC server at host:port (hotggml.rpc.connect puts its
    devices in the registry; BackendError when none answers or it is of another build); its ``device_name`` is
    then the registry's ('RPC0'), ``endpoint`` is 'host:port' (None for a local device) and ``remote`` the
    device behind it when a hotggml.rpc.Server of this process serves it ('CPU'; else None); InputError for a
    malformed 'RPC[...]' name. A server that no longer answers (it died, or the network failed) raises
    ConnectionLostError: when the Backend is opened, and from Graph.build / compute / profile / read and the
    Optimizer's calls afterwards (Backend.lost asks the server).

    Threads: a Backend computes one graph at a time. ggml's backends are not reentrant (the CPU
    backend's work buffer and thread pool are the backend's), so every compute on it (Graph.compute,
    Graph.profile, Optimizer.step) holds the Backend's ``lock``: graphs on one Backend may be driven
    from several Python threads and run one after another; for parallel work, one Backend per thread. The
    Backends of one RPC endpoint share one lock (ggml-rpc sends their commands over one connection).
    """

    def __init__(self, device_name: str, n_threads: int | None = None):
        """device_name: a registry device name, or ``Meta(NAME,NAME,..)``: ggml's meta device over those
        registry devices (Backend.meta). n_threads: the CPU backend's threads (each CPU of a meta device's)."""
        if not isinstance(device_name, str):
            raise InputTypeError(f"device_name must be a str (CPU, CUDA0, ..), got {type(device_name).__name__}")
        if "\0" in device_name or not device_name.isprintable():  # C would read up to a NUL: another device
            raise InputError(f"device_name must be printable text without NUL, got {device_name!r}")
        if n_threads is not None:
            if not isinstance(n_threads, (int, np.integer)) or isinstance(n_threads, bool):
                raise InputTypeError(f"n_threads must be an int, got {type(n_threads).__name__}")
            if not 1 <= n_threads <= GGML_MAX_N_THREADS:
                raise InputError(f"n_threads must be in [1, {GGML_MAX_N_THREADS}], got {n_threads}")
            n_threads = int(n_threads)
        from hotggml import meta

        lib = load()
        if device_name.startswith("RPC["):
            from hotggml import rpc

            m = rpc.DEVICE_NAME.match(device_name)
            if m is None:
                raise InputError(f"an RPC device is named 'RPC[host:port]', got {device_name!r}")
            device_name = rpc.connect(m.group("endpoint"))[0]
        simple_names = meta.parse_name(device_name)
        self.meta_devices: tuple[str, ...] | None = None  # the simple devices of a meta device, registry spelling
        if simple_names is None:
            dev = _registry_device(lib, device_name)
        else:
            if len(simple_names) > meta.MAX_DEVICES:
                raise InputError(f"a meta device wraps at most {meta.MAX_DEVICES} devices, got {len(simple_names)}")
            simple = [_registry_device(lib, name) for name in simple_names]
            self.meta_devices = tuple(ffi.string(lib.ggml_backend_dev_name(d)).decode() for d in simple)
            devs = ffi.new("ggml_backend_dev_t[]", simple)
            dev = lib.ggml_backend_meta_device(devs, len(simple), meta.callback(), ffi.NULL)
        self.device_name = ffi.string(lib.ggml_backend_dev_name(dev)).decode()  # the registry's spelling
        self.description = ffi.string(lib.ggml_backend_dev_description(dev)).decode()
        # an RPC device's description is its endpoint (a meta device is in no registry: ggml asserts on its reg)
        reg_name = None if self.meta_devices is not None else \
            ffi.string(lib.ggml_backend_reg_name(lib.ggml_backend_dev_backend_reg(dev))).decode()
        self.endpoint = self.description if reg_name == "RPC" else None
        self.remote = None
        if self.endpoint is not None:
            from hotggml import rpc

            self.remote = rpc.served_device(self.endpoint)
        self._dev = dev
        if n_threads is not None and any(name != "CPU" for name in (self.meta_devices or (self.device_name,))):
            raise InputError("n_threads applies to the CPU backend only")
        self.lib = lib
        # held across every compute on this backend (see the class docstring); one per RPC endpoint: ggml-rpc
        # sends every Backend's commands to a server over one connection, which two threads would interleave
        self.lock = _endpoint_lock(self.endpoint) if self.endpoint is not None else threading.RLock()
        self._ptr = lib.ggml_backend_dev_init(dev, ffi.NULL)
        if self._ptr == ffi.NULL:
            raise BackendError(f"backend device {device_name!r} failed to initialise")
        # freed by close(), or by the garbage collector for a Backend never closed (never twice)
        self._finalizer = weakref.finalize(self, lib.ggml_backend_free, self._ptr)
        # ggml-rpc makes a server's buffer type at its first use and gives NULL when the server does not answer
        # then, which ggml asserts on (a first graph after the server died): made now, once per endpoint and
        # process (ggml keeps it; later Backends ask nothing of the server here)
        if self.endpoint is not None:
            with self.lock:
                made = lib.ggml_backend_get_default_buffer_type(self._ptr) != ffi.NULL
            if not made:
                self.close()
                raise ConnectionLostError(f"the RPC server at {self.endpoint} does not answer (it died or closed the "
                                          "connection): open a Backend once a server listens there")
        if n_threads is not None:
            reg = lib.ggml_backend_dev_backend_reg(_registry_device(lib, "CPU"))
            set_n_threads = backend_proc(reg, "ggml_backend_set_n_threads", "ggml_backend_set_n_threads_t")
            if set_n_threads is None:
                raise BackendError("this build's CPU backend does not export ggml_backend_set_n_threads")
            if self.meta_devices is None:
                set_n_threads(self._ptr, n_threads)
            else:
                for j in range(len(self.meta_devices)):
                    set_n_threads(lib.ggml_backend_meta_simple_backend(self._ptr, j), n_threads)
        self.n_threads = n_threads

    @classmethod
    def meta(cls, device_names, n_threads: int | None = None) -> "Backend":
        """ggml's meta device (tensor parallelism) over the registry devices ``device_names``, e.g.
        ``Backend.meta(["CPU", "CPU"])``: two instances of the CPU device, its name ``Meta(CPU,CPU)``.

        Every tensor lives on each device, whole (mirrored, the default) or as a slice: ``Graph.split`` splits
        a leaf, and the meta backend infers the rest from the graph (hotggml.meta says what it can split at this
        pin). Its graphs compute through the scheduler (``Graph(backend, scheduled=True)``). Raises
        InputTypeError / InputError for a list that names no device, BackendError for a name not in the registry.
        """
        if isinstance(device_names, str) or not isinstance(device_names, (list, tuple)):
            raise InputTypeError(f"device_names must be a list of registry device names, got {type(device_names).__name__}")
        if not device_names or any(not isinstance(n, str) or not n.strip() or "," in n or "(" in n or ")" in n
                                   for n in device_names):
            raise InputError(f"device_names must list registry device names (e.g. ['CPU', 'CPU']), got {device_names!r}")
        return cls("Meta(" + ",".join(n.strip() for n in device_names) + ")", n_threads)

    @property
    def is_meta(self) -> bool:
        """Whether this is ggml's meta device over several devices (Backend.meta)."""
        return self.meta_devices is not None

    @property
    def n_devices(self) -> int:
        """The devices a tensor of this backend is split over: a meta device's count, else 1."""
        return len(self.meta_devices) if self.meta_devices is not None else 1

    def supports_op(self, tensor: "Tensor") -> bool:
        """The device's own answer for this node at its real shapes and types."""
        return bool(load().ggml_backend_dev_supports_op(self._dev, tensor.ptr))

    def fa_train_kernel(self, tensor: "Tensor") -> str:
        """The kernel a FLASH_ATTN_TRAIN(_BACK) node runs here (see _device_kernel); on a meta device the one
        kernel its devices all run (BackendError when they differ)."""
        if not self.supports_op(tensor):
            return "none"
        if self.meta_devices is None:
            return self._device_kernel(self.device_name, tensor)
        kernels = {self._device_kernel(name, tensor) for name in self.meta_devices}
        if len(kernels) != 1:
            raise BackendError(f"the devices of {self.device_name} run different kernels: {', '.join(sorted(kernels))}")
        return kernels.pop()

    def _device_kernel(self, device_name: str, tensor: "Tensor") -> str:
        """The kernel a FLASH_ATTN_TRAIN(_BACK) node runs here, as the library names it: on CUDA
        ``<precision>-<family>-d<D>[v<Dv>]-smem<KiB>`` for the register family ('tf32-reg-d96-smem227',
        'f32-x3-d192v128-smem99': its instance and shared-memory class), 'f32-scalar', or 'none' (refused);
        'f32-vulkan' on a Vulkan device (flash_attn_train.comp), or 'none'; 'f32-cpu' on the CPU, which has one path.

        Asked of the library, never inferred from the request: CUDA answers through the proc address
        ``ggml_backend_cuda_flash_attn_train_path`` (the decision its dispatch uses), Vulkan through
        ``ggml_backend_vk_flash_attn_train_path`` (the decision its supports_op uses). Through RPC, 'f32-cpu' when
        the server is a CPU this process serves (hotggml.rpc.Server), else 'f32-rpc' or 'tf32-rpc': the node's
        requested precision (GGML_PREC_DEFAULT may run TF32 on the server's device, and RPC does not report its
        kernels). Raises BackendError for a backend that cannot say.
        """
        lib = load()
        if device_name == "CPU" or (device_name == self.device_name and self.remote == "CPU"):
            return "f32-cpu"  # a CPU behind RPC runs the CPU's one path
        if device_name == self.device_name and self.endpoint is not None:
            # RPC does not say what the server runs: the precision the node asks for
            f32 = int(lib.ggml_flash_attn_train_get_prec(tensor.ptr)) == lib.GGML_PREC_F32
            return "f32-rpc" if f32 else "tf32-rpc"
        if device_name.startswith("Vulkan"):
            why = self._vulkan_path(device_name, tensor)
            return "none" if why.startswith("none") else why
        dev = lib.ggml_backend_dev_by_name(device_name.encode())
        path = None if dev == ffi.NULL else backend_proc(
            lib.ggml_backend_dev_backend_reg(dev), "ggml_backend_cuda_flash_attn_train_path", "ggml_backend_cuda_fa_train_path_t")
        if path is None or not device_name.startswith("CUDA"):
            raise BackendError(f"{device_name} does not report which flash_attn_train path it runs")
        return ffi.string(path(int(device_name[len("CUDA"):]), tensor.ptr)).decode()

    @staticmethod
    def _vulkan_path(device_name: str, tensor: "Tensor") -> str:
        """The Vulkan library's report for a FLASH_ATTN_TRAIN(_BACK) node on device_name ('Vulkan<i>'):
        'f32-vulkan', or 'none: <why>' (proc address ``ggml_backend_vk_flash_attn_train_path``)."""
        lib = load()
        dev = lib.ggml_backend_dev_by_name(device_name.encode())
        path = None if dev == ffi.NULL else backend_proc(
            lib.ggml_backend_dev_backend_reg(dev), "ggml_backend_vk_flash_attn_train_path", "ggml_backend_cuda_fa_train_path_t")
        if path is None:
            raise BackendError(f"{device_name} does not report which flash_attn_train path it runs "
                               "(a Vulkan build without the flash-attn-train-vulkan patch)")
        return ffi.string(path(int(device_name[len("Vulkan"):]), tensor.ptr)).decode()

    def fa_train_refusal(self, tensor: "Tensor") -> str | None:
        """Why this device refuses a FLASH_ATTN_TRAIN(_BACK) node, as the library says it (Vulkan: from the
        decision its supports_op uses), or None where it takes the node or cannot say why."""
        # the device's name first: elsewhere no second supports_op query (the caller asked it already)
        if self.meta_devices is not None or not self.device_name.startswith("Vulkan") or self.supports_op(tensor):
            return None
        why = self._vulkan_path(self.device_name, tensor)
        return why[len("none: "):] if why.startswith("none: ") else None

    def fa_train_pool_peak(self, reset: bool = False) -> int:
        """The most CUDA pool memory (bytes) one FLASH_ATTN_TRAIN(_BACK) node took on this backend's device
        since the last call with ``reset`` (then 0 again): its scratch (mask cells, TF32 operand copies, D_i,
        split dK/dV sums), as the pool handed it out. The library's own counter (the CUDA registry's proc
        address ``ggml_backend_cuda_flash_attn_train_pool_peak``, shared by the process's CUDA devices).
        Raises BackendError on a backend without one (the CPU's scratch is its work buffer, not a pool)."""
        lib = load()
        peak = None
        if self.device_name.startswith("CUDA"):
            peak = backend_proc(lib.ggml_backend_dev_backend_reg(self._dev), "ggml_backend_cuda_flash_attn_train_pool_peak",
                                "ggml_backend_cuda_fa_train_pool_peak_t")
        if peak is None:
            raise BackendError(f"{self.device_name} keeps no flash_attn_train pool counter")
        return int(peak(reset))

    def fa_train_path(self, tensor: "Tensor") -> str:
        """The precision a FLASH_ATTN_TRAIN(_BACK) node runs at here: 'tf32', 'f32' or 'none' (refused),
        read off fa_train_kernel (the first word of its name). Raises BackendError for a name that
        says neither (a library this binding does not know)."""
        kernel = self.fa_train_kernel(tensor)
        precision = kernel.split("-")[0]
        if precision not in ("tf32", "f32", "none"):
            raise BackendError(f"{self.device_name} reports an unknown flash_attn_train kernel {kernel!r}")
        return precision

    def close(self) -> None:
        """Free the backend (once; a Graph still holding it keeps it until that Graph is freed). Waits for a
        compute on it in another thread to end (``lock``)."""
        with self.lock:
            self._finalizer()
            self._ptr = None

    def lost(self) -> bool:
        """Whether this is an RPC backend whose server no longer answers (it died, or the connection failed:
        ggml-rpc then fails every call on it, and reads give NaN bytes). One round trip to the server (its
        device memory), under ``lock``; a new connection and handshake where no buffer holds one, which a
        server busy with another client answers only after GGML_RPC_HELLO_TIMEOUT_MS (then True). False for a
        local backend. The binding asks only after a call failed or read NaN bytes."""
        if self.endpoint is None or self._ptr is None:
            return False
        free, total = ffi.new("size_t *"), ffi.new("size_t *")
        with self.lock:
            self.lib.ggml_backend_dev_memory(self._dev, free, total)  # 0 from ggml-rpc when the server is gone
        return total[0] == 0

    def connection_lost(self, what: str) -> ConnectionLostError:
        """The error for ``what`` failing because this RPC backend's server is gone (Backend.lost)."""
        return ConnectionLostError(
            f"{what} failed on {self.device_name}: the RPC server at {self.endpoint} no longer answers (it died, "
            "closed the connection or refused a command); the buffers on it are lost: close this Graph and its "
            "Backend, and open new ones once a server listens there")

    def alloc_error(self, message: str) -> HotggmlError:
        """The error for an allocation that failed on this backend: ConnectionLostError where its RPC server is
        gone (ggml-rpc gives no buffer then), else OutOfMemoryError(message)."""
        return self.connection_lost("an allocation") if self.lost() else OutOfMemoryError(message)

    def need_open(self) -> None:
        """RuntimeError when the backend was closed (its C object is freed)."""
        if self._ptr is None:
            raise UsageError(f"backend {self.device_name} is closed")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


_endpoint_locks: dict[str, threading.RLock] = {}
_endpoint_locks_guard = threading.Lock()


def _endpoint_lock(endpoint: str) -> threading.RLock:
    """The lock of every Backend of an RPC endpoint (Backend.lock), made once per process."""
    with _endpoint_locks_guard:
        return _endpoint_locks.setdefault(endpoint, threading.RLock())


def lost_among(backends, what: str) -> ConnectionLostError | None:
    """Backend.connection_lost(what) of the first of ``backends`` whose RPC server is gone (Backend.lost), else None."""
    lost = next((b for b in backends if b.lost()), None)
    return lost.connection_lost(what) if lost is not None else None


class _Native:
    """What a Graph owns in C, freed in dependency order by free(): from close(), or by the garbage
    collector for a Graph never closed (weakref.finalize holds this object, never the Graph). It keeps
    the Graph's Backend alive while buffers made on it exist."""

    def __init__(self, lib, backend):
        self.lib, self.backend = lib, backend
        # looked up now: free() may run from the collector inside a cffi call that holds cffi's (non-reentrant)
        # lock, and the first lookup of a function takes that lock: the process hung there
        self._ggml_free = lib.ggml_free
        self.sched = self.galloc = self.in_buf = None
        self.ctx = self.ctx_in = None
        self.split_keys: list[int] = []  # hotggml.meta's registry entries of this Graph's leaves

    def free(self) -> None:
        if self.split_keys:
            from hotggml import meta

            meta.forget(self.split_keys)  # before the contexts: their addresses go back to the allocator
            self.split_keys = []
        if self.sched is not None:
            self.sched.close()  # its buffers hold the graph's nodes: before the contexts
        self.sched = self.galloc = self.in_buf = None  # cffi frees the allocator and the input buffer
        for ctx in (self.ctx, self.ctx_in):
            if ctx is not None and ctx != ffi.NULL:
                self._ggml_free(ctx)
        self.ctx = self.ctx_in = self.backend = None


@dataclass(frozen=True, eq=False)
class Tensor:
    """A ggml tensor node of a Graph (a thin handle on the C struct).

    The struct lives in its Graph's context: once the Graph is closed, every use of the handle raises
    RuntimeError (reading freed memory would crash the interpreter or return garbage).
    """

    graph: "Graph"
    raw: object

    @property
    def ptr(self):
        """The C struct; RuntimeError once the Graph is closed."""
        if self.graph.ctx is None:
            raise UsageError("this tensor's Graph is closed: its tensors are freed")
        return self.raw

    @property
    def ne(self) -> tuple[int, ...]:
        """Shape in ggml order, all four dims."""
        return tuple(int(x) for x in self.ptr.ne)

    @property
    def nb(self) -> tuple[int, ...]:
        """Strides in bytes, ggml order."""
        return tuple(int(x) for x in self.ptr.nb)

    @property
    def dtype(self) -> np.dtype:
        """The NumPy dtype of the values (float32, float16, int32); InputTypeError for a stored K/V type
        (bf16, q8_0: hotggml.kvcache decodes its bytes)."""
        ggml_type = int(self.ptr.type)
        if ggml_type not in _NP_TYPES:
            raise InputTypeError(f"a {self.type_name} tensor has no NumPy dtype: hotggml.kvcache decodes its bytes")
        return _NP_TYPES[ggml_type]

    @property
    def type_name(self) -> str:
        """ggml's name of the tensor's type: 'f32', 'f16', 'bf16', 'q8_0', 'i32', ..."""
        return ffi.string(load().ggml_type_name(self.ptr.type)).decode()

    @property
    def op(self) -> int:
        return int(self.ptr.op)

    @property
    def op_name(self) -> str:
        return ffi.string(load().ggml_op_name(self.ptr.op)).decode()

    def is_contiguous(self) -> bool:
        return bool(load().ggml_is_contiguous(self.ptr))


def walk(roots) -> tuple[list, list]:
    """(nodes, leafs): the tensor pointers reachable from the root pointers through src, split by
    ggml_visit_parents' rule (a tensor with no op that is not a parameter is a leaf); each once."""
    seen: set[int] = set()
    nodes, leafs = [], []
    stack = list(roots)
    while stack:
        ptr = stack.pop()
        key = int(ffi.cast("uintptr_t", ptr))
        if key in seen:
            continue
        seen.add(key)
        (leafs if int(ptr.op) == 0 and not int(ptr.flags) & FLAG_PARAM else nodes).append(ptr)
        stack.extend(src for src in ptr.src if src != ffi.NULL)
    return nodes, leafs


def topological(roots) -> list:
    """The tensor pointers reachable from the roots through src, each after its sources (ggml's graph order up to
    ties), leaves included."""
    seen: set[int] = set()
    order = []
    stack = [(ptr, False) for ptr in reversed(list(roots))]
    while stack:
        ptr, done = stack.pop()
        key = int(ffi.cast("uintptr_t", ptr))
        if done:
            order.append(ptr)
            continue
        if key in seen:
            continue
        seen.add(key)
        stack.append((ptr, True))
        stack.extend((src, False) for src in ptr.src if src != ffi.NULL)
    return order


# The operand types each op method takes (ggml type names), as tuples of its operands: what ggml's kernels run
# on every backend the binding drives, not what supports_op answers (the CPU says yes to add(i32, i32) and then
# aborts). Ops that only move bytes (cont, repeat, reshape, permute) take every type input() makes.
OP_TYPES = {
    "add":          {("f32", "f32"), ("f16", "f16"), ("f16", "f32")},  # the result has a's type
    "mul":          {("f32", "f32"), ("f16", "f16"), ("f16", "f32")},
    "sum":          {("f32",), ("f16",)},
    "mul_mat":      {("f32", "f32"), ("f16", "f32")},                  # b is f32 (ggml converts it for an f16 a)
    "soft_max_ext": {("f32",)},                                        # its mask: f16 or f32 (checked there)
}


def check_op_types(op: str, *tensors: "Tensor") -> None:
    """Raise InputTypeError unless the operands' types are a combination OP_TYPES lists for op."""
    got = tuple(t.type_name for t in tensors)
    if got not in OP_TYPES[op]:
        takes = ", ".join("(" + ", ".join(c) + ")" for c in sorted(OP_TYPES[op]))
        raise InputTypeError(f"{op} takes operand types {takes}, got ({', '.join(got)})")


@contextlib.contextmanager
def interrupts_deferred():
    """SIGINT held back while C code runs that calls into Python (the meta backend's split callback, the
    scheduler's eval callback), and delivered when the block ends. A KeyboardInterrupt raised inside a cffi
    callback never reaches the caller: the callback's fallback answer goes to ggml instead (a leaf's split
    answered wrong, which ggml then aborts on; a profile stopped after two nodes and taken as computed). C code
    does not look at signals anyway, so nothing is interrupted later than it would be. Outside the main
    thread, where Python delivers no signals, it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: pending.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler if previous is None else previous)
        if pending:  # to the handler the caller had, as if the signal came now (a termination before a SIGINT)
            deliver_interrupt(next((signum for signum in pending if signum != signal.SIGINT), pending[0]))


def _blocked(t: "Tensor") -> int:
    """The block size of a quantized tensor's type (q8_0: 32), 0 for a type of single values."""
    n = int(load().ggml_blck_size(t.ptr.type))
    return n if n > 1 else 0


def check_rows(op: str, name: str, t: "Tensor") -> None:
    """Raise InputError unless t's rows are contiguous (nb[0] is its type's size), as ggml's CPU kernels of op
    need for this operand (a transposed view there aborts, or, for sum, gives a wrong value)."""
    if t.nb[0] != int(load().ggml_type_size(t.ptr.type)):
        raise InputError(f"{op}: {name} (ne {t.ne}, nb {t.nb}) does not have contiguous rows (a transposed view): "
                         "cont() it first")


def check_scale(op: str, scale) -> float:
    """scale as a float, or InputTypeError for a non-real, InputError for one that is not finite as the float32
    ggml stores (1e39 is finite in Python and inf there)."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating, np.integer)):
        raise InputTypeError(f"{op}: scale must be a real number, got {type(scale).__name__}")
    try:
        value = float(scale)
    except OverflowError:
        value = np.inf
    if not np.isfinite(value) or abs(value) > float(np.finfo(np.float32).max):
        raise InputError(f"{op}: scale must be finite as a float32, got {scale}")
    if value != 0 and np.float32(value) == 0:
        raise InputError(f"{op}: scale {scale} is 0 as a float32")
    return value


def leaf_array(array: np.ndarray, dtype, what: str) -> np.ndarray:
    """``array`` as a private C-contiguous copy in a leaf's dtype (float32, float16 or int32). Raises
    InputTypeError for values of a kind the leaf cannot hold (floats for an int32 leaf), InputError for values
    the conversion would change without a word: integers outside the int32 range, finite floats beyond the
    float type's range (they would become inf)."""
    dtype = np.dtype(dtype)
    if array.dtype.kind not in ("f", "i", "u", "b") or (dtype.kind == "i" and array.dtype.kind == "f"):
        raise InputTypeError(f"{what}: {'an' if str(dtype)[0] in 'aeiou' else 'a'} {dtype} leaf cannot take {array.dtype} values")
    if array.size * dtype.itemsize > MAX_TENSOR_BYTES:  # before the copy (a broadcast view costs nothing to pass)
        raise InputError(f"{what}: shape {array.shape} of {dtype} is over {MAX_TENSOR_BYTES} bytes")
    if dtype.kind == "i" and array.size and (array.min() < np.iinfo(dtype).min or array.max() > np.iinfo(dtype).max):
        raise InputError(f"{what}: values out of the {dtype} range")
    try:
        with np.errstate(over="ignore"):  # an overflow is what the test below finds
            data = np.array(array, dtype=dtype, order="C", copy=True)  # the caller's array may change
    except MemoryError as exc:
        raise OutOfMemoryError(f"{what}: no host memory for a copy of {array.size * dtype.itemsize} bytes") from exc
    if dtype.kind == "f" and array.dtype.kind in "fiu" and array.size:
        lost = ~np.isfinite(data) & (np.isfinite(array) if array.dtype.kind == "f" else True)
        if lost.any():
            raise InputError(f"{what}: finite values beyond {dtype}'s range ({float(np.finfo(dtype).max):.6g}) "
                             "would become inf")
    return data


def leaf_values(array, what: str) -> np.ndarray:
    """``array`` as a NumPy array for a leaf (input, param, cache, set). Raises InputTypeError for None, a
    Tensor, or a masked array (its masked-out values would be taken as data: fill it first)."""
    if array is None or isinstance(array, (Tensor, np.ma.MaskedArray)):
        raise InputTypeError(f"{what} takes its values as a NumPy array (a masked array filled first), got "
                             f"{type(array).__name__}")
    return np.asarray(array)


def leaf_dtype(dtype, what: str) -> np.dtype:
    """np.dtype(dtype), or InputTypeError naming what for anything NumPy cannot read as one."""
    try:
        return np.dtype(dtype)
    except (TypeError, ValueError) as exc:
        raise InputTypeError(f"{what}: {dtype!r} is not a dtype (float32, float16 or int32)") from exc


def check_attention_mask_values(values: np.ndarray, what: str = "mask") -> None:
    """Raise InputError unless an additive attention mask holds finite values or -INF only (SPEC §4): +INF
    and NaN would turn rows, and every dK / dV, into NaN without an error."""
    values = np.asarray(values, dtype=np.float32)
    bad = np.isnan(values) | np.isposinf(values)
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        raise InputError(f"{what}: an attention mask holds finite values or -inf only, got "
                         f"{values[where]} at {where} (NumPy index)")


def ggml_shape(array_shape: tuple[int, ...]) -> tuple[int, ...]:
    """NumPy shape (slowest first) -> ggml ne (fastest first), padded with 1 to four dims."""
    if len(array_shape) > GGML_MAX_DIMS:
        raise InputError(f"ggml tensors have at most {GGML_MAX_DIMS} dims, got shape {array_shape}")
    ne = tuple(reversed(array_shape))
    return ne + (1,) * (GGML_MAX_DIMS - len(ne))


class Graph:
    """One context + one compute graph (with gradients) + one allocator on a Backend.

    Build with ``input``/``param`` and the op methods (or hotggml.ops), then ``build(outputs,
    loss)``, then either ``arena_bytes()`` (reserve only) or ``compute()`` and ``read``/``grad``.

    ``reserve_only=True`` makes a Graph that is measured and never computed (``hotggml memory``): its leaves
    take an array's shape and dtype, never its data (nothing is copied or uploaded: a zero-stride
    ``np.broadcast_to`` array of any size costs nothing), and sit on a zero-byte buffer of the backend, as
    tensors placed elsewhere, so ``arena_bytes()`` measures the same arena as a Graph with data;
    ``compute()``, ``profile()``, ``read()``, ``grad()``, ``set()`` and ``freeze()`` raise UsageError.

    ``scheduled=True`` computes through ``ggml_backend_sched`` over [backend, CPU] as a trainer
    does (hotggml.sched): nodes the backend refuses fall back to the CPU instead of raising,
    ``assign`` pins a node to a backend, and ``placement()`` / ``n_splits`` say where each node
    ran. Without it, every node must run on ``backend`` (BackendError otherwise). A Graph on a meta
    backend (Backend.meta) computes scheduled only (ggml's meta backend asserts on a graph that carries
    gradients; the scheduler hands it views of one; an Optimizer is refused there, hotggml.opt says why);
    ``split`` splits its leaves across the devices.
    """

    MAX_INPUTS = 4096  # leaves (inputs, params, loss weights) one graph may hold
    MAX_NODES_LIMIT = 1 << 20

    def __init__(self, backend: Backend, max_nodes: int = 16384, scheduled: bool = False, reserve_only: bool = False):
        """max_nodes: the graph's capacity, forward and backward nodes together (and leafs). build() counts
        the forward before ggml sees it and, with a loss, refuses a forward of more than
        max_nodes / (1 + BACKWARD_GROWTH) nodes: ggml aborts the process when a graph overflows.
        reserve_only: leaves without data, for arena_bytes() only (the class docstring)."""
        for flag, value in (("reserve_only", reserve_only), ("scheduled", scheduled)):
            if not isinstance(value, (bool, np.bool_)):
                raise InputTypeError(f"{flag} must be a bool, got {type(value).__name__}")
        self.reserve_only = bool(reserve_only)
        if not isinstance(max_nodes, (int, np.integer)) or isinstance(max_nodes, bool) or not 16 <= max_nodes <= self.MAX_NODES_LIMIT:
            raise InputError(f"max_nodes must be an int in [16, {self.MAX_NODES_LIMIT}], got {max_nodes!r}")
        max_nodes = int(max_nodes)
        if not isinstance(backend, Backend):
            raise InputTypeError(f"backend must be a hotggml Backend, got {type(backend).__name__}")
        backend.need_open()
        self.lib = load()
        self.backend = backend
        self.max_nodes = max_nodes
        self._native = _Native(self.lib, backend)
        self._finalizer = weakref.finalize(self, self._native.free)  # a Graph never closed is freed when collected
        if scheduled:
            from hotggml.sched import Scheduler

            # ggml asserts nodes + leafs <= the scheduler's hash size; each is bounded by max_nodes
            self._sched = Scheduler(backend, graph_size=2 * max_nodes)
        mem = self.lib.ggml_tensor_overhead() * max_nodes * 3 + self.lib.ggml_graph_overhead_custom(max_nodes, True)
        self._mem = mem
        self.ctx = self._native.ctx = self.lib.ggml_init({"mem_size": mem, "mem_buffer": ffi.NULL, "no_alloc": True})
        self.ctx_in = self._native.ctx_in = self.lib.ggml_init(
            {"mem_size": self.lib.ggml_tensor_overhead() * self.MAX_INPUTS, "mem_buffer": ffi.NULL, "no_alloc": True})
        if self.ctx == ffi.NULL or self.ctx_in == ffi.NULL:
            raise OutOfMemoryError("ggml_init failed")
        self.gf = None
        self._leaves: list[Tensor] = []  # inputs and params, in order
        self._pending: list[tuple[Tensor, np.ndarray]] = []  # their data until build() uploads it
        self.attention_masks: set = set()  # leaves an additive mask is made of (mark_mask): set() checks their values
        self._loss: Tensor | None = None
        self._computed = False
        self._uploaded = False  # the leaves' buffer allocated and their data in it (build(), or its retry)
        self._placed = False
        self._supported = False  # every node of the built graph runs on a backend (checked once: the graph is fixed)
        self._owner: str | None = None  # set by freeze(): who builds and computes this Graph's nodes instead
        self._splits: dict[int, tuple[int, tuple[int, ...], tuple[int, ...]]] = {}  # leaf address -> split (split())

    # -- leaves -------------------------------------------------------------------------
    def new_tensor(self, ne: tuple[int, ...], dtype=np.float32, name: str | None = None, _ctx=None) -> Tensor:
        """An uninitialised tensor of shape ne (ggml order); dtype float32 or float16."""
        if self.ctx is None:
            raise UsageError("this Graph is closed")
        if name is not None and not isinstance(name, str):
            raise InputTypeError(f"name must be a str, got {type(name).__name__}")
        dtype = leaf_dtype(dtype, "new_tensor")
        if dtype not in _GGML_TYPES:
            raise InputTypeError(f"unsupported dtype {dtype}: use float32, float16 or int32")
        if not 1 <= len(ne) <= GGML_MAX_DIMS or any(not isinstance(n, (int, np.integer)) or int(n) < 1 for n in ne):
            raise InputError(f"bad shape {ne}: 1 to 4 positive int dims in ggml order")
        if int(np.prod([int(n) for n in ne], dtype=object)) * dtype.itemsize > MAX_TENSOR_BYTES:
            raise InputError(f"shape {ne} of {dtype} is over {MAX_TENSOR_BYTES} bytes")
        self._room(_ctx or self.ctx)
        ne_c = ffi.new("int64_t[4]", [int(n) for n in ne] + [1] * (GGML_MAX_DIMS - len(ne)))
        ptr = self.lib.ggml_new_tensor(_ctx or self.ctx, _GGML_TYPES[dtype], GGML_MAX_DIMS, ne_c)
        if name:
            self.lib.ggml_set_name(ptr, name.encode()[:63])
        return Tensor(self, ptr)

    def input(self, array: np.ndarray, name: str | None = None, dtype=None) -> Tensor:
        """A leaf holding ``array`` (uploaded at compute time); NumPy shape (.., slowest) -> ggml reversed."""
        if self.ctx is None:
            raise UsageError("this Graph is closed")
        if name is not None and not isinstance(name, str):
            raise InputTypeError(f"input name must be a str, got {type(name).__name__}")
        array = leaf_values(array, f"input {name or ''}")
        # a byte-swapped float32 is float32: converted
        dtype = leaf_dtype(dtype or array.dtype, f"input {name or ''}").newbyteorder("=")
        if dtype not in _GGML_TYPES:
            raise InputTypeError(f"input {name or ''}: unsupported dtype {array.dtype}: use float32, float16 or int32")
        if self.gf is not None:
            raise UsageError("inputs must be created before build()")
        if self._owner is not None:
            raise UsageError(f"this Graph is trained by {self._owner}: its inputs were fixed when it took the Graph")
        if len(self._leaves) >= self.MAX_INPUTS:
            raise InputError(f"a Graph holds at most {self.MAX_INPUTS} inputs")
        data = None if self.reserve_only else leaf_array(array, dtype, f"input {name or ''}")  # before C: refused, nothing made
        t = self.new_tensor(ggml_shape(array.shape), dtype, name, _ctx=self.ctx_in)
        self.lib.ggml_set_input(t.ptr)
        self._leaves.append(t)
        if not self.reserve_only:  # a reserve-only leaf keeps no data: its shape and dtype are all it takes
            self._pending.append((t, data))
        return t

    def cache(self, array: np.ndarray, type_name: str, name: str | None = None) -> Tensor:
        """A K or V leaf stored as ``type_name`` ('f32', 'f16', 'bf16' or 'q8_0', hotggml.kvcache.TYPES): a
        frozen cache the training ops read in that type, taking no gradient. ``array`` holds float values in
        NumPy order (ggml's ne reversed, rows on the last axis: whole 32-value blocks for q8_0), converted by
        ggml's own converters (hotggml.kvcache.encode); ``kvcache.stored(array, type_name)`` is what it then
        holds. Raises InputTypeError / InputError for a type or an array the cache cannot take, UsageError
        after build()."""
        from hotggml import kvcache

        if name is not None and not isinstance(name, str):
            raise InputTypeError(f"cache name must be a str, got {type(name).__name__}")
        array = leaf_values(array, f"cache {name or ''}")
        kvcache.check_type(type_name)
        if array.dtype.kind not in "fiu" or not 1 <= array.ndim <= GGML_MAX_DIMS:
            raise InputTypeError(f"cache {name or ''}: a real array of 1 to 4 axes, got {array.dtype} {array.shape}")
        if 0 in array.shape:  # as input(): ggml takes the product of the dims, and the ops divide by them
            raise InputError(f"cache {name or ''}: every axis needs at least one element, got shape {array.shape}")
        kvcache.check_row(type_name, array.shape[-1], f"cache {name or ''}: a row")
        # before any conversion: a broadcast view of a huge shape costs nothing to pass, its copy everything
        if kvcache.row_bytes(type_name, array.shape[-1]) * int(np.prod(array.shape[:-1], dtype=object)) > MAX_TENSOR_BYTES:
            raise InputError(f"cache of shape {array.shape} is over {MAX_TENSOR_BYTES} bytes")
        if type_name == "f32":  # a float64 beyond float32's range is refused, not made inf
            if not self.reserve_only:
                kvcache.check_held(array, kvcache.encode(array, "f32"), "f32", f"cache {name or ''}")
            return self.input(array.astype(np.float32), name)
        if self.ctx is None:
            raise UsageError("this Graph is closed")
        if self.gf is not None:
            raise UsageError("inputs must be created before build()")
        if self._owner is not None:
            raise UsageError(f"this Graph is trained by {self._owner}: its inputs were fixed when it took the Graph")
        if len(self._leaves) >= self.MAX_INPUTS:
            raise InputError(f"a Graph holds at most {self.MAX_INPUTS} inputs")
        ne = ggml_shape(array.shape)
        ggml_type = getattr(self.lib, f"GGML_TYPE_{type_name.upper()}")
        raw = None if self.reserve_only else kvcache.encode(array, type_name)
        if raw is not None:  # ggml's converters make inf or NaN of what the type cannot hold: refused, as input() does
            kvcache.check_held(array, raw, type_name, f"cache {name or ''}")
        self._room(self.ctx_in)
        ne_c = ffi.new("int64_t[4]", list(ne))
        ptr = self.lib.ggml_new_tensor(self.ctx_in, ggml_type, GGML_MAX_DIMS, ne_c)
        if name:
            self.lib.ggml_set_name(ptr, name.encode()[:63])
        t = Tensor(self, ptr)
        self.lib.ggml_set_input(t.ptr)
        self._leaves.append(t)
        if raw is not None:
            self._pending.append((t, raw.reshape(-1)))
        return t

    def param(self, array: np.ndarray, name: str | None = None) -> Tensor:
        """An f32 input that gets a gradient (ggml_set_param)."""
        t = self.input(array, name, dtype=np.float32)  # input() checks the values, then converts (never the reverse)
        self.lib.ggml_set_param(t.ptr)
        return t

    def split(self, t: Tensor, axis: int, parts: list[int] | None = None) -> None:
        """Split leaf ``t`` (an input, param or cache of this Graph) across the devices of its meta backend along
        ``axis`` (0-2, ggml order: the meta backend copies no data split along axis 3): device j holds
        ``parts[j]`` of its ``ne[axis]`` (default: equal parts). Every other leaf is mirrored (whole on each
        device). Before build(); hotggml.meta says what the meta backend splits at this pin (the training ops
        by heads: q, k, v on axis 2, ``meta.heads_rule``), and build() refuses a graph that a split would make
        ggml abort.

        Raises UsageError off a meta backend or after build(), InputTypeError for a tensor that is not a leaf
        of this Graph, InputError for an axis or parts that do not fit the tensor.
        """
        self._split_state(t, axis, parts, None)

    def _split_state(self, t: Tensor, axis: int, ne: list[int] | None, nr: list[int] | None) -> None:
        """split(), or with ``nr`` the full per-segment state of a packed leaf (ne segment-major, nr per segment:
        meta.packed_forward_split)."""
        from hotggml import meta

        if self.ctx is None:
            raise UsageError("this Graph is closed")
        if not self.backend.is_meta:
            raise UsageError(f"split() needs a Graph on a meta backend (Backend.meta), not {self.backend.device_name}")
        if self.gf is not None or self._owner is not None:
            raise UsageError("split() comes before build(): the leaves are placed when it runs")
        if not isinstance(t, Tensor) or t.graph is not self or not any(t.ptr == leaf.ptr for leaf in self._leaves):
            raise InputTypeError("split() takes an input(), param() or cache() of this Graph")
        if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)) or not 0 <= int(axis) < GGML_MAX_DIMS:
            raise InputError(f"axis must be 0..{GGML_MAX_DIMS - 1} (ggml order), got {axis!r}")
        if int(axis) == GGML_MAX_DIMS - 1:  # ggml-backend-meta.cpp: GGML_ABORT in set_tensor / get_tensor
            raise InputError(f"the meta backend at this pin copies a split leaf's data along axes 0..{GGML_MAX_DIMS - 2} "
                             f"only, not axis {GGML_MAX_DIMS - 1}: split on another axis (a permuted view reorders them)")
        axis, n_dev = int(axis), self.backend.n_devices
        nr = [1] if nr is None else [int(n) for n in nr]
        if ne is None:
            if t.ne[axis] % n_dev:
                raise InputError(f"ne[{axis}] = {t.ne[axis]} of {t.ne} does not split into {n_dev} equal parts: pass parts")
            ne = meta.equal_parts(t.ne[axis], n_dev)
        if not isinstance(ne, (list, tuple, np.ndarray)) or np.ndim(ne) != 1 or not all(isinstance(n, (int, np.integer)) and not isinstance(n, bool) for n in ne):
            raise InputTypeError(f"parts must be ints (extents along axis {axis}), got {ne!r}")
        ne = [int(n) for n in ne]
        if len(ne) != n_dev * len(nr) or any(n < 0 for n in ne) or not 1 <= len(nr) <= meta.MAX_SEGMENTS:
            raise InputError(f"parts must give {n_dev} extents (one per device) per segment, got {ne!r}")
        if sum(n * nr[i // n_dev] for i, n in enumerate(ne)) != t.ne[axis]:
            raise InputError(f"parts {ne!r} do not add up to ne[{axis}] = {t.ne[axis]}")
        blck = 32 if t.type_name == "q8_0" else 1
        if axis == 0 and any(n % blck for n in ne):
            raise InputError(f"a {t.type_name} row splits in whole blocks of {blck}, got {ne!r}")
        if len(nr) > 1 or nr[0] != 1:
            if axis != 0 or any(d != 1 for d in t.ne[1:]):
                raise InputError("a split in segments is of a 1-D tensor along axis 0")
        self._splits[meta.register(t.ptr, axis, ne, nr)] = (axis, tuple(ne), tuple(nr))
        self._native.split_keys.append(meta._key(t.ptr))

    def split_of(self, t: Tensor) -> tuple[int, tuple[int, ...], tuple[int, ...]] | None:
        """(axis, per-device extents, repetitions) of a leaf split by split(), or of a permuted view of one (its
        axis moved as ggml_permute moves it); None for a mirrored leaf; InputError for a tensor computed from a
        split leaf in any other way (the meta backend infers that split: the binding does not)."""
        key = int(ffi.cast("uintptr_t", t.ptr))
        if key in self._splits:
            return self._splits[key]
        nodes, leafs = walk([t.ptr])
        if not any(int(ffi.cast("uintptr_t", p)) in self._splits for p in nodes + leafs):
            return None
        if t.op == self.lib.GGML_OP_PERMUTE and int(ffi.cast("uintptr_t", t.ptr.src[0])) in self._splits:
            axis, ne, nr = self._splits[int(ffi.cast("uintptr_t", t.ptr.src[0]))]
            return int(ffi.cast("int32_t *", t.ptr.op_params)[axis]), ne, nr
        raise InputError(f"{t.op_name} {t.ne} is computed from a split leaf: the binding knows the split of split "
                         "leaves and of permuted views of them only")

    def mark_mask(self, mask: Tensor, what: str) -> None:
        """Record that ``mask`` is an additive attention mask (of op ``what``) and check the values it is made of
        now: it is a leaf, or a view or cont() of one, whose values must be finite or -INF (SPEC section 4: +INF
        or NaN turn the rows, and every gradient of K and V, into NaN without an error); set() and the
        Optimizer's write() check the leaf's later values. Raises InputError naming the first bad entry."""
        leaf = mask.ptr
        while True:  # down the views (view_src) and the copies (CONT, DUP, CPY: src[0]) to what holds the values
            if leaf.view_src != ffi.NULL:
                leaf = leaf.view_src
            elif int(leaf.op) in (self.lib.GGML_OP_CONT, self.lib.GGML_OP_DUP, self.lib.GGML_OP_CPY):
                leaf = leaf.src[0]
            else:
                break
        if int(leaf.type) not in (self.lib.GGML_TYPE_F32, self.lib.GGML_TYPE_F16):  # a bf16 / q8_0 cache's bytes
            raise InputTypeError(f"{what}: an attention mask is made of f16 or f32 values, got a "
                                 f"{ffi.string(self.lib.ggml_type_name(leaf.type)).decode()} leaf")
        for t, values in self._pending:
            if t.ptr == leaf:  # a cache("f16") leaf keeps its bytes
                check_attention_mask_values(values.view(np.float16) if values.dtype == np.uint8 else values, what)
        self.attention_masks.add(leaf)

    def set(self, t: Tensor, array: np.ndarray) -> None:
        """New data for an input or param leaf ``t`` of this Graph, before or after build(): the next compute()
        uses it (a training loop's next batch; a graph test's next input). ``array`` has t's shape in NumPy
        order (ggml's ``ne`` reversed); its values are converted to t's dtype (float32, float16 or int32), an
        int32 leaf taking integer values only. Until the next compute(), read() and grad() raise (the computed
        values are the old data's).

        Raises InputTypeError for a tensor that is not one of this Graph's leaves or an array of a kind the
        leaf cannot hold, InputError for a shape or values the leaf cannot take, UsageError on a closed Graph
        or one an Optimizer took (its step takes the data).
        """
        if self.ctx is None:
            raise UsageError("this Graph is closed")
        if self._owner is not None:
            raise UsageError(f"this Graph is trained by {self._owner}: pass the data to its step")
        self._need_data("set()")
        if not isinstance(t, Tensor) or t.graph is not self or not any(t.ptr == leaf.ptr for leaf in self._leaves):
            raise InputTypeError("set() takes an input() or param() of this Graph"
                                 + ("" if isinstance(t, Tensor) else f", got a {type(t).__name__}"))
        array = leaf_values(array, "set()")
        if ggml_shape(array.shape) != t.ne:
            shape = tuple(reversed(t.ne))
            while len(shape) > 1 and shape[0] == 1:  # a leaf keeps no rank: its shape without the leading 1s
                shape = shape[1:]
            raise InputError(f"set(): the leaf holds {shape} (NumPy order), got {array.shape}")
        if t.type_name in ("bf16", "q8_0"):  # a cache (Graph.cache): stored by ggml's converters again
            from hotggml import kvcache

            if array.dtype.kind not in "fiu":
                raise InputTypeError(f"set(): a {t.type_name} cache takes real values, got {array.dtype}")
            raw = kvcache.encode(array, t.type_name)
            kvcache.check_held(array, raw, t.type_name, "set()")
            self._set_bytes(t, raw.reshape(-1))
            return
        data = leaf_array(array, t.dtype, "set()")
        if t.ptr in self.attention_masks:
            check_attention_mask_values(data, "set()")
        self._set_bytes(t, data)

    def _set_bytes(self, t: Tensor, data: np.ndarray) -> None:
        """Leaf t's new contents (data: its bytes in t's type, a private copy): uploaded with the other inputs
        before build(), at once after it."""
        if any(leaf.ptr == t.ptr for leaf, _ in self._pending):  # before build(): uploaded with the others
            self._pending = [(leaf, data if leaf.ptr == t.ptr else arr) for leaf, arr in self._pending]
        else:
            self.backend.need_open()
            # the lock: an RPC backend's commands share one connection with a compute in another thread
            with self.backend.lock, interrupts_deferred():  # a meta device asks the split callback (interrupts_deferred)
                self.lib.ggml_backend_tensor_set(t.ptr, ffi.from_buffer(data), 0, data.nbytes)
        self._computed = False

    # -- generic ops used by the exact chain and losses -----------------------------------
    def _wrap(self, ptr) -> Tensor:
        return Tensor(self, ptr)

    def wrap(self, ptr) -> Tensor:
        """Adopt a tensor made by a raw call of the generated API in this graph's context (``g.ctx``), e.g.
        ``g.wrap(g.lib.ggml_soft_max_ext_back(g.ctx, dy.ptr, y.ptr, 1.0, 0.0))``. The raw call itself is
        unchecked: ggml's own asserts apply there (hotggml.errors cover only the binding's methods).
        Raises InputError for a NULL pointer, InputTypeError for anything but a tensor pointer."""
        self.own()
        if not isinstance(ptr, ffi.CData) or ffi.typeof(ptr) is not ffi.typeof("struct ggml_tensor *"):
            raise InputTypeError(f"wrap needs a struct ggml_tensor * from a ggml call, got {ptr!r}")
        if ptr == ffi.NULL:
            raise InputError("wrap got NULL: the ggml call failed")
        return Tensor(self, ptr)

    def own(self, *tensors, room: bool = True) -> None:
        """Raise InputTypeError unless every argument is a Tensor of this (open) Graph, and (room) InputError
        when the context has no room left for the tensors one more call creates (room=False: a call that
        creates none, e.g. a read).

        A tensor of another graph lives in another context and buffer: ggml would read memory
        this graph never allocated (garbage), or freed memory. Every op method calls this before C.
        """
        if self.ctx is None:
            raise UsageError("this Graph is closed")
        for t in tensors:
            if not isinstance(t, Tensor):
                raise InputTypeError(f"expected a hotggml Tensor, got {type(t).__name__}")
            if t.graph is not self:
                raise InputTypeError("tensor belongs to another Graph")
        if room:
            self._room(self.ctx)

    def _room(self, ctx) -> None:
        """InputError unless ctx can hold TENSORS_PER_CALL more tensor objects (ggml aborts when it cannot)."""
        need = self.lib.ggml_tensor_overhead() * TENSORS_PER_CALL
        size = self._mem if ctx == self.ctx else self.lib.ggml_tensor_overhead() * self.MAX_INPUTS
        if self.lib.ggml_used_mem(ctx) + need > size:
            if ctx != self.ctx:  # the leaves' own context, of a fixed size
                raise InputError(f"this Graph's leaves fill their context ({len(self._leaves)} inputs, params and "
                                 f"caches; room for {self.MAX_INPUTS - TENSORS_PER_CALL}): pack them into fewer, "
                                 "larger tensors")
            raise InputError(f"this Graph's context is full ({self.lib.ggml_used_mem(ctx)} of {size} bytes of tensor "
                             f"objects): make the Graph with a larger max_nodes (now {self.max_nodes})")

    def permute(self, t: Tensor, *axes: int) -> Tensor:
        """ggml_permute: axes[i] is where source dim i goes."""
        self.own(t)
        if any(isinstance(a, bool) or not isinstance(a, (int, np.integer)) for a in axes) or sorted(axes) != [0, 1, 2, 3]:
            raise InputError(f"permute needs a permutation of 0..3 (ints), got {axes}")
        axes = tuple(int(a) for a in axes)
        if _blocked(t) and axes[0] != 0:
            raise InputError(f"permute {axes}: a {t.type_name} tensor's rows are blocks of {_blocked(t)} values, so axis 0 stays")
        return self._wrap(self.lib.ggml_permute(self.ctx, t.ptr, *axes))

    def reshape(self, t: Tensor, ne: tuple[int, int, int, int]) -> Tensor:
        """ggml_reshape_4d of a contiguous t to ne: four positive ints in ggml order, t's element count.
        Raises InputError for anything else (a negative or zero dim included: ggml would take its product)."""
        self.own(t)
        if not isinstance(ne, (tuple, list)) or len(ne) != GGML_MAX_DIMS or any(
                isinstance(n, bool) or not isinstance(n, (int, np.integer)) or int(n) < 1 for n in ne):
            raise InputError(f"reshape takes {GGML_MAX_DIMS} positive int dims in ggml order, got {ne!r}")
        if not t.is_contiguous():
            raise InputError("reshape needs a contiguous tensor: cont() it first")
        if _blocked(t) and int(ne[0]) % _blocked(t):
            raise InputError(f"reshape to {tuple(ne)}: a {t.type_name} row is whole blocks of {_blocked(t)} values")
        if int(np.prod([int(n) for n in ne], dtype=object)) != int(np.prod(t.ne, dtype=object)):
            raise InputError(f"reshape {t.ne} -> {tuple(ne)} changes the element count")
        return self._wrap(self.lib.ggml_reshape_4d(self.ctx, t.ptr, *(int(n) for n in ne)))

    def cont(self, t: Tensor) -> Tensor:
        self.own(t)
        return self._wrap(self.lib.ggml_cont(self.ctx, t.ptr))

    def repeat(self, t: Tensor, like: Tensor) -> Tensor:
        self.own(t, like)
        if any(b % a for a, b in zip(t.ne, like.ne)):
            raise InputError(f"repeat {t.ne} -> {like.ne}: target dims must be multiples")
        if _blocked(t):
            raise InputTypeError(f"repeat copies whole values (f32, f16, bf16, i32), not {t.type_name} blocks")
        check_rows("repeat", "t", t)
        return self._wrap(self.lib.ggml_repeat(self.ctx, t.ptr, like.ptr))

    def mul_mat(self, a: Tensor, b: Tensor) -> Tensor:
        """ggml_mul_mat(a, b) = b a^T per matrix: [K, M] x [K, N] -> [M, N]; a f32 or f16, b f32 (OP_TYPES)."""
        self.own(a, b)
        check_op_types("mul_mat", a, b)
        if a.ne[0] != b.ne[0] or b.ne[2] % a.ne[2] or b.ne[3] % a.ne[3]:
            raise InputError(f"mul_mat shapes {a.ne} x {b.ne} do not fit")
        check_rows("mul_mat", "a", a)
        check_rows("mul_mat", "b", b)
        return self._wrap(self.lib.ggml_mul_mat(self.ctx, a.ptr, b.ptr))

    def soft_max_ext(self, a: Tensor, mask: Tensor | None, scale: float) -> Tensor:
        """ggml_soft_max_ext(a, mask, scale, 0): softmax over ne0 of a*scale + mask; a contiguous, the mask f16
        or f32, contiguous, [ne0 = a's, ne1 >= a's, dims 2-3 dividing a's]."""
        self.own(a, *([mask] if mask is not None else []))
        check_op_types("soft_max_ext", a)
        if not a.is_contiguous():
            raise InputError("soft_max_ext needs a contiguous a: cont() it first")
        scale = check_scale("soft_max_ext", scale)
        if mask is not None:
            if mask.type_name not in ("f16", "f32"):
                raise InputTypeError(f"soft_max_ext mask must be f16 or f32, got {mask.type_name}")
            if not mask.is_contiguous():
                raise InputError("soft_max_ext mask must be contiguous")
            if mask.ne[0] != a.ne[0] or mask.ne[1] < a.ne[1] or a.ne[2] % mask.ne[2] or a.ne[3] % mask.ne[3]:
                raise InputError(f"soft_max_ext mask {mask.ne} does not fit a {a.ne}")
            self.mark_mask(mask, "soft_max_ext mask")
        return self._wrap(self.lib.ggml_soft_max_ext(self.ctx, a.ptr, mask.ptr if mask else ffi.NULL, float(scale), 0.0))

    def mul(self, a: Tensor, b: Tensor) -> Tensor:
        """Elementwise a * b of one shape; operand types as OP_TYPES lists (the result has a's)."""
        self.own(a, b)
        check_op_types("mul", a, b)
        check_rows("mul", "a", a)
        if a.ne != b.ne:
            raise InputError(f"mul shapes differ: {a.ne} vs {b.ne}")
        return self._wrap(self.lib.ggml_mul(self.ctx, a.ptr, b.ptr))

    def add(self, a: Tensor, b: Tensor) -> Tensor:
        """Elementwise a + b of one shape; operand types as OP_TYPES lists (the result has a's)."""
        self.own(a, b)
        check_op_types("add", a, b)
        check_rows("add", "a", a)
        if a.ne != b.ne:
            raise InputError(f"add shapes differ: {a.ne} vs {b.ne}")
        return self._wrap(self.lib.ggml_add(self.ctx, a.ptr, b.ptr))

    def sum(self, a: Tensor) -> Tensor:
        """The sum of every element of a (f32 or f16) as a one-element tensor of a's type."""
        self.own(a)
        check_op_types("sum", a)
        if a.ne[0] > 1:  # a column's sum reads no second element along a row
            check_rows("sum", "a", a)
        return self._wrap(self.lib.ggml_sum(self.ctx, a.ptr))

    def dot_loss(self, outputs: list[tuple[Tensor, np.ndarray]]) -> Tensor:
        """Scalar loss L = sum_i sum(t_i * w_i) with constant w_i, so dL/dt_i = w_i (seeded loss gradients)."""
        if not isinstance(outputs, (list, tuple)) or not outputs:
            raise InputError("dot_loss needs a non-empty list of (tensor, weight) pairs")
        if any(not isinstance(pair, (list, tuple)) or len(pair) != 2 for pair in outputs):
            raise InputTypeError("dot_loss takes (tensor, weight) pairs")
        self.own(*(t for t, _ in outputs))
        loss = None
        for t, w in outputs:
            w = np.asarray(w)
            # the distinct values only (a broadcast weight, as `memory` passes for a million queries, stays a view)
            core = w[tuple(slice(0, 1) if stride == 0 else slice(None) for stride in w.strides)]
            if w.dtype.kind not in "fiu" or (core.size and not np.abs(core.astype(np.float64)).max() <= np.finfo(np.float32).max):
                raise InputError("loss weights must be real values finite as float32")
            w = np.asarray(w, dtype=np.float32)
            if ggml_shape(w.shape) != t.ne:
                raise InputError(f"loss weight shape {w.shape} does not match tensor {t.ne}")
            term = self.sum(self.mul(self.cont(t) if not t.is_contiguous() else t, self.input(w, "loss weight")))
            loss = term if loss is None else self.add(loss, term)
        return loss

    # -- graph ----------------------------------------------------------------------------
    def build(self, outputs: list[Tensor], loss: Tensor | None = None) -> None:
        """Forward graph of outputs (+ loss); with a loss, ggml_build_backward_expand adds the gradients."""
        if self.ctx is None:
            raise UsageError("this Graph is closed")
        if self.gf is not None:
            raise UsageError("build() was already called on this Graph")
        self.backend.need_open()  # before the graph exists: a refused build() leaves the Graph unbuilt
        if self._owner is not None:
            raise UsageError(f"this Graph is trained by {self._owner}, which builds its graphs: use its methods")
        if isinstance(outputs, Tensor) or not isinstance(outputs, (list, tuple)):
            raise InputTypeError(f"build() takes a list of output tensors, got {type(outputs).__name__}")
        self.own(*outputs, *([loss] if loss is not None else []))
        if loss is not None:  # checked before anything is built: a refused build() leaves the Graph buildable
            if loss.ne != (1, 1, 1, 1) or loss.dtype != np.float32:
                raise InputError(f"loss must be an f32 scalar, got {loss.dtype} {loss.ne}")
            # ggml_build_backward_expand asserts (and kills the interpreter) when no node of the graph is a
            # parameter, when the loss is a leaf, and where autodiff meets what it cannot differentiate
            if int(loss.ptr.op) == 0 and not int(loss.ptr.flags) & FLAG_PARAM:
                raise InputError("the loss must be computed from the graph (an op's result), not an input")
            # (the loss's: one only an output depends on gets no gradient, and the loss none to seed)
            nodes, _ = walk([loss.ptr])
            if not any(int(n.flags) & FLAG_PARAM for n in nodes):
                raise InputError("build() with a loss needs a param() that the loss depends on: declare the "
                                 "leaves that need gradients with Graph.param")
            from hotggml import autodiff  # it imports this module

            autodiff.check([loss.ptr])
        roots = [*outputs, *([loss] if loss is not None else [])]
        if self._splits:  # before anything is built: a split ggml-backend-meta.cpp cannot follow aborts the process
            from hotggml import meta

            meta.check_graph(topological([t.ptr for t in roots]), lambda ptr: int(ffi.cast("uintptr_t", ptr)) in self._splits)
        n_nodes, n_leafs = self._count_forward(roots)
        room = self.max_nodes // (1 + BACKWARD_GROWTH) if loss is not None else self.max_nodes
        if n_nodes > room or n_leafs > self.max_nodes:
            need = n_nodes * (1 + BACKWARD_GROWTH if loss is not None else 1)
            raise InputError(f"the graph has {n_nodes} nodes and {n_leafs} leafs; max_nodes = {self.max_nodes} holds "
                             f"{room} forward nodes{' with their backward' if loss is not None else ''}: make the "
                             f"Graph with max_nodes >= {max(need, n_leafs)}")
        # the graph object and autodiff's new tensors come from the context the op calls filled (tensors never
        # built take room too): ggml aborts where they do not fit
        need = self.lib.ggml_graph_overhead_custom(self.max_nodes, True) + (
            self.lib.ggml_tensor_overhead() * n_nodes * BACKWARD_GROWTH if loss is not None else 0)
        if self.lib.ggml_used_mem(self.ctx) + need > self._mem:
            raise InputError(f"this Graph's context has no room left for the graph ({self.lib.ggml_used_mem(self.ctx)} "
                             f"of {self._mem} bytes taken by tensor objects, most of them not in the graph): make the "
                             f"Graph with a larger max_nodes (now {self.max_nodes})")
        self.gf = self.lib.ggml_new_graph_custom(self.ctx, self.max_nodes, True)
        for t in outputs:
            self.lib.ggml_set_output(t.ptr if t.ptr.view_src == ffi.NULL else t.ptr.view_src)
            self.lib.ggml_set_output(t.ptr)
            self.lib.ggml_build_forward_expand(self.gf, t.ptr)
        if loss is not None:
            self.lib.ggml_set_loss(loss.ptr)
            self.lib.ggml_set_output(loss.ptr)
            self.lib.ggml_build_forward_expand(self.gf, loss.ptr)
            self.lib.ggml_build_backward_expand(self.ctx, self.gf, ffi.NULL)
            # dL/dL is set before compute: an output, so the allocator never gives its memory to a later node
            # (a node poisoned or written there before that node runs would overwrite the seed)
            self.lib.ggml_set_output(self.lib.ggml_graph_get_grad(self.gf, loss.ptr))
            self._loss = loss
            for t in self._leaves:
                g = self.lib.ggml_graph_get_grad(self.gf, t.ptr)
                if g != ffi.NULL:
                    self.lib.ggml_set_output(g)
                    self.lib.ggml_build_forward_expand(self.gf, g)
        self._upload_leaves()

    def freeze(self, owner: str) -> None:
        """Allocate and upload the inputs and params now, for a caller that builds and computes its own graphs
        from this Graph's nodes (hotggml.opt.Optimizer, named by ``owner``): afterwards ``input``, ``param``,
        ``build`` and ``compute`` raise UsageError naming it. Raises UsageError on a built or closed Graph."""
        if self.ctx is None:
            raise UsageError("this Graph is closed")
        if self.gf is not None or self._owner is not None:
            raise UsageError("freeze() needs a Graph that is neither built nor frozen")
        self._need_data("freeze()")
        self._upload_leaves()
        self._owner = owner

    def _need_data(self, what: str) -> None:
        if self.reserve_only:
            raise UsageError(f"{what} on a reserve_only Graph: its leaves hold no data (it is for arena_bytes())")

    def _upload_leaves(self) -> None:
        # the lock: an RPC endpoint's Backends send their commands (this allocation, these uploads) over one connection
        with self.backend.lock, interrupts_deferred():  # a meta device asks the split callback of every leaf it allocates
            self._upload_leaves_now()

    def _upload_leaves_now(self) -> None:
        # inputs get their own buffer now, so the arena measures the graph's compute memory only
        self.backend.need_open()
        if self.reserve_only:
            # a zero-byte buffer of the backend (ggml's dummy buffer): the allocator takes a leaf on a buffer for
            # one placed elsewhere, as it takes the uploaded leaves below, and measures the same arena
            buf = self.lib.ggml_backend_alloc_buffer(self.backend._ptr, 0)
            if buf == ffi.NULL:
                raise OutOfMemoryError("a zero-byte buffer could not be made on " + self.backend.device_name)
            self._in_buf = ffi.gc(buf, self.lib.ggml_backend_buffer_free)
            for t in self._leaves:
                t.ptr.buffer = buf
            self._uploaded = True
            return
        buf = self.lib.ggml_backend_alloc_ctx_tensors(self.ctx_in, self.backend._ptr)
        if buf == ffi.NULL and self._leaves:
            # ggml frees the buffers it made before one failed, and leaves its tensors' addresses in them (its
            # next try skips a tensor with an address): those leaves are unplaced again, for the retry
            for t in self._leaves:
                t.ptr.data, t.ptr.buffer = ffi.NULL, ffi.NULL
            raise self.backend.alloc_error("input buffer allocation failed on " + self.backend.device_name)
        self._in_buf = ffi.gc(buf, self.lib.ggml_backend_buffer_free) if buf != ffi.NULL else None
        # uploaded once, now: the inputs' buffer is theirs alone (the graph's allocator never reuses it), so
        # the NumPy copies are dropped instead of held beside it for the Graph's life
        for t, arr in self._pending:
            self.lib.ggml_backend_tensor_set(t.ptr, ffi.from_buffer(arr), 0, arr.nbytes)
        self._pending = []
        self._uploaded = True

    def _need_uploaded(self) -> None:
        """Upload the leaves now if build() could not (OutOfMemoryError there leaves a built Graph whose leaves
        have no memory: computing it would read none; set() meanwhile changes the data waiting to go)."""
        if not self._uploaded:
            self._upload_leaves()

    def _count_forward(self, roots: list[Tensor]) -> tuple[int, int]:
        """The nodes and leafs ggml_build_forward_expand would put in a graph for roots, counted in Python."""
        nodes, leafs = walk([t.ptr for t in roots])
        return len(nodes), len(leafs)

    def find_nodes(self, op: int) -> list[Tensor]:
        """Graph nodes whose op is ``op`` (an enum ggml_op value: hotggml.ops.op_id("MUL_MAT")). Raises
        InputTypeError for anything else (a name matched nothing without a word)."""
        if isinstance(op, bool) or not isinstance(op, (int, np.integer)):
            raise InputTypeError(f"find_nodes takes an enum ggml_op value (hotggml.ops.op_id(name)), got {type(op).__name__}")
        return [t for t in self.nodes() if t.op == op]

    def nodes(self) -> list[Tensor]:
        self._need_graph()
        return [Tensor(self, self.lib.ggml_graph_node(self.gf, i)) for i in range(self.lib.ggml_graph_n_nodes(self.gf))]

    def _need_graph(self) -> None:
        if self.ctx is None:
            raise UsageError("this Graph is closed")
        if self._owner is not None:
            raise UsageError(f"this Graph is trained by {self._owner}, which computes it: use its methods")
        if self.gf is None:
            raise UsageError("call build() first")

    def _new_allocator(self):
        self.backend.need_open()
        buft = self.lib.ggml_backend_get_default_buffer_type(self.backend._ptr)
        return ffi.gc(self.lib.ggml_gallocr_new(buft), self.lib.ggml_gallocr_free)

    def arena_bytes(self) -> int:
        """Bytes the graph allocator needs for this graph on the backend (measured, nothing allocated).
        Raises OutOfMemoryError when the leaves' buffer, which build() could not allocate, still cannot be (the
        leaves would be measured as part of the arena)."""
        self._need_graph()
        self._need_uploaded()
        sizes = ffi.new("size_t[1]")
        # a throw-away allocator: one that measured without allocating cannot allocate afterwards
        self.lib.ggml_gallocr_reserve_n_size(self._new_allocator(), self.gf, ffi.NULL, ffi.NULL, sizes)
        return int(sizes[0])

    def unsupported_nodes(self) -> list[str]:
        """Nodes the backend's supports_op refuses ('' list when all run there); for a scheduled Graph, the nodes
        that none of the scheduler's backends supports (ggml's scheduler asserts on one, killing the process)."""
        backends = self._sched.backends if self._sched is not None else [self.backend]
        return [f"{t.op_name} {t.ne}" for t in self.nodes() if not any(b.supports_op(t) for b in backends)]

    def _check_supported(self) -> None:
        if self._supported:
            return
        refused = self.unsupported_nodes()
        self._supported = not refused
        if refused:
            names = self.backend.device_name if self._sched is None else " or ".join(b.device_name for b in self._sched.backends)
            raise BackendError(f"{names} does not support: {', '.join(refused[:5])}")

    # -- scheduler (scheduled=True) ----------------------------------------------------------
    def _need_sched(self):
        if self._sched is None:
            raise UsageError("this Graph was not made with scheduled=True")
        return self._sched

    def assign(self, t: Tensor, device_name: str) -> None:
        """Pin node ``t`` to the scheduler's backend ``device_name`` ('CPU' or the Graph's backend; on a meta
        backend, the meta device only).

        Raises RuntimeError for an unscheduled Graph, ValueError for a backend the scheduler lacks or, on a meta
        backend, for any other device.
        """
        self.own(t, room=False)
        if not isinstance(device_name, str):
            raise InputTypeError(f"device_name must be a str (a registry name such as 'CPU'), got {type(device_name).__name__}")
        sched = self._need_sched()
        if self.backend.is_meta and device_name.upper() != self.backend.device_name.upper():
            # the meta buffer's tensors have no memory of their own: a CPU kernel would read through their
            # placeholder addresses (SIGSEGV); the meta device runs each node on its devices' parts itself
            raise InputError(f"on the meta backend {self.backend.device_name} every node runs on the meta device, "
                             f"whose tensors {device_name} cannot read: assign() to {self.backend.device_name} only")
        sched.assign(t.ptr, device_name)

    def plan(self) -> None:
        """Place and split the built graph without allocating (placement() then answers): a probe."""
        self._need_graph()
        sched = self._need_sched()
        self.backend.need_open()  # the scheduler holds the Backend's C object: freed once it is closed
        self._check_supported()
        self._need_uploaded()
        with interrupts_deferred():  # a meta device asks the split callback (interrupts_deferred says why)
            sched.split(self.gf)
        self._placed = True

    def placement(self) -> list[tuple[Tensor, str]]:
        """(node, registry device name) for every graph node, as the scheduler placed it.

        Valid after ``plan()`` or ``compute()``; raises RuntimeError before either.
        """
        sched = self._need_sched()
        self.backend.need_open()  # device_of asks the Backend's freed C object once it is closed
        if not self._placed:
            raise UsageError("call plan() or compute() before placement()")
        return [(t, sched.device_of(t.ptr) or "unplaced") for t in self.nodes()]

    @property
    def n_splits(self) -> int:
        """Splits ggml made of the graph (1 when every node runs on one backend)."""
        if not self._placed:
            raise UsageError("call plan() or compute() before n_splits")
        return self._need_sched().n_splits

    def _allocate(self) -> None:
        self._check_supported()
        self._need_uploaded()
        if self._sched is not None:
            if not self._sched.alloc(self.gf):
                raise lost_among(self._sched.backends, "the graph's allocation") or OutOfMemoryError(
                    "graph allocation failed in the scheduler over " + ", ".join(b.device_name for b in self._sched.backends))
            self._placed = True
            return
        if self._galloc is None:
            self._galloc = self._new_allocator()
        if not self.lib.ggml_gallocr_alloc_graph(self._galloc, self.gf):
            raise self.backend.alloc_error("graph allocation failed on " + self.backend.device_name)

    def _run(self) -> int:
        if self._sched is not None:
            return self._sched.compute(self.gf)
        status = self.lib.ggml_backend_graph_compute(self.backend._ptr, self.gf)
        self.lib.ggml_backend_synchronize(self.backend._ptr)
        return int(status)

    def compute(self, poison: list[Tensor] = ()) -> float:
        """Allocate, upload inputs, seed dL/dL = 1, compute (on the backend, or through the scheduler).

        ``poison``: computed tensors (not inputs or params: their values are the caller's) filled with NaN
        (0xFF bytes) before compute, so that anything the kernel leaves unwritten shows up. Unscheduled, raises BackendError if a node is not
        supported by the backend (ggml would otherwise abort). On an RPC backend, raises ConnectionLostError
        when the server did not compute the graph (killed, network lost: ggml-rpc reports it, patch
        rpc-lost-server). Returns the seconds the compute took.
        """
        with self.backend.lock, interrupts_deferred():  # one graph at a time on a backend (Backend's docstring)
            self._prepare_run(poison)
            t0 = time.perf_counter()
            status = self._run()
            seconds = time.perf_counter() - t0
            self._computed = status == 0  # before a deferred interrupt is raised: the compute did complete
        if status != 0 and self.backend.endpoint is not None:
            raise ConnectionLostError(
                f"graph compute failed on {self.backend.device_name}: the RPC server at {self.backend.endpoint} did not "
                f"compute the graph (status {status}: it died, closed the connection or refused the graph); the buffers "
                "on it are lost: close this Graph and its Backend, and open new ones once a server listens there")
        if status != 0:
            raise BackendError(f"graph compute failed on {self.backend.device_name} (status {status})")
        return seconds

    def profile(self) -> list[tuple[Tensor, float]]:
        """Compute once through the scheduler, node by node: (node, seconds) in graph order.

        For attributing time to kernels (hotggml.sched.Scheduler.time_nodes says what a node's time
        includes); the values are the graph's real results. Raises RuntimeError unless scheduled=True.
        """
        sched = self._need_sched()
        with self.backend.lock, interrupts_deferred():
            self._prepare_run(())
            try:
                timed = sched.time_nodes(self.gf)
            except BackendError as exc:
                raise lost_among(sched.backends, "profile()") or BackendError(f"{exc} on {self.backend.device_name}") from None
            self._computed = True
        return [(Tensor(self, ptr), secs) for ptr, secs in timed]

    def _prepare_run(self, poison) -> None:
        """Allocate, upload the inputs, seed dL/dL = 1 and poison the given tensors. The computed values are
        stale from here until a compute completes (a failed or interrupted one leaves them half-written)."""
        self._need_graph()
        self._need_data("compute()")
        self.backend.need_open()  # a closed Backend's C object is freed: computing on it would crash
        if self.backend.is_meta and self._sched is None:
            raise UsageError(f"a Graph on {self.backend.device_name} computes through the scheduler: make it with "
                             "Graph(backend, scheduled=True) (ggml's meta backend asserts on a graph with gradients)")
        if isinstance(poison, Tensor) or not isinstance(poison, (list, tuple)):
            raise InputTypeError(f"poison must be a list of this Graph's tensors, got {type(poison).__name__}")
        for t in poison:
            if not isinstance(t, Tensor) or t.graph is not self:
                raise InputTypeError("poison must be a list of this Graph's tensors"
                                     + ("" if isinstance(t, Tensor) else f", got a {type(t).__name__}"))
        self._allocate()
        self._computed = False
        for t in poison:
            root = t.ptr.view_src if t.ptr.view_src != ffi.NULL else t.ptr
            if int(root.flags) & (FLAG_INPUT | FLAG_PARAM):  # uploaded once at build: the NaN would stay for good
                raise InputError(f"cannot poison {t.op_name} {t.ne}: it is (a view of) an input or parameter, whose "
                                 "values are the caller's; poison takes nodes the graph computes")
            if root.buffer == ffi.NULL or t.ptr.data == ffi.NULL:
                raise InputError(f"cannot poison {t.op_name} {t.ne}: it is not in the built graph (no memory)")
        for t in poison:  # before the seed: whatever the poisoned tensors share memory with, the seed survives
            if self.backend.is_meta and t.ptr.view_src != ffi.NULL:
                t = Tensor(self, t.ptr.view_src)  # a meta buffer sets whole tensors of its own: the view's computed root
            # (an RPC buffer's memset is a SET_TENSOR: patch rpc-memset-tensor; a meta buffer's each part's)
            self.lib.ggml_backend_tensor_memset(t.ptr, 0xFF, 0, self.lib.ggml_nbytes(t.ptr))
        if self._loss is not None:
            g = self.lib.ggml_graph_get_grad(self.gf, self._loss.ptr)
            one = np.ones(1, dtype=np.float32)
            self.lib.ggml_backend_tensor_set(g, ffi.from_buffer(one), 0, 4)

    def read(self, t: Tensor) -> np.ndarray:
        """The tensor's values as a NumPy array in its LOGICAL shape (strided views are honoured).

        Only inputs, parameters, build() outputs and gradients (or views of them) are readable: the
        allocator reuses every other node's memory once its consumers ran. Raises RuntimeError before
        compute() (nothing is allocated yet) or after close(), TypeError for a tensor of another Graph,
        ValueError for a tensor whose memory is not kept, ConnectionLostError on an RPC backend whose server
        is gone (ggml-rpc would give NaN bytes).
        """
        self._need_graph()
        self.own(t, room=False)
        self._need_data("read()")
        if not self._computed:
            raise UsageError("call compute() before reading tensors")
        keeps = FLAG_INPUT | FLAG_OUTPUT | FLAG_PARAM
        if not (int(t.ptr.flags) & keeps or (t.ptr.view_src != ffi.NULL and int(t.ptr.view_src.flags) & keeps)):
            # the allocator reuses a node's memory once its consumers ran: its bytes are someone else's now
            raise InputError(f"{t.op_name} {t.ne} is not an input, a parameter, an output or a gradient of this "
                             "graph: its memory was reused; pass it to build() as an output to read it")
        if t.ptr.buffer == ffi.NULL and (t.ptr.view_src == ffi.NULL or t.ptr.view_src.buffer == ffi.NULL):
            raise InputError("tensor is not part of the computed graph (no buffer): build() it as an output")
        ne, nb = t.ne, t.nb
        itemsize = np.dtype(t.dtype).itemsize
        span = itemsize + sum((n - 1) * s for n, s in zip(ne, nb))
        if self.backend.is_meta and t.ptr.view_src != ffi.NULL:
            # a meta buffer reads whole tensors of its own (ggml asserts on a view, placed or not, and on a range
            # of a split one): the view's bytes are its root's at view_offs
            src, offs, size = t.ptr.view_src, 0, int(self.lib.ggml_nbytes(t.ptr.view_src))
            start = int(t.ptr.view_offs)
        else:
            # a view the allocator never placed (made outside the built graph) has no data of its own: ggml aborts
            # on it; its bytes are its source's at view_offs
            src, offs = (t.ptr, 0) if t.ptr.data != ffi.NULL else (t.ptr.view_src, int(t.ptr.view_offs))
            size, start = span, 0
        raw = np.empty(size, dtype=np.uint8)
        with self.backend.lock:  # an RPC backend's commands share one connection with a compute in another thread
            self.lib.ggml_backend_tensor_get(src, ffi.from_buffer(raw), offs, size)
            # a failed get gives 0xFF bytes (rpc-lost-server): then the server is asked whether it is gone
            if self.backend.endpoint is not None and size and raw.min() == 0xFF and self.backend.lost():
                raise self.backend.connection_lost("read()")
        raw = raw[start:start + span]
        view = np.lib.stride_tricks.as_strided(raw.view(t.dtype) if span % itemsize == 0 else raw[: span - span % itemsize].view(t.dtype),
                                               shape=tuple(reversed(ne)), strides=tuple(reversed(nb)))
        return np.array(view, copy=True)

    def grad(self, t: Tensor) -> np.ndarray | None:
        """dL/dt of a param() leaf in t's logical shape, or None if t got no gradient (it does not reach the loss).

        Raises InputError for a computed node whose gradient build() did not keep, UsageError when build() was given no loss (there are no gradients at all), before build()
        or compute(), or after close(); InputTypeError for a tensor of another Graph."""
        self._need_graph()
        self.own(t, room=False)
        if self._loss is None:
            raise UsageError("this Graph was built without a loss: build(outputs, loss) to get gradients")
        g = self.lib.ggml_graph_get_grad(self.gf, t.ptr)
        if g == ffi.NULL:
            return None
        if not int(g.flags) & FLAG_OUTPUT:  # build() keeps the params' gradients only
            raise InputError(f"the gradient of {t.op_name} {t.ne} is not kept (the allocator reuses its memory; "
                             "autodiff may also keep it in another shape, e.g. dO alone for a flash_attn_train "
                             "result): grad() reads the gradients of param() leaves")
        return self.read(Tensor(self, g))

    # what the Graph owns in C lives in self._native (see _Native), so that the collector can free it
    _sched = property(lambda self: self._native.sched, lambda self, v: setattr(self._native, "sched", v))
    _galloc = property(lambda self: self._native.galloc, lambda self, v: setattr(self._native, "galloc", v))
    _in_buf = property(lambda self: self._native.in_buf, lambda self, v: setattr(self._native, "in_buf", v))

    def close(self) -> None:
        """Free the graph's contexts, buffers and scheduler (once); its tensors refuse any use afterwards.
        Waits for a compute on its Backend in another thread to end (Backend.lock)."""
        with self.backend.lock:
            self._finalizer()
            self.ctx = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
