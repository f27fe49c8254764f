"""cffi (ABI mode) binding to the patched ggml shared libraries.

The declarations are those a build generated from its own patched headers (``hotggml-cdef.h`` beside the
libraries, hotggml.cdefgen): every public function, struct and enum of the built tree is callable as
``load().ggml_...``, and enum values (op ids included) come from there. The library is located in this
order: ``$HOTGGML_LIB_DIR``, the package's own ``lib/`` (``pip install .``), then the newest good
``hotggml build``. At load, the stamp compiled into libggml-base (pin + series hash) is compared with what
this checkout (or the installed package) expects, and the layout of every struct the binding reads with
the library's own offsets; a stale library or a layout that disagrees raises LibraryError saying why.
"""

from __future__ import annotations

import importlib.resources
import json
import os
import sys
from functools import lru_cache
from pathlib import Path

import cffi

from hotggml.cdefgen import FILE_NAME as CDEF_FILE
from hotggml.errors import LibraryError

# what the stamp unit (hotggml/csrc/stamp.c.in) exports, and our own typedef for a proc address
CDEF_EXTRA = """
const char * hotggml_build_stamp(void);
const char * hotggml_struct_layout_names(void);
const size_t * hotggml_struct_layout(void);
const char * hotggml_rpc_proto_version(void);
typedef const char * (*ggml_backend_cuda_fa_train_path_t)(int device, const struct ggml_tensor * node);
typedef size_t (*ggml_backend_cuda_fa_train_pool_peak_t)(bool reset);
typedef ggml_backend_reg_t (*ggml_backend_rpc_add_server_t)(const char * endpoint);
typedef void (*ggml_backend_rpc_start_server_t)(const char * endpoint, const char * cache_dir, size_t n_threads,
                                                size_t n_devices, ggml_backend_dev_t * devices);
bool ggml_op_can_inplace(enum ggml_op op);  /* ggml-impl.h (exported): ops whose result may take a source's memory */
size_t ggml_backend_meta_n_backends(ggml_backend_t meta_backend);  /* ggml-backend-impl.h (exported): a meta backend's */
ggml_backend_t ggml_backend_meta_simple_backend(ggml_backend_t meta_backend, size_t index);  /* own backends */
"""

_LIB_NAMES = {"posix": "libggml.so", "darwin": "libggml.dylib", "nt": "ggml.dll"}

ffi = cffi.FFI()  # declared by load(), from the library folder's generated declarations
_declared: str | None = None  # the generated file whose declarations ffi holds


def _declare(lib_dir: Path) -> None:
    """Give ffi the declarations generated beside the library in lib_dir (once per file: cdef cannot be
    undone; another folder's declarations override them). LibraryError when the folder has none."""
    global _declared
    generated = lib_dir / CDEF_FILE
    if _declared == str(generated):
        return
    if not generated.is_file():
        raise LibraryError(f"{lib_dir} has no {CDEF_FILE} (the declarations a build generates from its headers; "
                           "an older build recipe): rebuild with `hotggml build --backend cpu` (or `pip install .`)")
    text = generated.read_text()
    if _declared is not None and Path(_declared).is_file() and Path(_declared).read_text() == text:
        _declared = str(generated)  # the same declarations (another folder of the same build recipe)
        return
    try:
        ffi.cdef(text + CDEF_EXTRA, override=_declared is not None)
    except NotImplementedError as exc:  # cffi cannot declare an enum's values a second time
        raise LibraryError(f"this process has declared the library in {Path(_declared).parent} to cffi; the one in "
                           f"{lib_dir} declares other functions or enums ({exc}), and a process uses one build: "
                           "start a new interpreter to use it (HOTGGML_LIB_DIR chooses the folder)") from exc
    except (cffi.CDefError, cffi.FFIError) as exc:
        raise LibraryError(f"{generated} cannot be declared to cffi ({exc}); rebuild with `hotggml build`") from exc
    _declared = str(generated)


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
    from hotggml import libdir  # where the builds are, without the build tooling

    current = libdir.current_lib_dir(series_hash=_checkout_series_hash())
    if current is not None:
        candidates.append(current)
    for cand in candidates:
        looked.append(str(cand))
        if (cand / _lib_file_name()).exists():
            return cand
    from hotggml import paths

    root = os.environ.get(paths.BUILD_ROOT_ENV)
    raise LibraryError("no built ggml library found (looked in: " + ", ".join(looked) + ", and the builds under "
                       + (f"{paths.BUILD_ROOT_ENV}={root}" if root else str(paths.build_root()))
                       + "); run `hotggml build --backend cpu` (or `pip install .`)")


def _checkout_series_hash() -> str | None:
    """The code hash of this checkout's series (hotggml.series.code_hash: a patch's message is not part of
    it), or None for an installed package without patches/."""
    from hotggml import paths

    if not paths.PATCHES_DIR.joinpath("series").is_file():
        return None
    from hotggml import series

    return series.code_hash()


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
    _refuse_stale(path, _build_record(lib_dir), expected_stamp(lib_dir))  # before cffi declares anything of it
    _declare(lib_dir)
    backend_dl = _build_record(lib_dir).get("backend_dl", False)
    try:
        _preload_dependencies(lib_dir, backend_dl)
        lib = ffi.dlopen(str(path))
        stamp = ffi.string(lib.hotggml_build_stamp()).decode()
        _init_backends(lib, lib_dir, backend_dl)
    except (OSError, AttributeError) as exc:
        raise LibraryError(_shadowed_message(lib_dir) or
                           f"{path} cannot be used ({exc}); rebuild with `hotggml build --backend cpu`") from exc
    shadowed = _shadowed_message(lib_dir)
    if shadowed:
        raise LibraryError(shadowed)
    check_layout(lib, path)
    check_cpu(lib_dir)
    _refuse_stale(path, parse_stamp(stamp), expected_stamp(lib_dir))  # the library's own stamp decides
    return lib


def _refuse_stale(path: Path, got: dict, want: dict) -> None:
    """LibraryError when a build's pin + series (`got`: its record or its library's stamp) are not `want`.
    A record without those fields (an older build recipe) is left to the stamp."""
    if not got.get("pin") or not got.get("series_hash"):
        return
    got = {"pin": got["pin"], "series_hash": got["series_hash"]}
    if got != want:
        how = ("reinstall the package (`pip install .` from its checkout)" if path.parent == _package_lib_dir()
               else "rebuild with `hotggml build --backend cpu` (or --backend cuda, --backend vulkan)")
        raise LibraryError(
            f"stale library {path}: built from ggml upstream {got['pin'][:12]} code {got['series_hash'][:12]}, but this "
            f"checkout is upstream {want['pin'][:12]} code {want['series_hash'][:12]} (the series' diffs); {how}")


_PRELOADED: list = []  # the dependencies' handles, kept open for the life of the process


def _init_backends(lib, lib_dir: Path, backend_dl: bool) -> None:
    """The backends registered without their INFO lines on stderr (a line per loaded module, ggml_vulkan's "No
    devices found." without a visible device): the modules of lib_dir loaded where the backends are modules
    (backend_dl: the registry picks the best CPU variant for this CPU), then the registry's first use, which
    enumerates the devices of the backends linked in. ggml's warnings and errors (and their continuation lines)
    pass; its default logger is back afterwards."""
    passing = [False]

    @ffi.callback("void(enum ggml_log_level, const char *, void *)")
    def warnings_only(level, text, user_data):
        if level != lib.GGML_LOG_LEVEL_CONT:
            passing[0] = level >= lib.GGML_LOG_LEVEL_WARN
        if passing[0]:
            sys.stderr.write(ffi.string(text).decode(errors="replace"))

    lib.ggml_log_set(warnings_only, ffi.NULL)
    try:
        if backend_dl:
            lib.ggml_backend_load_all_from_path(str(lib_dir).encode())
        lib.ggml_backend_dev_count()
    finally:
        lib.ggml_log_set(ffi.NULL, ffi.NULL)  # ggml's default logger again


def _build_record(lib_dir: Path) -> dict:
    """The build's record beside its libraries (hotggml-build.json, written by CMakeLists.txt); {} if none."""
    record_file = lib_dir / "hotggml-build.json"
    return json.loads(record_file.read_text()) if record_file.is_file() else {}


def _preload_dependencies(lib_dir: Path, backend_dl: bool = False) -> None:
    """dlopen lib_dir's other libggml*.so by absolute path, libggml-base first. The dynamic linker then
    resolves libggml.so's DT_NEEDED entries to these (a loaded object is matched by its soname) instead of
    searching LD_LIBRARY_PATH, which takes precedence over the RUNPATH ($ORIGIN) the build links with.
    With ``backend_dl`` libggml-base alone: the backends are modules for ggml's registry to load, and a CPU
    variant this CPU cannot run must never be mapped (its initializers may use the instructions it lacks)."""
    if os.name != "posix":
        return
    suffix = Path(_lib_file_name()).suffix
    deps = sorted((p for p in lib_dir.glob(f"libggml*{suffix}") if p.name != _lib_file_name()
                   and (not backend_dl or p.name == f"libggml-base{suffix}")),
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


def layout_mismatches(lib) -> list[str]:
    """The struct offsets and sizes where ffi's declarations disagree with the library's (its stamp unit
    exports them): 'ggml_tensor.op_params: binding 88, library 84'."""
    names = ffi.string(lib.hotggml_struct_layout_names()).decode().split(";")
    values = lib.hotggml_struct_layout()
    bad = []
    for i, name in enumerate(names):
        struct, _, field = name.partition(".")
        mine = ffi.offsetof(f"struct {struct}", field) if field else ffi.sizeof(f"struct {struct}")
        if mine != values[i]:
            bad.append(f"{name}: binding {mine}, library {values[i]}")
    return bad


def check_layout(lib, path: Path) -> None:
    """LibraryError naming each struct field whose offset (or struct whose size) differs between the
    binding's declarations and the library: reading a tensor's ne through a wrong offset gives garbage."""
    try:
        bad = layout_mismatches(lib)
    except AttributeError:  # a library whose stamp unit predates the layout export
        raise LibraryError(f"{path} does not export its struct layout (an older build recipe): rebuild with "
                           "`hotggml build`") from None
    if bad:
        raise LibraryError(f"the binding's declarations disagree with {path}: {'; '.join(bad)}; rebuild with "
                           "`hotggml build` (its declarations are generated from the same headers)")


def check_cpu(lib_dir: Path) -> None:
    """Raise LibraryError when the library in lib_dir was built natively (-march=native) for a CPU with
    instruction-set flags this one lacks (it would die of SIGILL); says how to get a library for this CPU."""
    from hotggml import cpu

    record = _build_record(lib_dir)
    if not record.get("native"):  # a portable build: ggml's registry picks a CPU variant this CPU runs
        return
    built_for = [f for f in str(record.get("cpu_flags", "")).split(",") if f]
    lacking = cpu.missing(built_for)
    if lacking:
        how = ("reinstall the package on this machine (`pip install .` from its checkout)" if lib_dir == _package_lib_dir()
               else "rebuild on this machine (`hotggml build --backend cpu`)")
        raise LibraryError(f"{lib_dir} was built with GGML_NATIVE for a CPU with {', '.join(lacking)}, which this "
                           f"CPU ({cpu.isa_flags()[0]}) lacks: it would stop on an illegal instruction; {how}")


def backend_proc(reg, name: str, ctype: str):
    """Function ``name`` of a backend's registry entry ``reg`` (ggml_backend_reg_get_proc_address), cast to
    the cffi function type ``ctype``, or None where the backend has none. The way to reach a backend's own
    calls (CPU threads, RPC servers, the CUDA kernel report): with GGML_BACKEND_DL they live in modules the
    binding never links, and the same call works for a build that links them."""
    fn = load().ggml_backend_reg_get_proc_address(reg, name.encode())
    return None if fn == ffi.NULL else ffi.cast(ctype, fn)


def library_info() -> dict:
    """Where the loaded library is and what it was built from (for reports): pin, series_hash, lib_dir, and
    cpu_backend, the CPU backend's file mapped in this process (in a portable build the variant ggml's
    registry chose for this CPU, e.g. libggml-cpu-haswell.so; None where the process map is unknown)."""
    lib = load()
    info = parse_stamp(ffi.string(lib.hotggml_build_stamp()).decode())
    info["lib_dir"] = str(find_lib_dir())
    cpu = [p.name for p in _mapped_ggml_libraries() if p.name.startswith("libggml-cpu")]
    info["cpu_backend"] = cpu[0] if cpu else None
    return info
