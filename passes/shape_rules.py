"""Shape arithmetic for the rules of ops that only move elements around: which dims a
reshape merges, where permutes and transposes move an axis, how indexing moves it.

A token value is described by (axis, per_unit): a chunk of grid units [u0, u1) is the slice
[u0 * per_unit, u1 * per_unit) of `axis`. `per_unit` is a Fraction while annotating; the
annotate pass scales every per_unit by the least common denominator at the end, which is
how a coarser grid (a patch of two latent rows, say) falls out of the graph by itself.
"""

from __future__ import annotations

from collections.abc import Sequence


def merge_groups(a: list[int], b: list[int]) -> list[tuple[list[int], list[int]]]:
    """Split two shapes of equal numel into runs of dims with equal products."""
    groups, i, j = [], 0, 0
    while i < len(a) or j < len(b):
        gi, gj, pa, pb = [], [], 1, 1
        if i < len(a):
            gi.append(i)
            pa *= a[i]
            i += 1
        if j < len(b):
            gj.append(j)
            pb *= b[j]
            j += 1
        while pa != pb:
            if pa < pb and i < len(a):
                gi.append(i)
                pa *= a[i]
                i += 1
            elif pb < pa and j < len(b):
                gj.append(j)
                pb *= b[j]
                j += 1
            else:
                return groups
        # Trailing size-1 dims join the group they follow; this keeps the mapping stable.
        groups.append((gi, gj))
    return groups


def permute_axis(axis: int, dims: Sequence[int], ndim: int) -> int:
    """Output position of input axis `axis` under permute(dims)."""
    dims = [d % ndim for d in dims]
    return dims.index(axis)


def transpose_axis(axis: int, d0: int, d1: int, ndim: int) -> int:
    d0, d1 = d0 % ndim, d1 % ndim
    if axis == d0:
        return d1
    if axis == d1:
        return d0
    return axis


def expand_index(index: object, ndim: int) -> list:
    """The items of tensor[index] with Ellipsis spelled out as slices."""
    items = list(index) if isinstance(index, tuple) else [index]
    if any(item is Ellipsis for item in items):
        at = items.index(Ellipsis)
        consumed = sum(1 for it in items if it is not None and it is not Ellipsis)
        items[at : at + 1] = [slice(None)] * (ndim - consumed)
    return items


def getitem_axis(items: list, axis: int, shape: Sequence[int]) -> tuple[int, int | None] | str:
    """(output axis, position in `items` of the token axis' item, None when taken whole) of
    tensor[items] (see expand_index), or why it cannot be followed.

    Only basic indexing is followed: None inserts an axis, an int drops one, a slice keeps
    one; the token axis itself may only be sliced with step 1, or taken at one position (an
    int: the output axis is where it would have been).
    """
    in_dim, out_dim = 0, 0
    for position, item in enumerate(items):
        if item is None:
            out_dim += 1
            continue
        if in_dim == axis:
            if _is_int(item):
                return out_dim, position
            if not isinstance(item, slice) or item.indices(shape[axis])[2] != 1:
                return f"indexing the token axis with {item!r}"
            return out_dim, None if _is_whole(item, shape[axis]) else position
        if isinstance(item, slice):
            out_dim += 1
        elif not isinstance(item, int):
            return (f"indexing axis {in_dim}, before the token axis, with a list or tensor "
                    "of indices (advanced indexing, which may move the axes)")
        in_dim += 1
    return out_dim + (axis - in_dim), None


def item_range(item: slice | int, size: int) -> tuple[int, int]:
    """[start, stop) of an axis of `size` that a slice (step 1) or an int takes."""
    if _is_int(item):
        return item % size, item % size + 1
    start, stop, _ = item.indices(size)
    return start, stop


def _is_int(item: object) -> bool:
    return isinstance(item, int) and not isinstance(item, bool)


def _is_whole(item: slice, size: int) -> bool:
    start, stop, step = item.indices(size)
    return start == 0 and stop == size and step == 1
