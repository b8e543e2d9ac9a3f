"""chunk_attention: each token-mixing attention becomes one `tokpipe::kv_attention` call.

    out = sdpa(q, k, v, is_causal=c)
becomes
    out = tokpipe.kv_attention(q, k, v, kv_cache_3_k, kv_cache_3_v, tokpipe_chunk,
                               per_unit, c, scale, mask_rows, lead, trail)

The caches and `tokpipe_chunk` are new graph inputs that the runtime provides: a persistent
K/V buffer per layer, and [first unit, units, visible units] of the chunk being run.
`lead`/`trail` count whole tokens around the chunk's tokens (the text of joint attention, a
start token). `refuse_unseen` (causal mode): a mask that shows a chunk keys of later chunks
raises, where stale's first step without warmup cuts it to the keys it sees. With
attention="triton", layers the fused kernel can run also get `fused=True`.
"""

from __future__ import annotations

import torch
import torch.fx

from tokpipe_compiler.core.args import SDPA, bound_args
from tokpipe_compiler.core.errors import TokpipeError, describe
from tokpipe_compiler.core.fx import example_value
from tokpipe_compiler.core.meta import ATTENTION, INVARIANT_INFO, META_KEY, TokenInfo
from tokpipe_compiler.core.warn import warn
from tokpipe_compiler.runtime.caches import CacheSpec
from tokpipe_compiler.runtime.kv_attention import CHUNK_INPUT


def chunk_attention(gm: torch.fx.GraphModule, mode: str, kernel: str = "sdpa"
                    ) -> list[CacheSpec]:
    attention = [n for n in gm.graph.nodes
                 if n.meta.get(META_KEY, INVARIANT_INFO).kind == ATTENTION]
    if not attention:
        return []
    chunk = add_input(gm, CHUNK_INPUT, torch.zeros(3, dtype=torch.long))
    specs, sdpa_layers = [], []
    for layer, node in enumerate(attention):
        args = _sdpa_args(node)
        causal = bool(args.get("is_causal", False))
        info = args["key"].meta[META_KEY]  # queries may lack the text segment of the keys
        if causal and info.segmented:
            _check_causal_segments(
                node, args["query"].meta.get(META_KEY, INVARIANT_INFO), info, mode)
        if mode == "causal" and not causal and args.get("attn_mask") is None:
            raise TokpipeError(
                f"mode='causal' needs causal attention, but {describe(node)} attends to the "
                "whole sequence (no is_causal=True, no mask); use mode='stale' or 'sync'"
            )
        k, v = example_value(args["key"]), example_value(args["value"])
        fused = False
        if kernel == "triton":
            unfused = _why_unfused(k, args.get("attn_mask"), info.segmented)
            fused = not unfused
            if unfused:
                sdpa_layers.append(f"{describe(node)}: {unfused}")
        spec = CacheSpec(layer, f"kv_cache_{layer}_k", f"kv_cache_{layer}_v", tuple(k.shape),
                         tuple(v.shape), k.dtype, node.meta[META_KEY].per_unit, info.lead,
                         info.trail, causal)
        k_cache = add_input(gm, spec.k_name, k)
        v_cache = add_input(gm, spec.v_name, v)
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(
                torch.ops.tokpipe.kv_attention.default,
                (args["query"], args["key"], args["value"], k_cache, v_cache, chunk,
                 spec.per_unit, causal, args.get("scale"), args.get("attn_mask"), info.lead,
                 info.trail),
                {"refuse_unseen": mode == "causal", **({"fused": True} if fused else {})},
            )
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        specs.append(spec)
    gm.recompile()
    if sdpa_layers:
        warn(f"tokpipe: attention='triton': {len(sdpa_layers)} of {len(attention)} attention "
             f"layers run with SDPA instead, since the fused kernel takes CUDA tensors, no "
             f"mask and one sequence ({sdpa_layers[0]}{', ...' if len(sdpa_layers) > 1 else ''})")
    return specs


def _check_causal_segments(node: torch.fx.Node, query: TokenInfo, key: TokenInfo,
                           mode: str) -> None:
    """Causal attention over [lead | chunked tokens | trail] runs when the queries hold the
    keys' segments: a lead segment (a start or class token) precedes every chunk's tokens,
    so each chunk sees it whole, as the model does. Tokens after the chunked ones see every
    chunk's, which causal mode computes chunk by chunk."""
    if (query.lead, query.trail) != (key.lead, key.trail):
        raise TokpipeError(
            f"{describe(node)} is causal with keys that hold {key.lead + key.trail} tokens "
            f"outside the chunked ones and queries that hold {query.lead + query.trail}; "
            "is_causal=True aligns such queries to the keys' first rows, which tokpipe does "
            "not chunk. Give the queries the same tokens as the keys, or pass the causal "
            "mask as attn_mask")
    if mode == "causal" and key.trail:
        raise TokpipeError(
            f"mode='causal': {describe(node)} is causal over a sequence with {key.trail} "
            "tokens after the chunked ones (tokens concatenated behind them); they see every "
            "chunk's tokens, which causal mode attends to chunk by chunk. Put those tokens "
            "before the chunked ones (a start or class token in front runs), or use "
            "mode='stale' or 'sync'")


def _why_unfused(k: torch.Tensor, mask: torch.fx.Node | None, segmented: bool) -> str:
    """Why the fused Triton kernel cannot run a layer ('' if it can)."""
    if k.device.type != "cuda":
        return f"its tensors are on {k.device.type}"
    if mask is not None:
        return "it passes an attention mask"
    return "it attends to text segments" if segmented else ""


def _sdpa_args(node: torch.fx.Node) -> dict:
    bound = bound_args(node, SDPA)
    if bound.get("dropout_p", 0.0):
        raise TokpipeError(f"attention dropout is on in {describe(node)}; call model.eval()")
    return bound


def add_input(gm: torch.fx.GraphModule, name: str, like: torch.Tensor) -> torch.fx.Node:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    with gm.graph.inserting_after(placeholders[-1]):
        node = gm.graph.placeholder(name)
    node.meta["example_value"] = like
    node.meta[META_KEY] = INVARIANT_INFO
    return node
