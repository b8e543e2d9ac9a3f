"""Attention spelt as two einsums, in any layout: which operand is the queries, keys,
probabilities or values, and the permutations that bring them to sdpa's [..., L, E].

    s = einsum("bnhd,bmhd->bhnm", q, k)      q, k: [b, n, h, d] -> [b, h, n, d], [b, h, m, d]
    o = einsum("bhnm,bmhd->bnhd", p, v)      v -> [b, h, m, d]; sdpa's [b, h, n, d] -> o's

The scores' einsum names one query letter (in the queries and the scores), one key letter
(in the keys and the scores, last: the softmax runs over it), one feature letter (summed)
and batch/head letters in all three; the output's einsum sums the probabilities' key
letter with the values and keeps their query and batch/head letters. sdpa's leading axes
follow the order of the scores' batch/head letters. `...` stands for the same leading
axes in every term.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from tokpipe_compiler.core.fx import example_value
from tokpipe_compiler.core.ops import op_key

# What a refusal of an einsum that mixes tokens tells the user, in case it is attention.
FORMS = ("attention written as einsums is folded into scaled_dot_product_attention where "
         "einsum('bhid,bhjd->bhij', q, k) gives the scores and einsum('bhij,bhjd->bhid', p, v) "
         "attends with their softmax over j, the batch, head, token and feature letters of "
         "each term in any order ('bihd,bjhd->bhij') but j last in the scores (laid out "
         "'bhij' where a mask is added), and nothing else reads the scores or probabilities")

Perm = tuple[int, ...] | None  # None: the layout is sdpa's already
_ELLIPSIS = "9876543210"  # ...'s axes, named from the right as einsum aligns them


@dataclass(frozen=True)
class ScoresLayout:
    """The scores' einsum: query and key permutations to sdpa's [..., L, E], and `order`:
    the scores' axis at each of sdpa's scores axes [..., L, S]."""

    query: Perm
    key: Perm
    order: Perm


def scores_einsum(node: torch.fx.Node) -> tuple[Any, Any, ScoresLayout] | None:
    """(queries, keys, layout) of an einsum that computes attention scores, or None."""
    found = _terms(node)
    if found is None:
        return None
    (a, b, scores), operands = found
    key = scores[-1]
    if len({len(a), len(b), len(scores)}) != 1 or (key in a) == (key in b):
        return None
    if key in a:  # einsum("bmd,bnd->bnm", k, q): the keys first
        (a, b), operands = (b, a), operands[::-1]
    lead = "".join(c for c in scores if c in a and c in b)
    query = [c for c in scores if c in a and c not in b]
    feature = set(a) & set(b) - set(scores)
    if len(query) != 1 or len(feature) != 1 or len(lead) != len(scores) - 2:
        return None
    d = feature.pop()
    layout = ScoresLayout(_perm(a, lead + query[0] + d), _perm(b, lead + key + d),
                          _perm(scores, lead + query[0] + key))
    return operands[0], operands[1], layout


def output_einsum(node: torch.fx.Node) -> tuple[Any, Any] | None:
    """(probabilities, values) of an einsum that could attend with one to the other: the
    probabilities' last letter is the one it sums. None for other ops."""
    found = _terms(node)
    if found is None:
        return None
    (a, b, out), operands = found
    if a[-1] not in out and a[-1] in b:
        return operands[0], operands[1]
    if b[-1] not in out and b[-1] in a:
        return operands[1], operands[0]
    return None


def output_layout(node: torch.fx.Node, probs: Any, order: Perm) -> tuple[Perm, Perm] | None:
    """(value permutation to sdpa's [..., S, Ev], sdpa's output permutation to the node's)
    of the attention whose output is `node` (an einsum or a matmul) over probabilities
    `probs`, laid out by the scores' `order`; None where `node` does not attend."""
    found = _terms(node)
    if found is None:  # probs @ v: the probabilities must be in sdpa's layout
        return (None, None) if order is None else None
    (a, b, out), operands = found
    p, v = (a, b) if operands[0] is probs else (b, a)
    sdpa = "".join(p[i] for i in order) if order is not None else p
    lead, query, key = sdpa[:-2], sdpa[-2], sdpa[-1]
    feature = [c for c in v if c not in sdpa]
    if len(feature) != 1 or len({len(p), len(v), len(out)}) != 1:
        return None
    if set(v) != {*lead, key, *feature} or set(out) != {*lead, query, *feature}:
        return None
    return _perm(v, lead + key + feature[0]), _perm(lead + query + feature[0], out)


def permuted_shape(shape: torch.Size, perm: Perm) -> tuple[int, ...]:
    return tuple(shape) if perm is None else tuple(shape[i] for i in perm)


def _perm(letters: str, wanted: str) -> Perm:
    """The permutation of axes named `letters` that names them `wanted`; None if none."""
    perm = tuple(letters.index(c) for c in wanted)
    return None if perm == tuple(range(len(perm))) else perm


def _terms(node: Any) -> tuple[list[str], list[Any]] | None:
    """The terms of a two-operand einsum (each operand's, then the output's), one letter an
    axis, and its operands; None for another op."""
    if op_key(node) is not torch.einsum or len(node.args) < 2:
        return None
    operands = list(node.args[1:])
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = list(operands[0])
    equation = node.args[0]
    if len(operands) != 2 or not isinstance(equation, str) or "->" not in equation:
        return None
    inputs, out = equation.replace(" ", "").split("->")
    terms = [*inputs.split(","), out]
    values = [example_value(v) for v in (*operands, node)]
    if len(terms) != 3 or not all(isinstance(v, torch.Tensor) for v in values):
        return None
    spelt = [_spelt(t, v.dim()) for t, v in zip(terms, values, strict=True)]
    if any(t is None or len(set(t)) != len(t) for t in spelt):
        return None
    return spelt, operands


def _spelt(term: str, rank: int) -> str | None:
    """`term` with `...` spelt out as letters of its own, for a value of `rank` axes."""
    if "..." not in term:
        return term if len(term) == rank else None
    axes = rank - len(term) + 3
    if not 0 <= axes <= len(_ELLIPSIS):
        return None
    return term.replace("...", _ELLIPSIS[len(_ELLIPSIS) - axes:])
