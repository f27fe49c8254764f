"""Keyed builds: an identical build is reused, anything that changes the key gets a new folder."""

from __future__ import annotations

import re

import pytest

from hotggml import build, paths, pin, series
from hotggml.errors import BuildError

PIN = "eced84c86f8b012c752c016f7fe789adea168e1e"


def test_second_build_is_reused(cpu_build):
    first = build.build("cpu")
    second = build.build("cpu")
    assert second.rebuilt is False
    assert second.build_dir == first.build_dir == cpu_build.build_dir
    assert second.lib_dir == second.build_dir / "lib"
    assert (second.lib_dir / "hotggml-build.json").is_file()
    assert (second.build_dir / ".complete").is_file()
    assert second.pin == pin.UPSTREAM_COMMIT == PIN
    assert second.series_hash == series.code_hash()  # the code of the series keys a build
    defines = build.cmake_defines("cpu")
    assert second.build_dir == build.build_dir_for("cpu", second.pin, second.series_hash, defines)
    assert build.current_lib_dir("cpu") == second.lib_dir


def test_build_key_is_deterministic_and_short():
    d = {"CMAKE_BUILD_TYPE": "Release", "GGML_NATIVE": "ON"}
    key = build.build_key(PIN, "a" * 64, d)
    assert re.fullmatch(r"[0-9a-f]{16}", key)
    assert build.build_key(PIN, "a" * 64, dict(d)) == key
    assert build.build_key(PIN, "a" * 64, dict(reversed(list(d.items())))) == key  # option order is irrelevant


def test_build_key_changes_with_inputs():
    d = build.cmake_defines("cpu")
    base = build.build_key(PIN, "a" * 64, d)
    assert build.build_key(PIN, "b" * 64, d) != base                                  # series hash
    assert build.build_key("f" * 40, "a" * 64, d) != base                             # pin
    assert build.build_key(PIN, "a" * 64, {**d, "GGML_NATIVE": "OFF"}) != base        # a define's value
    assert build.build_key(PIN, "a" * 64, {**d, "GGML_AVX2": "ON"}) != base           # an extra define
    assert build.build_key(PIN, "a" * 64, build.cmake_defines("cuda")) != base        # the backend's options
    assert build.build_key(PIN, "a" * 64, build.cmake_defines("vulkan")) != base


def test_build_key_changes_with_recipe(monkeypatch):
    if not hasattr(build, "_recipe_hash"):
        pytest.skip("build key has no recipe component")
    d = build.cmake_defines("cpu")
    base = build.build_key(PIN, "a" * 64, d)
    monkeypatch.setattr(build, "_recipe_hash", lambda: "0" * 64)
    assert build.build_key(PIN, "a" * 64, d) != base


def test_build_root_moves_with_its_own_variable(tmp_path, monkeypatch):
    monkeypatch.delenv("HOTGGML_BUILD_ROOT", raising=False)
    assert paths.build_root() == paths.state_dir() / "build"
    monkeypatch.setenv("HOTGGML_BUILD_ROOT", str(tmp_path / "shared"))
    assert paths.build_root() == tmp_path / "shared"
    assert paths.state_dir() != tmp_path  # the state folder (work tree, cache) stays where it was
    assert build.build_dir_for("cpu", PIN, "a" * 64, build.cmake_defines("cpu")).parent == tmp_path / "shared"


def test_build_dir_for():
    d = build.cmake_defines("cpu")
    bdir = build.build_dir_for("cpu", PIN, "a" * 64, d)
    assert bdir.parent == paths.build_root()
    assert bdir.name == "cpu-" + build.build_key(PIN, "a" * 64, d)
    assert build.build_dir_for("cpu", PIN, "b" * 64, d) != bdir


def test_cmake_defines(monkeypatch):
    monkeypatch.setattr(build, "gpu_compute_caps", lambda: [])  # no GPU visible: CMake's own detection
    cpu = build.cmake_defines("cpu")
    assert cpu["CMAKE_BUILD_TYPE"] == "Release"
    assert cpu["GGML_RPC"] == "ON"              # one build serves hotggml.rpc and ggml-rpc.h's op-count check
    assert "GGML_CUDA" not in cpu
    cuda = build.cmake_defines("cuda")
    assert cuda["GGML_CUDA"] == "ON"
    assert cuda["GGML_CUDA_FA"] == "OFF"        # upstream's inference FA kernels are not built
    assert cuda["CMAKE_CUDA_ARCHITECTURES"] == "native"
    assert build.cmake_defines("cuda", cuda_arch="90")["CMAKE_CUDA_ARCHITECTURES"] == "90"
    assert build.cmake_defines("vulkan")["GGML_VULKAN"] == "ON" and "GGML_CUDA" not in build.cmake_defines("vulkan")
    assert build.cmake_defines("cpu", extra={"GGML_NATIVE": "OFF"})["GGML_NATIVE"] == "OFF"
    # the defaults are not shared mutable state
    cpu["X"] = "1"
    assert "X" not in build.cmake_defines("cpu")


@pytest.mark.parametrize("name", ["nope", "CPU", "Vulkan", "metal", ""])
def test_cmake_defines_unknown_backend(name):
    with pytest.raises(BuildError, match="unknown backend"):
        build.cmake_defines(name)


def test_build_unknown_backend(cpu_build):
    with pytest.raises(BuildError, match="unknown backend"):
        build.build("nope")


def test_native_build_key_follows_the_cpu(monkeypatch):
    from hotggml import cpu

    native = build.cmake_defines("cpu")
    assert native["GGML_NATIVE"] == "ON"
    key = build.build_key("p", "s", native)
    monkeypatch.setattr(cpu, "isa_flags", lambda: ("arch:x86_64", "avx", "sse3"))
    assert build.build_key("p", "s", native) != key  # another CPU: another folder
    portable = {**native, "GGML_NATIVE": "OFF"}
    monkeypatch.setattr(cpu, "isa_flags", lambda: ("arch:x86_64",))
    k1 = build.build_key("p", "s", portable)
    monkeypatch.setattr(cpu, "isa_flags", lambda: ("arch:x86_64", "avx512f"))
    assert build.build_key("p", "s", portable) == k1  # a portable build runs anywhere


def test_native_library_refused_on_a_cpu_lacking_its_flags(tmp_path, monkeypatch, cpu_build):
    import json

    from hotggml import cpu, ffi
    from hotggml.errors import LibraryError

    record = json.loads((cpu_build.lib_dir / "hotggml-build.json").read_text())
    assert record["native"] is True and record["cpu_flags"].split(",") == list(cpu.isa_flags())
    ffi.check_cpu(cpu_build.lib_dir)  # the machine it was built on: fine
    (tmp_path / "hotggml-build.json").write_text(json.dumps({**record, "cpu_flags": "arch:x86_64,avx512f,amx_tile"}))
    monkeypatch.setattr(cpu, "isa_flags", lambda: ("arch:x86_64", "avx2"))
    with pytest.raises(LibraryError, match="GGML_NATIVE for a CPU with avx512f, amx_tile, which this CPU"):
        ffi.check_cpu(tmp_path)
    (tmp_path / "hotggml-build.json").write_text(json.dumps({**record, "native": False, "cpu_flags": "avx512f"}))
    ffi.check_cpu(tmp_path)  # portable: no claim to check


def test_installed_package_keeps_out_of_site_packages(tmp_path, monkeypatch, capsys):
    """Outside a checkout (an installed package), state goes to the user's cache folder, and the commands
    that work on patches/ and vendor/ggml refuse by name instead of creating them under site-packages."""
    from hotggml import cli

    site = tmp_path / "site-packages"
    site.mkdir()
    monkeypatch.setattr(paths, "REPO_ROOT", site)
    monkeypatch.delenv(paths.STATE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert not paths.is_checkout()
    assert paths.state_dir() == (tmp_path / "cache" / "hotggml").resolve()
    for command in (["fetch"], ["patches", "status"], ["prepare"], ["build"], ["floor"]):
        assert cli.main(command) == 2
        err = capsys.readouterr().err
        assert f"`hotggml {command[0]}` works on a hotggml checkout" in err and "Traceback" not in err
    assert list(site.iterdir()) == []


@pytest.mark.parametrize("caps, arch", [
    ([], "native"),                    # no nvidia-smi, or no GPU
    (["9.0"], "90a"),                  # an H100 / H200: the wgmma kernels need sm_90a
    (["9.0", "9.0"], "90a"),
    (["8.0"], "native"),               # an A100: CMake's detection (80) is all it needs
    (["9.0", "8.6"], "native"),        # mixed: a 90a binary would not run on the 8.6 card
])
def test_default_cuda_arch(monkeypatch, caps, arch):
    monkeypatch.setattr(build, "gpu_compute_caps", lambda: caps)
    assert build.default_cuda_arch() == arch
    assert build.cmake_defines("cuda")["CMAKE_CUDA_ARCHITECTURES"] == arch
    assert build.cmake_defines("cuda", cuda_arch="80")["CMAKE_CUDA_ARCHITECTURES"] == "80"  # a named one wins


def test_gpu_compute_caps_without_nvidia_smi(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    assert build.gpu_compute_caps() == []


def test_vulkan_without_glslc_is_refused_by_name(monkeypatch):
    monkeypatch.setattr(build.shutil, "which", lambda name: None)
    with pytest.raises(BuildError, match="glslc"):
        build.build("vulkan")

