"""`python3 scripts/hd.py <command>`: the one CLI of the patch-set tooling.

Each command module exposes `register(subparsers)`, which adds its sub-command(s) with
`set_defaults(func=...)`; func(args, pin) returns the exit status. A user-facing failure is
an HdError: printed as `error: ...` on stderr, exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from hdtool.pin import HdError, Pin

# Modules whose register() adds commands, in the order their commands are listed in --help.
COMMAND_MODULES = (
    "hdtool.fetch",  # fetch
    "hdtool.upstream",  # import
    "hdtool.series",  # apply, export, lint
    "hdtool.wheel",  # build-wheel, verify-wheel
    "hdtool.index",  # index
    "hdtool.venv",  # venv
    "hdtool.upstream_tests",  # upstream-tests
    "hdtool.rebase",  # rebase, bump-pin
    "hdtool.upstream_pr",  # upstream-pr
)

# The repository that holds this scripts/ directory.
DEFAULT_ROOT = Path(__file__).resolve().parents[2]


def _add_root_option(parser: argparse.ArgumentParser, default: object) -> None:
    parser.add_argument(
        "--root",
        type=Path,
        default=default,
        metavar="DIR",
        help=f"project directory holding VERSION, patches/, ... (default: {DEFAULT_ROOT})",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hd.py",
        description="vllm-hopper-decode patch-set tooling: upstream pin, patch series, "
        "overlay, wheel and index.",
    )
    _add_root_option(parser, DEFAULT_ROOT)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    # Every command also takes --root after its name. SUPPRESS keeps a sub-command without
    # it from overwriting the value given before the command name.
    for command_parser in sub.choices.values():
        if not any("--root" in a.option_strings for a in command_parser._actions):
            _add_root_option(command_parser, argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        pin = Pin.load(args.root.resolve())
        return int(args.func(args, pin) or 0)
    except HdError as e:
        sys.stdout.flush()
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
