"""The scores of attention written by hand: `scale * query @ keys^T` before any mask.

Found as `q @ kT` (matmul, bmm or the operator), an einsum (`attention_einsums`), or
either scaled by a number (`* s`, `/ s`) or by a tensor the same for every query and key
of a head (a learned temperature, folded into the queries). How the scores are then
masked is `attention_masks`; the fold itself is `attention_patterns`.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.fx

from tokpipe_compiler.core.fx import example_value
from tokpipe_compiler.core.ops import op_key
from tokpipe_compiler.passes import attention_einsums

MATMULS = {torch.matmul, torch.bmm, operator.matmul, "method:matmul", "method:bmm"}
MULS = {operator.mul, torch.mul, "method:mul"}
DIVS = {operator.truediv, torch.div, "method:div"}
SDPA_LAYOUT = attention_einsums.ScoresLayout(None, None, None)  # matmuls' and baddbmm's


@dataclass
class Scores:
    """softmax's input: scale * query @ keys^T, masked, computed by `nodes`."""

    query: torch.fx.Node
    keys: Any  # [..., E, S] when `transposed` (what q @ kT reads), else [..., S, E]
    mask: torch.fx.Node | None
    scale: float
    nodes: list[torch.fx.Node]  # each before the nodes it reads
    transposed: bool = True
    # The mask is a boolean table: of what may not be attended (masked_fill's), or, with
    # `kept`, of what may (torch.where's condition); else it is added to the scores.
    boolean: bool = False
    kept: bool = False
    # The finite score the places a boolean table hides get (the dtype's lowest,
    # transformers' fill), where not -inf: folded as an additive mask of it.
    fill: float | None = None
    # An additive mask with a boolean table: added on top of the filled scores (GPT-Neo's
    # padding mask), or, `under`, to the scores the table then fills (MPT's ALiBi bias).
    added: torch.fx.Node | None = None
    under: bool = False
    layout: attention_einsums.ScoresLayout = SDPA_LAYOUT  # an einsum's may differ
    # A tensor that scales each head's scores alike (a learned temperature), and whether it
    # divides them: folded into the queries, as sdpa's scale is a number.
    factor: tuple[torch.fx.Node, bool] | None = None


def scaled_product(node: Any) -> Scores | None:
    """`q @ kT`, `(q @ kT) * s` or `(q @ kT) / s` read by one node, or None."""
    if not isinstance(node, torch.fx.Node) or len(node.users) != 1:
        return None
    key, einsum = op_key(node), attention_einsums.scores_einsum(node)
    if einsum is not None:
        query, keys, layout = einsum
        return Scores(query, keys, None, 1.0, [node], transposed=False, layout=layout)
    if len(node.args) != 2 or node.kwargs:
        return None
    if key in MATMULS:
        return Scores(node.args[0], node.args[1], None, 1.0, [node])
    if key not in MULS and key not in DIVS:
        return None
    for product, factor in (node.args, node.args[::-1]) if key in MULS else (node.args,):
        found = scaled_product(product)
        if found is None or found.scale != 1.0 or found.mask is not None or found.factor:
            continue
        if is_number(factor) and factor != 0:
            scale = float(factor) if key in MULS else 1.0 / float(factor)
            return replace(found, scale=scale, nodes=[node, *found.nodes])
        if _per_head(factor, found):
            return replace(found, factor=(factor, key in DIVS), nodes=[node, *found.nodes])
    return None


def _per_head(factor: Any, scores: Scores) -> bool:
    """A tensor of size 1 along the queries and keys (per head, or one number), in the
    queries' dtype where it has dims (so that scaling them keeps their dtype and shape)."""
    if not isinstance(factor, torch.fx.Node) or scores.layout is not SDPA_LAYOUT:
        return False
    value, query = example_value(factor), example_value(scores.query)
    if not (isinstance(value, torch.Tensor) and isinstance(query, torch.Tensor)):
        return False
    if not value.is_floating_point() or (value.dim() and value.dtype != query.dtype):
        return False
    if any(size != 1 for size in value.shape[-2:]) or value.dim() > query.dim():
        return False
    try:
        return torch.broadcast_shapes(value.shape, query.shape) == query.shape
    except RuntimeError:
        return False


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
