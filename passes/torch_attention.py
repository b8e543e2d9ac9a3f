"""PyTorch's fused attention modules written out with scaled_dot_product_attention, before
annotate.

Dynamo keeps two of PyTorch's modules as single ops, projections, heads and attention in one,
which no token rule can chunk:
- `nn.MultiheadAttention`: `F.multi_head_attention_forward`;
- `nn.TransformerEncoderLayer` in evaluation without gradients (its fast path):
  `torch._transformer_encoder_layer_fwd`, the whole layer with its norms and MLP.
Written out as what they compute,

    q, k, v = linear(query, w_q, b_q), linear(key, w_k, b_k), linear(value, w_v, b_v)
    q, k, v = each [.., L, E] -> [N, H, L, E / H]
    o = sdpa(q, k, v, attn_mask, is_causal)  -> back to [.., L, E]
    out = linear(o, out_proj_weight, out_proj_bias)
    (the encoder layer: its layer norms, residuals and MLP around that, pre- or post-norm)

their attention is one that chunk_attention chunks (self-attention with the K/V caches,
cross-attention token-wise). Self-attention projects with the packed weight at once and
splits the result, as PyTorch does. Only rounding differs from the fused ops. The rewrite
applies where it computes what the op computes: batched inputs, evaluation (or dropout 0),
no bias_k/bias_v, zero attention or static keys, an attention mask of [L, S] or none and
a key padding mask of [N, S] or none (the encoder layer: a mask of the shape its
mask_type names, or of the scores' shape, or none), and the attention weights not read
(need_weights=False, or the second output unused). A query row whose keys are all masked
gets sdpa's finite output where the fused encoder layer gives NaN. The written-out nodes
keep the op's module path and source line.
"""

from __future__ import annotations

import contextlib
import inspect
import operator
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F

from tokpipe_compiler.core.fx import add_node, example_value, rewritten

SIGNATURE = inspect.signature(F.multi_head_attention_forward).parameters
PARAMETERS = tuple(SIGNATURE)
DEFAULTS = {name: p.default for name, p in SIGNATURE.items() if p.default is not p.empty}
SEQUENCE_FIRST, BATCH_FIRST = (1, 2, 0, 3), (0, 2, 1, 3)  # [L, N, H, D] / [N, L, H, D]

ENCODER_LAYERS = (torch._transformer_encoder_layer_fwd,
                  torch.ops.aten._transformer_encoder_layer_fwd.default)
ENCODER_PARAMETERS = tuple(
    a.name for a in torch.ops.aten._transformer_encoder_layer_fwd.default._schema.arguments)
VALUE_META = ("example_value", "val", "tensor_meta")  # a node's own value, not its origin


def write_out_torch_attention(gm: torch.fx.GraphModule) -> int:
    """Rewrites every call the module docstring describes; returns how many."""
    written = 0
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is F.multi_head_attention_forward:
            args = _bound(node)
            if args is not None and _writable(node, args):
                _with_its_line(gm.graph, node, _write_out, args)
                written += 1
        elif node.op == "call_function" and node.target in ENCODER_LAYERS:
            args = dict(zip(ENCODER_PARAMETERS, node.args, strict=False)) | node.kwargs
            if _encoder_writable(args):
                _with_its_line(gm.graph, node, _write_out_encoder, args)
                written += 1
    return rewritten(gm, written, "fused attention op(s) written out with sdpa")


def _with_its_line(graph: torch.fx.Graph, node: torch.fx.Node, write_out, args) -> None:
    """`write_out(graph, node, args)`, the nodes it adds given `node`'s meta but its value:
    its source line (errors about them name the user's line of the call) and module path
    (the plan names their layer). Their values are computed in the fake mode of `node`'s,
    where there is one: sdpa makes tensors of its own for a boolean mask, which a fake
    tensor outside its mode refuses."""
    before = set(graph.nodes)
    kept = {k: v for k, v in node.meta.items() if k not in VALUE_META}
    with getattr(example_value(node), "fake_mode", None) or contextlib.nullcontext():
        write_out(graph, node, args)
    for new in graph.nodes:
        if new not in before:
            new.meta.update(kept)


def _bound(node: torch.fx.Node) -> dict[str, Any] | None:
    if len(node.args) > len(PARAMETERS):
        return None
    args = {**DEFAULTS, **dict(zip(PARAMETERS, node.args, strict=False)), **node.kwargs}
    return args if set(args) <= set(PARAMETERS) else None


def _writable(node: torch.fx.Node, args: dict[str, Any]) -> bool:
    """Whether the written-out form computes what the call computes (module docstring)."""
    if any(args[k] is not None for k in ("bias_k", "bias_v", "static_k", "static_v")):
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
    if args["is_causal"]:
        return args["attn_mask"] is not None and not args["need_weights"]
    mask, padding = example_value(args["attn_mask"]), example_value(args["key_padding_mask"])
    return _shaped(mask, (query.shape[0], key.shape[0])) and \
        _shaped(padding, (query.shape[1], key.shape[0]))


def _shaped(mask: Any, shape: tuple[int, int]) -> bool:
    """No mask, or a tensor mask of `shape`."""
    return mask is None or (isinstance(mask, torch.Tensor) and tuple(mask.shape) == shape)


def _write_out(graph: torch.fx.Graph, node: torch.fx.Node, args: dict[str, Any]) -> None:
    width = example_value(args["query"]).shape[-1]
    with graph.inserting_before(node):
        q, k, v = _projections(graph, args, width)
        out = _attend(graph, (q, k, v), args["num_heads"], SEQUENCE_FIRST,
                      _attention_kwargs(graph, args))
        out = add_node(graph, "function", F.linear,
                       (out, args["out_proj_weight"], args["out_proj_bias"]))
    for user in list(node.users):
        user.replace_all_uses_with(out)
        graph.erase_node(user)
    graph.erase_node(node)


def _attend(graph: torch.fx.Graph, qkv: tuple, heads: int, layout: tuple[int, ...],
            kwargs: dict[str, Any]) -> torch.fx.Node:
    """sdpa over `heads` heads of q, k, v [.., L, E]; `layout`: the permutation that takes
    [.., L, .., H, D] to [N, H, L, D] (its inverse takes the result back)."""
    width = example_value(qkv[0]).shape[-1]
    split = [add_node(graph, "method", "unflatten", (t, -1, (heads, width // heads)))
             for t in qkv]
    q, k, v = (add_node(graph, "method", "permute", (t, *layout)) for t in split)
    attended = add_node(graph, "function", F.scaled_dot_product_attention, (q, k, v), kwargs)
    inverse = tuple(layout.index(axis) for axis in range(len(layout)))
    back = add_node(graph, "method", "permute", (attended, *inverse))
    return add_node(graph, "method", "flatten", (back, -2))


def _projections(graph: torch.fx.Graph, args: dict[str, Any], width: int) -> list:
    query, key, value = args["query"], args["key"], args["value"]
    bias = args["in_proj_bias"]
    biases = [None] * 3 if bias is None else [
        add_node(graph, "function", operator.getitem, (bias, slice(i * width, (i + 1) * width)))
        for i in range(3)]
    if args["use_separate_proj_weight"]:
        weights = [args[f"{n}_proj_weight"] for n in "qkv"]
    elif query is key is value:  # one projection, split: what PyTorch computes
        return _packed_projection(graph, query, args["in_proj_weight"], bias)
    else:
        weights = [add_node(graph, "function", operator.getitem,
                       (args["in_proj_weight"], slice(i * width, (i + 1) * width)))
                   for i in range(3)]
    return [add_node(graph, "function", F.linear, (x, w, b))
            for x, w, b in zip((query, key, value), weights, biases, strict=True)]


def _packed_projection(graph: torch.fx.Graph, x: Any, weight: Any, bias: Any) -> list:
    packed = add_node(graph, "function", F.linear, (x, weight, bias))
    parts = add_node(graph, "method", "chunk", (packed, 3, -1))
    return [add_node(graph, "function", operator.getitem, (parts, i)) for i in range(3)]


def _attention_kwargs(graph: torch.fx.Graph, args: dict[str, Any]) -> dict[str, Any]:
    """sdpa's mask arguments. As F.multi_head_attention_forward: with is_causal (a hint
    that the mask is causal) and no key padding mask the mask is dropped; a boolean mask
    marks what may not be attended, sdpa's what may. The key padding mask [N, S] joins
    the attention mask [L, S] as [N, 1, 1, S]: both boolean, what neither hides may be
    attended; else their additive forms (True: -inf) add up."""
    mask, padding = args["attn_mask"], args["key_padding_mask"]
    if args["is_causal"] and padding is None:
        return {"is_causal": True}
    if padding is not None:
        padding = add_node(graph, "function", operator.getitem,
                           (padding, (slice(None), None, None, slice(None))))
    masks = [m for m in (mask, padding) if m is not None]
    if not masks:
        return {}
    if all(example_value(m).dtype == torch.bool for m in masks):
        hidden = masks[0] if len(masks) == 1 else \
            add_node(graph, "function", torch.logical_or, tuple(masks))
        return {"attn_mask": add_node(graph, "function", torch.logical_not, (hidden,))}
    dtype = example_value(args["query"]).dtype
    additive = [_additive(graph, m, dtype) for m in masks]
    total = additive[0] if len(additive) == 1 else \
        add_node(graph, "function", operator.add, tuple(additive))
    return {"attn_mask": total}


def _additive(graph: torch.fx.Graph, mask: torch.fx.Node, dtype: torch.dtype) -> torch.fx.Node:
    """A mask as a float to add to the scores: a boolean one's True as -inf."""
    if example_value(mask).dtype != torch.bool:
        return mask
    zeros = add_node(graph, "function", torch.zeros_like, (mask,), {"dtype": dtype})
    return add_node(graph, "method", "masked_fill", (zeros, mask, float("-inf")))


def _encoder_writable(args: dict[str, Any]) -> bool:
    src = example_value(args.get("src"))
    return (set(args) <= set(ENCODER_PARAMETERS)
            and isinstance(src, torch.Tensor) and src.dim() == 3
            and src.shape[-1] == args["embed_dim"] and not src.shape[-1] % args["num_heads"]
            and _encoder_mask_fits(args, src.shape))


def _encoder_mask_fits(args: dict[str, Any], shape: torch.Size) -> bool:
    """No mask, or one of the shape its mask_type names (torch's merge_masks: 0 the attention
    mask [L, L], 1 the key padding mask [N, L], 2 both merged [N, H, L, L]); the op also takes
    one of the scores' shape [N, H, L, L] whatever the mask_type."""
    if args.get("mask") is None:
        return True
    mask = example_value(args["mask"])
    batch, length, heads = shape[0], shape[1], args["num_heads"]
    scores = (batch, heads, length, length)
    named = {0: (length, length), 1: (batch, length), 2: scores}.get(args.get("mask_type"))
    return isinstance(mask, torch.Tensor) and tuple(mask.shape) in (scores, named)


def _encoder_mask(graph: torch.fx.Graph, args: dict[str, Any]) -> dict[str, Any]:
    """sdpa's attn_mask for the fused layer's mask. The op hides the keys where its mask is
    nonzero (True, or a float mask's -inf: it reads any mask as boolean, a float one not as
    scores to add), sdpa those where its boolean mask is False; the key padding mask [N, L]
    as [N, 1, 1, L]."""
    mask = args.get("mask")
    if mask is None:
        return {}
    if example_value(mask).dim() == 2 and args["mask_type"] == 1:
        mask = add_node(graph, "function", operator.getitem,
                        (mask, (slice(None), None, None, slice(None))))
    return {"attn_mask": add_node(graph, "function", torch.logical_not, (mask,))}


def _write_out_encoder(graph: torch.fx.Graph, node: torch.fx.Node, args: dict[str, Any]
                       ) -> None:
    """The layer as nn.TransformerEncoderLayer's slow path computes it (batch first)."""
    width, eps = args["embed_dim"], args["eps"]

    def norm(x: Any, i: int) -> torch.fx.Node:
        return add_node(graph, "function", F.layer_norm, (
            x, (width,), args[f"norm_weight_{i}"], args[f"norm_bias_{i}"], eps))

    def attention(x: Any) -> torch.fx.Node:
        qkv = _packed_projection(graph, x, args["qkv_weight"], args["qkv_bias"])
        out = _attend(graph, tuple(qkv), args["num_heads"], BATCH_FIRST,
                      _encoder_mask(graph, args))
        return add_node(graph, "function", F.linear,
                        (out, args["proj_weight"], args["proj_bias"]))

    def mlp(x: Any) -> torch.fx.Node:
        hidden = add_node(graph, "function", F.linear,
                          (x, args["ffn_weight_1"], args["ffn_bias_1"]))
        hidden = add_node(graph, "function", F.gelu if args["use_gelu"] else F.relu, (hidden,))
        return add_node(graph, "function", F.linear,
                        (hidden, args["ffn_weight_2"], args["ffn_bias_2"]))

    def add(x: Any, y: Any) -> torch.fx.Node:
        return add_node(graph, "function", operator.add, (x, y))

    with graph.inserting_before(node):
        x = args["src"]
        if args["norm_first"]:
            x = add(x, attention(norm(x, 1)))
            out = add(x, mlp(norm(x, 2)))
        else:
            x = norm(add(x, attention(x)), 1)
            out = norm(add(x, mlp(x)), 2)
    node.replace_all_uses_with(out)
    graph.erase_node(node)
