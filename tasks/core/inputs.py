"""Reading the files users hand in (profiles, traces, configs, the catalog) strictly: a regular
file of at most MAX_INPUT_MB, UTF-8 text; for JSON, integers within int64, no NaN or Infinity, no
key given twice, nesting no deeper than Python can parse. Each problem is a UserInputError naming
the file, so it fails here and not deep in numpy or pydantic (or never: a FIFO or /dev/zero would
block or fill the memory)."""
from __future__ import annotations

import json
import math
import os
import re
import stat
from pathlib import Path

from tasks.core.errors import UserInputError, shown

_INT64 = 2**63
MAX_INPUT_MB = 64  # the largest input any command reads: the shipped catalog source is under 1 MB


class _NumberError(ValueError):
    """A JSON number out of range; `literal` is its text, so that the error can say where it is."""

    def __init__(self, literal: str, message: str):
        super().__init__(message)
        self.literal = literal


def _int(text: str) -> int:
    if len(text.lstrip("-")) > 19:  # before int(): Python refuses over 4300 digits with a message of its own
        raise _NumberError(text, f"integer {shown(text, 30)} is beyond int64")
    value = int(text)
    if not -_INT64 <= value < _INT64:
        raise _NumberError(text, f"integer {shown(text, 30)} is beyond int64")
    return value


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999: Python reads it as infinity, which JSON has no word for
        raise _NumberError(text, f"number {shown(text, 30)} is past the range of a float")
    return value


# JSON's strings and numbers, in order: the first number token with a refused number's text is
# where the parser met it (an earlier one alike would have been refused first).
_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?')


def _where(text: str, literal: str) -> str:
    """`line L, column C` of the number `literal` in the JSON `text`."""
    for token in _TOKENS.finditer(text):
        if token.group() == literal:
            start = token.start()
            return f"line {text.count(chr(10), 0, start) + 1}, column {start - text.rfind(chr(10), 0, start)}"
    return "somewhere"


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number JSON allows")


def _object(pairs: list[tuple[str, object]]) -> dict:
    """A JSON object whose keys are all different: with a key twice, which value counts would
    depend on the reader (here, silently the last)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        twice = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"key {twice[:60]!r} is given twice in one object")
    return out


def loads_json(text: str, what: str) -> object:
    """`text` parsed strictly; `what` names the source in the error ("profile p.json")."""
    try:
        return json.loads(text, parse_int=_int, parse_float=_float, parse_constant=_no_constant,
                          object_pairs_hook=_object)
    except RecursionError:
        raise UserInputError(f"{what}: JSON nested too deeply") from None
    except json.JSONDecodeError as err:
        raise UserInputError(f"{what}: not valid JSON ({err.msg} at line {err.lineno})") from None
    except _NumberError as err:
        raise UserInputError(f"{what}: {_where(text, err.literal)}: {err}") from None
    except ValueError as err:
        raise UserInputError(f"{what}: {err}") from None


def read_text(path: str | Path, what: str) -> str:
    """The file's text; missing, unreadable or not UTF-8 is a UserInputError naming it."""
    path = Path(path)
    name = shown(path)
    try:
        with open(path, "rb", opener=_open_nonblocking) as f:
            info = os.fstat(f.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise UserInputError(f"{what} {name} is not a regular file (a folder, a pipe or a device)")
            if info.st_size > MAX_INPUT_MB * 1_000_000:
                raise UserInputError(f"{what} {name} is {info.st_size / 1e6:.0f} MB, more than the {MAX_INPUT_MB} MB "
                                     "an input may have")
            return f.read().decode("utf-8")
    except FileNotFoundError:
        raise UserInputError(f"{what} not found: {name}") from None
    except IsADirectoryError:
        raise UserInputError(f"{what} {name} is not a regular file (a folder, a pipe or a device)") from None
    except UnicodeDecodeError as err:
        raise UserInputError(f"{what} {name} is not UTF-8 text (byte offset {err.start})") from None
    except OSError as err:
        raise UserInputError(f"cannot read {what} {name}: {err.strerror}") from None


def _open_nonblocking(path: str, flags: int) -> int:
    """Opening a FIFO for reading blocks until a writer comes; non-blocking, the open returns
    and fstat tells what it is."""
    return os.open(path, flags | os.O_NONBLOCK)


def read_json(path: str | Path, what: str) -> object:
    return loads_json(read_text(path, what), f"{what} {shown(path)}")
