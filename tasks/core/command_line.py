"""argparse as every spotfill command line uses it (the `spotfill` CLI and the runtime processes'
own command lines): a usage error is one line, an option that takes one value is given once, and
an option's value type is one of core's checks (tasks.core.limits), adapted by `arg_type`."""
from __future__ import annotations

import argparse
import functools
import sys
from typing import Callable, TypeVar

from tasks.core.errors import UserInputError

T = TypeVar("T")


def arg_type(check: Callable[[str], T]) -> Callable[[str], T]:
    """An argparse `type=` from a check that raises UserInputError: argparse then names the option
    and prints the check's own words (a ValueError would become "invalid VALUE value")."""

    @functools.wraps(check)
    def parse(text: str) -> T:
        try:
            return check(text)
        except UserInputError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    return parse


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
