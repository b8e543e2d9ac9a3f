"""Slicing a per-call tensor to a chunk and assembling the chunks back, with the token axis
repeated in outer blocks (batch rows merged outside the tokens)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokpipe_compiler.core.meta import TOKEN, TokenInfo
from tokpipe_compiler.runtime.chunking import assemble, chunk_table, slice_to_chunk


@settings(max_examples=60, deadline=None)
@given(outer=st.integers(1, 3), units=st.integers(1, 6), per_unit=st.integers(1, 3),
       axis=st.integers(0, 2), data=st.data())
def test_slices_of_every_chunk_assemble_to_the_whole(outer, units, per_unit, axis, data):
    chunks = chunk_table(units, data.draw(st.integers(1, units)))
    shape = [2, 3, 2]
    shape[axis] = outer * units * per_unit
    x = torch.arange(torch.Size(shape).numel()).reshape(shape)
    info = TokenInfo(TOKEN, axis, per_unit, outer=outer)
    pieces = [slice_to_chunk(x, axis, per_unit, c, outer) for c in chunks]
    assert [p.shape[axis] for p in pieces] == [info.extent(c.units) for c in chunks]
    assert torch.equal(assemble(pieces, axis, outer), x)


def test_a_chunk_is_its_rows_in_every_block():
    x = torch.arange(12)  # 2 blocks of 3 units, 2 elements a unit
    chunk = chunk_table(3, 3)[1]
    assert slice_to_chunk(x, 0, 2, chunk, outer=2).tolist() == [2, 3, 8, 9]
