"""The `spotfill` command line (docs/cli.md).

Start-up stays light: each subcommand lives in its own module and imports torch, Prefect or boto3
only inside its handler. Bad input is one line on stderr and exit status 2, never a traceback:
main() is the one place that turns the errors bad input raises (UserInputError, an unreadable or
non-UTF-8 file, JSON nested too deeply, a number out of range) into that line. Ctrl-C exits 130
and SIGTERM 143, each with one line, after the command's own clean-up ran.
"""
from __future__ import annotations

import argparse
import functools
import importlib
import json
import signal
import sys
import warnings


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
    """argparse, but a usage error is one line naming the problem (exit 2), and an option that
    takes one value may be given once: argparse would keep the last (`--loss 1.8 --loss 9`) without
    a word. Options are named in full: with argparse's prefixes, `--los 9` would be `--loss 9`
    and slip past the once-only check."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(2)

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        args = sys.argv[1:] if args is None else list(args)
        seen: set[str] = set()
        for token in args:
            if token == "--":
                break
            action = self._option_string_actions.get(token.split("=", 1)[0])
            if type(action) is argparse._StoreAction:  # one value; append, count and flags may repeat
                if action.dest in seen:
                    self.error(f"{'/'.join(action.option_strings)} given twice")
                seen.add(action.dest)
        return super().parse_known_args(args, namespace)


@functools.cache
def build_parser() -> argparse.ArgumentParser:
    """The whole parser, built once per process (main() may run many times in one, as in tests);
    parsing does not change it: defaults and types are applied to each parse's own namespace."""
    parser = OneLineParser(prog="spotfill", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def print_json(obj: object) -> None:
    """One JSON object on stdout, numbers at full precision (the contract's --json)."""
    sys.stdout.write(json.dumps(obj, allow_nan=False) + "\n")


class Terminated(BaseException):
    """SIGTERM, raised in the main thread so that `finally` clean-up runs (like KeyboardInterrupt)."""


def _raise_terminated(signum, frame) -> None:
    raise Terminated()


def one_line(err: BaseException) -> str:
    """The message of an error bad input caused, as one line naming the problem."""
    if isinstance(err, UnicodeDecodeError):
        return f"input is not UTF-8 text (byte {err.object[err.start:err.start + 1]!r} at offset {err.start})"
    if isinstance(err, OSError) and err.strerror:
        where = f": {err.filename}" if err.filename is not None else ""
        return f"{err.strerror}{where}"
    if isinstance(err, RecursionError):
        return "input nested too deeply (JSON or YAML deeper than Python can read)"
    if isinstance(err, OverflowError):
        return f"a number is out of range ({err})"
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= 400 else text[:400] + "..."


# Errors a handler lets through only when its input was bad; anything else is a bug and keeps its
# traceback. ValueError covers UserInputError, json.JSONDecodeError and pydantic's ValidationError.
INPUT_ERRORS = (ValueError, OSError, RecursionError, OverflowError)


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exit_:  # --help, or a usage error already printed
        return int(exit_.code or 0)
    previous_sigterm = signal.getsignal(signal.SIGTERM)
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL and _in_main_thread():
        signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        with warnings.catch_warnings():
            # Inputs that would overflow numpy are refused up front; what numpy still says about
            # an intermediate value (overflow in exp, 0/0 masked later) is not the user's business.
            warnings.simplefilter("ignore", RuntimeWarning)
            return int(args.handler(args) or 0)
    except BrokenPipeError:  # output piped into `head` and the like
        sys.stderr.close()
        return 0
    except INPUT_ERRORS as err:
        sys.stderr.write(f"spotfill: error: {one_line(err)}\n")
        return 2
    except MemoryError:  # a limit raised knowingly (SPOTFILL_MAX_*) past what this machine holds
        sys.stderr.write("spotfill: error: out of memory: the input asks for more than this machine has "
                         "(a count, quota or size raised past the default limits?)\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("spotfill: interrupted\n")
        return 130
    except Terminated:
        sys.stderr.write("spotfill: terminated\n")
        return 143
    finally:
        if _in_main_thread():
            signal.signal(signal.SIGTERM, previous_sigterm)


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


if __name__ == "__main__":
    raise SystemExit(main())
