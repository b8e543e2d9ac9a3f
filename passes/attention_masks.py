"""How hand-written attention masks its scores, and the one mask sdpa gets for it.

    s + mask                               an additive mask          -> attn_mask=mask
    s.masked_fill(hidden, -inf)            a boolean table of what    -> attn_mask=~hidden
                                           may not be attended
    torch.where(seen, s, -inf)             a boolean table of what    -> attn_mask=seen
                                           may (or where(hidden, -inf, s))
    baddbmm(mask, q, kT, beta=1)           an additive mask          -> attn_mask=mask

A table filled with the dtype's lowest value (transformers' `torch.finfo(dtype).min`)
instead of -inf becomes an additive mask of it, and an additive mask may come on top of a
table (GPT-Neo's `torch.where(causal, s, min) + attention_mask`: sdpa adds their sum) or
under it (MPT's ALiBi bias, `(s + bias).masked_fill(hidden, min)`: the fill where hidden,
else the bias). Each gives eager's value: a score plus the lowest value rounds to it, so a
row with every key hidden stays even, as eager's does (in float32 and bfloat16; in
float16 sdpa adds in float32, where such a row is not absorbed).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.fx

from tokpipe_compiler.core.fx import add_node, example_value
from tokpipe_compiler.core.ops import op_key
from tokpipe_compiler.passes.attention_scores import Scores, is_number, scaled_product

BADDBMMS = {torch.baddbmm, "method:baddbmm"}
ADDS = {operator.add, torch.add, "method:add"}
MASKED_FILLS = {torch.masked_fill, "method:masked_fill"}
WHERES = {torch.where, "method:where"}
# Factories of the fill value as a 0-d tensor (GPT-Neo's torch.tensor(finfo.min)).
SCALAR_TENSORS = {torch.tensor, torch.scalar_tensor}


def masked_scores(node: torch.fx.Node) -> Scores | None:
    """How `node` computes masked (or plain) attention scores, or None."""
    if op_key(node) in ADDS:
        return _plus_mask(node, lambda product: _table_masked(product) or
                          scaled_product(product))
    return _table_masked(node) or _unfilled(node)


def _unfilled(node: Any) -> Scores | None:
    """Scores read by one node, with an additive mask or none: what a table fills."""
    if not _read_once(node):
        return None
    if op_key(node) in BADDBMMS:
        return _baddbmm(node)
    return _plus_mask(node, scaled_product) or scaled_product(node)


def _plus_mask(node: torch.fx.Node, under: Callable[[Any], Scores | None]) -> Scores | None:
    """`scores + mask`, the scores found by `under`: the mask is added to them, or on top
    of a table's (MPT's ALiBi bias under its fill, GPT-Neo's padding mask over its)."""
    if op_key(node) not in ADDS or len(node.args) != 2 or node.kwargs:
        return None
    for product, mask in (node.args, node.args[::-1]):
        if not isinstance(mask, torch.fx.Node) or not _read_once(product):
            continue
        found = under(product)
        if found is None or found.added is not None or \
                (found.mask is not None and not found.boolean):
            continue
        masks = {"added": mask} if found.boolean else {"mask": mask}
        return replace(found, **masks, nodes=[node, *found.nodes])
    return None


def _read_once(node: Any) -> bool:
    return isinstance(node, torch.fx.Node) and len(node.users) == 1


def _table_masked(node: torch.fx.Node) -> Scores | None:
    """Scores filled where a boolean table says: masked_fill or torch.where."""
    if op_key(node) in MASKED_FILLS and len(node.args) == 3 and not node.kwargs:
        product, table, value = node.args
        return _filled(node, product, table, value, kept=False)
    if op_key(node) not in WHERES or len(node.args) != 3 or node.kwargs:
        return None
    if op_key(node) == "method:where":  # scores.where(seen, fill)
        product, seen, fill = node.args
        return _filled(node, product, seen, fill, kept=True)
    table, chosen, other = node.args  # where(seen, scores, fill) or (hidden, fill, scores)
    return _filled(node, chosen, table, other, kept=True) or \
        _filled(node, other, table, chosen, kept=False)


def _filled(node: torch.fx.Node, product: Any, table: Any, value: Any,
            kept: bool) -> Scores | None:
    found = _unfilled(product)
    if found is None or not isinstance(table, torch.fx.Node):
        return None
    fill = _fill_value(value)
    if fill is None or not _hides(fill, example_value(product)):
        return None
    return replace(found, mask=table, boolean=True, kept=kept, added=found.mask,
                   under=found.mask is not None, nodes=[node, *found.nodes],
                   fill=None if fill == -math.inf else fill)


def _fill_value(value: Any) -> float | None:
    """A number, or a 0-d tensor made of one in the graph (whose node is then dropped
    with the scores: `attention_patterns._pure`), as its own dtype holds it (the float32
    lowest value made a bfloat16 tensor is -inf)."""
    if is_number(value):
        return float(value)
    if isinstance(value, torch.fx.Node) and op_key(value) in SCALAR_TENSORS and \
            len(value.users) == 1 and len(value.args) == 1 and is_number(value.args[0]):
        made = example_value(value)
        if isinstance(made, torch.Tensor) and made.dim() == 0 and made.is_floating_point():
            return float(torch.tensor(value.args[0], dtype=made.dtype))
    return None


def _hides(value: float, scores: Any) -> bool:
    """Whether filling `scores` with `value` folds into sdpa: -inf (a boolean mask), or the
    dtype's lowest value (an additive mask: a score plus it rounds to it, in the
    precision sdpa adds it in; a half-precision row with every key filled is the
    exception, which README's padded rows name). Another finite value is left as written:
    a row with every key filled would not stay even."""
    if not isinstance(scores, torch.Tensor) or not scores.is_floating_point():
        return False
    return value == -math.inf or value == torch.finfo(scores.dtype).min


def _baddbmm(node: torch.fx.Node) -> Scores | None:
    """baddbmm(bias, q, kT, beta=0 or 1, alpha=scale): with beta 1 the bias is a mask."""
    beta, alpha = node.kwargs.get("beta", 1), node.kwargs.get("alpha", 1)
    if len(node.args) != 3 or not is_number(alpha) or beta not in (0, 1):
        return None
    bias, query, keys_t = node.args
    if beta == 1 and not isinstance(bias, torch.fx.Node):
        return None
    return Scores(query, keys_t, bias if beta == 1 else None, float(alpha), [node])


def masks_fit(scores: Scores, shape: torch.Size, dtype: torch.dtype) -> bool:
    """The scores' masks broadcast to sdpa's scores `shape` (laid out as sdpa's), a table
    boolean, an additive mask of the operands' `dtype`."""
    if scores.mask is None:
        return True
    wanted = [(scores.mask, torch.bool if scores.boolean else dtype)]
    if scores.added is not None:
        wanted.append((scores.added, dtype))
    return scores.layout.order is None and all(
        _broadcasts(example_value(mask), shape, kind) for mask, kind in wanted)


def _broadcasts(mask: Any, shape: torch.Size, dtype: torch.dtype) -> bool:
    return (isinstance(mask, torch.Tensor) and mask.dtype == dtype
            and mask.dim() <= len(shape) and torch.broadcast_shapes(mask.shape, shape) == shape)


def sdpa_mask(graph: torch.fx.Graph, scores: Scores, dtype: torch.dtype) -> torch.fx.Node:
    """sdpa's attn_mask for the scores' masks: True where attended (a table filled with
    -inf alone), or added to the scores (the fill where hidden, else 0, plus any added)."""
    if not scores.boolean:
        return scores.mask
    if scores.fill is None and scores.added is None:
        return scores.mask if scores.kept else \
            add_node(graph, "function", torch.logical_not, (scores.mask,))
    hidden = add_node(graph, "function", torch.logical_not, (scores.mask,)) \
        if scores.kept else scores.mask
    fill = -math.inf if scores.fill is None else scores.fill
    if scores.under:  # the fill replaces the added mask where hidden, as it did the sum
        return add_node(graph, "function", torch.masked_fill, (scores.added, hidden, fill))
    zero = add_node(graph, "function", torch.zeros_like, (scores.mask,), {"dtype": dtype})
    mask = add_node(graph, "function", torch.masked_fill, (zero, hidden, fill))
    if scores.added is None:
        return mask
    return add_node(graph, "function", operator.add, (mask, scores.added))
