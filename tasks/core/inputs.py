"""Reading the files users hand in (profiles, traces, configs, the catalog) strictly: a regular
file of at most MAX_INPUT_MB, UTF-8 text; for JSON, integers within int64, no NaN or Infinity, no
key given twice, nesting no deeper than Python can parse. Each problem is a UserInputError naming
the file, so it fails here and not deep in numpy or pydantic (or never: a FIFO or /dev/zero would
block or fill the memory)."""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from tasks.core.errors import UserInputError

_INT64 = 2**63
MAX_INPUT_MB = 64  # the largest input any command reads: the shipped catalog source is under 1 MB


def _int(text: str) -> int:
    if len(text.lstrip("-")) > 19:  # before int(): Python refuses over 4300 digits with a message of its own
        raise ValueError(f"integer {text[:30]}... is beyond int64")
    value = int(text)
    if not -_INT64 <= value < _INT64:
        raise ValueError(f"integer {text[:30]}{'...' if len(text) > 30 else ''} is beyond int64")
    return value


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
        return json.loads(text, parse_int=_int, parse_constant=_no_constant, object_pairs_hook=_object)
    except RecursionError:
        raise UserInputError(f"{what}: JSON nested too deeply") from None
    except json.JSONDecodeError as err:
        raise UserInputError(f"{what}: not valid JSON ({err.msg} at line {err.lineno})") from None
    except ValueError as err:
        raise UserInputError(f"{what}: {err}") from None


def read_text(path: str | Path, what: str) -> str:
    """The file's text; missing, unreadable or not UTF-8 is a UserInputError naming it."""
    path = Path(path)
    try:
        with open(path, "rb", opener=_open_nonblocking) as f:
            info = os.fstat(f.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise UserInputError(f"{what} {path} is not a regular file (a folder, a pipe or a device)")
            if info.st_size > MAX_INPUT_MB * 1_000_000:
                raise UserInputError(f"{what} {path} is {info.st_size / 1e6:.0f} MB, more than the {MAX_INPUT_MB} MB "
                                     "an input may have")
            return f.read().decode("utf-8")
    except FileNotFoundError:
        raise UserInputError(f"{what} not found: {path}") from None
    except IsADirectoryError:
        raise UserInputError(f"{what} {path} is not a regular file (a folder, a pipe or a device)") from None
    except UnicodeDecodeError as err:
        raise UserInputError(f"{what} {path} is not UTF-8 text (byte offset {err.start})") from None
    except OSError as err:
        raise UserInputError(f"cannot read {what} {path}: {err.strerror}") from None


def _open_nonblocking(path: str, flags: int) -> int:
    """Opening a FIFO for reading blocks until a writer comes; non-blocking, the open returns
    and fstat tells what it is."""
    return os.open(path, flags | os.O_NONBLOCK)


def read_json(path: str | Path, what: str) -> object:
    return loads_json(read_text(path, what), f"{what} {path}")
