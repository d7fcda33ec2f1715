"""Reading the JSON files users hand in (profiles, configs, the catalog) strictly: UTF-8 text,
integers within int64, no NaN or Infinity, nesting no deeper than Python can parse. Each
problem is a UserInputError naming the file, so it fails here and not deep in numpy or pydantic."""
from __future__ import annotations

import json
from pathlib import Path

from tasks.errors import UserInputError

_INT64 = 2**63


def _int(text: str) -> int:
    value = int(text)
    if not -_INT64 <= value < _INT64:
        raise ValueError(f"integer {text[:30]}{'...' if len(text) > 30 else ''} is beyond int64")
    return value


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number JSON allows")


def loads_json(text: str, what: str) -> object:
    """`text` parsed strictly; `what` names the source in the error ("profile p.json")."""
    try:
        return json.loads(text, parse_int=_int, parse_constant=_no_constant)
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
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserInputError(f"{what} not found: {path}") from None
    except UnicodeDecodeError as err:
        raise UserInputError(f"{what} {path} is not UTF-8 text (byte offset {err.start})") from None
    except OSError as err:
        raise UserInputError(f"cannot read {what} {path}: {err.strerror}") from None


def read_json(path: str | Path, what: str) -> object:
    return loads_json(read_text(path, what), f"{what} {path}")
