"""Token layouts of joins and cuts along the token axis (passes/segments.py): samples'
sequences joined end to end become outer blocks (Z-Image joins its guidance branches'
token sequences into one, then splits them back), cut again only at block boundaries."""

from __future__ import annotations

from tokpipe_compiler.core.meta import TOKEN, TokenInfo
from tokpipe_compiler.passes import segments

IMAGE = TokenInfo(TOKEN, 0, 4)  # 4 rows per grid unit
FULL = 16  # 4 units of one sample


def test_equal_sequences_joined_end_to_end_are_outer_blocks():
    joined = segments.joined([(IMAGE, FULL), (IMAGE, FULL)])
    assert joined == TokenInfo(TOKEN, 0, 4, outer=2)
    assert joined.extent(1) == 8  # a chunk of one unit: its 4 rows in each sample


def test_sequences_of_other_layouts_joined_are_refused():
    other = TokenInfo(TOKEN, 0, 4, trail=5)
    assert isinstance(segments.joined([(IMAGE, FULL), (other, FULL + 5)]), str)
    assert isinstance(segments.joined([(IMAGE, FULL), (IMAGE, 2 * FULL)]), str)


def test_outer_blocks_are_cut_at_block_boundaries_only():
    blocks = TokenInfo(TOKEN, 0, 4, outer=2)
    assert segments.cut_sizes(blocks, 2 * FULL, [FULL, FULL]) == [IMAGE, IMAGE]
    assert isinstance(segments.cut(blocks, 2 * FULL, 0, FULL // 2), str)
    # a bound between blocks on a chunk of 1 unit: block 1 starts at 4
    assert segments.to_chunk(FULL, blocks, 2 * FULL, units=1) == 4
