"""cffi (ABI mode) binding to the patched ggml shared libraries.

The cdef below is one unit per ggml header, copied from the pinned v0.15.3 headers plus
the declarations the ``flash-attn-train`` patch adds. The library is located in this order:
``$HOTGGML_LIB_DIR``, the package's own ``lib/`` (``pip install .``), then the newest good
``hotggml build``. At load, the stamp compiled into libggml-base (pin + series hash) is
compared with what this checkout (or the installed package) expects; a stale library raises
LibraryError saying how to rebuild.
"""

from __future__ import annotations

import importlib.resources
import json
import os
from functools import lru_cache
from pathlib import Path

import cffi

from hotggml.errors import LibraryError

CDEF_GGML = """
typedef uint16_t ggml_fp16_t;
enum ggml_type { GGML_TYPE_F32 = 0, GGML_TYPE_F16 = 1, GGML_TYPE_I32 = 26 };
enum ggml_prec { GGML_PREC_DEFAULT = 0, GGML_PREC_F32 = 10 };
/* only the values we name; the patch appends the two training ops at the end of the v0.15.3 enum (97 ops) */
enum ggml_op { GGML_OP_NONE = 0, GGML_OP_FLASH_ATTN_TRAIN = 97, GGML_OP_FLASH_ATTN_TRAIN_BACK = 98, GGML_OP_COUNT = 99 };
enum ggml_tensor_flag {
    GGML_TENSOR_FLAG_INPUT = 1, GGML_TENSOR_FLAG_OUTPUT = 2, GGML_TENSOR_FLAG_PARAM = 4,
    GGML_TENSOR_FLAG_LOSS = 8, GGML_TENSOR_FLAG_COMPUTE = 16,
};

struct ggml_context;
struct ggml_cgraph;
struct ggml_backend_buffer;

struct ggml_init_params {
    size_t mem_size;
    void * mem_buffer;
    bool   no_alloc;
};

struct ggml_tensor {
    enum ggml_type type;
    struct ggml_backend_buffer * buffer;
    int64_t ne[4];
    size_t  nb[4];
    enum ggml_op op;
    int32_t op_params[16];
    int32_t flags;
    struct ggml_tensor * src[10];
    struct ggml_tensor * view_src;
    size_t view_offs;
    void * data;
    char name[64];
    void * extra;
    char padding[8];
};

struct ggml_context * ggml_init(struct ggml_init_params params);
void   ggml_free(struct ggml_context * ctx);
size_t ggml_tensor_overhead(void);
size_t ggml_used_mem(const struct ggml_context * ctx);
size_t ggml_graph_overhead_custom(size_t size, bool grads);
size_t ggml_nbytes(const struct ggml_tensor * tensor);
int64_t ggml_nelements(const struct ggml_tensor * tensor);
bool   ggml_is_contiguous(const struct ggml_tensor * tensor);
const char * ggml_op_name(enum ggml_op op);
const char * ggml_op_desc(const struct ggml_tensor * t);

struct ggml_tensor * ggml_new_tensor(struct ggml_context * ctx, enum ggml_type type, int n_dims, const int64_t * ne);
struct ggml_tensor * ggml_set_name(struct ggml_tensor * tensor, const char * name);
void ggml_set_input(struct ggml_tensor * tensor);
void ggml_set_output(struct ggml_tensor * tensor);
void ggml_set_param(struct ggml_tensor * tensor);
void ggml_set_loss(struct ggml_tensor * tensor);

struct ggml_tensor * ggml_add(struct ggml_context * ctx, struct ggml_tensor * a, struct ggml_tensor * b);
struct ggml_tensor * ggml_mul(struct ggml_context * ctx, struct ggml_tensor * a, struct ggml_tensor * b);
struct ggml_tensor * ggml_scale(struct ggml_context * ctx, struct ggml_tensor * a, float s);
struct ggml_tensor * ggml_sum(struct ggml_context * ctx, struct ggml_tensor * a);
struct ggml_tensor * ggml_cont(struct ggml_context * ctx, struct ggml_tensor * a);
struct ggml_tensor * ggml_repeat(struct ggml_context * ctx, struct ggml_tensor * a, struct ggml_tensor * b);
struct ggml_tensor * ggml_mul_mat(struct ggml_context * ctx, struct ggml_tensor * a, struct ggml_tensor * b);
struct ggml_tensor * ggml_soft_max_ext(struct ggml_context * ctx, struct ggml_tensor * a, struct ggml_tensor * mask, float scale, float max_bias);
struct ggml_tensor * ggml_reshape_4d(struct ggml_context * ctx, struct ggml_tensor * a, int64_t ne0, int64_t ne1, int64_t ne2, int64_t ne3);
struct ggml_tensor * ggml_permute(struct ggml_context * ctx, struct ggml_tensor * a, int axis0, int axis1, int axis2, int axis3);
struct ggml_tensor * ggml_view_4d(struct ggml_context * ctx, struct ggml_tensor * a, int64_t ne0, int64_t ne1, int64_t ne2, int64_t ne3,
                                  size_t nb1, size_t nb2, size_t nb3, size_t offset);

struct ggml_cgraph * ggml_new_graph_custom(struct ggml_context * ctx, size_t size, bool grads);
void ggml_build_forward_expand(struct ggml_cgraph * cgraph, struct ggml_tensor * tensor);
void ggml_build_backward_expand(struct ggml_context * ctx, struct ggml_cgraph * cgraph, struct ggml_tensor ** grad_accs);
struct ggml_tensor * ggml_graph_get_grad(const struct ggml_cgraph * cgraph, const struct ggml_tensor * node);
int ggml_graph_n_nodes(struct ggml_cgraph * cgraph);
struct ggml_tensor * ggml_graph_node(struct ggml_cgraph * cgraph, int i);

/* added by patches/flash-attn-train.patch */
struct ggml_tensor * ggml_flash_attn_train(struct ggml_context * ctx, struct ggml_tensor * q, struct ggml_tensor * k,
                                           struct ggml_tensor * v, struct ggml_tensor * mask, float scale);
struct ggml_tensor * ggml_flash_attn_train_get_o(struct ggml_context * ctx, struct ggml_tensor * fwd);
struct ggml_tensor * ggml_flash_attn_train_get_lse(struct ggml_context * ctx, struct ggml_tensor * fwd);
void ggml_flash_attn_train_set_prec(struct ggml_tensor * a, enum ggml_prec prec);
enum ggml_prec ggml_flash_attn_train_get_prec(const struct ggml_tensor * a);
void ggml_flash_attn_train_set_implicit_mask(struct ggml_tensor * a, bool causal, int32_t window);
bool ggml_flash_attn_train_get_causal(const struct ggml_tensor * a);
int32_t ggml_flash_attn_train_get_window(const struct ggml_tensor * a);
struct ggml_tensor * ggml_flash_attn_train_back(struct ggml_context * ctx, struct ggml_tensor * q, struct ggml_tensor * k,
                                                struct ggml_tensor * v, struct ggml_tensor * mask,
                                                struct ggml_tensor * fwd, struct ggml_tensor * d);
struct ggml_tensor * ggml_flash_attn_train_back_get_dq(struct ggml_context * ctx, struct ggml_tensor * back);
struct ggml_tensor * ggml_flash_attn_train_back_get_dk(struct ggml_context * ctx, struct ggml_tensor * back);
struct ggml_tensor * ggml_flash_attn_train_back_get_dv(struct ggml_context * ctx, struct ggml_tensor * back);
size_t ggml_flash_attn_train_lse_offset(const struct ggml_tensor * fwd);
size_t ggml_flash_attn_train_back_offset(const struct ggml_tensor * back, int i);
"""

CDEF_BACKEND = """
typedef struct ggml_backend_buffer_type * ggml_backend_buffer_type_t;
typedef struct ggml_backend_buffer * ggml_backend_buffer_t;
typedef struct ggml_backend * ggml_backend_t;
typedef struct ggml_backend_device * ggml_backend_dev_t;
typedef struct ggml_backend_reg * ggml_backend_reg_t;
typedef struct ggml_gallocr * ggml_gallocr_t;
enum ggml_status { GGML_STATUS_ALLOC_FAILED = -2, GGML_STATUS_FAILED = -1, GGML_STATUS_SUCCESS = 0, GGML_STATUS_ABORTED = 1 };

size_t ggml_backend_dev_count(void);
ggml_backend_dev_t ggml_backend_dev_get(size_t index);
ggml_backend_dev_t ggml_backend_dev_by_name(const char * name);
const char * ggml_backend_dev_name(ggml_backend_dev_t device);
const char * ggml_backend_dev_description(ggml_backend_dev_t device);
ggml_backend_t ggml_backend_dev_init(ggml_backend_dev_t device, const char * params);
bool ggml_backend_dev_supports_op(ggml_backend_dev_t device, const struct ggml_tensor * op);
ggml_backend_reg_t ggml_backend_dev_backend_reg(ggml_backend_dev_t device);
const char * ggml_backend_reg_name(ggml_backend_reg_t reg);
void * ggml_backend_reg_get_proc_address(ggml_backend_reg_t reg, const char * name);
/* flash-attn-train-cuda: the path a FLASH_ATTN_TRAIN(_BACK) node runs on CUDA device `device` */
typedef const char * (*ggml_backend_cuda_fa_train_path_t)(int device, const struct ggml_tensor * node);

void ggml_backend_free(ggml_backend_t backend);
const char * ggml_backend_name(ggml_backend_t backend);
ggml_backend_dev_t ggml_backend_get_device(ggml_backend_t backend);
ggml_backend_buffer_type_t ggml_backend_get_default_buffer_type(ggml_backend_t backend);
bool ggml_backend_supports_op(ggml_backend_t backend, const struct ggml_tensor * op);
enum ggml_status ggml_backend_graph_compute(ggml_backend_t backend, struct ggml_cgraph * cgraph);
void ggml_backend_synchronize(ggml_backend_t backend);

void ggml_backend_tensor_set(struct ggml_tensor * tensor, const void * data, size_t offset, size_t size);
void ggml_backend_tensor_get(const struct ggml_tensor * tensor, void * data, size_t offset, size_t size);
void ggml_backend_tensor_memset(struct ggml_tensor * tensor, uint8_t value, size_t offset, size_t size);

ggml_backend_buffer_t ggml_backend_alloc_ctx_tensors(struct ggml_context * ctx, ggml_backend_t backend);
void ggml_backend_buffer_free(ggml_backend_buffer_t buffer);
size_t ggml_backend_buffer_get_size(ggml_backend_buffer_t buffer);

typedef struct ggml_backend_sched * ggml_backend_sched_t;
ggml_backend_sched_t ggml_backend_sched_new(ggml_backend_t * backends, ggml_backend_buffer_type_t * bufts, int n_backends,
                                            size_t graph_size, bool parallel, bool op_offload);
void ggml_backend_sched_free(ggml_backend_sched_t sched);
void ggml_backend_sched_reset(ggml_backend_sched_t sched);
void ggml_backend_sched_set_tensor_backend(ggml_backend_sched_t sched, struct ggml_tensor * node, ggml_backend_t backend);
ggml_backend_t ggml_backend_sched_get_tensor_backend(ggml_backend_sched_t sched, struct ggml_tensor * node);
void ggml_backend_sched_split_graph(ggml_backend_sched_t sched, struct ggml_cgraph * graph);
bool ggml_backend_sched_alloc_graph(ggml_backend_sched_t sched, struct ggml_cgraph * graph);
enum ggml_status ggml_backend_sched_graph_compute(ggml_backend_sched_t sched, struct ggml_cgraph * graph);
void ggml_backend_sched_synchronize(ggml_backend_sched_t sched);
int ggml_backend_sched_get_n_splits(ggml_backend_sched_t sched);
int ggml_backend_sched_get_n_copies(ggml_backend_sched_t sched);
typedef bool (*ggml_backend_sched_eval_callback)(struct ggml_tensor * t, bool ask, void * user_data);
void ggml_backend_sched_set_eval_callback(ggml_backend_sched_t sched, ggml_backend_sched_eval_callback callback, void * user_data);

ggml_gallocr_t ggml_gallocr_new(ggml_backend_buffer_type_t buft);
void ggml_gallocr_free(ggml_gallocr_t galloc);
bool ggml_gallocr_reserve(ggml_gallocr_t galloc, struct ggml_cgraph * graph);
bool ggml_gallocr_alloc_graph(ggml_gallocr_t galloc, struct ggml_cgraph * graph);
size_t ggml_gallocr_get_buffer_size(ggml_gallocr_t galloc, int buffer_id);
void ggml_gallocr_reserve_n_size(ggml_gallocr_t galloc, struct ggml_cgraph * graph, const int * node_buffer_ids,
                                 const int * leaf_buffer_ids, size_t * sizes);
"""

CDEF_CPU = """
void ggml_backend_cpu_set_n_threads(ggml_backend_t backend_cpu, int n_threads);
"""

CDEF_STAMP = """
const char * hotggml_build_stamp(void);
"""

_LIB_NAMES = {"posix": "libggml.so", "darwin": "libggml.dylib", "nt": "ggml.dll"}

ffi = cffi.FFI()
ffi.cdef(CDEF_GGML)
ffi.cdef(CDEF_BACKEND)
ffi.cdef(CDEF_CPU)
ffi.cdef(CDEF_STAMP)


def _package_lib_dir() -> Path:
    """The package's own lib/ (`pip install .`): beside the modules, or, for an editable install
    (`pip install -e .`), where the installer put the compiled files; importlib.resources knows both."""
    here = Path(__file__).resolve().parent / "lib"
    try:
        found = Path(str(importlib.resources.files("hotggml").joinpath("lib")))
    except (ImportError, TypeError, ValueError):
        return here
    return found if found.is_dir() else here


def find_lib_dir() -> Path:
    """Folder holding libggml*, hotggml-build.json: $HOTGGML_LIB_DIR, the package's lib/, or the newest build.

    Raises LibraryError naming every place looked at when none has a library.
    """
    looked = []
    env = os.environ.get("HOTGGML_LIB_DIR")
    if env:  # asked for by name: that library or an error, never another one
        if not (Path(env) / _lib_file_name()).is_file():
            raise LibraryError(f"HOTGGML_LIB_DIR={env} holds no {_lib_file_name()}: point it at a build's lib/ "
                               "folder, or unset it to use this checkout's build or the installed package")
        return Path(env)
    candidates = []
    candidates.append(_package_lib_dir())
    from hotggml import build  # the binding only needs to know where the built library is

    current = build.current_lib_dir(series_hash=_checkout_series_hash())
    if current is not None:
        candidates.append(current)
    for cand in candidates:
        looked.append(str(cand))
        if (cand / _lib_file_name()).exists():
            return cand
    raise LibraryError("no built ggml library found (looked in: " + ", ".join(looked) +
                       "); run `hotggml build --backend cpu` (or `pip install .`)")


def _checkout_series_hash() -> str | None:
    """Series hash of this checkout's patches/, or None for an installed package without one."""
    from hotggml import paths

    if not paths.PATCHES_DIR.joinpath("series").is_file():
        return None
    from hotggml import series

    return series.series_hash()


def _lib_file_name() -> str:
    import sys

    return _LIB_NAMES["darwin" if sys.platform == "darwin" else os.name]


def expected_stamp(lib_dir: Path) -> dict:
    """What the library in lib_dir must say: this checkout's pin + series hash, else the installed record."""
    from hotggml import paths

    if paths.PATCHES_DIR.joinpath("series").is_file() and lib_dir != _package_lib_dir():
        from hotggml import pin_record

        return {"pin": pin_record.UPSTREAM_COMMIT, "series_hash": _checkout_series_hash()}
    record = json.loads((lib_dir / "hotggml-build.json").read_text())
    return {"pin": record.get("pin", ""), "series_hash": record.get("series_hash", "")}  # the stamp's fields only


def parse_stamp(stamp: str) -> dict:
    fields = dict(part.split("=", 1) for part in stamp.split(";") if "=" in part)
    return {"pin": fields.get("pin", ""), "series_hash": fields.get("series", "")}


@lru_cache(maxsize=1)
def load():
    """Open the library once and check its stamp; returns the cffi lib object.

    Raises LibraryError when no library is found, when it lacks the stamp (not built by hotggml),
    or when its stamp differs from the expected pin + series (stale: says how to rebuild).
    """
    lib_dir = find_lib_dir()
    path = lib_dir / _lib_file_name()
    try:
        _preload_dependencies(lib_dir)
        lib = ffi.dlopen(str(path))
        stamp = ffi.string(lib.hotggml_build_stamp()).decode()
    except (OSError, AttributeError) as exc:
        raise LibraryError(_shadowed_message(lib_dir) or
                           f"{path} cannot be used ({exc}); rebuild with `hotggml build --backend cpu`") from exc
    shadowed = _shadowed_message(lib_dir)
    if shadowed:
        raise LibraryError(shadowed)
    check_cpu(lib_dir)
    got, want = parse_stamp(stamp), expected_stamp(lib_dir)
    if got != want:
        how = ("reinstall the package (`pip install .` from its checkout)" if lib_dir == _package_lib_dir()
               else "rebuild with `hotggml build --backend cpu` (or --backend cuda)")
        raise LibraryError(
            f"stale library {path}: built from pin {got['pin'][:12]} series {got['series_hash'][:12]}, "
            f"but this checkout is pin {want['pin'][:12]} series {want['series_hash'][:12]}; {how}")
    return lib


_PRELOADED: list = []  # the dependencies' handles, kept open for the life of the process


def _preload_dependencies(lib_dir: Path) -> None:
    """dlopen lib_dir's other libggml*.so by absolute path, libggml-base first. The dynamic linker then
    resolves libggml.so's DT_NEEDED entries to these (a loaded object is matched by its soname) instead of
    searching LD_LIBRARY_PATH, which takes precedence over the RUNPATH ($ORIGIN) the build links with."""
    if os.name != "posix":
        return
    suffix = Path(_lib_file_name()).suffix
    deps = sorted((p for p in lib_dir.glob(f"libggml*{suffix}") if p.name != _lib_file_name()),
                  key=lambda p: (p.name != f"libggml-base{suffix}", p.name))
    for dep in deps:
        _PRELOADED.append(ffi.dlopen(str(dep)))


def _mapped_ggml_libraries() -> list[Path]:
    """Every libggml* file mapped into this process (Linux: /proc/self/maps; elsewhere nothing is known)."""
    try:
        text = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    found = {line.split(maxsplit=5)[-1] for line in text.splitlines() if "/libggml" in line}
    return sorted(Path(p) for p in found if Path(p).name.startswith("libggml"))


def _shadowed_message(lib_dir: Path) -> str | None:
    """A LibraryError message when a libggml* from another folder is mapped beside ours (LD_LIBRARY_PATH, or
    another ggml loaded first in this process): the patched library would run against foreign symbols."""
    mine = lib_dir.resolve()
    foreign = [p for p in _mapped_ggml_libraries() if p.parent.resolve() != mine]
    if not foreign:
        return None
    where = os.environ.get("LD_LIBRARY_PATH")
    why = (f"LD_LIBRARY_PATH={where} overrides the library's RUNPATH: take those folders out of it (or unset it)"
           if where else "another ggml was loaded into this process first: load hotggml before it, or in a "
           "process of its own")
    return (f"{', '.join(map(str, foreign))} loaded beside the patched libraries in {lib_dir}; {why}. "
            "A rebuild cannot help.")


def check_cpu(lib_dir: Path) -> None:
    """Raise LibraryError when the library in lib_dir was built natively (-march=native) for a CPU with
    instruction-set flags this one lacks (it would die of SIGILL); says how to get a library for this CPU."""
    from hotggml import cpu

    record_file = lib_dir / "hotggml-build.json"
    if not record_file.is_file():
        return
    record = json.loads(record_file.read_text())
    if not record.get("native"):
        return
    built_for = [f for f in str(record.get("cpu_flags", "")).split(",") if f]
    lacking = cpu.missing(built_for)
    if lacking:
        how = ("reinstall the package on this machine (`pip install .` from its checkout)" if lib_dir == _package_lib_dir()
               else "rebuild on this machine (`hotggml build --backend cpu`)")
        raise LibraryError(f"{lib_dir} was built with GGML_NATIVE for a CPU with {', '.join(lacking)}, which this "
                           f"CPU ({cpu.isa_flags()[0]}) lacks: it would stop on an illegal instruction; {how}")


def library_info() -> dict:
    """Where the loaded library is and what it was built from (for reports)."""
    lib = load()
    info = parse_stamp(ffi.string(lib.hotggml_build_stamp()).decode())
    info["lib_dir"] = str(find_lib_dir())
    return info
