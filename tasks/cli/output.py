"""What every verb's handler shares: JSON on stdout, and a started run's failure as one line."""
from __future__ import annotations

import json
import sys


def print_json(obj: object) -> None:
    """One JSON object on stdout, numbers at full precision (the contract's --json)."""
    sys.stdout.write(json.dumps(obj, allow_nan=False) + "\n")


def runtime_errors_in_one_line(handler):
    """A run that fails once started (a process died, a timeout) is one line on stderr and exit
    status 1: the input was fine, the run was not."""

    def run(args) -> int:
        try:
            return handler(args)
        except (RuntimeError, TimeoutError) as err:
            sys.stderr.write(f"spotfill: error: {str(err).splitlines()[0] if str(err) else type(err).__name__}\n")
            return 1

    return run
