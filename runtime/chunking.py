"""The chunk table: how a step's token grid is cut into chunks, and slicing to a chunk."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from itertools import accumulate

import torch

from tokpipe_compiler.core.errors import TokpipeError


@dataclass(frozen=True)
class Chunk:
    """Units [start, stop) of the token grid (a unit is one row of patches).

    segments: whether the chunk computes the whole text segments of joint attention. In
    stale mode only a step's first chunk does; the later ones attend to the segments' K/V
    in the caches, as the first chunk left them (`with_first_segments`).
    """

    index: int
    start: int
    stop: int
    segments: bool = True

    @property
    def units(self) -> int:
        return self.stop - self.start


def chunk_table(units: int, chunks: int) -> list[Chunk]:
    """`chunks` contiguous ranges tiling [0, units): equal sizes, the last one smaller when
    the split is uneven."""
    if chunks > units:
        raise TokpipeError(
            f"chunks={chunks} is more than the {units} rows of the token grid (its first "
            f"axis: an image's rows of patches, a video's latent frames); use chunks <= {units}"
        )
    size = -(-units // chunks)
    bounds = [min(i * size, units) for i in range(chunks + 1)]
    if bounds[-2] == units:  # ceil sizes can run out early (10 units, 4 chunks -> 3,3,3,1 ok;
        # 5 units, 4 chunks -> 2,2,1,0 not): fall back to spreading the remainder.
        base, extra = divmod(units, chunks)
        sizes = [base + (i < extra) for i in range(chunks)]
        bounds = [sum(sizes[:i]) for i in range(chunks + 1)]
    return [Chunk(i, bounds[i], bounds[i + 1]) for i in range(chunks)]


def table_from_sizes(sizes: Sequence[int]) -> list[Chunk]:
    """Consecutive chunks of `sizes` units each."""
    bounds = [0, *accumulate(sizes)]
    return [Chunk(i, bounds[i], bounds[i + 1]) for i in range(len(sizes))]


def table_from_tokens(units: int, tokens: int, lengths: Sequence[int]) -> list[Chunk]:
    """The chunks of a user's explicit token lengths, which must tile the grid by whole
    units: `tokens` tokens in `units` units (rows, or a video's frames)."""
    per_unit = tokens // units
    if sum(lengths) != tokens:
        raise TokpipeError(
            f"chunks={list(lengths)} covers {sum(lengths)} tokens but the token input has "
            f"{tokens}; give lengths that sum to {tokens}"
        )
    ragged = [n for n in lengths if n % per_unit]
    if ragged:
        raise TokpipeError(
            f"chunk lengths {ragged} are not whole units of the token grid ({per_unit} tokens "
            f"a unit, {units} units; a unit is an image's row of patches, a video's latent "
            f"frame); use multiples of {per_unit}"
        )
    return table_from_sizes([n // per_unit for n in lengths])


def with_first_segments(table: Sequence[Chunk]) -> list[Chunk]:
    """`table` with the text segments computed by its first chunk only."""
    return [replace(c, segments=c.index == 0) for c in table]


def chunk_slice(x: torch.Tensor, axis: int, per_unit: int, outer: int = 1) -> torch.Tensor:
    """Marker for a per-token constant cut to the chunk. The split pass turns each call into
    a stage input that the runtime slices with `slice_to_chunk`; it never runs in a graph."""
    raise TokpipeError("chunk_slice is a marker and runs only through the tokpipe runtime")


def slice_to_chunk(x: torch.Tensor, axis: int, per_unit: int, chunk: Chunk,
                   outer: int = 1) -> torch.Tensor:
    """The chunk's rows of `x` along `axis`; with `outer` blocks (batch rows merged outside
    the tokens), the chunk's rows of every block, blocks kept in order."""
    if outer == 1:
        return x.narrow(axis, chunk.start * per_unit, chunk.units * per_unit)
    blocks = x.unflatten(axis, (outer, -1))
    return blocks.narrow(axis + 1, chunk.start * per_unit, chunk.units * per_unit).flatten(
        axis, axis + 1)


def assemble(pieces: Sequence[torch.Tensor], axis: int, outer: int = 1, lead: int = 0,
             trail: int = 0, segments: Sequence[bool] | None = None) -> torch.Tensor:
    """The inverse of `slice_to_chunk` over a chunk table: the chunks' pieces, in order,
    joined along `axis` within each of the `outer` blocks. With whole segments around the
    chunked rows (`lead`/`trail` text tokens), the segments are the last chunk's where
    every chunk computed its own copy (it ran after every other chunk of the step), else
    the one chunk's that computed them. `segments`: which pieces hold segments (the
    chunks' `segments`; all of them when not given)."""
    if len(pieces) == 1:
        return pieces[0]
    if lead or trail:
        held = segments if segments is not None else [True] * len(pieces)
        last = pieces[-1] if held[-1] else pieces[held.index(True)]
        rows = [p.narrow(axis, lead, p.shape[axis] - lead - trail) if has else p
                for p, has in zip(pieces, held, strict=True)]
        return torch.cat([last.narrow(axis, 0, lead), torch.cat(rows, axis),
                          last.narrow(axis, last.shape[axis] - trail, trail)], axis)
    if outer == 1:
        return torch.cat(list(pieces), axis)
    blocked = [p.unflatten(axis, (outer, -1)) for p in pieces]
    return torch.cat(blocked, axis + 1).flatten(axis, axis + 1)
