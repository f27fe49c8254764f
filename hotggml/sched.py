"""ggml_backend_sched for the binding's graphs: the requested backend first, the CPU as fallback.

A trainer does not call one backend's ``graph_compute``: it hands the graph to ggml's scheduler,
which places every node on the first backend (in priority order) that supports it, splits the
graph where consecutive nodes change backend and copies the tensors that cross a split. A node
the device refuses then runs on the CPU without any error, so a device result is claimed only
after asking the scheduler where each node ran (``placement``).

The scheduler's backends are ``[backend, CPU]`` (ggml requires the CPU last), or ``[CPU]`` when
the requested backend is the CPU. The fallback CPU backend is opened and owned here.
"""

from __future__ import annotations

from hotggml.errors import BackendError, InputError, InputTypeError
from hotggml.ffi import ffi, load


def _address(ptr) -> int:
    return int(ffi.cast("uintptr_t", ptr))


class Scheduler:
    """One ``ggml_backend_sched`` over ``[backend, CPU]``, for graphs of up to ``graph_size`` nodes.

    ``graph_size`` bounds nodes + leafs of the graphs it schedules (ggml asserts it); Graph
    passes twice its node budget, at most ``GRAPH_SIZE_LIMIT``. Raises InputTypeError for a backend that is not
    a hotggml Backend, UsageError for a closed one, InputError for a graph_size outside [1, GRAPH_SIZE_LIMIT]
    (ggml aborts when it cannot allocate the hash set), BackendError (via Backend) when the CPU cannot open.
    """

    GRAPH_SIZE_LIMIT = 1 << 24  # above what a Graph (twice MAX_NODES_LIMIT) or an Optimizer of one asks for

    def __init__(self, backend, graph_size: int):
        from hotggml.graph import Backend  # graph imports this module lazily: no cycle at load

        if not isinstance(backend, Backend):
            raise InputTypeError(f"backend must be a hotggml Backend, got {type(backend).__name__}")
        backend.need_open()
        if isinstance(graph_size, bool) or not isinstance(graph_size, int) or not 1 <= graph_size <= self.GRAPH_SIZE_LIMIT:
            raise InputError(f"graph_size must be an int in [1, {self.GRAPH_SIZE_LIMIT}], got {graph_size!r}")
        self.lib = load()
        self._sched_free = self.lib.ggml_backend_sched_free  # looked up now: close() may run inside a cffi call
        self._own_cpu = None if backend.device_name == "CPU" else Backend("CPU")
        self.backends = [backend] + ([self._own_cpu] if self._own_cpu else [])
        ptrs = ffi.new("ggml_backend_t[]", [b._ptr for b in self.backends])
        self._ptr = self.lib.ggml_backend_sched_new(ptrs, ffi.NULL, len(self.backends), graph_size, False, False)
        self.graph_size = graph_size
        self._assigned: list[tuple[object, object]] = []  # (tensor ptr, Backend)

    def backend_named(self, device_name: str):
        """The scheduler's Backend called ``device_name`` (registry spelling, case-insensitive)."""
        for b in self.backends:
            if b.device_name.upper() == device_name.upper():
                return b
        raise InputError(f"no backend {device_name!r} in this scheduler (have: "
                         f"{', '.join(b.device_name for b in self.backends)})")

    def assign(self, tensor_ptr, device_name: str) -> None:
        """Pin a node to one of the scheduler's backends (``ggml_backend_sched_set_tensor_backend``);
        kept across runs: ggml forgets assignments at each reset, so they are re-applied before each split."""
        self._assigned.append((tensor_ptr, self.backend_named(device_name)))

    def _prepare(self, gf) -> None:
        self.lib.ggml_backend_sched_reset(self._ptr)
        in_graph = self._tensors_of(gf) if self._assigned else set()
        for ptr, backend in self._assigned:
            if _address(ptr) in in_graph:  # ggml's hash set holds the graph's tensors: others would overflow it
                self.lib.ggml_backend_sched_set_tensor_backend(self._ptr, ptr, backend._ptr)

    def _tensors_of(self, gf) -> set[int]:
        """Addresses of gf's nodes and of their sources (the leafs among them), computed once per graph."""
        key = (_address(gf), self.lib.ggml_graph_n_nodes(gf))
        if getattr(self, "_graph_key", None) != key:
            found = set()
            for i in range(key[1]):
                node = self.lib.ggml_graph_node(gf, i)
                found.add(_address(node))
                found.update(_address(src) for src in node.src if src != ffi.NULL)
            self._graph_key, self._graph_tensors = key, found
        return self._graph_tensors

    def split(self, gf) -> None:
        """Place every node and split the graph without allocating anything (a probe's plan)."""
        self._prepare(gf)
        self.lib.ggml_backend_sched_split_graph(self._ptr, gf)

    def alloc(self, gf) -> bool:
        """Place, split and allocate the graph in the scheduler's per-backend buffers; False on failure."""
        self._prepare(gf)
        return bool(self.lib.ggml_backend_sched_alloc_graph(self._ptr, gf))

    def compute(self, gf) -> int:
        """Run the allocated graph split by split; returns ggml's status (0 = success)."""
        status = self.lib.ggml_backend_sched_graph_compute(self._ptr, gf)
        self.lib.ggml_backend_sched_synchronize(self._ptr)
        return int(status)

    def time_nodes(self, gf) -> list[tuple[object, float]]:
        """Compute the allocated graph node by node: (node ptr, seconds) for each node in order.

        ggml's eval callback makes the scheduler stop after every node it asks about; each stop waits
        for every backend, so a node's time is its kernels plus one launch and one synchronisation
        (tens of microseconds: for attributing milliseconds, not for quoting small nodes).
        """
        import time

        lib, sched = self.lib, self._ptr
        stamps: list[tuple[object, float]] = []
        failed: list[BaseException] = []

        def stop(exc_type, exc_value, tb):  # cffi swallows a callback's exception: keep it, stop the compute
            failed.append(exc_value)
            return False

        @ffi.callback("bool(struct ggml_tensor *, bool, void *)", onerror=stop)
        def observe(t, ask, _user):
            if not ask:
                lib.ggml_backend_sched_synchronize(sched)
                stamps.append((t, time.perf_counter()))
            return True

        lib.ggml_backend_sched_set_eval_callback(sched, observe, ffi.NULL)
        try:
            t0 = time.perf_counter()
            status = self.compute(gf)
        finally:
            lib.ggml_backend_sched_set_eval_callback(sched, ffi.NULL, ffi.NULL)
        if failed:
            raise failed[0]
        if status != 0:
            raise BackendError(f"graph compute failed (status {status})")
        out, prev = [], t0
        for t, stamp in stamps:
            out.append((t, stamp - prev))
            prev = stamp
        return out

    def device_of(self, tensor_ptr) -> str | None:
        """Registry name of the backend a placed node runs on, or None when the scheduler left it unplaced."""
        b = self.lib.ggml_backend_sched_get_tensor_backend(self._ptr, tensor_ptr)
        if b == ffi.NULL:
            return None
        return ffi.string(self.lib.ggml_backend_dev_name(self.lib.ggml_backend_get_device(b))).decode()

    @property
    def n_splits(self) -> int:
        """ggml's count of graph splits after the last split/alloc."""
        return int(self.lib.ggml_backend_sched_get_n_splits(self._ptr))

    @property
    def n_copies(self) -> int:
        return int(self.lib.ggml_backend_sched_get_n_copies(self._ptr))

    def close(self) -> None:
        """Free the scheduler, then the CPU backend it opened (never the caller's backend)."""
        if self._ptr is not None:
            self._sched_free(self._ptr)
            self._ptr = None
        if self._own_cpu is not None:
            self._own_cpu.close()
            self._own_cpu = None

