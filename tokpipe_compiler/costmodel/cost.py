"""Cost pass: FLOPs and bytes of each node when it processes one chunk of tokens.

A chunk holds `n` tokens (`N`) of a `tokens`-long sequence and attends over `c` tokens of
context (`C`). A TOKEN value's token axis of full size S becomes S * n / tokens; an
INVARIANT value keeps its full shape, so its cost is a constant. Rules are keyed by
`core.ops.op_key`, like the token rules; an op without a rule is costed as elementwise over
its output (one flop per output element), and a rule that crashes raises `RuleCrashed`.

    linear(x[1, 256, 384] token(1), w[1536, 384])
      -> flops 2*384*1536*n + 1536*n,  bytes 4*(384*n + 1536*384 + 1536 + 1536*n)
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

import sympy
import torch
import torch.fx
import torch.nn.functional as F

from tokpipe_compiler.core.args import arg, varargs
from tokpipe_compiler.core.fx import example_value
from tokpipe_compiler.core.ops import call_rule, merge_tables, op_key
from tokpipe_compiler.costmodel.symbolic import (
    TEXT,
    TILE,
    ZERO,
    C,
    Cost,
    Gemm,
    N,
    dims,
    io_bytes,
    merged,
    nbytes,
    numel,
    out_numel,
    padded_head,
    tensors,
    token_info,
)

__all__ = ["RULES", "TEXT", "TILE", "ZERO", "C", "Cost", "N", "dims", "graph_cost", "node_cost"]

# ---- rules -----------------------------------------------------------------------------

Rule = Callable[[torch.fx.Node, int], Cost]


def _free(node: torch.fx.Node, tokens: int) -> Cost:
    return ZERO


def _elementwise(flops_per_element: int) -> Rule:
    def rule(node: torch.fx.Node, tokens: int) -> Cost:
        flops = flops_per_element * out_numel(node, tokens)
        return Cost(flops, io_bytes(node, tokens), launches=1)

    return rule


def _copy(node: torch.fx.Node, tokens: int) -> Cost:
    return Cost(sympy.Integer(0), io_bytes(node, tokens), launches=1)


def _cast(node: torch.fx.Node, tokens: int) -> Cost:
    # .to()/.float() to the dtype a tensor already has returns it unchanged.
    source = example_value(arg(node, 0, "input"))
    target = example_value(node)
    same = (
        isinstance(source, torch.Tensor)
        and isinstance(target, torch.Tensor)
        and (source.dtype, source.device) == (target.dtype, target.device)
    )
    if same:
        return ZERO
    return _copy(node, tokens)


def _dropout(node: torch.fx.Node, tokens: int) -> Cost:
    training = arg(node, 2, "training", True)
    return _elementwise(2)(node, tokens) if training else ZERO


def _embedding(node: torch.fx.Node, tokens: int) -> Cost:
    # A gather: reads one table row per output row and writes it.
    return Cost(sympy.Integer(0), 2 * nbytes(node, tokens), launches=1)


def _creation(node: torch.fx.Node, tokens: int) -> Cost:
    return Cost(out_numel(node, tokens), nbytes(node, tokens), launches=1)


def _matmul_cost(node: torch.fx.Node, tokens: int, k: sympy.Expr, bias: bool) -> Cost:
    out = out_numel(node, tokens)
    mm = 2 * out * k
    return Cost(mm + (out if bias else 0), io_bytes(node, tokens), mm, launches=1,
                gemms=_gemm(node, tokens, k))


def _gemm(node: torch.fx.Node, tokens: int, k: sympy.Expr) -> tuple[Gemm, ...]:
    """The product's shape, its leading dims folded into rows; none where the output's
    columns or the depth depend on the chunk (a score matrix over the context)."""
    shape = dims(node, tokens)
    depth = sympy.sympify(k)
    if not shape or not shape[-1].is_Integer or not depth.is_Integer:
        return ()
    return (Gemm(numel(shape[:-1]), int(shape[-1]), int(depth)),)


def _linear(node: torch.fx.Node, tokens: int) -> Cost:
    k = dims(arg(node, 0, "input"), tokens)[-1]
    return _matmul_cost(node, tokens, k, arg(node, 2, "bias") is not None)


def _matmul(node: torch.fx.Node, tokens: int) -> Cost:
    k = dims(arg(node, 0, "input"), tokens)[-1]
    return _matmul_cost(node, tokens, k, bias=False)


def _addmm(left: str) -> Rule:
    """addmm(input, mat1, mat2), baddbmm(input, batch1, batch2): `left` names argument 1."""

    def rule(node: torch.fx.Node, tokens: int) -> Cost:
        k = dims(arg(node, 1, left), tokens)[-1]
        return _matmul_cost(node, tokens, k, bias=True)

    return rule


def _conv(node: torch.fx.Node, tokens: int) -> Cost:
    # weight [C_out, C_in/groups, *kernel]: each output element is a dot of that length.
    weight = dims(arg(node, 1, "weight"), tokens)
    return _matmul_cost(node, tokens, numel(weight[1:]), arg(node, 2, "bias") is not None)


def _conv_transpose(node: torch.fx.Node, tokens: int) -> Cost:
    # weight [C_in, C_out/groups, *kernel]: each input element scatters into that many.
    inp, weight = dims(arg(node, 0, "input"), tokens), dims(arg(node, 1, "weight"), tokens)
    mm = 2 * numel(inp) * numel(weight[1:])
    return Cost(mm, io_bytes(node, tokens), mm, launches=1)


def _einsum(node: torch.fx.Node, tokens: int) -> Cost:
    equation = str(arg(node, 0, "equation")).replace(" ", "")
    operands = varargs(node, 1)
    if len(operands) < 2:
        return _copy(node, tokens)  # a permutation or reduction of one operand
    sizes: dict[str, sympy.Expr] = {}
    for letters, operand in zip(equation.split("->")[0].split(","), operands, strict=False):
        for letter, size in zip(letters, dims(operand, tokens), strict=False):
            sizes[letter] = size
    mm = 2 * (len(operands) - 1) * sympy.Mul(*sizes.values())
    return Cost(mm, io_bytes(node, tokens), mm, launches=1)


_SOFTMAX_FLOPS = 5  # scale, max, exp, sum, divide per score


def _attention(node: torch.fx.Node, tokens: int) -> Cost:
    """q of n tokens against k/v of c tokens (or a fixed length for token-free k/v).

    A fused kernel never writes the score matrix, so bytes are q, k, v and the output.
    """
    q, k, v = (arg(node, i, name) for i, name in enumerate(("query", "key", "value")))
    qd, kd, vd = dims(q, tokens), dims(k, tokens, C), dims(v, tokens, C)
    keys = kd[-2]
    key_info = token_info(k)
    if arg(node, 5, "is_causal", False) and key_info is not None and key_info.carries_tokens:
        keys = C - N / 2 + sympy.Min(N, TILE) / 2  # the chunk's own block is half masked
    rows = numel(dims(node, tokens)[:-1])  # batch * heads * query tokens
    flops = rows * keys * (2 * qd[-1] + 2 * vd[-1] + _SOFTMAX_FLOPS)
    padded = rows * keys * (2 * padded_head(qd[-1]) + 2 * padded_head(vd[-1]))
    moved = nbytes(q, tokens) + nbytes(k, tokens, C) + nbytes(v, tokens, C)
    mask = arg(node, 3, "attn_mask")
    if isinstance(mask, torch.fx.Node):
        moved += nbytes(mask, tokens, N)
    return Cost(flops, moved + nbytes(node, tokens), attention_flops=flops, launches=1,
                attention_scores=rows * keys, attention_padded=padded)


def _reduction(node: torch.fx.Node, tokens: int) -> Cost:
    # One flop per element read, not per element written.
    source = arg(node, 0, "input")
    flops = numel(dims(source, tokens)) if isinstance(source, torch.fx.Node) else 0
    return Cost(sympy.sympify(flops), io_bytes(node, tokens), launches=1)


_VIEWS = (
    "view", "reshape", "transpose", "permute", "unsqueeze", "squeeze", "flatten", "unflatten",
    "expand", "expand_as", "view_as", "getitem", "chunk", "split", "unbind", "narrow", "select",
    "movedim", "t", "detach", "size", "dim",
)  # fmt: skip
_COPIES = ("cat", "stack", "clone", "contiguous", "pad", "repeat", "roll", "index_select",
           "pixel_shuffle", "pixel_unshuffle")
_CASTS = ("to", "float", "half", "bfloat16", "type", "type_as")
_NORMS = ("layer_norm", "group_norm", "rms_norm", "batch_norm", "instance_norm", "normalize")
_TRANSCENDENTAL = ("exp", "log", "sin", "cos", "tanh", "sigmoid", "rsqrt", "sqrt", "erf", "pow")
_REDUCTIONS = ("sum", "mean", "amax", "amin", "max", "min", "var", "std", "norm")

# Where a call's function may live; each name above is looked up in every one of them and
# as a tensor method, so torch.cat, F.linear and x.view all find their rule.
_NAMESPACES = (torch, F, torch._C._nn, torch.functional, operator)


def _ops(*names: str) -> list[Any]:
    """The op keys (`core.ops.op_key`) of the ops called `names`."""
    keys = []
    for name in names:
        keys.append(f"method:{name}")
        keys += [getattr(ns, name) for ns in _NAMESPACES if callable(getattr(ns, name, None))]
    return list(dict.fromkeys(keys))  # F.gelu is torch._C._nn.gelu: one key


RULES: dict[Any, Rule] = merge_tables({
    "views": dict.fromkeys(_ops(*_VIEWS), _free),
    "copies": dict.fromkeys(_ops(*_COPIES), _copy),
    "casts": dict.fromkeys(_ops(*_CASTS), _cast),
    "norms": dict.fromkeys(_ops(*_NORMS), _elementwise(8)),  # mean, variance, normalise, affine
    "transcendental": dict.fromkeys(_ops(*_TRANSCENDENTAL), _elementwise(4)),
    "softmax": dict.fromkeys(_ops("softmax", "log_softmax"), _elementwise(_SOFTMAX_FLOPS)),
    "activations": dict.fromkeys(_ops("gelu", "silu", "mish"), _elementwise(8)),
    "creation": dict.fromkeys(_ops("arange", "zeros", "ones", "full", "empty", "randn", "rand"),
                              _creation),
    "dropout": dict.fromkeys(_ops("dropout"), _dropout),
    "embedding": dict.fromkeys(_ops("embedding"), _embedding),
    "linear": dict.fromkeys(_ops("linear"), _linear),
    "matmul": dict.fromkeys(_ops("matmul", "mm", "bmm"), _matmul),
    "addmm": {**dict.fromkeys(_ops("addmm"), _addmm("mat1")),
              **dict.fromkeys(_ops("baddbmm"), _addmm("batch1"))},
    "conv": dict.fromkeys(_ops("conv1d", "conv2d", "conv3d"), _conv),
    "conv_transpose": dict.fromkeys(
        _ops("conv_transpose1d", "conv_transpose2d", "conv_transpose3d"), _conv_transpose),
    "einsum": dict.fromkeys(_ops("einsum"), _einsum),
    "attention": dict.fromkeys(_ops("scaled_dot_product_attention"), _attention),
    "reductions": dict.fromkeys(_ops(*_REDUCTIONS), _reduction),
})

# An op without a rule: elementwise over its output, one flop per element.
_DEFAULT = _elementwise(1)
_ROLES_WITHOUT_WORK = ("placeholder", "get_attr", "output")


def node_cost(node: torch.fx.Node, tokens: int) -> Cost:
    """FLOPs and bytes of `node` on a chunk of N tokens with C tokens of context."""
    if node.op in _ROLES_WITHOUT_WORK or not tensors(example_value(node)):
        return ZERO
    rule = RULES.get(op_key(node), _DEFAULT)
    cost = call_rule("cost", rule, node, tokens)  # a crash is a bug in the rule: it raises
    info = token_info(node)
    if info is not None and info.carries_tokens and info.segmented:
        text_launches = cost.launches if info.only_segment else 0
        cost = replace(cost, text_rows=info.lead + info.trail, text_launches=text_launches)
    return cost


def graph_cost(nodes: Iterable[torch.fx.Node], tokens: int) -> Cost:
    """Sum of `node_cost` over `nodes`."""
    costs = [node_cost(node, tokens) for node in nodes]
    return Cost(
        sympy.Add(*(c.flops for c in costs)),
        sympy.Add(*(c.bytes for c in costs)),
        sympy.Add(*(c.matmul_flops for c in costs)),
        sympy.Add(*(c.attention_flops for c in costs)),
        sum(c.launches for c in costs),
        max((c.text_rows for c in costs), default=0),
        sum(c.text_launches for c in costs),
        merged(tuple(g for c in costs for g in c.gemms)),
        sympy.Add(*(c.attention_scores for c in costs)),
        sympy.Add(*(c.attention_padded for c in costs)),
    )
