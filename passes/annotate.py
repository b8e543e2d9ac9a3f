"""annotate: the token axis of every value, by a rule table keyed by op.

Seed: the token-carrying input (auto-detected, or `token_input`). Propagation visits nodes in
order; a node with no token-carrying input is INVARIANT and needs no rule.

    latents [1,4,32,32]  token(2, 1)      seed: one latent row per unit
    conv2d stride 2      token(2, 1/2)    [1,384,16,16]
    flatten(2)           token(2, 8)      [1,384,256]
    ...                                   grid scale 2: a unit is one patch row (16 tokens)

Per-token constants (positional tables) that meet a token value in an elementwise op are
cut to the chunk by a `chunk_slice` node inserted in front of the use.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import torch
import torch.fx
from tokpipe_compiler.runtime.chunking import chunk_slice

from tokpipe_compiler.errors import NoTokenInput, TokpipeError, describe
from tokpipe_compiler.graph_utils import (
    example_value,
    is_tensor_node,
    is_user_input,
    node_shape,
    source_name,
    target_name,
)
from tokpipe_compiler.tokens import INVARIANT_INFO, META_KEY, UNSUPPORTED, TokenInfo

from .rules import RULES, SLICES_KEY, RuleContext, op_key, scaled_per_unit, unsupported


@dataclass(frozen=True)
class Annotation:
    """What annotate learnt about the graph as a whole."""

    token_input: torch.fx.Node
    units: int  # rows of the token grid: chunks are ranges of units
    unsupported: tuple[torch.fx.Node, ...]


def annotate(gm: torch.fx.GraphModule, token_input: str | int | None) -> Annotation:
    seed = find_token_input(gm, token_input)
    axis = seed_axis(seed)
    infos: dict[torch.fx.Node, TokenInfo] = {}
    ctx = RuleContext(infos)
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        if node is seed or _aligned_with(node, seed):
            infos[node] = TokenInfo("token", axis, Fraction(1))
        elif node.op == "placeholder" or not ctx.token_args(node):
            infos[node] = INVARIANT_INFO
        else:
            infos[node] = _apply_rule(node, ctx)
    scale = math.lcm(*(Fraction(i.per_unit).denominator for i in infos.values()
                       if i.carries_tokens))
    rows = node_shape(seed)[axis]
    if rows % scale:
        raise TokpipeError(
            f"the token input '{seed.name}' has {rows} rows along axis {axis}, which is not a "
            f"multiple of the token grid's row height {scale} (the patch size); pad the input"
        )
    for node, info in infos.items():
        node.meta[META_KEY] = scaled_per_unit(info, scale)
    _insert_chunk_slices(gm, scale)
    bad = tuple(n for n, i in infos.items() if i.kind == UNSUPPORTED)
    return Annotation(seed, rows // scale, bad)


def _apply_rule(node: torch.fx.Node, ctx: RuleContext) -> TokenInfo:
    rule = RULES.get(op_key(node))
    if rule is None:
        return unsupported(f"no token rule for '{target_name(node)}'")
    if not (is_tensor_node(node) or isinstance(example_value(node), (tuple, list))):
        return unsupported(f"'{target_name(node)}' of a token tensor gives a non-tensor value")
    try:
        return rule(node, ctx)
    except (TypeError, IndexError, KeyError, AttributeError) as err:
        return unsupported(f"rule for '{target_name(node)}' could not read its arguments: {err}")


def _aligned_with(node: torch.fx.Node, seed: torch.fx.Node) -> bool:
    """User inputs shaped exactly like the token input (a scheduler's history, a second
    latent) carry tokens on the same axis."""
    if node.op != "placeholder" or not is_user_input(node):
        return False
    value, ref = example_value(node), example_value(seed)
    return isinstance(value, torch.Tensor) and value.shape == ref.shape \
        and value.dtype == ref.dtype


def find_token_input(gm: torch.fx.GraphModule, choice: str | int | None) -> torch.fx.Node:
    """The placeholder carrying the tokens: named, by position among user inputs, or the
    largest floating user input of rank >= 3."""
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder" and is_user_input(n)]
    if isinstance(choice, str):
        for node in inputs:
            if choice in (node.name, node.target) or node.name == f"l_{choice}_" \
                    or source_name(node) == f"L['{choice}']":
                return node
        raise NoTokenInput(
            f"token_input={choice!r} matches no input of the graph; inputs are "
            f"{[n.name for n in inputs]}"
        )
    if isinstance(choice, int):
        if not 0 <= choice < len(inputs):
            raise TokpipeError(f"token_input={choice} is out of range: {len(inputs)} inputs")
        return inputs[choice]
    candidates = [n for n in inputs if _is_float(n) and len(node_shape(n)) >= 3]
    if not candidates:
        raise NoTokenInput(
            "no input looks like a token sequence (a float tensor of rank >= 3); pass "
            "options={'token_input': NAME} to name it"
        )
    return max(candidates, key=lambda n: node_shape(n).numel())


def seed_axis(node: torch.fx.Node) -> int:
    """Rows of an image latent [B, C, H, W]; the sequence of tokens [B, L, D] or ids [B, L]."""
    ndim = len(node_shape(node))
    return {2: 1, 3: 1, 4: 2}.get(ndim, 1)


def _is_float(node: torch.fx.Node) -> bool:
    value = example_value(node)
    return isinstance(value, torch.Tensor) and value.is_floating_point()


def _insert_chunk_slices(gm: torch.fx.GraphModule, scale: int) -> None:
    for node in list(gm.graph.nodes):
        for operand, axis, per_unit in node.meta.pop(SLICES_KEY, []):
            with gm.graph.inserting_before(node):
                sliced = gm.graph.call_function(chunk_slice, (operand, axis, int(per_unit * scale)))
            sliced.meta["example_value"] = example_value(operand)
            sliced.meta[META_KEY] = TokenInfo("token", axis, int(per_unit * scale))
            sliced.meta["stack_trace"] = node.meta.get("stack_trace")
            node.replace_input_with(operand, sliced)


def raise_unsupported(annotation: Annotation) -> None:
    """The error a user sees for a graph that mixes tokens in a way that cannot be chunked."""
    lines = [f"  - {describe(n)}\n    why: {n.meta[META_KEY].reason}"
             for n in annotation.unsupported[:5]]
    raise TokpipeError(
        "tokpipe cannot split this graph into token chunks; these ops mix tokens:\n"
        + "\n".join(lines)
        + "\nWhat you can do: compute that part outside the compiled model, rewrite it "
        "token-wise (attention through F.scaled_dot_product_attention), pass "
        "options={'fallback': True} to run this graph unpipelined, or name another input "
        "with options={'token_input': ...}."
    )
