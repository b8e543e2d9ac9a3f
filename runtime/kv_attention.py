"""The attention custom op that chunk_attention emits: write the chunk's K/V into the
layer's cache at the chunk's offset, then attend over the cache with the mode's semantics.

`fused` chooses how: False copies the chunk into the cache and calls the library's
attention over it (cuDNN or flash on a GPU), True does both in one launch of the fused
Triton kernel (chunk_attention asks for it, with the option attention="triton", only on
CUDA, for layers without a mask or text segments). The argument is not called `kernel`:
Inductor's lowering passes an op's arguments by name beside a `kernel` of its own. On an
H200 the library's kernels were faster (BENCHMARKS.md, "GPU: one H200"), so the option's
default is "sdpa".
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch
import torch.nn.functional as F
from torch.autograd import _profiler_enabled
from torch.nn.attention.bias import causal_lower_right

from tokpipe_compiler.core.errors import TokpipeError
from tokpipe_compiler.runtime.op_library import define_op

CHUNK_INPUT = "tokpipe_chunk"  # the graph input that carries the chunk descriptor
# chunk tensor layout: [first unit of the chunk, units in the chunk, units of the cache to
# attend to]. A tensor (not ints) so one compiled stage serves every chunk of a length.
CHUNK_START, CHUNK_UNITS, CHUNK_VISIBLE = 0, 1, 2
# The CPU flash kernel returns the log-sum-exp that merging a chunk's two parts needs; where
# it is missing (or lacks the dtype) the masked path is exact too, only slower.
_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_CPU_FLASH_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
CACHE_WRITE_RANGE = "tokpipe/kv_cache_write"  # the profiler range of the cache writes
_NO_RANGE = nullcontext()
# A float mask entry at or below this hides its key: exp underflows to 0 in every float
# dtype (covers -inf, torch.finfo(dtype).min and the older -10000).
MASKED_BELOW = -1e4


def _kv_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    chunk: torch.Tensor,
    per_unit: int,
    causal: bool,
    scale: float | None = None,
    mask: torch.Tensor | None = None,
    lead: int = 0,
    trail: int = 0,
    segments: bool = True,
    fused: bool = False,
    refuse_unseen: bool = True,
) -> torch.Tensor:
    """q, k, v: [..., n, D] for the chunk's n tokens; caches [..., L, D].

    Keys visible to query i (global position offset + i): cache positions < visible, and,
    when `causal`, <= offset + i. `mask` holds the chunk's rows of the model's own mask.
    `lead`/`trail`: tokens before/after the chunk's (text tokens of joint attention, a start
    token), at the cache's ends and always visible but for causal masking. `segments`:
    whether k and v hold them (the chunk computes them and writes them to the cache) or not
    (the cache's are attended to). `refuse_unseen` (causal mode, whose chunks must give the
    model's answer): a mask that shows the chunk keys it does not see raises; else (stale's
    first step without warmup) the mask is cut to the visible keys, the mode's approximation.
    """
    if lead or trail:
        return _segmented(q, k, v, k_cache, v_cache, chunk, per_unit, scale, mask,
                          (lead, trail) if segments else (0, 0), (lead, trail), causal,
                          refuse_unseen)
    start, _, visible = (int(x) for x in chunk.tolist())
    offset, n, kv_len = start * per_unit, q.shape[-2], visible * per_unit
    if fused:  # never with text segments: chunk_attention asks for it only without them
        from tokpipe_compiler.runtime.triton_attention import fused_kv_attention

        return fused_kv_attention(q, k, v, k_cache, v_cache, offset, kv_len, causal, scale)
    with _cache_write_range():
        k_cache[..., offset : offset + n, :].copy_(k)
        v_cache[..., offset : offset + n, :].copy_(v)
    keys, values = k_cache[..., :kv_len, :], v_cache[..., :kv_len, :]
    if refuse_unseen and not causal:
        _refuse_unseen_keys(mask, kv_len, None if mask is None else mask.shape[-1])
    groups = q.shape[-3] // keys.shape[-3] if q.dim() >= 3 else 1
    if causal and mask is None and kv_len == offset + n:
        if _has_cpu_flash(q):
            return _causal_cpu(q, keys, values, offset, scale, groups)
        # The chunk's queries are the last n of the keys: causal aligned to the lower right,
        # which flash and cuDNN run without a mask in memory (and skip the masked blocks).
        attn_mask = causal_lower_right(n, kv_len)
    else:
        attn_mask = _visible_mask(q, offset, kv_len, causal, mask)
    # SDPA's output strides follow its inputs'; define_op makes the result contiguous.
    return F.scaled_dot_product_attention(
        q, keys, values, attn_mask=attn_mask, scale=scale, enable_gqa=groups > 1)


def _kv_attention_fake(q, k, v, k_cache, v_cache, chunk, per_unit, causal, scale=None,
                       mask=None, lead=0, trail=0, segments=True, fused=False,
                       refuse_unseen=True):
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


kv_attention = define_op("kv_attention", _kv_attention, _kv_attention_fake,
                         mutates=("k_cache", "v_cache"))


def _segmented(q, k, v, k_cache, v_cache, chunk, per_unit, scale, mask, held, cached,
               causal, refuse_unseen):
    """Attention over [lead segment, visible chunked cache, trail segment]. The queries are
    the chunk's tokens, with or without the segments (text attending too, or not). `held`:
    the (lead, trail) segments k and v hold, written to the cache; `cached`: the cache's.
    `causal`: over the whole sequence's order, the queries holding the segments the keys
    hold (chunk_attention refuses other causal layouts)."""
    start, _, visible = (int(x) for x in chunk.tolist())
    (lead, trail), (held_lead, held_trail) = cached, held
    full, n = k_cache.shape[-2], k.shape[-2] - held_lead - held_trail
    offset = lead + start * per_unit
    with _cache_write_range():
        for cache, new in ((k_cache, k), (v_cache, v)):
            cache[..., offset : offset + n, :].copy_(new[..., held_lead : held_lead + n, :])
            if held_lead or held_trail:
                cache[..., :lead, :].copy_(new[..., :lead, :])
                cache[..., full - trail :, :].copy_(new[..., lead + n :, :])
    if refuse_unseen and not causal:
        _refuse_unseen_keys(mask, lead + visible * per_unit, full - trail)
    seen = torch.cat([torch.arange(lead + visible * per_unit, device=q.device),
                      torch.arange(full - trail, full, device=q.device)])
    keys, values = k_cache.index_select(-2, seen), v_cache.index_select(-2, seen)
    if mask is not None:
        mask = mask.index_select(-1, seen)
    if causal:
        rows = torch.cat([torch.arange(held_lead, device=q.device),
                          torch.arange(offset, offset + n, device=q.device),
                          torch.arange(full - held_trail, full, device=q.device)])
        mask = _causal_and(mask, seen[None, :] <= rows[:, None])
    groups = q.shape[-3] // keys.shape[-3] if q.dim() >= 3 else 1
    return F.scaled_dot_product_attention(
        q, keys, values, attn_mask=mask, scale=scale, enable_gqa=groups > 1)


def _refuse_unseen_keys(mask: torch.Tensor | None, start: int, stop: int | None) -> None:
    """Keys `start:stop` belong to later chunks, which the chunk does not attend to (mode
    causal): right only where the model's own mask hides them from every query of the chunk,
    as a causal mask does. A padding or bidirectional mask that shows them would give another
    answer than the model's, so it raises. Checked on the host; not while a CUDA graph is
    captured (the uncaptured first call of a chunk checked the same mask)."""
    if mask is None or stop is None or start >= stop or _capturing(mask):
        return
    visible = mask if mask.dtype == torch.bool else mask > MASKED_BELOW
    showing = visible[..., start:stop].any(dim=-1)
    if bool(showing.any()):
        whole = visible.all(dim=-1)
        # Only rows that see every key show later keys, and some rows do not: a causal mask
        # whose fully hidden rows were unmasked.
        whole_rows = bool((whole | ~showing).all()) and not bool(whole.all())
        raise TokpipeError(
            f"mode='causal': an attention without is_causal=True has a mask that lets the "
            f"tokens of a chunk see keys {start}..{stop - 1} of later chunks (a padding or "
            "bidirectional mask, not a causal one); causal mode attends each chunk to the "
            "chunks up to its own, which would change the answer"
            + (" (some of its rows see every key: padding rows a causal mask left fully "
               "unmasked, as transformers does for left padding, differ too)"
               if whole_rows else "") +
            ". Use mode='stale' or 'sync', or pass is_causal=True where the model is causal")


def _capturing(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def _cache_write_range() -> AbstractContextManager:
    """A profiler range around the cache writes, only while a profiler runs (a range costs
    a dispatcher call even when nothing records it)."""
    if _profiler_enabled():
        return torch.profiler.record_function(CACHE_WRITE_RANGE)
    return _NO_RANGE


def _causal_cpu(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, offset: int,
    scale: float | None, groups: int,
) -> torch.Tensor:  # fmt: skip
    """Causal attention of a chunk at `offset` without a mask: the context before the chunk
    unmasked, the chunk's own block with the kernel's causal flag (which skips the masked
    half), merged by their log-sum-exps. With an explicit [n, offset + n] mask every chunk
    would pay for its whole rectangle: about n * n / 2 wasted, which is what the cost model
    and TeraPipe's slicing assume causal attention saves."""
    shape = q.shape
    q4, k4, v4 = _as_4d(q, 1), _as_4d(keys, groups), _as_4d(values, groups)
    out, lse = _CPU_FLASH(q4, k4[..., offset:, :], v4[..., offset:, :], 0.0, True, scale=scale)
    if offset:
        before, lse_before = _CPU_FLASH(
            q4, k4[..., :offset, :], v4[..., :offset, :], 0.0, False, scale=scale
        )
        # softmax over both parts = each part's output weighted by its share of exp(lse)
        acc = torch.promote_types(q.dtype, torch.float32)
        weight = torch.sigmoid(lse_before - lse).unsqueeze(-1).to(acc)
        out = torch.lerp(out.to(acc), before.to(acc), weight).to(q.dtype)
    return out.reshape(*shape[:-1], values.shape[-1])


def _has_cpu_flash(q: torch.Tensor) -> bool:
    return _CPU_FLASH is not None and q.device.type == "cpu" and q.dtype in _CPU_FLASH_DTYPES


def _as_4d(t: torch.Tensor, groups: int) -> torch.Tensor:
    """[..., L, D] as [batch, heads, L, D], K/V heads repeated for grouped queries."""
    if t.dim() < 4:
        t = t.reshape(*(1,) * (4 - t.dim()), *t.shape)
    elif t.dim() > 4:
        t = t.flatten(0, t.dim() - 4)
    return t.repeat_interleave(groups, dim=1) if groups > 1 else t


def _visible_mask(
    q: torch.Tensor, offset: int, kv_len: int, causal: bool, mask: torch.Tensor | None
) -> torch.Tensor | None:
    if mask is not None:
        mask = mask[..., :kv_len]
    if not causal:
        return mask
    rows = torch.arange(offset, offset + q.shape[-2], device=q.device)[:, None]
    return _causal_and(mask, torch.arange(kv_len, device=q.device)[None, :] <= rows)


def _causal_and(mask: torch.Tensor | None, allowed: torch.Tensor) -> torch.Tensor:
    """The model's mask (bool or additive, or none) with the keys `allowed` hides hidden."""
    if mask is None:
        return allowed
    if mask.dtype == torch.bool:
        return mask & allowed
    return mask.masked_fill(~allowed, float("-inf"))
