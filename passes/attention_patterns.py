"""Attention written by hand folded into `F.scaled_dot_product_attention`, before annotate.

    s = torch.baddbmm(mask_or_empty, q, k.transpose(-1, -2), beta=b, alpha=scale)
    p = s.softmax(dim=-1)                                 ->   o = sdpa(q, k, v,
    o = torch.bmm(p, v)                                            attn_mask=mask, scale=scale)

diffusers' classic `AttnProcessor` (what `set_default_attn_processor()` installs, and
what older models such as T5FilmDecoder use) computes attention this way: its scores
matrix mixes every token with every other, so no token rule can chunk it, while the
attention it spells is what the K/V-cache rewrite (chunk_attention) chunks. Also matched:
`q @ k.transpose(-1, -2)` or `q @ k.mT` (matmul, bmm or the operator) and einsums, latent
diffusion's ("b i d, b j d -> b i j", then "b i j, b j d -> b i d") or with the heads
between tokens and features ("bnhd,bmhd->bhnm", then "bhnm,bmhd->bnhd": permuted to sdpa's
layout and back, `attention_einsums.py`), scaled by a number (`* s`, `/ s`) or by a
tensor the same for every query and key of a head (a learned temperature such as Swin v2's
`logit_scale.exp()`, which scales the queries instead: `attention_scores.py`), masked
(an added mask, nanoGPT's causal `masked_fill`, GPT-Neo's `torch.where`:
`attention_masks.py`), casts of the scores or probabilities (an upcast softmax), and a
dropout that is off. A causal table reaches sdpa as a mask, not as `is_causal`: causal
mode runs it exactly, but attends over the masked keys after the chunk too.

The fold is exact in value and approximate in rounding: the scores are no longer
materialised, so float32 results move by about 1e-7 relative. It applies only where
nothing else reads the scores or the probabilities, the operands share a dtype and a rank,
and an added mask has the operands' dtype (and scores laid out as sdpa's [..., L, S]).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F

from tokpipe_compiler.core.args import arg
from tokpipe_compiler.core.fx import add_node, example_value, rewritten
from tokpipe_compiler.core.ops import op_key
from tokpipe_compiler.passes import attention_einsums
from tokpipe_compiler.passes.attention_einsums import Perm, permuted_shape
from tokpipe_compiler.passes.attention_masks import (
    SCALAR_TENSORS,
    masked_scores,
    masks_fit,
    sdpa_mask,
)
from tokpipe_compiler.passes.attention_scores import MATMULS, Scores
from tokpipe_compiler.passes.view_rules import swapped_axes

SOFTMAXES = {torch.softmax, F.softmax, "method:softmax"}
CASTS = {"method:float", "method:half", "method:bfloat16"}
DROPOUTS = {F.dropout, torch.dropout}


@dataclass
class HandWritten:
    """One matched attention: its scores, values, and the nodes the fold replaces."""

    scores: Scores
    value: Any
    output: torch.fx.Node
    replaced: list[torch.fx.Node]  # the output first, then backwards to the scores
    value_perm: Perm = None  # to sdpa's [..., S, Ev]
    output_perm: Perm = None  # from sdpa's [..., L, Ev] to the output's layout


def fold_hand_written_attention(gm: torch.fx.GraphModule) -> int:
    """Rewrites every attention the module docstring describes; returns how many."""
    folded = 0
    # One at a time, in graph order: a fold erases only nodes at or before the output it
    # replaces, and an attention read by a later one is matched with its fold in place.
    for node in list(gm.graph.nodes):
        attention = match(node)
        if attention is not None:
            _fold(gm, attention)
            folded += 1
    return rewritten(gm, folded, "attention(s) written by hand folded into sdpa")


def match(node: torch.fx.Node) -> HandWritten | None:
    """The hand-written attention whose `probs @ v` is `node`, or None."""
    if op_key(node) in MATMULS and len(node.args) == 2 and not node.kwargs:
        probs, value = node.args
    elif attention_einsums.output_einsum(node) is not None:
        probs, value = attention_einsums.output_einsum(node)
    else:
        return None
    replaced = [node]
    softmax = _through(probs, _is_transparent, replaced)
    if softmax is None or op_key(softmax) not in SOFTMAXES or not _last_axis(softmax):
        return None
    replaced.append(softmax)
    scores_node = _through(softmax.args[0], _is_cast, replaced)
    scores = masked_scores(scores_node) if scores_node is not None else None
    if scores is None:
        return None
    layouts = attention_einsums.output_layout(node, probs, scores.layout.order)
    if layouts is None:
        return None
    attention = HandWritten(scores, value, node, replaced + scores.nodes, *layouts)
    return attention if _operands_fit(attention) else None


def _through(node: Any, skip: Any, replaced: list[torch.fx.Node]) -> torch.fx.Node | None:
    """Back from `node` past the nodes `skip` accepts, each read by the next node alone."""
    while isinstance(node, torch.fx.Node) and len(node.users) == 1 and skip(node):
        replaced.append(node)
        node = node.args[0]
    return node if isinstance(node, torch.fx.Node) and len(node.users) == 1 else None


def _is_cast(node: torch.fx.Node) -> bool:
    if op_key(node) in ("method:to", "method:type"):  # to a dtype only, not a device
        rest = [*node.args[1:], *node.kwargs.values()]
        return len(rest) == 1 and isinstance(rest[0], torch.dtype)
    return op_key(node) in CASTS


def _is_transparent(node: torch.fx.Node) -> bool:
    """A cast, or a dropout that drops nothing (evaluation, or p = 0)."""
    if op_key(node) in DROPOUTS:
        return arg(node, 1, "p", 0.5) == 0 or arg(node, 2, "training", True) is False
    return _is_cast(node)


def _last_axis(softmax: torch.fx.Node) -> bool:
    dim = arg(softmax, 1, "dim")
    value = example_value(softmax)
    return isinstance(value, torch.Tensor) and dim in (-1, value.dim() - 1)


def _operands_fit(attention: HandWritten) -> bool:
    """Operands sdpa takes once permuted: one floating dtype, one rank (at least 3), keys
    and values of one length, a mask of the same dtype that broadcasts to the scores (an
    einsum's scores laid out as sdpa's, then)."""
    scores, layout = attention.scores, attention.scores.layout
    values = [example_value(n) for n in (scores.query, scores.keys, attention.value)]
    if not all(isinstance(t, torch.Tensor) for t in values):
        return False
    if not values[0].is_floating_point() or len({t.dtype for t in values}) != 1:
        return False
    q, k, v = (permuted_shape(t.shape, perm) for t, perm in
               zip(values, (layout.query, layout.key, attention.value_perm), strict=True))
    if scores.transposed:
        k = (*k[:-2], k[-1], k[-2])
    if not len(q) == len(k) == len(v) >= 3 or len({q[:-2], k[:-2], v[:-2]}) != 1:
        return False
    if q[-1] != k[-1] or k[-2] != v[-2]:
        return False
    return masks_fit(scores, torch.Size((*q[:-1], k[-2])), values[0].dtype)


def _fold(gm: torch.fx.GraphModule, attention: HandWritten) -> None:
    graph, out, scores = gm.graph, attention.output, attention.scores
    layout = scores.layout
    with graph.inserting_before(out):
        query = _permuted(graph, scores.query, layout.query)
        if scores.factor is not None:
            factor, divides = scores.factor
            query = add_node(graph, "function", operator.truediv if divides else operator.mul,
                             (query, factor))
        key = (_untransposed(graph, scores.keys) if scores.transposed
               else _permuted(graph, scores.keys, layout.key))
        value = _permuted(graph, attention.value, attention.value_perm)
        kwargs = {"scale": scores.scale}
        if scores.mask is not None:
            kwargs["attn_mask"] = sdpa_mask(graph, scores, example_value(value).dtype)
        sdpa = graph.call_function(F.scaled_dot_product_attention, (query, key, value), kwargs)
        sdpa.meta.update(out.meta)
        result = _back_to(graph, sdpa, out, attention.output_perm)
    out.replace_all_uses_with(result)
    leftovers = {a for n in attention.replaced for a in n.all_input_nodes}
    for node in attention.replaced:  # users before what they use
        graph.erase_node(node)
    for node in leftovers:  # the transpose of the keys, the empty bias of baddbmm
        if not node.users and _pure(node):
            graph.erase_node(node)


def _permuted(graph: torch.fx.Graph, node: torch.fx.Node, perm: Perm) -> torch.fx.Node:
    return node if perm is None else add_node(graph, "method", "permute", (node, *perm))


def _back_to(graph: torch.fx.Graph, sdpa: torch.fx.Node, out: torch.fx.Node,
             perm: Perm) -> torch.fx.Node:
    """sdpa's output in the layout of the einsum `out` it replaces (`perm`), contiguous
    where that was: a later `.view` may rely on it."""
    if perm is None:
        return sdpa
    wanted = example_value(out)
    sdpa.meta["example_value"] = wanted.permute(sorted(range(len(perm)), key=perm.__getitem__))
    permute = add_node(graph, "method", "permute", (sdpa, *perm))
    result = (add_node(graph, "method", "contiguous", (permute,)) if wanted.is_contiguous()
              else permute)
    for node in (permute, result):  # the source line, for messages
        node.meta = {**out.meta, "example_value": example_value(node)}
    return result


def _untransposed(graph: torch.fx.Graph, keys_t: torch.fx.Node) -> torch.fx.Node:
    """The keys [..., S, E]: what `keys_t` transposed, else a transpose of it."""
    if _swaps_last_two(keys_t):
        return keys_t.args[0]
    return add_node(graph, "method", "transpose", (keys_t, -1, -2))


def _swaps_last_two(node: torch.fx.Node) -> bool:
    """A transpose of the last two axes: `transpose(-2, -1)`, `.mT` or `.mH` (which a
    complex dtype keeps from being folded)."""
    rank = example_value(node).dim()
    swapped = swapped_axes(node)
    return swapped is not None and {d % rank for d in swapped} == {rank - 1, rank - 2}


def _pure(node: torch.fx.Node) -> bool:
    """A transpose, or a factory of a new tensor (nothing else can observe its removal)."""
    return swapped_axes(node) is not None or op_key(node) in {
        torch.empty, torch.zeros, torch.ones, torch.full, *SCALAR_TENSORS}
