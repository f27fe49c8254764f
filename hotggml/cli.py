"""The `hotggml` command: thin argument parsing over the modules that do the work.

Each subcommand is registered in COMMANDS as name -> "module:function"; the function
takes argparse's subparsers object, adds its parser, and sets `func` (args -> exit
code) as the parser default. Modules are imported only when the parser is built, so
adding `build`, `parity`, `memory`, `bench` is one line each here plus an
`add_parser(subparsers)` in the module.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from collections.abc import Callable, Sequence

from hotggml.errors import HotggmlError

COMMANDS: dict[str, str] = {
    "fetch": "hotggml.cli:add_fetch_parser",
    "patches": "hotggml.cli:add_patches_parser",
    "prepare": "hotggml.cli:add_prepare_parser",
    "build": "hotggml.cli:add_build_parser",
    "parity": "hotggml.cli:add_parity_parser",
    "memory": "hotggml.cli:add_memory_parser",
    "bench": "hotggml.cli:add_bench_parser",
    "probe": "hotggml.cli:add_probe_parser",
    "floor": "hotggml.cli:add_floor_parser",
    "pin": "hotggml.cli:add_pin_parser",
    "train-demo": "hotggml.train_demo:add_parser",
}


# commands that work on the repository's patches/ and vendor/ggml: refused, by name, from an installed package
NEEDS_CHECKOUT = {"fetch", "patches", "prepare", "build", "floor", "pin"}


EXIT_OK, EXIT_CHECK_FAILED, EXIT_ERROR, EXIT_INTERRUPTED = 0, 1, 2, 130
EXIT_STDOUT_CLOSED = 141  # 128 + SIGPIPE: what a shell reports for a Unix tool whose reader went away (| head)

EPILOG = """exit status: 0 ok; 1 a check failed (parity, probe, floor, patches check, train-demo), patches export
--dry-run found stale patches, pin set stopped at a conflict; 2 a usage or
input error, or a step that could not run (the message says which); 130 interrupted (Ctrl-C); 141 stdout
closed by its reader (| head), quietly."""

_CHOSEN = "_hotggml_parser"  # namespace key: the parser of the subcommand argparse chose (_mark_parsers)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; return the exit code (EPILOG): errors are one line on stderr, never a traceback. A reader
    that closes stdout early (``| head``) ends the command quietly, as Unix tools do: no message, exit 141.
    SIGTERM and SIGHUP (``timeout``, ``kill``, a closed terminal) end a command as Ctrl-C does: what it started
    is ended and its state left as after an interrupt (else a build's compilers outlived it)."""
    _terminate_as_interrupt()
    try:
        code = _main(argv)
        sys.stdout.flush()  # what is still buffered: a closed pipe shows here, not as a warning at exit
        return code
    except BrokenPipeError as exc:
        if not _stdout_closed():  # another pipe than stdout (a child's): an error like any OSError
            print(f"hotggml: error: {exc}", file=sys.stderr)
            return EXIT_ERROR
        _stdout_to_devnull()
        return EXIT_STDOUT_CLOSED


def _terminate_as_interrupt() -> None:
    """SIGTERM and SIGHUP delivered as SIGINT, to whatever handles SIGINT then (KeyboardInterrupt, or a block
    that defers it: hotggml.graph.interrupts_deferred). Main thread only (where Python takes signals)."""
    import signal
    import threading

    from hotggml.procs import deliver_interrupt

    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, deliver_interrupt)


def _stdout_closed() -> bool:
    """Whether stdout is a pipe whose reader has gone (POLLERR); True where poll cannot tell."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll (Windows), or a stdout without a file descriptor
        return True


def _stdout_to_devnull() -> None:
    """Point stdout's file descriptor at /dev/null, so the interpreter's own flush at exit has nowhere to fail
    (Python's documentation, signal module: "Note on SIGPIPE")."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (AttributeError, OSError, ValueError):  # a stdout with no descriptor (a test's capture): nothing to do
        pass


def _main(argv: Sequence[str] | None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    named = args_list[0] if args_list and args_list[0] in COMMANDS else None
    parser = build_parser(only=named)
    try:
        args, extra = parser.parse_known_args(args_list)
        # the parser of the (sub)command chosen, innermost (patches check): its usage and prog for the error;
        # options before the command name are the top-level parser's
        chosen = vars(args).pop(_CHOSEN, None)
        if extra:
            if chosen is None or not args_list or args_list[0] != getattr(args, "command", None):
                chosen = parser
            chosen.error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as exc:  # argparse: --help / --version (0) or a usage error (2, its message printed)
        return int(exc.code or 0)
    if not hasattr(args, "func"):
        parser.print_help(sys.stderr)
        return EXIT_ERROR
    try:
        if args.command in NEEDS_CHECKOUT:
            from hotggml import paths

            paths.require_checkout(args.command)
        if args.func in _DISTURB_A_PIN_SET:
            from hotggml import rebase

            rebase.refuse_if_in_progress(" ".join(args_list[:2] if args.command == "patches" else args_list[:1]))
        return int(args.func(args) or 0)
    except HotggmlError as exc:
        print(f"hotggml: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except ImportError as exc:  # a dependency not installed (GitPython: the tooling's, not the binding's)
        name = (getattr(exc, "name", None) or "").split(".")[0]
        if name == "hotggml":
            raise  # a module of this package missing: a broken install, not the user's to fix by pip
        if name == "git" or "git" in str(exc).lower():
            print(f"hotggml: error: `hotggml {args.command}` needs GitPython and git: {exc} (pip install gitpython, "
                  "or this package's `tooling` extra; git from the OS)", file=sys.stderr)
        else:
            print(f"hotggml: error: `hotggml {args.command}` needs the Python module {name or '?'}, which is not "
                  f"installed: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except BrokenPipeError:
        raise  # main's: stdout closed by its reader
    except OSError as exc:  # a file the command reads or writes (a --json path, a log): say which, no traceback
        from hotggml import paths

        setting = paths.setting_behind(exc.filename)
        print(f"hotggml: error: {exc}" + (f" (the folder {setting} names)" if setting else ""), file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        if args.func is _run_pin_set and _pin_set_in_progress():
            print("hotggml: interrupted: a `hotggml pin set` is in progress (this one, or another that holds its "
                  "lock): once none runs, finish it with `hotggml pin set --continue` or undo it with `hotggml pin "
                  "set --abort`", file=sys.stderr)
        else:
            print("hotggml: interrupted (a keyed build or tree left half-done is redone on the next run)", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:  # git's own failure that no module put in words: still one line, never a traceback
        if type(exc).__name__ != "GitCommandError":
            raise
        print(f"hotggml: error: {git_failure(exc)}", file=sys.stderr)
        return EXIT_ERROR


def git_failure(exc: Exception) -> str:
    """One line for a git.exc.GitCommandError: the git command, its exit status and the first line git wrote."""
    command = getattr(exc, "command", None)
    words = [str(w) for w in command] if isinstance(command, (list, tuple)) else [str(command or "git")]
    shown = " ".join(w for w in words if not w.startswith("-c") and "=" not in w)[:120]
    stderr = getattr(exc, "stderr", "") or ""
    stderr = stderr.decode(errors="replace") if isinstance(stderr, bytes) else str(stderr)
    lines = [line.strip() for line in stderr.replace("stderr:", "").strip().strip("'").splitlines() if line.strip()]
    return f"`{shown}` failed (exit {getattr(exc, 'status', '?')}): {lines[0] if lines else 'no message'}"


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """Return the top-level parser with every registered subcommand, or with command ``only`` alone: a
    command imports its own module only (``prepare`` runs inside pip's build environment, which has the
    build's requirements and not numpy, which train-demo's module needs)."""
    parser = argparse.ArgumentParser(prog="hotggml", description="pinned ggml + patch series tooling", epilog=EPILOG)
    parser.add_argument("--version", action="version", version=version_line())
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND", dest="command")
    # every subcommand's --help shows its defaults
    subparsers.add_parser = _with_defaults_shown(subparsers.add_parser)
    for name, target in COMMANDS.items():
        if only is None or name == only:
            _load(target)(subparsers)
    _mark_parsers(parser)
    return parser


def _mark_parsers(parser: argparse.ArgumentParser) -> None:
    """Give every subcommand's parser, nested ones too (patches check), itself as the default of _CHOSEN: after
    parse_known_args the namespace names the innermost parser chosen, whose error() then reports an unknown
    option with that command's usage and prog (argparse's parse_args reports it with the top level's)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                sub.set_defaults(**{_CHOSEN: sub})
                _mark_parsers(sub)


class _DefaultsShown(argparse.HelpFormatter):
    """Help that ends each option with its default, where it has one worth showing."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.option_strings and action.default not in (None, False, argparse.SUPPRESS) and "%(default)" not in text:
            text += " (default: %(default)s)"
        return text


def _with_defaults_shown(add_parser: Callable[..., argparse.ArgumentParser]) -> Callable[..., argparse.ArgumentParser]:
    def add(name: str, **kwargs) -> argparse.ArgumentParser:
        kwargs.setdefault("formatter_class", _DefaultsShown)
        kwargs.setdefault("epilog", EPILOG)
        return add_parser(name, **kwargs)
    return add


def version_line() -> str:
    """'hotggml X (ggml TAG upstream COMMIT, code HASH)': the package version (hotggml.__version__, which
    pyproject.toml reads), the pin, and the code hash of this checkout's series (hotggml.series.code_hash: the
    diffs a build consumes, as the library's stamp holds it; the `patches` commands print the series hash of the
    patch files themselves) or of the installed build's record."""
    from hotggml import __version__, paths
    from hotggml import pin_record as pin  # the record alone: no git needed to say the version

    series = "unknown"
    try:
        if paths.is_checkout():
            from hotggml import series as series_file

            series = series_file.code_hash()[:12]  # what the build stamps: hotggml-build.json's series_hash
        else:
            import json

            from hotggml.ffi import find_lib_dir

            series = json.loads((find_lib_dir() / "hotggml-build.json").read_text())["series_hash"][:12]
    except (HotggmlError, OSError, KeyError, ValueError):
        pass
    return f"hotggml {__version__} (ggml {pin.TAG} upstream {pin.UPSTREAM_COMMIT[:12]}, code {series})"


def _load(target: str) -> Callable[[argparse._SubParsersAction], None]:
    module, _, function = target.partition(":")
    return getattr(importlib.import_module(module), function)


# -- fetch ------------------------------------------------------------------------------

def add_fetch_parser(subparsers: argparse._SubParsersAction) -> None:
    """Add `fetch [--sdist PATH] [--force]`."""
    parser = subparsers.add_parser("fetch", help="materialize and verify the pinned ggml in vendor/ggml")
    parser.add_argument("--sdist", metavar="PATH", help="the ggml_python-0.0.45.tar.gz to use (else "
                        "$HOTGGML_GGML_SDIST, the cache, then pip)")
    parser.add_argument("--force", action="store_true",
                        help="replace a committed vendor/ggml that is not the pin")
    parser.set_defaults(func=_run_fetch)


def _run_fetch(args: argparse.Namespace) -> int:
    from hotggml import pin

    result = pin.fetch(args.sdist, force=args.force)
    what = "verified" if not result.changed else f"materialized from {result.source}"
    local = "" if result.commit == pin.UPSTREAM_COMMIT else f", local commit {result.commit[:12]} (same trees)"
    print(f"pin ggml {pin.TAG} (upstream {pin.UPSTREAM_COMMIT[:12]}) at {result.path}: {what}{local}")
    return 0


# -- patches ----------------------------------------------------------------------------

def add_patches_parser(subparsers: argparse._SubParsersAction) -> None:
    """Add `patches status|apply|check|export`."""
    parser = subparsers.add_parser("patches", help="manage the patch series on top of the pin")
    actions = parser.add_subparsers(title="actions", metavar="ACTION", required=True)
    actions.add_parser("status", help="state of each patch in the work tree").set_defaults(func=_run_status)
    apply = actions.add_parser("apply", help="build the patched work tree (.hotggml/work/ggml)")
    apply.add_argument("--force", action="store_true", help="discard uncommitted or unexported work in it")
    apply.set_defaults(func=_run_apply)
    actions.add_parser("check", help="CI gate: apply to a scratch pin, markers, canonical export"
                       ).set_defaults(func=_run_check)
    export = actions.add_parser("export", help="write the work tree's commits back to patches/")
    export.add_argument("--dry-run", action="store_true", help="list files that would change; exit 1 if any")
    export.add_argument("--force", action="store_true",
                        help="write even where patches/ changed since the work tree was made from it")
    export.add_argument("--upstream", metavar="DIR", default=None,
                        help="instead: write the `Upstream-Status: submit` patches to DIR for ggml upstream, "
                             "one mail-ready file each, without the project's trailers")
    export.set_defaults(func=_run_export)


def _run_apply(args: argparse.Namespace) -> int:
    from hotggml import patches

    result = patches.apply(force=args.force)
    if result.already_applied:
        print(f"already applied: {result.tree} (series {result.series_hash[:12]})")
        return 0
    for name, sha in result.commits:
        print(f"applied {name}: {sha}")
    print(f"work tree {result.tree}: pin {result.pin_commit[:12]}, series {result.series_hash[:12]}")
    return 0


def _run_status(args: argparse.Namespace) -> int:
    from hotggml import patches

    report = patches.status()
    width = max((len(entry.name) for entry in report), default=0)
    for entry in report:
        found = sum(present for _, present in entry.markers)
        print(f"{entry.state:<14} {entry.name:<{width}}  markers {found}/{len(entry.markers)}")
        for marker, present in entry.markers:
            if not present:
                print(f"{'':<14} missing marker {marker}")
    tree = patches.default_tree()
    made = (tree / ".git").exists()
    print(f"work tree {tree}, series {patches.series_hash()[:12]}"
          + ("" if made else ": no work tree there yet (`hotggml patches apply` makes it)"))
    return 0


def _run_check(args: argparse.Namespace) -> int:
    from hotggml import patches
    from hotggml.errors import PatchError

    try:
        result = patches.check()
    except PatchError as exc:  # the series fails a check (apply, markers, canonical export): the gate's "no"
        print(f"hotggml: error: {exc}", file=sys.stderr)
        return EXIT_CHECK_FAILED
    print(f"ok: {len(result.commits)} patch(es) apply to pin {result.pin_commit[:12]}, markers present, "
          f"export canonical (series {result.series_hash[:12]})")
    return 0


def _run_export(args: argparse.Namespace) -> int:
    from hotggml import patches

    if args.upstream is not None:  # "" is a folder named wrongly, not "not given"
        if args.dry_run:
            print("hotggml: error: --upstream and --dry-run do not go together", file=sys.stderr)
            return 2
        for path in patches.export_upstream(args.upstream):
            print(f"wrote {path}")
        return 0
    changed = patches.export(dry_run=args.dry_run, force=args.force)
    for path in changed:
        verb = "would change" if args.dry_run else "updated" if path.exists() else "removed"
        print(f"{verb} {path}")
    if not changed:
        print("patches are up to date")
    return 1 if args.dry_run and changed else 0


# -- prepare / build --------------------------------------------------------------------

def add_prepare_parser(subparsers: argparse._SubParsersAction) -> None:
    """Add `prepare [--json]` (fetch + apply; used by CMakeLists.txt under pip install)."""
    parser = subparsers.add_parser("prepare", help="fetch the pin and apply the series; print the tree")
    parser.add_argument("--json", action="store_true", help="print {source_dir, pin, series_hash} as JSON")
    parser.set_defaults(func=_run_prepare)


def _run_prepare(args: argparse.Namespace) -> int:
    import contextlib
    import json

    from hotggml import prepare

    # under CMake, stdout must carry the JSON alone: progress goes to stderr
    with contextlib.redirect_stdout(sys.stderr):
        prep = prepare.prepare()
    if args.json:
        from hotggml import cpu

        print(json.dumps({"source_dir": str(prep.source_dir), "pin": prep.pin, "series_hash": prep.series_hash,
                          "cpu_flags": ",".join(cpu.isa_flags())}))
    else:
        print(f"patched tree {prep.source_dir}: upstream {prep.pin[:12]}, code {prep.series_hash[:12]}")
    return 0


def add_build_parser(subparsers: argparse._SubParsersAction) -> None:
    """Add `build --backend cpu|cuda|vulkan [--jobs N] [--cuda-arch A] [--tests] [-D KEY=VALUE]`."""
    parser = subparsers.add_parser("build", help="CMake build of the patched tree, keyed by pin + series")
    parser.add_argument("--backend", choices=("cpu", "cuda", "vulkan"), default="cpu")
    parser.add_argument("--jobs", type=_int("jobs"), default=None, help="parallel compile jobs (default: all cores)")
    parser.add_argument("--cuda-arch", default=None,
                        help="CMAKE_CUDA_ARCHITECTURES (default: 90a where every GPU is compute capability 9.0, else native)")
    parser.add_argument("--define", "-D", action="append", default=[], metavar="KEY=VALUE",
                        help="extra CMake option, e.g. -D GGML_CPU_HBM=ON (part of the build key; such builds "
                             "are checked to build, the tools keep loading the plain build)")
    parser.add_argument("--tests", action="store_true",
                        help="also build ggml's tests: ctest in <build>/ggml, test-backend-ops in <build>/lib")
    parser.set_defaults(func=_run_build)


def _run_build(args: argparse.Namespace) -> int:
    from hotggml import build

    if args.cuda_arch is not None and args.backend != "cuda":  # a CPU or Vulkan build would ignore it
        print(f"hotggml: error: --cuda-arch is for --backend cuda, not {args.backend}", file=sys.stderr)
        return 2
    extra = {}
    for item in args.define:
        key, sep, value = item.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):  # a CMake cache variable's name
            print(f"hotggml: error: --define wants KEY=VALUE with KEY a CMake variable name, got {item!r}",
                  file=sys.stderr)
            return 2
        extra[key] = value
    info = build.build(args.backend, jobs=args.jobs, cuda_arch=args.cuda_arch, extra_defines=extra, tests=args.tests)
    state = "built" if info.rebuilt else "up to date, not rebuilt"
    print(f"{args.backend} build {info.build_dir}: {state} (upstream {info.pin[:12]}, code {info.series_hash[:12]})")
    return 0


# -- tools ------------------------------------------------------------------------------

def _int_in(text: str, noun: str, low: int, high: int | None) -> int:
    """text as an int in [low, high] (high None: no upper bound), else ArgumentTypeError naming ``noun``."""
    try:
        value = int(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{noun} must be an integer, got {text!r}") from None
    if value < low or (high is not None and value > high):
        raise argparse.ArgumentTypeError(f"{noun} must be >= {low}, got {value}" if high is None else
                                         f"{noun} must be in [{low}, {high}], got {value}")
    return value


def _ints(noun: str, low: int = 1, high: Callable[[], int] | None = None) -> Callable[[str], list[int]]:
    """An argparse type: a comma list of ints in [low, high()] (high a callable, so a bound from a module that
    loads NumPy is read only when the option is given), the errors naming ``noun``."""
    def parse(text: str) -> list[int]:
        parts = text.split(",")
        try:  # an empty item ("1,,2", "2,") is a typo, not a list of two
            values = [int(x) for x in parts] if all(x.strip() for x in parts) else []
        except ValueError:
            values = []
        if not values:
            raise argparse.ArgumentTypeError(f"{noun} must be a comma list of integers, got {text!r}")
        top = high() if high else None
        return [_int_in(str(v), noun, low, top) for v in values]
    parse.__name__ = noun  # argparse's "invalid <name> value" should it ever print one
    return parse


def _int(noun: str, low: int = 1, high: Callable[[], int] | None = None) -> Callable[[str], int]:
    """An argparse type: one int in [low, high()], as _ints."""
    def parse(text: str) -> int:
        return _int_in(text, noun, low, high() if high else None)
    parse.__name__ = noun
    return parse


def _max_threads() -> int:
    from hotggml.graph import GGML_MAX_N_THREADS

    return GGML_MAX_N_THREADS


def _max_seq() -> int:
    """The longest S any case can take: S f32 values alone are the binding's tensor limit (graph.MAX_TENSOR_BYTES,
    2^48 bytes; a longer S is refused there anyway), far below where the inputs' NumPy shapes overflow (S near
    2^63 / (B Nh D), a ValueError traceback from np.broadcast_to, not an error line)."""
    from hotggml.graph import MAX_TENSOR_BYTES

    return MAX_TENSOR_BYTES // 4


_threads = _ints("threads", 1, _max_threads)
_seq_lens = _ints("sequence lengths S", 1, _max_seq)


def add_parity_parser(subparsers: argparse._SubParsersAction) -> None:
    """Add `parity --backend NAME --set smoke [--set real] [-p REGEX] [--threads 1,2] [--json PATH]`."""
    parser = subparsers.add_parser(
        "parity", help="fused op vs exact chain vs float64 oracle",
        description="A line per case on stderr, and inside a case that runs long a line per arm and oracle head. "
                    "Expected on a 2-core machine: smoke in about a second at --threads 1,2 (measured); the field "
                    "set's long-context chunk (-p chunk) alone about 14 min on the CPU (reported once, not re-timed).")
    parser.add_argument("-b", "--backend", default="cpu",
                        help="cpu | cuda | vulkan, or a registry device name (CUDA0); rpc: through a CPU RPC server "
                             "this command starts on 127.0.0.1 (the server's record of computed nodes is checked too); "
                             "rpc:DEVICE (rpc:CUDA0): the same with a server of that device; RPC[host:port]: through a "
                             "running RPC server; Meta(CPU,CPU): ggml's meta device over several, the fused arm split by "
                             "heads and compared bit for bit with one device")
    parser.add_argument("--set", dest="sets", action="append", choices=("smoke", "real", "types", "limits", "field"),
                        help="case set (repeatable; default smoke; types: K/V in stored types; field holds the "
                             "long-context chunk)")
    parser.add_argument("-p", dest="pattern", default=None, type=_regex, help="regex on case ids")
    parser.add_argument("--threads", type=_threads, default=None, help="CPU thread counts, e.g. 1,2 (bitwise check)")
    parser.add_argument("--prec", choices=("default", "f32"), default="f32",
                        help="the fused nodes' precision: f32 (the 1e-4 bar) or default (TF32 on CUDA sm_80+)")
    parser.add_argument("--no-chain", action="store_true", help="skip the exact-chain arm")
    parser.add_argument("--json", metavar="PATH", type=_json_path, help="also write the records as JSON")
    parser.add_argument("-l", "--list", action="store_true", help="list the selected cases and exit")
    parser.set_defaults(func=_run_parity)


def _regex(text: str) -> str:

    try:
        re.compile(text)
    except re.error as exc:
        raise argparse.ArgumentTypeError(f"bad regex {text!r}: {exc}") from None
    return text


def _json_path(text: str) -> str:
    """A file the command will write at its end: refused now if it cannot be (a folder, or no such folder),
    so a finished run is never lost to the write."""
    from pathlib import Path

    path = Path(text)
    if not text:
        raise argparse.ArgumentTypeError("an empty path: give a file name")
    if text == "-":  # read as stdout by most tools: here it would be a file named '-' in this folder
        raise argparse.ArgumentTypeError("'-' is no file name here (the report goes to a file; stdout has the table): "
                                         "give a path, ./- for a file named '-'")
    try:
        if path.is_dir():
            raise argparse.ArgumentTypeError(f"{text!r} is a folder: give a file name")
        if path.exists() and not path.is_file():  # a FIFO or a device: the check's open (and the write) would block
            raise argparse.ArgumentTypeError(f"{text} is not a regular file: give a file name")
        parent = path.resolve().parent
    except (OSError, RuntimeError) as exc:  # a symbolic link loop (RuntimeError before Python 3.13)
        raise argparse.ArgumentTypeError(f"{text} cannot be written: {exc}") from None
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: {parent} is not a folder" if parent.exists()
                                         else f"{text}: no such folder {parent}")
    existed = path.exists()
    try:  # opened for append, as the end of the run will: permissions, read-only or pseudo file systems
        with open(path, "a"):
            pass
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"{text} cannot be written: {exc.strerror}") from None
    if not existed:
        path.unlink(missing_ok=True)  # nothing left behind by the check
    return text


def _select_cases(sets: list[str], pattern: str | None) -> list:
    """The cases of sets whose id matches pattern; InputError naming the sets and listing the ids when
    none does (a run that selects nothing must not look like a pass)."""
    from hotggml import cases
    from hotggml.errors import InputError

    selected = cases.select(sets, pattern)
    if not selected:
        ids = ", ".join(c.id for c in cases.select(sets, None))
        raise InputError(f"no case of {'+'.join(sets)} matches -p {pattern!r}; the ids are: {ids}")
    return selected


def _progress(done: int, total: int, text: str) -> None:
    """One progress line on stderr: a bar redrawn in place on a terminal, a plain [done/total] line in a log."""
    if sys.stderr.isatty():
        width = 24
        fill = width * done // max(total, 1)
        end = "\n" if done == total else ""
        print(f"\r[{'#' * fill}{'.' * (width - fill)}] {done}/{total} {text}"[:160].ljust(100), end=end,
              file=sys.stderr, flush=True)
    else:
        print(f"[{done}/{total}] {text}", file=sys.stderr, flush=True)


class _Heartbeat:
    """A progress callback that prints ``PREFIX: text`` on stderr (flushed) once EVERY_S seconds have passed since
    the start or its last line: a long case (the field set's chunk on a CPU) shows where it is, short ones stay
    quiet."""

    EVERY_S = 5.0

    def __init__(self, prefix: str):
        import time

        self.prefix, self.clock = prefix, time.monotonic
        self.last = self.clock()

    def __call__(self, text: str) -> None:
        now = self.clock()
        if now - self.last >= self.EVERY_S:
            self.last = now
            print(f"{self.prefix}: {text}", file=sys.stderr, flush=True)


def _print_cases(selected: list) -> int:
    for case in selected:
        print(f"{case.id:<32} {case.shape}")
    return EXIT_OK


def _runs(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"runs must be an integer, got {text!r}") from None
    if value < 3:
        raise argparse.ArgumentTypeError("runs must be >= 3 (medians of fewer are not worth quoting)")
    return value


MAX_SMEM_CAP_KIB = 1 << 20  # 1 GiB: no GPU's block has near that; the backend multiplies the KiB by 1024 in a long


def _smem_caps(text: str) -> tuple[int, ...]:
    try:
        caps = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected KiB values separated by commas (e.g. 99,163), got {text!r}")
    if not caps or any(not 0 < kib <= MAX_SMEM_CAP_KIB for kib in caps):
        raise argparse.ArgumentTypeError(f"shared-memory caps must be KiB values in [1, {MAX_SMEM_CAP_KIB}], "
                                         f"got {text!r}")
    return caps


def resolve_device(backend: str) -> str:
    """cpu -> CPU, cuda -> CUDA0, vulkan -> Vulkan0; a registry device name passes through; a meta device
    ``meta(cpu,cpu)`` -> ``Meta(CPU,CPU)`` (each of its devices resolved so)."""
    from hotggml import meta

    simple = meta.parse_name(backend)
    if simple is not None:
        return "Meta(" + ",".join(resolve_device(name) for name in simple) + ")"
    return {"cpu": "CPU", "cuda": "CUDA0", "vulkan": "Vulkan0"}.get(backend.lower(), backend)


def _run_parity(args: argparse.Namespace) -> int:
    from pathlib import Path

    from hotggml import parity

    selected = _select_cases(args.sets or ["smoke"], args.pattern)
    if args.list:
        return _print_cases(selected)
    import contextlib

    from hotggml import rpc

    results = []
    with contextlib.ExitStack() as stack:
        server = None
        kind, _, served = args.backend.partition(":")
        if kind.lower() == "rpc" and not args.backend.startswith("RPC["):  # a server of this build for this run
            served = resolve_device(served) if served else "CPU"
            server = stack.enter_context(rpc.Server(served))
            print(f"RPC server ({served}) at {server.endpoint}, pid {server.proc.pid}", file=sys.stderr, flush=True)
        device = server.device_name if server is not None else resolve_device(args.backend)
        for i, case in enumerate(selected, start=1):
            res = parity.run_case(case, device, threads=args.threads, prec=args.prec, with_chain=not args.no_chain,
                                  progress=_Heartbeat(f"[{i}/{len(selected)}] {case.id}"), server=server)
            _progress(i, len(selected), f"{'PASS' if res.passed else 'FAIL'} {case.id}"
                      + ("" if res.passed else ": " + "; ".join(res.failures)))
            results.append(res)
        if server is not None:
            ops = server.computed_ops()
            print(f"RPC server record: {len(ops)} nodes computed, {ops.count('FLASH_ATTN_TRAIN')} FLASH_ATTN_TRAIN, "
                  f"{ops.count('FLASH_ATTN_TRAIN_BACK')} FLASH_ATTN_TRAIN_BACK")
    print(parity.table(results))
    if args.json:
        Path(args.json).write_text(parity.to_json(results) + "\n")
    failed = [r.case for r in results if not r.passed]
    print(f"{len(results) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


def add_memory_parser(subparsers: argparse._SubParsersAction) -> None:
    """Add `memory [--backend NAME] [--case ID] [--seq 625,1250,3000] [--no-chain]`."""
    parser = subparsers.add_parser("memory", help="allocator arena bytes, fused vs exact chain (reserve only)")
    parser.add_argument("-b", "--backend", default="cpu", help="cpu | cuda | vulkan, or a registry device name (CUDA0)")
    parser.add_argument("--case", default=None, help="a geometry from the field set (default: DiT full attention); "
                                                     "S varies, Skv keeps the case's context Skv - S")
    parser.add_argument("--seq", type=_seq_lens, default=None, help="query lengths S, e.g. 625,1250,3000")
    parser.add_argument("--no-chain", action="store_true", help="fused arena only")
    parser.set_defaults(func=_run_memory)


def _run_memory(args: argparse.Namespace) -> int:
    from hotggml import bench, cases

    base = bench.DIT_FULL
    if args.case is not None:  # '' is an unknown case, not the default
        found = [c for c in cases.FIELD + cases.REAL + cases.SMOKE if c.id == args.case]
        if not found:
            known = ", ".join(dict.fromkeys(c.id for c in cases.FIELD + cases.REAL + cases.SMOKE))
            print(f"hotggml: error: unknown case {args.case!r} (known: {known})", file=sys.stderr)
            return 2
        base = found[0]
    rows = bench.memory_table(base, tuple(args.seq or bench.MEMORY_S), resolve_device(args.backend),
                              with_chain=not args.no_chain)
    print(f"fwd+bwd graph arena at {base.id} geometry ({base.shape}; S varies, {bench.memory_kv_rule(base)}), "
          f"{args.backend}:")
    print(bench.format_memory(rows))
    return 0


def add_bench_parser(subparsers: argparse._SubParsersAction) -> None:
    """Add `bench [--backend NAME] [--case ID | --set field [-p REGEX]] [--runs N] [--json PATH] [--profile]`."""
    parser = subparsers.add_parser("bench", help="paired interleaved fwd+bwd timing, fused vs exact chain")
    parser.add_argument("-b", "--backend", default="cpu", help="cpu | cuda | vulkan, or a registry device name (CUDA0)")
    parser.add_argument("--case", default=None, help="a case id from the smoke/real/field sets (default: dit-self-full-1250)")
    parser.add_argument("--set", dest="sets", action="append", choices=("smoke", "real", "field"),
                        help="the table over a case set: TF32 and f32 fused vs chain, TFLOP/s, arenas")
    parser.add_argument("-p", dest="pattern", default=None, type=_regex, help="regex on case ids (with --set)")
    parser.add_argument("--no-f32", action="store_true", help="table without the f32 path's time")
    parser.add_argument("--no-chain", action="store_true", help="table without the exact chain")
    parser.add_argument("--profile", action="store_true", help="also time every node (per op, each arm)")
    parser.add_argument("--json", metavar="PATH", type=_json_path, help="also write the table's rows as JSON")
    parser.add_argument("-l", "--list", action="store_true", help="list the selected cases (with --set) and exit")
    parser.add_argument("--threads", type=_int("threads", 1, _max_threads), default=None,
                        help="CPU threads (default: ggml's own choice)")
    parser.add_argument("--runs", type=_runs, default=5, help="runs per arm (>= 3)")
    parser.add_argument("--smem-caps", type=_smem_caps, default=(), metavar="KIB[,KIB]",
                        help="with --set on CUDA: also time the TF32 path with the shared-memory budget per block "
                             "capped at each (e.g. 99,163: the kernels of those cards' classes)")
    parser.set_defaults(func=_run_bench)


def _run_bench(args: argparse.Namespace) -> int:
    from hotggml import bench, cases

    if args.sets and args.case is not None:  # the table would time the set and ignore the case
        print("hotggml: error: --case times one case, --set a table over sets (-p selects in them): not both",
              file=sys.stderr)
        return 2
    if args.sets:
        return _run_bench_table(args)
    args.case = "dit-self-full-1250" if args.case is None else args.case
    table_only = [flag for flag, given in (("--json", args.json), ("--profile", args.profile), ("--no-chain", args.no_chain),
                  ("--no-f32", args.no_f32), ("-p", args.pattern), ("--smem-caps", args.smem_caps)) if given]
    if table_only:  # they shape the table; the one case's paired timing would silently ignore them
        print(f"hotggml: error: {', '.join(table_only)} {'needs' if len(table_only) == 1 else 'need'} --set (the "
              "table); --case prints one paired timing",
              file=sys.stderr)
        return 2
    if args.list:
        return _print_cases([c for c in cases.SMOKE + cases.REAL + cases.FIELD])
    found = [c for c in cases.SMOKE + cases.REAL + cases.FIELD if c.id == args.case]
    if not found:
        known = ", ".join(dict.fromkeys(c.id for c in cases.SMOKE + cases.REAL + cases.FIELD))
        print(f"hotggml: error: unknown case {args.case!r} (known: {known})", file=sys.stderr)
        return 2
    result = bench.time_pair(found[0], resolve_device(args.backend), args.threads, args.runs)
    print(bench.format_timing(result))
    return 0


def _run_bench_table(args: argparse.Namespace) -> int:
    import dataclasses
    import json
    from pathlib import Path

    from hotggml import bench

    selected = _select_cases(args.sets, args.pattern)
    if args.list:
        return _print_cases(selected)
    device = resolve_device(args.backend)
    if args.smem_caps and not device.startswith("CUDA"):
        print(f"hotggml: error: --smem-caps caps the CUDA backend's shared memory; {device} has no such budget",
              file=sys.stderr)
        return 2
    ceiling_n = bench.ceiling_size(device)
    if ceiling_n != bench.CEILING_N:
        print(f"hotggml: bench: the TFLOP/s ceiling is ggml's f32 mul_mat at {ceiling_n}^3 on {device} (seconds; "
              f"{bench.CEILING_N}^3, the GPU's, takes minutes on a CPU)", file=sys.stderr, flush=True)
    ceiling = bench.tf32_ceiling(device, n=ceiling_n, threads=args.threads)
    rows = []
    for i, case in enumerate(selected, start=1):
        rows.append(bench.field_row(case, device, args.runs, with_f32=not args.no_f32, with_chain=not args.no_chain,
                                    caps=args.smem_caps, threads=args.threads))
        _progress(i, len(selected), f"timed {case.id}")
        if args.profile:
            for arm, prec in (("fused tf32", "default"), ("chain", None)):
                if prec is None and args.no_chain:
                    continue
                ops = bench.profile_by_op(case, device, prec, args.threads)
                print(f"  profile {case.id} {arm}: " + ", ".join(f"{op} {s * 1e3:.2f} ms" for op, s in ops.items()
                                                               if s >= 0.01 * sum(ops.values())), flush=True)
    print(bench.format_field(rows, ceiling, device, ceiling_n))
    if args.json:
        Path(args.json).write_text(json.dumps({"device": device, "tf32_ceiling_tflops": ceiling,
                                               "tf32_ceiling_n": ceiling_n,
                                               "rows": [dataclasses.asdict(r) for r in rows]}, indent=1) + "\n")
    return 0


def add_probe_parser(subparsers: argparse._SubParsersAction) -> None:
    """Add `probe --backend NAME [--set field] [-p REGEX] [--prec default|f32]`."""
    parser = subparsers.add_parser("probe", help="does the device's supports_op take the fused nodes at real shapes")
    parser.add_argument("-b", "--backend", default="cpu", help="cpu | cuda | vulkan, or a registry device name (CUDA0)")
    parser.add_argument("--set", dest="sets", action="append", choices=("smoke", "real", "types", "field", "limits"),
                        help="case set (repeatable; default field: every SPEC §7 geometry)")
    parser.add_argument("-p", dest="pattern", default=None, type=_regex, help="regex on case ids")
    parser.add_argument("--prec", choices=("default", "f32"), default="default",
                        help="the fused nodes' precision the probe asks supports_op about")
    parser.add_argument("-l", "--list", action="store_true", help="list the selected cases and exit")
    parser.set_defaults(func=_run_probe)


def _run_probe(args: argparse.Namespace) -> int:
    from hotggml.errors import UnsupportedOpError
    from hotggml.graph import Backend
    from hotggml.probe import probe

    selected = _select_cases(args.sets or ["field"], args.pattern)
    if args.list:
        return _print_cases(selected)
    refused = 0
    with Backend(resolve_device(args.backend)) as be:
        for case in selected:
            try:
                path = probe(case, be, args.prec)
                print(f"supported   {case.id:<26} {path.kernel:<24} {case.shape}")
            except UnsupportedOpError as exc:
                refused += 1
                print(f"REFUSED     {case.id:<24} {exc}")
    return 1 if refused else 0


# -- floor ------------------------------------------------------------------------------

def add_floor_parser(subparsers: argparse._SubParsersAction) -> None:
    """Add `floor --backend cpu|cuda [--device NAME] [--mode grad|test] [--op OP] [--no-stock] [--no-ctest]`."""
    parser = subparsers.add_parser(
        "floor", help="ggml's own tests: the patched tree no worse than stock, op for op",
        description="Builds both trees with ggml's tests (when not built yet: minutes each), runs ctest on both, then "
                    "test-backend-ops once per op on both, a progress line per op on stderr. Expected on a 2-core "
                    "machine: the per-op grad pass measured 2 min for one tree (126 ops, MUL_MAT 86 s of it), so "
                    "4-5 min for both plus 2 reruns of each op that differs; a whole run, builds included, was seen "
                    "at about 38 min (an estimate from parts, not a timed full run).")
    parser.add_argument("--backend", choices=("cpu", "cuda"), default="cpu", help="what both trees are built for")
    parser.add_argument("--device", default=None, help="test-backend-ops -b (default: CPU, or CUDA0 for cuda)")
    parser.add_argument("--mode", dest="modes", action="append", choices=("grad", "test"),
                        help="test-backend-ops mode (repeatable; default grad, plus test off the CPU)")
    parser.add_argument("--op", dest="ops", action="append", help="only this op (repeatable; default every op)")
    parser.add_argument("--no-stock", action="store_true",
                        help="patched tree only: every case run must pass (for our own ops on a device)")
    parser.add_argument("--no-ctest", action="store_true", help="skip ggml's ctest")
    parser.add_argument("--jobs", type=_int("jobs"), default=None)
    parser.add_argument("--cuda-arch", default=None)
    parser.set_defaults(func=_run_floor)


def _run_floor(args: argparse.Namespace) -> int:
    from hotggml import build, floor

    if args.cuda_arch is not None and args.backend != "cuda":  # a CPU build would ignore it
        print(f"hotggml: error: --cuda-arch is for --backend cuda, not {args.backend}", file=sys.stderr)
        return 2
    device = args.device or ("CPU" if args.backend == "cpu" else "CUDA0")
    modes = args.modes or (["grad"] if device == "CPU" else ["test", "grad"])
    patched = build.build_with_tests(args.backend, jobs=args.jobs, cuda_arch=args.cuda_arch)
    stock = None if args.no_stock else build.build_stock(args.backend, jobs=args.jobs, cuda_arch=args.cuda_arch)
    bad = False
    if not args.no_ctest:
        print("hotggml: floor: ctest on the patched build ...", file=sys.stderr, flush=True)
        n, failed = floor.ctest_failures(patched, args.jobs)
        line = f"ctest patched: {n - len(failed)}/{n} passed" + (f" (failed: {', '.join(failed)})" if failed else "")
        if stock is not None:
            print("hotggml: floor: ctest on the stock build ...", file=sys.stderr, flush=True)
            n_s, failed_s = floor.ctest_failures(stock, args.jobs)
            only = sorted(set(failed) - set(failed_s))
            line += f"; stock: {n_s - len(failed_s)}/{n_s} passed; failing only when patched: {only or 'none'}"
            bad |= bool(only)
        else:
            bad |= bool(failed)
        print(line, flush=True)
    for mode in modes:
        def progress(done: int, total: int, verdict, seconds: float, mode=mode) -> None:
            _progress(done, total, f"{mode} {floor.verdict_line(verdict)} ({seconds:.0f} s)")

        verdicts = floor.compare_ops(stock, patched, mode, device, args.ops, progress=progress)
        print(floor.format_ops(verdicts, mode, device), flush=True)
        bad |= any(not v.ok for v in verdicts)
    return 1 if bad else 0


# -- pin ----------------------------------------------------------------------------------

def add_pin_parser(subparsers: argparse._SubParsersAction) -> None:
    """Add `pin show` and `pin set SOURCE | --continue | --abort`."""
    parser = subparsers.add_parser("pin", help="show the pin, or move the series onto a new one (a 3-way rebase)")
    sub = parser.add_subparsers(title="actions", metavar="ACTION", dest="action", required=True)
    show = sub.add_parser("show", help="print the pin's record (hotggml/pin.json)")
    show.set_defaults(func=_run_pin_show)
    put = sub.add_parser("set", help="rebase the series onto the pin made from SOURCE; on a conflict it stops "
                                     "(resolve with git in the work repo, then --continue), --abort undoes it",
                         formatter_class=_DefaultsShown, epilog=EPILOG)
    put.add_argument("source", nargs="?", help="a tarball with a ggml tree (an sdist, or one top folder), or a "
                                               "commit of vendor/ggml's repository")
    put.add_argument("--tag", help="a label for the new pin (default: the tarball's name or the commit)")
    put.add_argument("--upstream-commit", help="upstream's commit id of the tarball's tree (default: its tree hash)")
    what = put.add_mutually_exclusive_group()
    what.add_argument("--continue", dest="resume", action="store_true", help="go on after resolving a conflict")
    what.add_argument("--abort", action="store_true", help="restore the previous pin, series and work repo")
    put.set_defaults(func=_run_pin_set)


def _run_pin_show(args: argparse.Namespace) -> int:
    import json

    from hotggml import pin_record

    print(json.dumps(pin_record.read(), indent=2))
    return EXIT_OK


def _pin_set_in_progress() -> bool:
    from hotggml import rebase

    return rebase.in_progress()


def _run_pin_set(args: argparse.Namespace) -> int:
    from hotggml import paths, rebase
    from hotggml.errors import InputError

    given = [name for name, value in (("SOURCE", args.source), ("--tag", args.tag),
                                      ("--upstream-commit", args.upstream_commit)) if value is not None]
    if (args.abort or args.resume) and given:  # the pin set in progress has its source and record already
        raise InputError(f"{', '.join(given)} go with a new `pin set SOURCE`, not with "
                         f"{'--abort' if args.abort else '--continue'}: the pin set in progress keeps what it started with")
    # two pin sets at once rebased one work repo over each other: the second waits, then finds the first done
    with paths.lock(rebase.state_dir(), "the `hotggml pin set` in progress"):
        return _pin_set_locked(args)


def _pin_set_locked(args: argparse.Namespace) -> int:
    from hotggml import rebase
    from hotggml.errors import InputError

    if args.abort:
        record = rebase.abort()
        print(f"aborted: the pin is ggml {record['tag']} ({record['pin_commit'][:12]}), patches/ and the work repo "
              "as they were")
        return EXIT_OK
    if args.resume:
        outcome = rebase.resume()
    elif args.source:
        outcome = rebase.start(args.source, tag=args.tag, upstream=args.upstream_commit)
    else:
        raise InputError("pin set needs a SOURCE, --continue or --abort")
    record = outcome.record
    if outcome.status == "same":
        print(f"pin set: {args.source} holds the tree of the current pin, ggml {record['tag']} (upstream "
              f"{record['upstream_commit'][:12]}): nothing to do, nothing changed")
        return EXIT_OK
    if outcome.status == "conflict":
        print(f"hotggml: pin set stopped: patch {outcome.patch} conflicts with ggml {record['tag']} in "
              f"{', '.join(outcome.files) or '(see git status)'}; resolve in {rebase.patches.default_tree()} "
              "(edit, git add), then `hotggml pin set --continue`, or `hotggml pin set --abort`", file=sys.stderr)
        return EXIT_CHECK_FAILED
    print(f"pin set: ggml {record['tag']} (pin commit {record['pin_commit'][:12]}); the series is rebased and "
          "re-exported to patches/, hotggml/pin.json rewritten, vendor/ggml replaced, its gitlink staged at "
          f"upstream {record['upstream_commit'][:12]}: commit patches/, hotggml/pin.json and vendor/ggml together")
    if outcome.dropped:
        print(f"hotggml: note: the rebase left out {', '.join(outcome.dropped)} (a resolution emptied it, or it was "
              "skipped): no longer in patches/series; its text is in git (`git show HEAD:patches/NAME`): to keep "
              "it, commit its change in the work tree with its trailers, then `hotggml patches export`",
              file=sys.stderr)
    if record["upstream_commit"] == record.get("tree"):  # a tarball without --upstream-commit
        print(f"hotggml: note: {record['upstream_commit'][:12]} is the tarball's tree hash, not an upstream commit: no "
              "clone can fetch it as vendor/ggml; pass --upstream-commit with upstream's commit of this tree",
              file=sys.stderr)
    return EXIT_OK


# what a pin set in progress holds half-moved: these refuse, naming it, until --continue or --abort
_DISTURB_A_PIN_SET = (_run_fetch, _run_apply, _run_export, _run_check, _run_prepare, _run_build, _run_floor,
                      _run_status)  # status: the work repo is mid-rebase onto the new pin (its commits look foreign)
