"""Slice updates rewritten as whole-tensor adds, before annotate.

    x[:, :, 1:] = x[:, :, 1:] + y        ->   x2 = x + F.pad(y, (0, 0, 0, 0, 1, 0))

WanAnimate adds its pose features to every latent frame but the first this way. On the
token axis the range [1, F) need not line up with any chunk, so annotate refuses the slice.
Written as an add of y padded with zeros to x's shape, it is an elementwise op whose second
operand is a per-token table, which annotate cuts to each chunk as it cuts a positional
embedding. The rewrite is exact (x + 0 == x) and applies only where nothing can observe the
difference: x is no view, the update's slice is read by the add alone, and no view of x
made before the update is read after it.
"""

from __future__ import annotations

import operator

import torch
import torch.fx
import torch.nn.functional as F

from tokpipe_compiler.core.fx import example_value

_ADDS = (operator.add, torch.add)


def functional_slice_adds(gm: torch.fx.GraphModule) -> None:
    """Rewrites every `x[slices] = x[slices] + y` the module docstring describes."""
    for node in [n for n in gm.graph.nodes if n.target is operator.setitem]:
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        padding = _padding(node, order)
        if padding is not None:
            _rewrite(gm, node, padding, order)


def _rewrite(gm: torch.fx.GraphModule, update: torch.fx.Node, padding: list[int],
             order: dict[torch.fx.Node, int]) -> None:
    x, _, total = update.args
    read, addend = _operands(total, x)
    value = example_value(x)
    with gm.graph.inserting_before(update):
        padded = gm.graph.call_function(F.pad, (addend, padding))
        result = gm.graph.call_function(operator.add, (x, padded))
    for node in (padded, result):
        node.meta["example_value"] = value  # both have x's shape and dtype
        node.meta["stack_trace"] = update.meta.get("stack_trace")
    for user in list(x.users):
        if order.get(user, -1) > order[update]:
            user.replace_input_with(x, result)
    for node in (update, total, read):
        gm.graph.erase_node(node)
    gm.recompile()


def _padding(update: torch.fx.Node, order: dict[torch.fx.Node, int]) -> list[int] | None:
    """F.pad's padding that places the update's addend at its slice of x, or None where
    the setitem is not a slice add the rewrite can replace exactly."""
    x, index, total = update.args
    value = example_value(x)
    slices = index if isinstance(index, tuple) else (index,)
    if (not isinstance(total, torch.fx.Node) or not isinstance(value, torch.Tensor)
            or value._is_view() or not all(_plain(s) for s in slices)
            or len(slices) > value.dim()):
        return None
    operands = _operands(total, x)
    if operands is None or operands[0].args[1] != index:
        return None
    read, addend = operands
    added, shown = example_value(addend), example_value(read)
    if (not isinstance(added, torch.Tensor) or added.shape != shown.shape
            or added.dtype != value.dtype or len(total.users) != 1 or len(read.users) != 1
            or any(order[u] < order[update] and u is not read for u in x.users)):
        return None
    padding: list[int] = []
    for axis in reversed(range(value.dim())):  # F.pad lists the last axis first
        size = value.shape[axis]
        start, stop, _ = (slices[axis].indices(size) if axis < len(slices)
                          else (0, size, 1))
        padding += [start, size - stop]
    return padding


def _operands(total: torch.fx.Node, x: torch.fx.Node):
    """(x[index] read, addend) of `total = x[index] + addend` (either order), or None."""
    if total.target not in _ADDS or total.kwargs or len(total.args) != 2:
        return None
    for read, addend in (total.args, total.args[::-1]):
        if (isinstance(read, torch.fx.Node) and read.target is operator.getitem
                and read.args[0] is x and isinstance(addend, torch.fx.Node)):
            return read, addend
    return None


def _plain(item) -> bool:
    """A slice with step 1 and constant bounds."""
    return (isinstance(item, slice) and item.step in (None, 1)
            and all(b is None or isinstance(b, int) for b in (item.start, item.stop)))
