"""The CLI's conventions: one exit-code scheme (0 ok, 1 a check failed, 2 a usage or input error, 130
interrupted), errors as one `hotggml: error:` line and never a traceback, test-backend-ops' spellings
(-b BACKEND, -p REGEX with a hint when nothing matches, a way to list cases), defaults in --help and a
--version that names the package, the pin and the series."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys

import pytest

from hotggml import __version__, cli, paths, pin
from hotggml.errors import BuildError


def _hotggml(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hotggml", *args], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(paths.REPO_ROOT), **(env or {})})


@pytest.mark.parametrize("command", ["parity", "probe", "bench --set field"])
def test_a_pattern_that_matches_nothing_is_an_error_that_lists_the_ids(command):
    run = _hotggml(*command.split(), "-p", "nomatch")
    assert run.returncode == cli.EXIT_ERROR
    assert "hotggml: error: no case of" in run.stderr and "matches -p 'nomatch'; the ids are:" in run.stderr
    assert "Traceback" not in run.stderr


@pytest.mark.parametrize("name", [paths.STATE_ENV, paths.BUILD_ROOT_ENV])
def test_a_state_or_build_folder_setting_it_cannot_use_is_named(name, tmp_path):
    # a relative path (another folder from each working directory), a file, and a folder that cannot be made: the
    # message names the variable, and nothing is made under the working directory
    run = _hotggml("build", "--backend", "cpu", env={name: "relative-state"})
    assert run.returncode == cli.EXIT_ERROR and f"{name}=relative-state is a relative path" in run.stderr
    assert not (paths.REPO_ROOT / "relative-state").exists()
    (tmp_path / "f").write_text("")
    run = _hotggml("build", "--backend", "cpu", env={name: str(tmp_path / "f")})
    assert run.returncode == cli.EXIT_ERROR and f"{name}={tmp_path / 'f'} is not a folder" in run.stderr
    run = _hotggml("build", "--backend", "cpu", env={name: str(paths.VENDOR_DIR / "state")})
    assert run.returncode == cli.EXIT_ERROR and "inside the pinned tree" in run.stderr
    assert not (paths.VENDOR_DIR / "state").exists()
    run = _hotggml("build", "--backend", "cpu", env={name: "/proc/hotggml-state"})
    assert run.returncode == cli.EXIT_ERROR and f"(the folder {name}=/proc/hotggml-state names)" in run.stderr
    assert "Traceback" not in run.stderr


def test_json_pointing_at_a_folder_is_refused_before_the_run(tmp_path):
    for command in (["parity"], ["bench", "--set", "field"]):
        run = _hotggml(*command, "--json", str(tmp_path))
        assert run.returncode == cli.EXIT_ERROR and "is a folder: give a file name" in run.stderr
        run = _hotggml(*command, "--json", str(tmp_path / "no" / "such" / "x.json"))
        assert run.returncode == cli.EXIT_ERROR and "no such folder" in run.stderr
        assert "Traceback" not in run.stderr
    # a folder that exists but takes no new file (a pseudo file system): refused before the run too
    run = _hotggml("train-demo", "--json", "/proc/x.json")
    assert run.returncode == cli.EXIT_ERROR and "cannot be written" in run.stderr and "Traceback" not in run.stderr
    target = tmp_path / "fresh.json"  # the check leaves no file behind
    assert cli._json_path(str(target)) == str(target) and not target.exists()
    # '-' (stdout to most tools) made a file named '-' here; a file where a folder should be was "no such folder"
    (tmp_path / "file").write_text("x")
    for path, said in (("-", "'-' is no file name here"), (str(tmp_path / "file" / "x.json"), "file is not a folder")):
        with pytest.raises(argparse.ArgumentTypeError, match=said):
            cli._json_path(path)


def test_list_prints_the_selected_cases_and_runs_nothing():
    run = _hotggml("parity", "-l", "--set", "real", "-p", "lm")
    ids = [line.split()[0] for line in run.stdout.splitlines()]
    assert run.returncode == 0 and ids and all("lm" in i for i in ids) and "passed" not in run.stdout


def test_backend_short_option_and_defaults_in_help():
    for command in ("parity", "bench", "probe", "memory"):
        text = _hotggml(command, "--help").stdout
        flat = re.sub(r"\s+", " ", text)  # argparse wraps the help where it likes
        assert "-b BACKEND, --backend BACKEND" in text and "(default: cpu)" in flat
        assert "exit status: 0 ok; 1 a check failed" in flat


def test_version_names_package_pin_and_series():
    run = _hotggml("--version")
    assert run.returncode == 0
    assert run.stdout.startswith(f"hotggml {__version__} (ggml {pin.TAG} upstream {pin.UPSTREAM_COMMIT[:12]}, code ")
    # the code hash of this checkout's series (its diffs: what the library's stamp holds), named apart from the
    # series hash of the patch files that `patches check` prints: two different values, two different names
    from hotggml import series
    assert f"code {series.code_hash()[:12]})" in run.stdout and series.series_hash()[:12] not in run.stdout


def test_usage_errors_exit_2_and_unknown_commands_too():
    assert _hotggml("parity", "--prec", "f64").returncode == cli.EXIT_ERROR
    assert _hotggml("no-such-command").returncode == cli.EXIT_ERROR
    assert cli.main(["parity", "--runs"]) == cli.EXIT_ERROR  # argparse's exit is turned into a return code


@pytest.mark.parametrize("command, bad", [("parity", "--bogus"), ("memory", "--bogus"), ("probe", "-x"),
                                          ("train-demo", "--stepz 3"), ("patches check", "--x"),
                                          ("bench --set field", "--bogus")])
def test_an_unknown_option_is_reported_with_the_commands_usage_and_prog(command, bad):
    # parse_args on the top-level parser reported it as `usage: hotggml [-h] [--version] COMMAND ...` and
    # `hotggml: error:`; the README says: the command's usage and `hotggml <command>: error: ...`
    prog = "hotggml " + " ".join(w for w in command.split() if not w.startswith("-") and w != "field")
    run = _hotggml(*command.split(), *bad.split())
    assert run.returncode == cli.EXIT_ERROR, run.stderr
    lines = run.stderr.strip().splitlines()
    assert lines[0].startswith(f"usage: {prog} ") and "COMMAND ..." not in run.stderr, run.stderr
    assert lines[-1] == f"{prog}: error: unrecognized arguments: {bad}"
    assert "Traceback" not in run.stderr
    # an unknown option before the command is the top level's
    run = _hotggml("--bogus", *command.split())
    assert run.returncode == cli.EXIT_ERROR
    assert run.stderr.strip().splitlines()[-1] == "hotggml: error: unrecognized arguments: --bogus"


@pytest.mark.parametrize("seq", ["4611686018427387904", str(2**46 + 1), "0", "-3", "625,0", "1,x", ","])
def test_memory_refuses_a_sequence_length_out_of_range_as_a_usage_error(seq):
    # S = 2^62 was a NumPy traceback ("iterator is too large", exit 1); 0 was "threads must be >= 1"
    run = _hotggml("memory", "--seq", seq, "--no-chain")
    assert run.returncode == cli.EXIT_ERROR and "Traceback" not in run.stderr, run.stderr[-2000:]
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("hotggml memory: error: argument --seq: sequence lengths S must be "), last
    assert "threads" not in run.stderr
    if seq not in ("1,x", ","):
        assert f"in [1, {2**46}]" in last


def test_the_longest_sequence_length_accepted_is_refused_by_the_binding_in_one_line():
    # the parser's bound, 2^46 (2^48 bytes of f32: graph.MAX_TENSOR_BYTES), meets the binding's own refusal
    from hotggml import graph

    run = _hotggml("memory", "--seq", str(2**46), "--no-chain")
    assert run.returncode == cli.EXIT_ERROR and "Traceback" not in run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hotggml: error: shape ") and "is over" in lines[0], run.stderr
    assert cli._max_seq() == 2**46 == graph.MAX_TENSOR_BYTES // 4


@pytest.mark.parametrize("flag", [["--json", "ROWS"], ["--profile"], ["--no-chain"], ["-p", "dit"]])
def test_bench_table_options_without_a_set_are_refused_not_ignored(flag, tmp_path):
    # they shape the --set table; the one case's timing printed as if they had been taken (exit 0, no JSON)
    rows = tmp_path / "rows.json"
    run = _hotggml("bench", "--case", "tiny", *[str(rows) if f == "ROWS" else f for f in flag])
    assert run.returncode == cli.EXIT_ERROR and "Traceback" not in run.stderr
    assert f"{flag[0]} needs --set" in run.stderr and not rows.exists(), run.stderr


@pytest.mark.parametrize("args, message", [
    (["bench", "--set", "smoke", "--case", "tiny", "-l"], "--case times one case, --set a table"),
    (["memory", "--case", "", "--no-chain"], "unknown case ''"),
    (["build", "--cuda-arch", "90"], "--cuda-arch is for --backend cuda, not cpu"),
])
def test_arguments_a_command_would_ignore_are_refused(args, message):
    # each ran something else and exited 0: the --set table without the case, the default case, a CPU build
    run = _hotggml(*args)
    assert run.returncode == cli.EXIT_ERROR and "Traceback" not in run.stderr
    assert message in run.stderr, run.stderr


@pytest.mark.parametrize("args, message", [
    (["parity", "--threads", "1,513"], "argument --threads: threads must be in [1, 512], got 513"),
    (["parity", "--threads", "0"], "argument --threads: threads must be in [1, 512], got 0"),
    (["parity", "--threads", "1,,2"], "argument --threads: threads must be a comma list of integers, got '1,,2'"),
    (["memory", "--seq", "1024,"], "argument --seq: "),
    (["bench", "--threads", "-1"], "argument --threads: threads must be in [1, 512], got -1"),
    (["bench", "--threads", str(2**70)], f"argument --threads: threads must be in [1, 512], got {2**70}"),
    (["bench", "--runs", "x"], "argument --runs: runs must be an integer, got 'x'"),
    (["bench", "--smem-caps", str(2**63)], "argument --smem-caps: shared-memory caps must be KiB values in [1, "),
    (["build", "--jobs", "0"], "argument --jobs: jobs must be >= 1, got 0"),
    (["floor", "--jobs", "-2"], "argument --jobs: jobs must be >= 1, got -2"),
])
def test_absurd_numbers_are_usage_errors_naming_the_option(args, message, capsys):
    # the parser alone: where it accepted them, they reached a build, a timing run or the C side
    with pytest.raises(SystemExit) as exc:
        cli.build_parser(only=args[0]).parse_args(args)
    err = capsys.readouterr().err
    assert exc.value.code == cli.EXIT_ERROR and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith(f"hotggml {args[0]}: error: {message}"), err


def test_a_closed_stdout_ends_the_command_quietly():
    # `hotggml parity -l | head -1` ended with `hotggml: error: [Errno 32] Broken pipe`; Unix tools end quietly
    proc = subprocess.Popen([sys.executable, "-m", "hotggml", "probe", "-l", "--set", "field", "--set", "real"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(paths.REPO_ROOT)})
    proc.stdout.close()  # the reader goes away before the first line
    err = proc.stderr.read()
    assert (proc.wait(timeout=600), err) == (141, "")
    assert cli.EXIT_STDOUT_CLOSED == 141  # 128 + SIGPIPE, what a shell shows for a tool ended by the pipe


def test_a_broken_pipe_that_is_not_stdout_is_still_an_error_line():
    code = ("import sys\nfrom hotggml import cli\n"
            "def step(args):\n"
            "    raise BrokenPipeError(32, 'Broken pipe')\n"
            "parser = cli.build_parser()\n"
            "cli.build_parser = lambda only=None: parser\n"
            "parser._subparsers._group_actions[0].choices['probe'].set_defaults(func=step)\n"
            "sys.exit(cli.main(['probe']))\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(paths.REPO_ROOT)})
    assert run.returncode == cli.EXIT_ERROR and run.stderr == "hotggml: error: [Errno 32] Broken pipe\n", run.stderr


def test_the_bench_ceiling_is_sized_for_the_cpu_and_says_so():
    # 8192^3 f32 on a CPU took minutes before the table's first case; the GPU's ceiling is unchanged
    from hotggml import bench

    assert bench.ceiling_size("CPU") == bench.ceiling_size("Meta(CPU,CPU)") == bench.CEILING_N_CPU < 8192
    assert bench.ceiling_size("CUDA0") == bench.ceiling_size("Meta(CUDA0,CUDA1)") == bench.CEILING_N == 8192
    row = bench.FieldRow("c", "s", 1e-3, None, 2e-3, 1 << 20, 2 << 20, 10**9, {"fused_tf32": "f32-cpu"})
    assert f"mul_mat {bench.CEILING_N_CPU}^3: sized for the CPU" in bench.format_field([row], 0.06, "CPU", 2048)
    assert "mul_mat 8192^3: TF32 tensor cores on CUDA) 400.0 TFLOP/s" in bench.format_field([row], 400.0, "CUDA0")


def test_a_missing_tool_is_a_build_error_not_a_traceback(tmp_path):
    from hotggml import build

    with pytest.raises(BuildError, match="cmake-not-installed is not on PATH"):
        build._run(["cmake-not-installed", "--version"], tmp_path / "log")


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_an_interactive_shell_survives_a_failing_command(tmp_path):
    script = f"source {paths.REPO_ROOT}/ci/env.sh; hotggml parity -p nomatch; echo alive $?"
    run = subprocess.run(["bash", "-i", "-c", script], capture_output=True, text=True, timeout=600,
                         cwd=tmp_path, env={**os.environ, "HOME": str(tmp_path)})
    assert "alive 2" in run.stdout


def test_an_error_in_the_command_is_one_line(monkeypatch, capsys):
    """Any HotggmlError or OSError a command raises ends as `hotggml: error: ...` and exit 2."""
    import argparse

    def boom(args: argparse.Namespace) -> int:
        raise OSError(21, "Is a directory", "/tmp")

    parser = cli.build_parser()
    monkeypatch.setattr(cli, "build_parser", lambda only=None: parser)
    parser._subparsers._group_actions[0].choices["probe"].set_defaults(func=boom)
    assert cli.main(["probe"]) == cli.EXIT_ERROR
    err = capsys.readouterr().err
    assert err.startswith("hotggml: error: [Errno 21] Is a directory: '/tmp'") and "Traceback" not in err


@pytest.mark.parametrize("how", ["SIGINT", "SIGTERM", "SIGHUP", "SIGTERM, SIGINT ignored"])
def test_ctrl_c_exits_130_and_ends_the_build_tools(tmp_path, how):
    """SIGINT while a build step runs: the step's process group (cmake, ninja, compilers; its own session, so
    the terminal's SIGINT does not reach it) is ended, and the command exits 130, not 'build failed'. SIGTERM
    (timeout, kill) and SIGHUP (a closed terminal) end it the same way (they left the build tools running),
    also where SIGINT is ignored, as a shell script's background job starts (they were passed to SIGINT's
    disposition: ignored, so `kill` and `timeout` ended nothing)."""
    import signal
    import time

    code = ("import sys\nfrom pathlib import Path\nfrom hotggml import build, cli\n"
            "def step(args):\n"
            f"    build._run(['sleep', '60'], Path({str(tmp_path / 'log')!r}), Path({str(tmp_path)!r}), 'compile')\n"
            "    return 0\n"
            "parser = cli.build_parser()\n"
            "cli.build_parser = lambda only=None: parser\n"
            "parser._subparsers._group_actions[0].choices['probe'].set_defaults(func=step)\n"
            "sys.exit(cli.main(['probe']))\n")
    ignore_sigint = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if "ignored" in how else None
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(paths.REPO_ROOT)}, preexec_fn=ignore_sigint)
    pgid_file = tmp_path / ".build-pgid"
    deadline = time.monotonic() + 60
    while not pgid_file.is_file() and time.monotonic() < deadline:
        time.sleep(0.05)
    pgid = int(pgid_file.read_text())
    proc.send_signal(getattr(signal, how.split(",")[0]))
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == cli.EXIT_INTERRUPTED, err
    assert "interrupted" in err and "Traceback" not in err and "failed" not in err
    from hotggml import procs

    assert not procs.group_members(pgid)


def test_a_command_imports_only_its_own_module():
    # `pip install .` runs `hotggml prepare` in pip's build environment, which has no numpy: a command must
    # not import the other commands' modules (train-demo's needs numpy). numpy made unimportable here.
    code = ("import sys; sys.modules['numpy'] = None\n"
            "from hotggml.cli import main\n"
            "raise SystemExit(main(['prepare', '--help']))\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(paths.REPO_ROOT)})
    assert run.returncode == 0, run.stderr
    assert "usage: hotggml prepare" in run.stdout
    full = _hotggml("--help")  # the full parser still lists every command
    assert full.returncode == 0 and all(name in full.stdout for name in cli.COMMANDS)


# GitPython made unimportable in a child interpreter: what a user with the binding's dependencies alone has
_NO_GIT = """
import runpy, sys
class _NoGit:
    def find_spec(self, name, path=None, target=None):
        if name == "git" or name.startswith("git."):
            raise ModuleNotFoundError("No module named 'git'", name="git")
sys.meta_path.insert(0, _NoGit())
sys.argv = ["hotggml"] + sys.argv[1:]
runpy.run_module("hotggml", run_name="__main__")
"""


def _without_git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _NO_GIT, *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(paths.REPO_ROOT)}, cwd=paths.REPO_ROOT)


@pytest.mark.parametrize("args", [["--help"], ["--version"], *([c, "--help"] for c in cli.COMMANDS)],
                         ids=lambda a: " ".join(a))
def test_help_without_gitpython(args):
    run = _without_git(*args)
    assert run.returncode == 0, run.stderr[-1500:]
    assert "Traceback" not in run.stderr and run.stdout.strip()


@pytest.mark.parametrize("args", [["patches", "check"], ["fetch"], ["build", "--backend", "cpu"]])
def test_tooling_without_gitpython_is_one_error_line(args):
    run = _without_git(*args)
    assert run.returncode == cli.EXIT_ERROR and "Traceback" not in run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hotggml: error:") and "GitPython" in lines[0], run.stderr


def test_a_repository_git_refuses_for_its_owner_is_one_line_naming_it_and_the_fix(tmp_path):
    """git's safe.directory refusal ("dubious ownership") of vendor/ggml or the work repo, from every command that
    reaches them: one `hotggml: error:` line naming the folder and the `git config --global --add safe.directory`
    that allows it (it was a GitCommandError traceback, or `patches apply`'s false "vendor/ggml has no commit"),
    and that command, run as the line says, is enough. git is made to take every repository for another user's
    (GIT_TEST_ASSUME_DIFFERENT_OWNER, git's own switch for its tests), the checkout itself allowed."""
    sdist = next((p for p in (os.environ.get(pin.SDIST_ENV), paths.cache_dir() / pin.SDIST_FILE)
                  if p and os.path.isfile(p)), None)
    if sdist is None:
        pytest.skip("no cached pinned sdist")
    repo, home = tmp_path / "repo", tmp_path / "home"
    home.mkdir()
    subprocess.run(["git", "clone", "--quiet", str(paths.REPO_ROOT), str(repo)], check=True)
    env = {**os.environ, "PYTHONPATH": str(repo), paths.STATE_ENV: str(tmp_path / "state"), pin.SDIST_ENV: str(sdist),
           "HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config")}
    env.pop("GIT_CONFIG_GLOBAL", None)

    def hotggml(*args: str, **extra) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "hotggml", *args], cwd=repo, env={**env, **extra},
                              capture_output=True, text=True, timeout=600)

    for args in (["fetch"], ["patches", "apply"]):
        assert hotggml(*args).returncode == 0
    allow = lambda folder: subprocess.run(["git", "config", "--global", "--add", "safe.directory", folder],
                                          env=env, check=True)
    allow(str(repo))
    env["GIT_TEST_ASSUME_DIFFERENT_OWNER"] = "1"
    vendor, work = str((repo / "vendor" / "ggml").resolve()), str((tmp_path / "state" / "work" / "ggml").resolve())
    for args, folder in ((["fetch"], vendor), (["patches", "apply"], vendor), (["patches", "check"], vendor),
                         (["build", "--backend", "cpu"], vendor), (["patches", "export"], work),
                         (["patches", "status"], work), (["pin", "set", "HEAD"], work)):
        run = hotggml(*args)
        lines = run.stderr.strip().splitlines()
        assert run.returncode == cli.EXIT_ERROR and len(lines) == 1, (args, run.stderr[-2000:])
        assert lines[0].startswith(f"hotggml: error: git refuses to work in {folder}: ") and "dubious ownership" in \
            lines[0] and f"`git config --global --add safe.directory {folder}`" in lines[0], (args, lines[0])
    allow(vendor)
    assert hotggml("fetch").returncode == 0
    assert f"safe.directory {work}`" in hotggml("patches", "apply").stderr
    allow(work)
    run = hotggml("patches", "apply")
    assert run.returncode == 0 and "already applied" in run.stdout, run.stderr


def test_patches_status_without_a_work_tree_says_so(tmp_path):
    # every patch "not applied", exit 0, and no word that there is no tree at all: now the last line says it
    run = _hotggml("patches", "status", env={paths.STATE_ENV: str(tmp_path / "state")})
    assert run.returncode == 0 and "not applied" in run.stdout
    assert run.stdout.rstrip().endswith("no work tree there yet (`hotggml patches apply` makes it)")
    # the markers column lines up however long a name is (a 28-wide name column ran into it)
    rows = [line for line in run.stdout.splitlines() if "markers " in line]
    assert len(rows) > 1 and len({line.index(" markers ") for line in rows}) == 1, rows


def test_a_define_whose_key_is_no_cmake_variable_is_refused_before_building():
    """`-D 'A B=1'` started a new keyed build (CMake took it as some other variable, or failed minutes later)."""
    for item in ("A B=1", "=1", "X-Y=2"):
        run = _hotggml("build", "--backend", "cpu", "-D", item)
        assert run.returncode == cli.EXIT_ERROR and "KEY a CMake variable name" in run.stderr, run.stderr[-1000:]


def test_empty_names_are_named_as_such(tmp_path):
    """`fetch --sdist ""` said ": a directory"; `patches export --upstream ""` wrote the patches into the folder the
    command ran from (Path("") is ".")."""
    run = _hotggml("fetch", "--sdist", "")
    assert run.returncode == cli.EXIT_ERROR and "'': an empty name, not the tarball" in run.stderr, run.stderr
    run = subprocess.run([sys.executable, "-m", "hotggml", "patches", "export", "--upstream", ""], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(paths.REPO_ROOT)})
    assert run.returncode == cli.EXIT_ERROR and "named by an empty string" in run.stderr, run.stderr
    assert not list(tmp_path.iterdir())
