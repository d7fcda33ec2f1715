"""The `spotfill` command line (docs/cli.md).

Start-up stays light: each subcommand lives in its own module and imports torch, Prefect or boto3
only inside its handler. Bad input is one line on stderr and exit status 2, never a traceback:
main() is the one place that turns the errors bad input raises (UserInputError, an unreadable or
non-UTF-8 file, JSON nested too deeply, a number out of range) into that line. Ctrl-C exits 130
and SIGTERM 143, each with one line, after the command's own clean-up ran.
"""
from __future__ import annotations

import argparse
import atexit
import functools
import importlib
import os
import signal
import sys
import threading
import warnings

from tasks.core.command_line import OneLineParser
from tasks.core.errors import one_line
from tasks.core.processes import process_stats


# Each module defines `register(subparsers)`, adding one subcommand whose handler is set with
# `set_defaults(handler=...)`; a handler returns the process exit status.
COMMAND_MODULES = [
    "tasks.cli.plan",
    "tasks.cli.catalog",
    "tasks.cli.bench",
    "tasks.cli.run",
    "tasks.cli.cleanup",
    "tasks.cli.simulate",
    "tasks.cli.train",
    "tasks.cli.profile",
]


@functools.cache
def build_parser() -> argparse.ArgumentParser:
    """The whole parser, built once per process (main() may run many times in one, as in tests);
    parsing does not change it: defaults and types are applied to each parse's own namespace."""
    parser = OneLineParser(prog="spotfill", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


class Terminated(BaseException):
    """SIGTERM, raised in the main thread so that `finally` clean-up runs (like KeyboardInterrupt)."""


def _raise_terminated(signum, frame) -> None:
    raise Terminated()


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
    return threading.current_thread() is threading.main_thread()


def entry() -> None:
    """`spotfill` as a process: the command, then its end. Plug-in code a command runs in this
    process (a workload's build(), checked before anything launches) may leave a non-daemon
    thread, which would keep the interpreter from ever exiting, or a child process, which would
    outlive the command. Neither may: the atexit clean-up runs (the local provider's kill of what
    it started), stray children are killed, and the process ends with the command's status."""
    status = main()
    atexit._run_exitfuncs()  # what the interpreter's exit would run, but without joining threads first
    end_stray_children()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (BrokenPipeError, ValueError):  # piped into `head`, or closed already
        pass
    os._exit(status)


def end_stray_children() -> None:
    """SIGKILL every child of this process still running (each with its own process group when it
    has one): by the command's end, the children it meant to run have ended or been stopped."""
    me, my_group = os.getpid(), os.getpgrp()
    for child in process_stats():
        if child.parent != me or not child.running:
            continue
        try:
            if child.group != my_group:
                os.killpg(child.group, signal.SIGKILL)
            else:
                os.kill(child.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

if __name__ == "__main__":
    entry()
