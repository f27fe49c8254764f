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
import sys
from collections.abc import Callable, Sequence

from hotggml.errors import HotggmlError

COMMANDS: dict[str, str] = {
    "fetch": "hotggml.cli:add_fetch_parser",
    "patches": "hotggml.cli:add_patches_parser",
}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; return the exit code (0 ok, 1 check failed/stale, 2 error)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(args.func(args) or 0)
    except HotggmlError as exc:
        print(f"hotggml: error: {exc}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    """Return the top-level parser with every registered subcommand."""
    parser = argparse.ArgumentParser(prog="hotggml", description="pinned ggml + patch series tooling")
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    for target in COMMANDS.values():
        _load(target)(subparsers)
    return parser


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
    print(f"pin ggml {pin.TAG} at {result.path}: {what}, commit {result.commit}")
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
    for entry in report:
        found = sum(present for _, present in entry.markers)
        print(f"{entry.state:<14} {entry.name:<28} markers {found}/{len(entry.markers)}")
        for marker, present in entry.markers:
            if not present:
                print(f"{'':<14} missing marker {marker}")
    print(f"work tree {patches.default_tree()}, series {patches.series_hash()[:12]}")
    return 0


def _run_check(args: argparse.Namespace) -> int:
    from hotggml import patches

    result = patches.check()
    print(f"ok: {len(result.commits)} patch(es) apply to pin {result.pin_commit[:12]}, markers present, "
          f"export canonical (series {result.series_hash[:12]})")
    return 0


def _run_export(args: argparse.Namespace) -> int:
    from hotggml import patches

    changed = patches.export(dry_run=args.dry_run)
    verb = "would change" if args.dry_run else "updated"
    for path in changed:
        print(f"{verb} {path}")
    if not changed:
        print("patches are up to date")
    return 1 if args.dry_run and changed else 0
