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
from collections.abc import Iterator
from dataclasses import dataclass, replace
from fractions import Fraction

import torch
import torch.fx

from tokpipe_compiler.core.errors import TokpipeError, UnchunkableOps, describe
from tokpipe_compiler.core.fx import (
    example_value,
    is_tensor_node,
    is_user_input,
    node_shape,
    target_name,
)
from tokpipe_compiler.core.meta import (
    ATTENTION,
    INVARIANT_INFO,
    META_KEY,
    SLICES_KEY,
    TOKEN,
    TOKEN_SUM,
    UNSUPPORTED,
    WHOLE_REASON_KEY,
    TokenInfo,
)
from tokpipe_compiler.core.ops import call_rule, op_key
from tokpipe_compiler.passes import segments
from tokpipe_compiler.passes.attention_patterns import fold_hand_written_attention
from tokpipe_compiler.passes.buffer_fills import concatenate_buffer_fills
from tokpipe_compiler.passes.dead_rows import constant_dead_rows
from tokpipe_compiler.passes.piecewise_maps import join_piecewise_maps
from tokpipe_compiler.passes.rule_base import Rule, RuleContext, scaled_per_unit, unsupported
from tokpipe_compiler.passes.rules import IN_PLACE, RULES
from tokpipe_compiler.passes.slice_updates import functional_slice_adds
from tokpipe_compiler.passes.token_input import find_token_input, is_conditioning, seed_axes
from tokpipe_compiler.passes.token_writes import (
    tokens_written_into,
    writes_into_invariant,
    written_reason,
)
from tokpipe_compiler.passes.torch_attention import write_out_torch_attention
from tokpipe_compiler.runtime.chunking import chunk_slice


@dataclass(frozen=True)
class Annotation:
    """What annotate learnt about the graph as a whole."""

    token_input: torch.fx.Node
    units: int  # rows of the token grid: chunks are ranges of units
    unsupported: tuple[torch.fx.Node, ...]


def annotate(gm: torch.fx.GraphModule, token_input: str | int | None,
             mode: str = "stale") -> Annotation:
    """`mode`: in "sync" the one chunk is the whole sequence, so a value that mixes tokens
    (and everything computed from it) runs whole instead of being unsupported."""
    write_out_torch_attention(gm)  # attention as chunk_attention chunks it: sdpa
    fold_hand_written_attention(gm)
    concatenate_buffer_fills(gm)  # the written values then reach their readers in FX
    join_piecewise_maps(gm)  # feed-forward chunking: the MLP of the whole rows
    functional_slice_adds(gm)
    constant_dead_rows(gm)  # Z-Image's padding: the last token repeated, then overwritten
    seed = find_token_input(gm, token_input)
    _static_dtypes(gm)
    seeded, ctx = _first_supported(gm, seed)
    if mode == "sync" and any(i.kind == UNSUPPORTED for i in ctx.infos.values()):
        ctx = _propagate(gm, seed, seeded, whole_mixing=True)
    infos = ctx.infos
    scale = math.lcm(*(Fraction(i.per_unit).denominator for i in infos.values()
                       if i.carries_tokens), *(band.denominator for band in ctx.bands))
    axis = seeded.axis
    rows = node_shape(seed)[axis] - seeded.lead - seeded.trail
    if rows % scale:
        raise TokpipeError(
            f"the token input '{seed.name}' has {rows} rows along axis {axis}, which is not a "
            f"multiple of the token grid's row height {scale} (the patch size); pad the input"
        )
    for node, info in infos.items():
        node.meta[META_KEY] = scaled_per_unit(info, scale)
    _detach_new_tensors(gm, seed)
    _cut_segmented_inputs(gm)
    _insert_chunk_slices(gm, scale)
    bad = tuple(n for n, i in infos.items() if i.kind == UNSUPPORTED)
    return Annotation(seed, rows // scale, bad)


def _static_dtypes(gm: torch.fx.GraphModule) -> None:
    """x.type_as(y) and x.to(y) -> x.to(dtype and device of y): both are known statically,
    and a token `y` must not make an invariant `x` (a positional table) depend on the
    tokens."""
    for node in gm.graph.nodes:
        key = op_key(node)
        if key == "method:type_as" and isinstance(node.args[1], torch.fx.Node):
            node.target, node.args = "to", (node.args[0], example_value(node.args[1]).dtype)
        elif key == "method:to" and _tensor_like(node) is not None:
            like = example_value(_tensor_like(node))
            flags = dict(zip(("non_blocking", "copy"), node.args[2:], strict=False))
            node.args = (node.args[0],)
            node.kwargs = {**{k: v for k, v in node.kwargs.items() if k != "tensor"}, **flags,
                           "dtype": like.dtype, "device": like.device}


def _tensor_like(node: torch.fx.Node) -> torch.fx.Node | None:
    """The tensor whose dtype and device `x.to(tensor)` takes, if it is called so."""
    other = node.args[1] if len(node.args) > 1 else node.kwargs.get("tensor")
    if isinstance(other, torch.fx.Node) and isinstance(example_value(other), torch.Tensor):
        return other
    return None


def _first_supported(gm: torch.fx.GraphModule,
                     seed: torch.fx.Node) -> tuple[TokenInfo, RuleContext]:
    """The seed's first candidate info whose propagation meets no unsupported op (else the
    first candidate, whose errors the user sees): each candidate token axis, then each with
    whole segments around its chunked range (segments.seed_candidates), of which the first
    that leaves the output chunked goes first. A token input that already holds registers
    or text before its image tokens slices both out; the range the output is made of is
    the one to chunk, whichever slice the graph takes first."""
    tried, supported = [], []
    for seeded in _seed_infos(gm, seed):
        ctx = _propagate(gm, seed, seeded)
        if all(i.kind != UNSUPPORTED for i in ctx.infos.values()):
            whole_axis = not (seeded.lead or seeded.trail)
            if whole_axis or _output_chunked(gm, ctx):
                return seeded, ctx
            supported.append((seeded, ctx))
        tried.append((seeded, ctx))
    return (supported or tried)[0]


def _output_chunked(gm: torch.fx.GraphModule, ctx: RuleContext) -> bool:
    """Whether an output of the graph holds chunked tokens (not only whole segments)."""
    infos = (ctx.infos.get(n) for n in gm.graph.output_node().all_input_nodes)
    return any(i is not None and i.kind == TOKEN and i.per_unit for i in infos)


def _seed_infos(gm: torch.fx.GraphModule, seed: torch.fx.Node) -> Iterator[TokenInfo]:
    axes = seed_axes(seed)
    for axis in axes:
        yield TokenInfo(TOKEN, axis, Fraction(1))
    for axis in axes:
        for lead, trail in segments.seed_candidates(gm, seed, axis):
            yield TokenInfo(TOKEN, axis, Fraction(1), lead=lead, trail=trail)


def _propagate(gm: torch.fx.GraphModule, seed: torch.fx.Node, seeded: TokenInfo,
               whole_mixing: bool = False) -> RuleContext:
    """TokenInfos from the seed's (`seeded`), in the returned context with the bands the rules
    asked chunks to keep whole. `whole_mixing`: a node that mixes tokens, and every node
    computed from it, holds a whole value (segments.whole) instead of UNSUPPORTED; but not a
    write into a tensor without tokens (its readers would be taken for invariant)."""
    infos: dict[torch.fx.Node, TokenInfo] = {}
    ctx = RuleContext(infos)
    mixed: set[torch.fx.Node] = set()
    for node in gm.graph.nodes:
        node.meta.pop(SLICES_KEY, None)  # left by an earlier candidate axis
        node.meta.pop(WHOLE_REASON_KEY, None)
        if node.op == "output":
            continue
        if node is seed or _aligned_with(node, seed):
            infos[node] = seeded
        elif node.op == "placeholder" or not ctx.token_args(node):
            infos[node] = INVARIANT_INFO
        elif mixed.isdisjoint(node.all_input_nodes):
            infos[node] = _apply_rule(node, ctx)
        written = tokens_written_into(node, infos)
        if written is not None:
            infos[node] = unsupported(written_reason(written))
            continue
        if whole_mixing and (node not in infos or infos[node].kind == UNSUPPORTED):
            if writes_into_invariant(node, infos):
                infos.setdefault(node, unsupported("a value that mixes tokens is written "
                                                   "into a tensor without tokens"))
                continue
            if node in infos:  # the op that mixes tokens, not a value computed from it
                node.meta[WHOLE_REASON_KEY] = infos[node].reason
            infos[node] = segments.whole(example_value(node))
            node.meta.pop(SLICES_KEY, None)  # the whole node reads its tables whole
            mixed.add(node)
    return ctx


def _apply_rule(node: torch.fx.Node, ctx: RuleContext) -> TokenInfo:
    rule = RULES.get(op_key(node))
    if rule is None:
        return unsupported(f"no token rule for '{target_name(node)}'")
    if not (is_tensor_node(node) or isinstance(example_value(node), (tuple, list))
            or node.target in IN_PLACE):
        return unsupported(f"'{target_name(node)}' of a token tensor gives a non-tensor value")
    info = call_rule("token", rule, node, ctx)  # a crash is a bug in the rule: it raises
    return _passed_through(node, rule, info, ctx)


def _passed_through(node: torch.fx.Node, rule: Rule, info: TokenInfo, ctx: RuleContext
                    ) -> TokenInfo:
    """An info of a token-mixing kind is the op's own only where its rule mixes tokens
    (`mixes_tokens`) and made it anew: handed on from an input (a linear after a group_norm,
    an attention over tokens on its batch axis), it is the input's layout, not its kind.
    Judged by the object, not its value: an attention over another's output, a convolution
    fed by another, have their input's layout and mix tokens all the same."""
    if info.kind not in (ATTENTION, TOKEN_SUM):
        return info
    if getattr(rule, "mixes_tokens", False) and all(ctx.infos[a] is not info
                                                     for a in node.all_input_nodes):
        return info
    return replace(info, kind=TOKEN)


def _aligned_with(node: torch.fx.Node, seed: torch.fx.Node) -> bool:
    """User inputs shaped exactly like the token input (a scheduler's history, a second
    latent) carry tokens on the same axis, where both are floating (a float32 history of
    bfloat16 latents is aligned). Integer and boolean ones come whole, and their readers
    take the chunk's part: a mask covers every key (a language model's `attention_mask`
    and `position_ids` build one). A conditioning stream by its name is not, whatever its
    shape: a joint-attention block's text stream may tie the image stream's shape."""
    if node.op != "placeholder" or not is_user_input(node) or \
            (is_conditioning(node) and not is_conditioning(seed)):
        return False
    value, ref = example_value(node), example_value(seed)
    if not isinstance(value, torch.Tensor) or value.shape != ref.shape:
        return False
    return value.is_floating_point() and ref.is_floating_point()


_NEW_TENSORS = ("method:new_empty", "method:new_zeros", "method:new_ones", "method:new_full")


def _detach_new_tensors(gm: torch.fx.GraphModule, seed: torch.fx.Node) -> None:
    """`h.new_zeros(size)` of a token `h` -> `seed.new_zeros(size, dtype=h.dtype)`: the new
    tensor is invariant (`h` lends only its dtype and device), and computed in the prelude,
    which must not compute `h` (a token value, maybe from attention) to make it."""
    device = example_value(seed).device
    for node in gm.graph.nodes:
        made_from = node.args[0] if node.args else None
        if (op_key(node) in _NEW_TENSORS and not node.meta[META_KEY].carries_tokens
                and made_from is not seed and made_from.meta[META_KEY].carries_tokens
                and example_value(made_from).device == device):
            node.kwargs = {"dtype": example_value(made_from).dtype, **node.kwargs}
            node.args = (seed, *node.args[1:])


def _cut_segmented_inputs(gm: torch.fx.GraphModule) -> None:
    """A token input holding whole segments (text joined before a graph break) is read as
    a per-token table: its readers get the chunk's rows with the segments around them, cut
    in the graph, and the input itself comes whole, like any invariant input."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node in placeholders:
        info = node.meta[META_KEY]
        if not (info.carries_tokens and info.segmented):
            continue
        readers = list(node.users)
        with gm.graph.inserting_before(placeholders[-1].next):
            table = _chunk_table(gm.graph, node, info.axis, info)
        for reader in readers:
            reader.replace_input_with(node, table)
        node.meta[META_KEY] = INVARIANT_INFO


def _insert_chunk_slices(gm: torch.fx.GraphModule, scale: int) -> None:
    for node in list(gm.graph.nodes):
        for operand, axis, info in node.meta.pop(SLICES_KEY, []):
            info = scaled_per_unit(info, scale)
            with gm.graph.inserting_before(node):
                sliced = _chunk_table(gm.graph, operand, axis, info)
            for new in _new_nodes(operand, sliced):
                new.meta["stack_trace"] = node.meta.get("stack_trace")
            node.replace_input_with(operand, sliced)


def _chunk_table(graph: torch.fx.Graph, table: torch.fx.Node, axis: int,
                 info: TokenInfo) -> torch.fx.Node:
    """The chunk's rows of a per-token table: chunk_slice(table), or, around text segments,
    cat([table head, chunk_slice(middle rows), table tail]); with segments in every one of
    several blocks (Z-Image's padding after each guided branch's image), that cut in each
    block, the blocks unflattened from the axis and flattened back."""
    if info.segmented and info.outer > 1:
        value = example_value(table).unflatten(axis, (info.outer, -1))
        blocks = _add(graph, torch.unflatten, (table, axis, value.shape[axis:axis + 2]),
                      value, INVARIANT_INFO)
        cut = _chunk_table(graph, blocks, axis + 1, replace(info, axis=axis + 1, outer=1))
        return _add(graph, torch.flatten, (cut, axis, axis + 1), example_value(table), info)
    if not info.segmented:
        blocks = (info.outer,) if info.outer > 1 else ()
        return _add(graph, chunk_slice, (table, axis, info.per_unit, *blocks),
                    example_value(table), info)
    full = node_shape(table)[axis]
    bounds = [(0, info.lead), (info.lead, full - info.trail), (full - info.trail, full)]
    parts = [_add(graph, torch.narrow, (table, axis, a, b - a),
                  example_value(table).narrow(axis, a, b - a), INVARIANT_INFO)
             for a, b in bounds]
    middle = replace(info, lead=0, trail=0)
    parts[1] = _add(graph, chunk_slice, (parts[1], axis, info.per_unit),
                    example_value(parts[1]), middle)
    kept = [p for p, (a, b) in zip(parts, bounds, strict=True) if b > a]
    return _add(graph, torch.cat, (kept, axis), example_value(table), info)


def _add(graph: torch.fx.Graph, target, args: tuple, value, info: TokenInfo) -> torch.fx.Node:
    node = graph.call_function(target, args)
    node.meta["example_value"] = value
    node.meta[META_KEY] = info
    return node


def _new_nodes(stop: torch.fx.Node, node: torch.fx.Node) -> list[torch.fx.Node]:
    """`node` and the nodes it was built from, back to `stop`."""
    found, stack = [], [node]
    while stack:
        current = stack.pop()
        if current is stop or current in found:
            continue
        found.append(current)
        stack.extend(current.all_input_nodes)
    return found


def raise_unsupported(annotation: Annotation, mode: str = "stale") -> None:
    """The error a user sees for a graph that mixes tokens in a way that cannot be chunked:
    each op and source line once (a model's blocks repeat them), the first five. In
    `mode` 'sync' (what raised it: an op that cannot run on one stage's rank either, such
    as a write to the model's state) the error does not advise sync."""
    places: dict[tuple[str, str], int] = {}
    for node in annotation.unsupported:
        key = (describe(node), node.meta[META_KEY].reason)
        places[key] = places.get(key, 0) + 1
    lines = [f"  - {what}{f' ({count} times)' if count > 1 else ''}\n    why: {why}"
             for (what, why), count in list(places.items())[:5]]
    attention = any(word in target_name(node) for node in annotation.unsupported
                    for word in _ATTENTION_WORDS)
    sdpa = any("scaled_dot_product_attention" in target_name(node)
               for node in annotation.unsupported)
    how = ("keys and values from the queries' own tokens at their grid, or from inputs "
           "that are not chunked, such as text" if sdpa
           else "attention through F.scaled_dot_product_attention" if attention
           else "each token's output rows from its own input rows")
    fast_path = any(op in str(node.target) for node in annotation.unsupported
                    for op in _FAST_PATH_OPS)
    raise UnchunkableOps(
        "tokpipe cannot split this graph into token chunks; these ops mix tokens, or have "
        "no rule that tells how they use them:\n"
        + "\n".join(lines),
        f"\nWhat you can do: {_FAST_PATH_HINT if fast_path else ''}"
        "compute that part outside the compiled model, rewrite it "
        f"token-wise ({how}), "
        + ("" if mode == "sync" else "use mode='sync' (stage after stage, no chunks: exact), ")
        + "pass options={'fallback': True} to run this graph unpipelined, or name another "
        "input with options={'token_input': ...}.",
        tuple(node.name for node in annotation.unsupported),
    )


# Ops of attention (SDPA, torch's fused layers) or of attention written by hand.
_ATTENTION_WORDS = ("attention", "transformer", "softmax", "matmul", "bmm", "einsum")
# The fast paths of nn.TransformerEncoderLayer and nn.MultiheadAttention, one op each.
_FAST_PATH_OPS = ("_transformer_encoder_layer_fwd", "_native_multi_head_attention")
_FAST_PATH_HINT = ("call torch.backends.mha.set_fastpath_enabled(False) before the first "
                   "call, which makes torch's layer run through F.multi_head_attention_forward "
                   "(tokpipe writes that out with sdpa); or ")
