"""Limits and strict value checks shared by every entry point: the CLI's options, the flow's
parameter models and the runtime processes' command lines. Each check takes the text (or value)
a user gave and returns it parsed, or raises UserInputError with the words the user sees, so
every entry point refuses the same input in the same words. No argparse here: the CLI adapts
these checks (tasks.core.command_line.arg_type)."""
from __future__ import annotations

import ipaddress
import math
import os
import re
from pathlib import Path
from urllib.parse import urlsplit

from tasks.core.errors import UserInputError, shown

# Counts and quotas above this are almost surely a typo (and beyond int64 they crash numpy); a user
# who means them raises the limit knowingly with SPOTFILL_MAX_COUNT.
DEFAULT_MAX_COUNT = 1000
# Durations (deadlines, timeouts): past ten years a number is a typo and overflows time arithmetic.
MAX_DURATION_S = 10 * 365 * 86400.0
MAX_SEED = 2**32 - 1
MAX_BATCH_SIZE = 65536  # numpy's seed range
# A model above this many parameters does not fit the local provider's emulated GPUs (a typo such
# as width=1000000 would take the machine's memory): SPOTFILL_MAX_PARAMS raises it.
DEFAULT_MAX_PARAMS = 2_000_000_000
# An emulated link's bandwidth: below a kilobit a second one pull of a small model takes hours (and
# the shaper's waits overflow a sleep); above a petabit it is no limit, only a typo.
MIN_MBPS, MAX_MBPS = 1e-3, 1e9
_ID = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,63}$")


def env_limit(name: str, default: int) -> int:
    """A limit raised knowingly with environment variable `name` (unset or empty: `default`); a
    value that is not a positive whole number is refused, not silently replaced by the default."""
    text = os.environ.get(name, "")
    if not text:
        return default
    if not (text.isascii() and text.isdigit() and len(text) < 19 and int(text) > 0):
        raise UserInputError(f"{name} must be a positive whole number, got {text!r}")
    return int(text)


def max_count() -> int:
    """The largest count or quota accepted: SPOTFILL_MAX_COUNT, else DEFAULT_MAX_COUNT."""
    return env_limit("SPOTFILL_MAX_COUNT", DEFAULT_MAX_COUNT)


def check_count(what: str, n: int) -> int:
    limit = max_count()
    if n > limit:
        raise UserInputError(f"{what} is {n}, above the limit of {limit} (set SPOTFILL_MAX_COUNT to raise it)")
    return n


def counts(text: str) -> dict[str, int]:
    """Parse `TYPE=N,TYPE=N` into {type: n}; repeated types and negative counts are errors."""
    result: dict[str, int] = {}
    if not text.strip():
        return result
    for item in text.split(","):
        name, sep, value = item.strip().partition("=")
        if not sep or not name:
            raise UserInputError(f"expected TYPE=N, got {item.strip()!r}")
        n = _strict_number(value, int, f"count for {name} is not an integer: {value!r}")
        if n < 0:
            raise UserInputError(f"count for {name} is negative: {n}")
        check_count(f"count for {name}", n)
        if name in result:
            raise UserInputError(f"type {name} given twice")
        result[name] = n
    return result


def _strict_number(text: str, parse, message: str):
    """parse(text), without Python's digit separators (`1_8` is a typo of 1.8 more often than 18)
    or digits of another script (٣, ２)."""
    try:
        if "_" in text or not text.isascii():
            raise ValueError(text)
        return parse(text)
    except ValueError:
        raise UserInputError(message) from None


def strict_float(text: str) -> float:
    return _strict_number(text, float, f"not a number: {text!r}")


def positive_float(text: str) -> float:
    value = strict_float(text)
    if not math.isfinite(value) or value <= 0:
        raise UserInputError(f"must be a positive number, got {text}")
    return value


def positive_floats(text: str) -> list[float]:
    """Parse `X` or `X,Y,...` into a list of distinct positive finite numbers (a sweep)."""
    values: list[float] = []
    for item in text.split(","):
        value = positive_float(item.strip())
        if value in values:
            raise UserInputError(f"{item.strip()} given twice")
        values.append(value)
    return values


def nonnegative_float(text: str) -> float:
    value = strict_float(text)
    if not math.isfinite(value) or value < 0:
        raise UserInputError(f"must be zero or more, got {text}")
    return value


def finite_float(text: str) -> float:
    value = strict_float(text)
    if not math.isfinite(value):
        raise UserInputError(f"must be a finite number, got {text}")
    return value


def strict_int(text: str) -> int:
    return _strict_number(text, int, f"not an integer: {text[:40]!r}")


def positive_int(text: str) -> int:
    value = strict_int(text)
    if not 0 < value < 2**63:
        raise UserInputError(f"must be a positive integer below 2^63, got {text[:40]}")
    return value


def positive_count(text: str) -> int:
    """A positive count (workers, replays, parallel runs), at most SPOTFILL_MAX_COUNT."""
    return check_count("the count", positive_int(text))


def batch_size(text: str) -> int:
    value = positive_int(text)
    if value > MAX_BATCH_SIZE:
        raise UserInputError(f"batch size {value} is above {MAX_BATCH_SIZE}")
    return value


def seed(text: str) -> int:
    value = strict_int(text)
    if not 0 <= value <= MAX_SEED:
        raise UserInputError(f"seed must be in 0..{MAX_SEED}, got {text[:40]}")
    return value


def check_mbps(what: str, mbps: float) -> float:
    """An emulated bandwidth in megabits a second, within MIN_MBPS..MAX_MBPS."""
    if not MIN_MBPS <= mbps <= MAX_MBPS:
        raise UserInputError(f"{what} of {mbps:g} Mbps is outside {MIN_MBPS:g}..{MAX_MBPS:g} Mbps")
    return mbps


def mbps(text: str) -> float:
    """A bandwidth option's text: a positive number of megabits a second, within MIN_MBPS..MAX_MBPS."""
    return check_mbps("a bandwidth", positive_float(text))


def _at_most_ten_years(text: str, value: float) -> float:
    if value > MAX_DURATION_S:
        raise UserInputError(f"{text} s is more than ten years")
    return value


def duration_s(text: str) -> float:
    """A positive, finite number of seconds of at most ten years."""
    return _at_most_ten_years(text, positive_float(text))


def nonnegative_duration_s(text: str) -> float:
    return _at_most_ten_years(text, nonnegative_float(text))


def time_window_s(text: str) -> tuple[float, float]:
    """`START,END` in seconds, 0 <= START < END (a stretch of a run, such as a drought)."""
    start, sep, end = text.partition(",")
    if not sep:
        raise UserInputError(f"expected START,END in seconds, got {text[:40]!r}")
    window = nonnegative_duration_s(start.strip()), duration_s(end.strip())
    if window[0] >= window[1]:
        raise UserInputError(f"the window's start ({start.strip()}) must come before its end ({end.strip()})")
    return window


def is_identifier(text: str) -> bool:
    """1-64 letters, digits, '.', '_' or '-', not starting with '.' (so never '..', a hidden
    folder or a path): safe as a folder or file name."""
    return bool(_ID.match(text))


def identifier(text: str) -> str:
    """A run id or other name that becomes a folder (see is_identifier)."""
    if not is_identifier(text):
        raise UserInputError(f"{text[:80]!r} must be 1-64 letters, digits, '.', '_' or '-', not starting with '.'")
    return text


def _check_name_lengths(path: Path) -> None:
    if len(os.fsencode(str(path))) >= 4096 or any(len(os.fsencode(p)) > 255 for p in path.parts):
        raise UserInputError(f"path too long: {shown(path, 80)}")


def _first_existing(path: Path) -> Path:
    """The nearest ancestor (or the path itself) that exists; a file in the way is an error."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            return candidate
        if candidate.is_symlink():  # a dangling link: writing would follow it
            raise UserInputError(f"{shown(candidate)} is a dangling symbolic link")
    return Path.cwd()


def _check_writable_dir(existing: Path, target: Path) -> None:
    if not existing.is_dir():
        raise UserInputError(f"cannot write {shown(target)}: {shown(existing)} is not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserInputError(f"cannot write {shown(target)}: {shown(existing)} is read-only")


def output_file(text: str) -> Path:
    """A file the command will write: not a folder, not under a file, its folder writable."""
    path = Path(text).expanduser().absolute()
    if not text:
        raise UserInputError("empty output path")
    _check_name_lengths(path)
    if path.is_dir():
        raise UserInputError(f"{shown(text)} is a folder, not a file")
    if path.is_symlink() or (path.exists() and not path.is_file()):
        # the write replaces the path with a new file: a device or a link would be replaced, not written
        raise UserInputError(f"{shown(text)} is not a regular file (a link or a device); name a file")
    if path.exists():
        if not os.access(path, os.W_OK):
            raise UserInputError(f"{shown(text)} is read-only")
        return path
    _check_writable_dir(_first_existing(path.parent), path)
    return path


def output_dir(text: str) -> Path:
    """A folder the command will write into (created if missing): not a file, not under one."""
    if not text:
        raise UserInputError("empty output folder")
    path = Path(text).expanduser().absolute()
    _check_name_lengths(path)
    _check_writable_dir(_first_existing(path), path)
    return path


def file_stem(name: str) -> str:
    """`name` made safe as part of a file name (a profile's workload may be `../../x` or `a:b`)."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", name).lstrip(".")[:64] or "unnamed"


PS_BIND_ENV = "SPOTFILL_PS_BIND"  # the address a parameter server listens on (AWS: 0.0.0.0)


def ps_bind_address() -> str:
    """$SPOTFILL_PS_BIND, else 127.0.0.1: an IPv4 or IPv6 address, checked where it is read and
    before anything launches, not by each PS failing to listen after it started."""
    text = os.environ.get(PS_BIND_ENV) or "127.0.0.1"
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        raise UserInputError(f"{PS_BIND_ENV}='{shown(text, 60)}' is not an IP address "
                             "(such as 127.0.0.1, 0.0.0.0 or ::)") from None


def endpoint_url(text: str) -> str:
    """An http(s) URL with a host (an endpoint such as moto's); anything else fails here, not
    deep in botocore."""
    try:
        parts = urlsplit(text)
        parts.port  # noqa: B018  (raises ValueError on a bad port)
    except ValueError as err:
        raise UserInputError(f"malformed endpoint URL {text[:80]!r}: {err}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UserInputError(f"endpoint URL must be http(s)://HOST[:PORT], got {text[:80]!r}")
    return text
