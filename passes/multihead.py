"""nn.MultiheadAttention written out with scaled_dot_product_attention, before annotate.

Dynamo keeps `F.multi_head_attention_forward` as one node: projections, heads and attention
in one op, which no token rule can chunk. Written out as what it computes,

    q, k, v = linear(query, w_q, b_q), linear(key, w_k, b_k), linear(value, w_v, b_v)
    q, k, v = each [L, N, E] -> [N, H, L, E / H]
    o = sdpa(q, k, v, attn_mask, is_causal)  -> [L, N, E]
    out = linear(o, out_proj_weight, out_proj_bias)

its attention is one that chunk_attention chunks (self-attention with the K/V caches,
cross-attention token-wise). Self-attention projects with the packed weight at once and
splits the result, as PyTorch does. The rewrite applies where it computes what the op
computes: batched inputs [L, N, E], evaluation (or dropout 0), no bias_k/bias_v, zero
attention, static keys or key padding mask, an attention mask of [L, S] or none, and
the attention weights not read (need_weights=False, or the second output unused). Like
PyTorch's own fast path, only rounding differs.
"""

from __future__ import annotations

import inspect
import operator
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F

from tokpipe_compiler.core.fx import add_node, example_value
from tokpipe_compiler.core.logs import LOG

SIGNATURE = inspect.signature(F.multi_head_attention_forward).parameters
PARAMETERS = tuple(SIGNATURE)
DEFAULTS = {name: p.default for name, p in SIGNATURE.items() if p.default is not p.empty}


def write_out_multihead_attention(gm: torch.fx.GraphModule) -> int:
    """Rewrites every call the module docstring describes; returns how many."""
    calls = [n for n in gm.graph.nodes
             if n.op == "call_function" and n.target is F.multi_head_attention_forward]
    written = 0
    for node in calls:
        args = _bound(node)
        if args is not None and _writable(node, args):
            _write_out(gm.graph, node, args)
            written += 1
    if written:
        gm.graph.lint()
        gm.recompile()
        LOG.info("%d multi_head_attention_forward call(s) written out with "
                 "scaled_dot_product_attention", written)
    return written


def _bound(node: torch.fx.Node) -> dict[str, Any] | None:
    if len(node.args) > len(PARAMETERS):
        return None
    args = {**DEFAULTS, **dict(zip(PARAMETERS, node.args, strict=False)), **node.kwargs}
    return args if set(args) <= set(PARAMETERS) else None


def _writable(node: torch.fx.Node, args: dict[str, Any]) -> bool:
    """Whether the written-out form computes what the call computes (module docstring)."""
    if any(args[k] is not None for k in ("bias_k", "bias_v", "static_k", "static_v",
                                         "key_padding_mask")):
        return False
    if args["add_zero_attn"] or (args["training"] and args["dropout_p"]):
        return False
    if any(u.target is not operator.getitem or u.args[1] != 0 for u in node.users):
        return False  # the attention weights are read
    query, key = example_value(args["query"]), example_value(args["key"])
    if not all(isinstance(t, torch.Tensor) and t.dim() == 3
               for t in (query, key, example_value(args["value"]))):
        return False
    if args["embed_dim_to_check"] != query.shape[-1] or query.shape[-1] % args["num_heads"]:
        return False
    mask = example_value(args["attn_mask"])
    if args["is_causal"]:
        return args["attn_mask"] is not None and not args["need_weights"]
    return mask is None or (isinstance(mask, torch.Tensor)
                            and tuple(mask.shape) == (query.shape[0], key.shape[0]))


def _write_out(graph: torch.fx.Graph, node: torch.fx.Node, args: dict[str, Any]) -> None:
    heads, width = args["num_heads"], example_value(args["query"]).shape[-1]
    with graph.inserting_before(node):
        q, k, v = _projections(graph, args, width)
        q, k, v = (add_node(graph, "method", "unflatten", (t, -1, (heads, width // heads)))
                   for t in (q, k, v))
        q, k, v = (add_node(graph, "method", "permute", (t, 1, 2, 0, 3)) for t in (q, k, v))
        kwargs = _attention_kwargs(graph, args)
        attended = add_node(graph, "function", F.scaled_dot_product_attention, (q, k, v), kwargs)
        merged = add_node(graph, "method", "flatten",
                     (add_node(graph, "method", "permute", (attended, 2, 0, 1, 3)), 2))
        out = add_node(graph, "function", F.linear,
                  (merged, args["out_proj_weight"], args["out_proj_bias"]))
    for user in list(node.users):
        user.replace_all_uses_with(out)
        graph.erase_node(user)
    graph.erase_node(node)


def _projections(graph: torch.fx.Graph, args: dict[str, Any], width: int) -> list:
    query, key, value = args["query"], args["key"], args["value"]
    bias = args["in_proj_bias"]
    biases = [None] * 3 if bias is None else [
        add_node(graph, "function", operator.getitem, (bias, slice(i * width, (i + 1) * width)))
        for i in range(3)]
    if args["use_separate_proj_weight"]:
        weights = [args[f"{n}_proj_weight"] for n in "qkv"]
    elif query is key is value:  # one projection, split: what PyTorch computes
        packed = add_node(graph, "function", F.linear, (query, args["in_proj_weight"], bias))
        parts = add_node(graph, "method", "chunk", (packed, 3, -1))
        return [add_node(graph, "function", operator.getitem, (parts, i)) for i in range(3)]
    else:
        weights = [add_node(graph, "function", operator.getitem,
                       (args["in_proj_weight"], slice(i * width, (i + 1) * width)))
                   for i in range(3)]
    return [add_node(graph, "function", F.linear, (x, w, b))
            for x, w, b in zip((query, key, value), weights, biases, strict=True)]


def _attention_kwargs(graph: torch.fx.Graph, args: dict[str, Any]) -> dict[str, Any]:
    """sdpa's mask arguments. As F.multi_head_attention_forward: with is_causal (a hint
    that the mask is causal) the mask is dropped; a boolean mask marks what may not be
    attended, sdpa's what may."""
    if args["is_causal"]:
        return {"is_causal": True}
    mask = args["attn_mask"]
    if mask is None:
        return {}
    if example_value(mask).dtype == torch.bool:
        mask = add_node(graph, "function", torch.logical_not, (mask,))
    return {"attn_mask": mask}
