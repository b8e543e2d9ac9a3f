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

import operator
from collections.abc import Sequence
from dataclasses import replace

import torch
import torch.fx

from tokpipe_compiler.core.fx import example_value
from tokpipe_compiler.core.meta import TOKEN, TokenInfo
from tokpipe_compiler.passes.shape_rules import expand_index

# Segments are ranges of one block; a token axis of several blocks (batch merged with the
# frames) is only ever taken whole.
_BLOCKED = "taking part of a token axis that repeats in outer blocks (batch rows)"
_SEED_CANDIDATES = 4  # each is a propagation over the whole graph


def cut(info: TokenInfo, full: int, start: int, stop: int) -> TokenInfo | str:
    """The TokenInfo of elements [start, stop) of a token axis of full size `full`: of an
    axis in outer blocks, whole blocks only (one sample's sequence of a batch joined)."""
    if info.outer > 1:
        block = full // info.outer
        if start % block or stop % block or stop <= start:
            return _BLOCKED
        return replace(info, kind=TOKEN, outer=(stop - start) // block)
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


def to_chunk(index: int, info: TokenInfo, full: int, units: int,
             segments: bool = True) -> int:
    """A position on the full axis (a slice bound outside the chunked range, or between
    outer blocks) on a chunk, with its segments or without them."""
    if info.outer > 1:
        return index // (full // info.outer) * info.block(units, segments)
    if index <= info.lead:
        return index if segments else 0
    return index - full + info.extent(units) if segments else info.extent(units, False)


def joined(pieces: Sequence[tuple[TokenInfo | None, int]]) -> TokenInfo | str:
    """The TokenInfo of a concatenation along the token axis of (info or None, size) pieces
    (None: an invariant piece, whole in every chunk)."""
    if any(info is not None and info.outer > 1 for info, _ in pieces):
        return _BLOCKED
    chunked = [i for i, (info, _) in enumerate(pieces) if info is not None and info.per_unit]
    if len(chunked) > 1:
        return _blocks(pieces)
    if not chunked:
        total = sum(size for _, size in pieces)
        axis = next(info.axis for info, _ in pieces if info is not None)
        return TokenInfo(TOKEN, axis, 0, lead=total)
    at = chunked[0]
    info = pieces[at][0]
    before = sum(size for _, size in pieces[:at])
    after = sum(size for _, size in pieces[at + 1:])
    return replace(info, kind=TOKEN, lead=info.lead + before, trail=info.trail + after)


def _blocks(pieces: Sequence[tuple[TokenInfo | None, int]]) -> TokenInfo | str:
    """Chunked sequences of one layout and size joined end to end (Z-Image joins its
    samples' token sequences into one, then splits them back): outer blocks, a chunk its
    range in each."""
    infos = {(info, size) for info, size in pieces}
    if len(infos) != 1 or next(iter(infos))[0] is None:
        return "concatenation of two chunked token sequences along the token axis"
    info = pieces[0][0]
    return replace(info, kind=TOKEN, outer=len(pieces))


def whole(value: object) -> TokenInfo:
    """A value every chunk holds whole, all of it a segment: what a token-mixing op gives in
    sync mode, where the one chunk is the whole sequence. The segment spans the first axis
    (no axis for a scalar or a tuple), so its size never changes with the chunk."""
    if isinstance(value, torch.Tensor) and value.dim():
        return TokenInfo(TOKEN, 0, 0, lead=value.shape[0])
    return TokenInfo(TOKEN, None, 0)


def seed_candidates(gm: torch.fx.GraphModule, seed: torch.fx.Node,
                    axis: int) -> list[tuple[int, int]]:
    """(lead, trail) segments the token input may hold around its chunked range: text joined
    to the image before a graph break reaches the blocks' graph as one sequence. Read from
    the constant slices the graph takes of an axis as long as the input's token axis, first
    found first; at most `_SEED_CANDIDATES`."""
    full = example_value(seed).shape[axis]
    found: list[tuple[int, int]] = []
    for node in gm.graph.nodes:
        value = example_value(node.args[0]) if node.target is operator.getitem else None
        if not isinstance(value, torch.Tensor):
            continue
        items = [i for i in expand_index(node.args[1], value.dim()) if i is not None]
        for size, item in zip(value.shape, items, strict=False):
            if size != full or not isinstance(item, slice) or item.step not in (None, 1):
                continue
            start, stop, _ = item.indices(full)
            lead, trail = start, full - stop
            if 0 < lead + trail < full and stop > start and (lead, trail) not in found:
                found.append((lead, trail))
    return found[:_SEED_CANDIDATES]
