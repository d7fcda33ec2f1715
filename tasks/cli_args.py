"""Parsers for the CLI's shared value formats (`TYPE=N,TYPE=N`, positive numbers)."""
from __future__ import annotations

import argparse
import math


def counts(text: str) -> dict[str, int]:
    """Parse `TYPE=N,TYPE=N` into {type: n}; repeated types and negative counts are errors."""
    result: dict[str, int] = {}
    if not text.strip():
        return result
    for item in text.split(","):
        name, sep, value = item.strip().partition("=")
        if not sep or not name:
            raise argparse.ArgumentTypeError(f"expected TYPE=N, got {item.strip()!r}")
        try:
            n = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"count for {name} is not an integer: {value!r}") from None
        if n < 0:
            raise argparse.ArgumentTypeError(f"count for {name} is negative: {n}")
        if name in result:
            raise argparse.ArgumentTypeError(f"type {name} given twice")
        result[name] = n
    return result


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def positive_floats(text: str) -> list[float]:
    """Parse `X` or `X,Y,...` into a list of distinct positive finite numbers (a sweep)."""
    values: list[float] = []
    for item in text.split(","):
        value = positive_float(item.strip())
        if value in values:
            raise argparse.ArgumentTypeError(f"{item.strip()} given twice")
        values.append(value)
    return values


def nonnegative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be zero or more, got {text}")
    return value


def finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value
