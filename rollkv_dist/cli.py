"""The `rollkv` command line.

Subcommands live in the modules of COMMAND_MODULES; each has ``register(subparsers)`` that
adds its parser with ``rollkv_dist.commands.add_command`` (the one way to add a command), whose
handler takes the parsed arguments and returns an exit status. Errors are the types in rollkv_dist.errors; main() turns them into their exit
code and a one-line message (the traceback only with --debug).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path

from rollkv_dist import __version__, log, proc
from rollkv_dist.errors import RollkvError, UsageError
from rollkv_dist.util import disk_full_error, is_enospc

COMMAND_MODULES = [
    "rollkv_dist.source",
    "rollkv_dist.patches",
    "rollkv_dist.build",
    "rollkv_dist.pack",
    "rollkv_dist.doctor",
    "rollkv_dist.models",
    "rollkv_dist.gates.command",
    "rollkv_dist.smoke",
    "rollkv_dist.recipe",
    "rollkv_dist.channel",
    "rollkv_dist.perfdoc",
]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse would exit(2) itself
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="rollkv",
        description="Pin, patch, build and pack llama.cpp with rolling KV.",
    )
    parser.add_argument("--version", action="version", version=f"rollkv {__version__}")
    parser.add_argument("--debug", action="store_true",
                        help="show tracebacks for errors")
    parser.add_argument("-v", "--verbose", action="store_true", help="more output")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    with proc.handle_termination():
        try:
            return _main(argv)
        finally:
            # a child group whose owner did not stop it (an interrupt between start and the
            # owner's clean-up): nothing rollkv started outlives it
            proc.kill_all()


def _main(argv: list[str]) -> int:
    debug = "--debug" in argv
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        log.configure(verbose=args.verbose)
        handler = getattr(args, "handler", None)
        if handler is None:
            parser.print_help(sys.stderr)
            return UsageError.exit_code
        return int(handler(args) or 0)
    except RollkvError as exc:
        if debug:
            traceback.print_exc()
        print(f"rollkv: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except OSError as exc:
        if is_enospc(exc):
            err = disk_full_error(Path(exc.filename) if exc.filename else None, exc)
            if debug:
                traceback.print_exc()
            print(f"rollkv: error: {err}", file=sys.stderr)
            return err.exit_code
        if debug:
            traceback.print_exc()
        print(f"rollkv: error: {exc} (run with --debug for the traceback)", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:
        terminated = isinstance(exc, proc.Terminated)
        print(f"rollkv: {'terminated' if terminated else 'interrupted'}: child processes stopped, "
              f"partial outputs removed", file=sys.stderr)
        return 143 if terminated else 130
    except Exception as exc:  # an unexpected bug: still one line unless --debug
        if debug:
            traceback.print_exc()
        print(f"rollkv: internal error: {type(exc).__name__}: {exc} "
              f"(run with --debug for the traceback and report it)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
