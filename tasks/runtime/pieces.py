"""How the flat vector (flat.py) is cut for the wire: the push and the pull each move as pieces.

Each PS shard's range of the vector is cut into pieces of at most `piece_numel` elements; piece i
of a shard's range travels on gloo tag i + 1 (tag 0 carries the headers). The worker sends its
push piece by piece as backward finishes them (push.py), and receives its pull piece by piece
while forward already runs (pull.py); the PS posts and sends the same cut (ps.py).
"""
from __future__ import annotations

from dataclasses import dataclass

PIECE_MB = 4.0  # small enough to start early in a 25M model's backward or forward, large enough that a message's fixed cost is noise


@dataclass(frozen=True)
class Piece:
    shard: int
    tag: int
    lo: int  # global offsets in the flat vector
    hi: int


def pieces(numel: int, piece_numel: int) -> list[tuple[int, int]]:
    """[lo, hi) pieces covering 0..numel in order, each at most `piece_numel` elements: piece i
    travels on gloo tag i + 1."""
    if piece_numel <= 0:
        raise ValueError(f"piece size must be positive, got {piece_numel}")
    return [(lo, min(numel, lo + piece_numel)) for lo in range(0, numel, piece_numel)]


def piece_numel_for(piece_mb: float) -> int:
    return max(1, int(piece_mb * 1e6 / 4))  # float32 elements


def shard_pieces(ranges: list[tuple[int, int]], piece_numel: int) -> list[Piece]:
    """Every shard's pieces, in global offsets: shard 0's first, each shard's in order."""
    return [Piece(shard, tag, lo + a, lo + b)
            for shard, (lo, hi) in enumerate(ranges)
            for tag, (a, b) in enumerate(pieces(hi - lo, piece_numel), start=1)]


def holding(all_pieces: list[Piece], lo: int, hi: int) -> list[int]:
    """The indices of the pieces that hold any of [lo, hi)."""
    return [j for j, p in enumerate(all_pieces) if p.lo < hi and lo < p.hi]


def pull_order(cut: list[tuple[int, int]], param_numel: int) -> list[int]:
    """The order a shard sends its pull's pieces in (indices into `cut`, offsets within the
    shard's range; `param_numel`: how much of that range is parameters): the pieces holding
    floating-point buffers first, then the parameters' in order. A BatchNorm layer at the start
    of the network reads its statistics from the end of the vector: sent last, they would hold
    forward up until the whole pull had landed."""
    first = [i for i, (_, hi) in enumerate(cut) if hi > param_numel]
    return first + [i for i, (_, hi) in enumerate(cut) if hi <= param_numel]
