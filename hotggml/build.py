"""CMake build of the patched ggml, keyed by pin + series hash + backend options.

A build folder is ``<state>/build/<backend>-<key>`` where key hashes the pin commit, the
series hash and the CMake options, so a changed series never reuses a stale build, and an
unchanged one is not rebuilt. A build is "good" once ``hotggml-build.json`` (written by
CMakeLists.txt) and the libraries exist and ``.complete`` is written after a successful
``cmake --build``; an interrupted build leaves other keyed builds untouched.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from hotggml import paths, procs
from hotggml.errors import BuildError, HotggmlError

BACKENDS = ("cpu", "cuda", "vulkan")

# the CUDA options SPEC §5 / the device notes ask for: inference FA kernels off, no NCCL
_BACKEND_DEFINES = {
    "cpu": {},
    "cuda": {"GGML_CUDA": "ON", "GGML_CUDA_FA": "OFF", "GGML_CUDA_NCCL": "OFF"},
    "vulkan": {"GGML_VULKAN": "ON"},
}


@dataclass(frozen=True)
class BuildInfo:
    """A finished build: its folder, the folder of its shared libraries, and what it was built from."""

    backend: str
    build_dir: Path
    lib_dir: Path
    pin: str
    series_hash: str
    rebuilt: bool


def gpu_compute_caps() -> list[str]:
    """Compute capabilities of the visible NVIDIA GPUs as ``nvidia-smi`` prints them (``["9.0"]`` on an
    H200); ``[]`` without nvidia-smi, when it fails, or when it lists none."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def default_cuda_arch() -> str:
    """CMAKE_CUDA_ARCHITECTURES when the caller names none: ``90a`` when every visible GPU is compute
    capability 9.0 (Hopper: the TF32 flash-attention training kernels use wgmma there, an sm_90a feature
    that CMake's ``native`` (plain 90) leaves out; a 90a binary runs on those GPUs only, as a native one
    does), else ``native``."""
    caps = gpu_compute_caps()
    return "90a" if caps and all(cap == "9.0" for cap in caps) else "native"


def cmake_defines(backend: str, cuda_arch: str | None = None, extra: dict[str, str] | None = None) -> dict[str, str]:
    """CMake -D options for a backend (``cpu``, ``cuda`` or ``vulkan``; ``cuda_arch`` None: default_cuda_arch());
    raises BuildError for another backend name."""
    if backend not in BACKENDS:
        raise BuildError(f"unknown backend {backend!r}: choose one of {', '.join(BACKENDS)}")
    # RPC is part of every build: hotggml.rpc needs it, and ggml-rpc.h's own GGML_OP_COUNT check only
    # compiles with it, so one build proves every op-count check and serves the binding and the tests
    defines = {"CMAKE_BUILD_TYPE": "Release", "GGML_NATIVE": "ON", "GGML_RPC": "ON"}
    defines.update(_BACKEND_DEFINES[backend])
    if backend == "cuda":
        defines["CMAKE_CUDA_ARCHITECTURES"] = cuda_arch or default_cuda_arch()
    defines.update(extra or {})
    return defines


def _recipe_hash() -> str:
    """Hash of our own build recipe (CMakeLists.txt, the stamp source, the cffi declaration generator): a
    change means a new build."""
    h = hashlib.sha256()
    for rel in ("CMakeLists.txt", "hotggml/csrc/stamp.c.in", "hotggml/cdefgen.py"):
        h.update((paths.REPO_ROOT / rel).read_bytes())
    return h.hexdigest()


def build_key(pin: str, series_hash: str, defines: dict[str, str]) -> str:
    """16 hex digits identifying (pin, series, options, recipe, and for a native build the CPU's
    instruction-set flags); the build folder's name ends with it."""
    from hotggml import cpu

    record = {"pin": pin, "series": series_hash, "defines": defines, "recipe": _recipe_hash()}
    if defines.get("GGML_NATIVE") == "ON":
        record["cpu"] = cpu.isa_flags()  # -march=native code must not run on another CPU
    blob = json.dumps(record, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def build_dir_for(backend: str, pin: str, series_hash: str, defines: dict[str, str]) -> Path:
    return paths.build_root() / f"{backend}-{build_key(pin, series_hash, defines)}"


def _is_complete(build_dir: Path) -> bool:
    """Whether a build finished: its record readable (an empty one is a write cut short: a full disk) and its
    library in lib/ (a folder whose library was deleted is rebuilt, not called up to date)."""
    from hotggml import ffi, libdir

    return (libdir._record(build_dir / ".complete") is not None
            and (build_dir / "lib" / "hotggml-build.json").is_file()
            and (build_dir / "lib" / ffi._lib_file_name()).is_file())


def _generator() -> list[str]:
    return ["-G", "Ninja"] if shutil.which("ninja") else []


def _lock_dir() -> Path:
    """Where build locks live: in the build root, so that checkouts sharing it ($HOTGGML_BUILD_ROOT) with state
    folders of their own still wait for each other's build of one folder."""
    return paths.build_root() / ".locks"


_PGID_FILE = ".build-pgid"  # in a build folder while its CMake runs: the process group to end if we die


def _end_stale_group(bdir: Path) -> None:
    """End the process group a killed build left running in bdir (cmake, ninja, compilers still writing
    into the folder), and wait until it is gone. Called with the folder's lock held. A recorded group
    none of whose processes works in bdir is someone else's (process ids are reused): left alone."""
    record = bdir / _PGID_FILE
    if not record.is_file():
        return
    try:
        pgid = int(record.read_text().split()[0])
    except (ValueError, IndexError):
        pgid = 0
    # the build's session (CMake ran as its leader): ninja's compilers are in it, each in a group of its own
    members = procs.session_members(pgid) if pgid > 1 and pgid != os.getsid(0) else []
    if any(procs.works_in(pid, bdir) for pid in members):
        print(f"hotggml: ending the processes of an interrupted build in {bdir} (session {pgid})",
              file=sys.stderr, flush=True)
        try:
            procs.end(members)
        except HotggmlError:
            raise BuildError(f"processes of an interrupted build (session {pgid}) in {bdir} did not end") from None
    record.unlink(missing_ok=True)


_NINJA_STEP = re.compile(r"^\[(\d+)/(\d+)\]")   # ninja: [n/m] ...
_MAKE_STEP = re.compile(r"^\[\s*(\d+)%\]")        # make: [ 45%] ...


def _progress(line: str) -> str | None:
    """'n/m' or 'p%' when line is a generator's progress line, else None."""
    if m := _NINJA_STEP.match(line):
        return f"{m.group(1)}/{m.group(2)}"
    if m := _MAKE_STEP.match(line):
        return f"{m.group(1)}%"
    return None


def _stop(proc: subprocess.Popen) -> None:
    """End an interrupted CMake run and what it started: SIGTERM to its group first (ninja then ends its
    compilers, which it starts in process groups of their own: a SIGKILL of its group alone left them compiling
    into the folder), then SIGKILL to whatever is left of its session (CMake is the session's leader)."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=5.0)
    except subprocess.TimeoutExpired:
        pass
    procs.end(procs.session_members(proc.pid))
    proc.wait()


def _run(cmd: list[str], log: Path, bdir: Path | None = None, stage: str = "cmake") -> None:
    """Run cmd in its own process group, its output into log, its progress (every 2 s, and the last
    step) on stderr. With bdir, the group is recorded there while it runs (a later build ends it if we
    are killed), and it is ended if we are interrupted."""
    print(f"hotggml: {stage} ...", file=sys.stderr, flush=True)
    with open(log, "a") as fh:
        fh.write("$ " + " ".join(cmd) + "\n")
        fh.flush()
        try:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                                    text=True, errors="replace")
        except FileNotFoundError:
            raise BuildError(f"{cmd[0]} is not on PATH: install it (pip install {cmd[0]}, or your system's "
                             f"package), then run the build again") from None
        if bdir is not None:  # whole or not at all (a reader must never see it empty)
            (bdir / f"{_PGID_FILE}.tmp").write_text(f"{proc.pid}\n")
            os.replace(bdir / f"{_PGID_FILE}.tmp", bdir / _PGID_FILE)
        try:
            last = 0.0
            for line in proc.stdout:
                fh.write(line)
                step = _progress(line)
                if step and (time.monotonic() - last > 2.0 or step.split("/")[0] == step.split("/")[-1]):
                    print(f"hotggml: {stage} {step}", file=sys.stderr, flush=True)
                    last = time.monotonic()
            proc.wait()
        except BaseException:  # Ctrl-C: its own session does not get the terminal's SIGINT
            _stop(proc)
            raise
        finally:
            if bdir is not None and proc.returncode is not None:
                (bdir / _PGID_FILE).unlink(missing_ok=True)
    if proc.returncode != 0:
        tail = log.read_text(errors="replace").splitlines()[-30:]
        raise BuildError(f"{' '.join(cmd[:3])} ... failed (exit {proc.returncode}); last lines of {log}:\n" + "\n".join(tail))


def build(backend: str = "cpu", jobs: int | None = None, cuda_arch: str | None = None,
          extra_defines: dict[str, str] | None = None, tests: bool = False) -> BuildInfo:
    """Fetch the pin, apply the series, and build ``backend`` unless an identical build exists.

    ``tests``: also build ggml's own tests (``ctest`` in ``<build_dir>/ggml``, ``test-backend-ops`` in
    ``<build_dir>/lib``); the libraries are the same, so such a build is pointed at like a plain one.

    Returns the BuildInfo of the (possibly reused) build. Raises PinError / PatchError from the
    preparation steps, BuildError when CMake fails (the log path is in the message).
    """
    from hotggml import prepare

    defines = cmake_defines(backend, cuda_arch, extra_defines)  # validates the backend name first
    if backend == "vulkan" and not shutil.which("glslc"):
        # ggml-vulkan compiles its shaders with glslc at build time; CMake would fail far into the configure
        raise BuildError("the vulkan backend needs glslc and the Vulkan headers (Debian/Ubuntu packages glslc, "
                         "libvulkan-dev, spirv-headers; the README's prerequisites)")
    if tests:
        defines["HOTGGML_BUILD_TESTS"] = "ON"
    prep = prepare.prepare()
    bdir = build_dir_for(backend, prep.pin, prep.series_hash, defines)
    info = BuildInfo(backend, bdir, bdir / "lib", prep.pin, prep.series_hash, rebuilt=False)
    # the binding loads the plain build of a backend; builds with extra options (e.g. GGML_CPU_HBM=ON)
    # are checked for building, not pointed at
    point = not extra_defines
    with paths.lock(bdir, f"the build in {bdir}", _lock_dir()):  # a second build waits, then finds this one complete
        _end_stale_group(bdir)
        if not _is_complete(bdir):
            _cmake(bdir, prep, defines, jobs)
            info = BuildInfo(backend, bdir, bdir / "lib", prep.pin, prep.series_hash, rebuilt=True)
        if point:
            _set_current(info)
    return info


def _cmake(bdir: Path, prep, defines: dict[str, str], jobs: int | None) -> None:
    """Configure and build into bdir; `.complete` is written only after both succeed."""
    from hotggml import cpu

    bdir.mkdir(parents=True, exist_ok=True)
    (bdir / ".complete").unlink(missing_ok=True)
    log = bdir / "build.log"
    configure = ["cmake", "-S", str(paths.REPO_ROOT), "-B", str(bdir), *_generator(),
                 f"-DHOTGGML_GGML_SOURCE_DIR={prep.source_dir}",
                 f"-DHOTGGML_PIN={prep.pin}", f"-DHOTGGML_SERIES_HASH={prep.series_hash}",
                 f"-DHOTGGML_CPU_FLAGS={','.join(cpu.isa_flags())}",
                 f"-DPython_EXECUTABLE={sys.executable}",  # runs hotggml.cdefgen: the interpreter building
                 *[f"-D{k}={v}" for k, v in sorted(defines.items())]]
    _run(configure, log, bdir, "configure")
    _run(["cmake", "--build", str(bdir), "-j", str(jobs or os.cpu_count() or 2)], log, bdir, "compile and link")
    (bdir / ".complete").write_text(json.dumps({"pin": prep.pin, "series_hash": prep.series_hash,
                                                 "defines": defines}, indent=1) + "\n")


@dataclass(frozen=True)
class TestBuild:
    """Where a build's ggml tests are: the ctest folder and the test-backend-ops program."""

    name: str            # 'stock' or 'patched'
    ctest_dir: Path
    test_backend_ops: Path


def build_with_tests(backend: str = "cpu", jobs: int | None = None, cuda_arch: str | None = None) -> TestBuild:
    """The patched tree built with ggml's tests (``build(..., tests=True)``)."""
    info = build(backend, jobs=jobs, cuda_arch=cuda_arch, tests=True)
    return TestBuild("patched", info.build_dir / "ggml", info.lib_dir / "test-backend-ops")


def build_stock(backend: str = "cpu", jobs: int | None = None, cuda_arch: str | None = None,
                extra_defines: dict[str, str] | None = None, tests: bool = True) -> TestBuild:
    """The pristine pin (vendor/ggml, verified by ``pin.fetch``) built as upstream builds it, with its
    tests (unless ``tests`` is False): the floor the patched tree is compared against, or a stock RPC peer
    (``tests=False``). Keyed by pin + options; reused when complete.

    Raises PinError when the pin cannot be materialized, BuildError when CMake fails.
    """
    from hotggml import pin

    pin.fetch()
    defines = cmake_defines(backend, cuda_arch, extra_defines)
    defines["GGML_BUILD_TESTS"] = "ON" if tests else "OFF"
    bdir = paths.build_root() / f"stock-{backend}-{build_key(pin.UPSTREAM_COMMIT, 'stock', defines)}"
    result = TestBuild("stock", bdir, bdir / "bin" / "test-backend-ops")
    with paths.lock(bdir, f"the build in {bdir}", _lock_dir()):
        _end_stale_group(bdir)
        if (bdir / ".complete").is_file():
            return result
        bdir.mkdir(parents=True, exist_ok=True)
        log = bdir / "build.log"
        _run(["cmake", "-S", str(paths.VENDOR_DIR), "-B", str(bdir), *_generator(),
              *[f"-D{k}={v}" for k, v in sorted(defines.items())]], log, bdir, "configure (stock)")
        _run(["cmake", "--build", str(bdir), "-j", str(jobs or os.cpu_count() or 2)], log, bdir, "compile and link (stock)")
        (bdir / ".complete").write_text(json.dumps({"pin": pin.UPSTREAM_COMMIT, "defines": defines}, indent=1) + "\n")
    return result


def _set_current(info: BuildInfo) -> None:
    """Point ``<state>/build/current-<backend>`` at a good build (atomic replace)."""
    pointer = paths.build_root() / f"current-{info.backend}.json"
    tmp = pointer.with_suffix(".tmp")
    tmp.write_text(json.dumps({"lib_dir": str(info.lib_dir), "pin": info.pin,
                               "series_hash": info.series_hash}) + "\n")
    os.replace(tmp, pointer)


def current_lib_dir(backend: str | None = None, series_hash: str | None = None) -> Path | None:
    """hotggml.libdir.current_lib_dir, an older build of the code counted only with this checkout's options."""
    from hotggml import libdir

    return libdir.current_lib_dir(backend, series_hash, defines_of=cmake_defines)
