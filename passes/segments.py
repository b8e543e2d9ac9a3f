"""Segments: whole, unchunked ranges of a token axis around its chunked range.

Joint text+image attention concatenates text tokens with image tokens along the sequence:

    q = cat([img_q, txt_q], dim=2)      [1, 2, 16 + 5, 8]    token(2, per_unit 4, trail 5)

Every chunk carries the 5 text tokens whole: on a chunk of 2 units the axis has
0 + 2 * 4 + 5 elements. Slicing the text back out gives a value that is only a segment,
per_unit 0 (`out[:, 16:]` -> token(1, 0, lead 5)): it differs per chunk (it attended to the
chunk's view of the K/V caches) but always has 5 rows.

A range [a, b) of the full axis is a value of this kind when it does not cut the chunked
range [lead, full - trail): it either holds all of it or none of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from tokpipe_compiler.core.meta import TOKEN, TokenInfo

# Segments are ranges of one block; a token axis of several blocks (batch merged with the
# frames) is only ever taken whole.
_BLOCKED = "taking part of a token axis that repeats in outer blocks (batch rows)"


def cut(info: TokenInfo, full: int, start: int, stop: int) -> TokenInfo | str:
    """The TokenInfo of elements [start, stop) of a token axis of full size `full`."""
    if info.outer > 1:
        return _BLOCKED
    lo, hi = info.lead, full - info.trail
    if start <= lo and stop >= hi and hi > lo:
        return replace(info, kind=TOKEN, lead=lo - start, trail=stop - hi)
    if stop <= lo or start >= hi:
        return replace(info, kind=TOKEN, per_unit=0, lead=stop - start, trail=0)
    return (f"taking elements [{start}, {stop}) of a token axis whose chunked range is "
            f"[{lo}, {hi}) cuts through the chunks")


def cut_sizes(info: TokenInfo, full: int, sizes: Sequence[int]) -> list[TokenInfo] | str:
    """TokenInfos of the pieces of `split(sizes)` along the token axis."""
    pieces, start = [], 0
    for size in sizes:
        piece = cut(info, full, start, start + size)
        if isinstance(piece, str):
            return piece
        pieces.append(piece)
        start += size
    return pieces


def to_chunk(index: int, info: TokenInfo, full: int, units: int) -> int:
    """A position on the full axis (a slice bound outside the chunked range) on a chunk."""
    if index <= info.lead:
        return index
    return index - full + info.extent(units)


def joined(pieces: Sequence[tuple[TokenInfo | None, int]]) -> TokenInfo | str:
    """The TokenInfo of a concatenation along the token axis of (info or None, size) pieces
    (None: an invariant piece, whole in every chunk)."""
    if any(info is not None and info.outer > 1 for info, _ in pieces):
        return _BLOCKED
    chunked = [i for i, (info, _) in enumerate(pieces) if info is not None and info.per_unit]
    if len(chunked) > 1:
        return "concatenation of two chunked token sequences along the token axis"
    if not chunked:
        total = sum(size for _, size in pieces)
        axis = next(info.axis for info, _ in pieces if info is not None)
        return TokenInfo(TOKEN, axis, 0, lead=total)
    at = chunked[0]
    info = pieces[at][0]
    before = sum(size for _, size in pieces[:at])
    after = sum(size for _, size in pieces[at + 1:])
    return replace(info, kind=TOKEN, lead=info.lead + before, trail=info.trail + after)


def whole(value: object) -> TokenInfo:
    """A value every chunk holds whole, all of it a segment: what a token-mixing op gives in
    sync mode, where the one chunk is the whole sequence. The segment spans the first axis
    (no axis for a scalar or a tuple), so its size never changes with the chunk."""
    if isinstance(value, torch.Tensor) and value.dim():
        return TokenInfo(TOKEN, 0, 0, lead=value.shape[0])
    return TokenInfo(TOKEN, None, 0)
