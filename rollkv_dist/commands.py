"""The one way a module adds a `rollkv` command (or a command's action): ``add_command``.

A command module lists itself in ``rollkv_dist.cli.COMMAND_MODULES`` and has ``register(subparsers)``,
which calls ``add_command`` for its command and for each of its actions. This module imports nothing of
rollkv, so command modules never import the command line back.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any


def add_command(subparsers: argparse._SubParsersAction, name: str, summary: str, description: str | None = None,
                run: Callable[[argparse.Namespace], object] | None = None, **parser_args: Any
                ) -> argparse.ArgumentParser:
    """The parser of `rollkv NAME` (or an action's), help = summary; with `run`, its handler calls run(args) and
    the exit status is what run returns when that is an int, else 0. Without `run` the command has actions
    (its own subparsers) whose handlers are set by their add_command."""
    p = subparsers.add_parser(name, help=summary, description=description, **parser_args)
    if run is not None:
        p.set_defaults(handler=lambda args: _status(run(args)))
    return p


def _status(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0
