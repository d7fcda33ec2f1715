"""The `spotfill` command line (docs/cli.md).

Start-up stays light: each subcommand lives in its own module and imports torch, Prefect or boto3
only inside its handler. Bad input is one line on stderr and exit status 2, never a traceback.
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys

from tasks.errors import UserInputError

# Each module defines `register(subparsers)`, adding one subcommand whose handler is set with
# `set_defaults(handler=...)`; a handler returns the process exit status.
COMMAND_MODULES = [
    "tasks.planner.commands",
    "tasks.catalog",
    "tasks.bench",
    "tasks.pipeline.commands",
    "tasks.cleanup",
    "tasks.market.simulate",
    "tasks.runtime.commands",
    "tasks.profiling.commands",
]


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line naming the problem (exit 2)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="spotfill", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def print_json(obj: object) -> None:
    """One JSON object on stdout, numbers at full precision (the contract's --json)."""
    sys.stdout.write(json.dumps(obj, allow_nan=False) + "\n")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except UserInputError as err:
        sys.stderr.write(f"spotfill: error: {err}\n")
        return 2
    except BrokenPipeError:  # output piped into `head` and the like
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:
        sys.stderr.write("spotfill: interrupted\n")
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
