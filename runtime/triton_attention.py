"""Fused chunk attention over a K/V cache: store the chunk's K/V, then attend over the cache.

One Triton program per (batch, query head, block of query rows). The key axis splits into
three ranges, each streamed through the same online-softmax update:

    [0, offset)            cache (earlier chunks, or the previous call's K/V in stale mode)
    [offset, offset + n)   the chunk's fresh K/V, read from the k/v inputs, not the cache
    [offset + n, kv_len)   cache (stale mode only; causal rows never look past their chunk)

Reading the fresh range from the inputs means no program ever loads a cache row that this
launch writes, so the store needs no ordering against other programs. The store is done by
the first query head of each K/V group, for the rows of its query block: every cache row is
written exactly once.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from tokpipe_compiler.core.errors import TokpipeError

__all__ = ["fused_kv_attention", "reference_kv_attention"]

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_LOG2E = 1.4426950408889634
# Triton decides at decoration time whether a kernel is compiled or interpreted on CPU.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _configs() -> list[triton.Config]:
    """Launch configurations to autotune over; one small block under the CPU interpreter."""
    if INTERPRETED:
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16}, num_warps=1, num_stages=1)]
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
        for bm, bn, w, s in [
            (64, 32, 4, 2),
            (64, 64, 4, 3),
            (128, 64, 4, 3),
            (128, 64, 8, 3),
            (128, 128, 8, 2),
        ]
    ]


def _prune(configs: list[triton.Config], named_args: dict, **_: object) -> list[triton.Config]:
    """float32 tiles are twice as large and use no tensor cores: keep only the smallest.

    Larger float32 tiles overflow shared memory on A100-class GPUs and compile slowly.
    """
    if named_args["q_ptr"].dtype != torch.float32:
        return configs
    return [min(configs, key=lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"])]


@triton.jit
def _attend_range(
    acc, m_i, l_i, q, rows, offset, offs_d, d_mask, qk_scale,
    k_base, v_base, stride_kn, stride_vn, shift, start, stop,
    APPLY_CAUSAL: tl.constexpr, PRECISION: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Online-softmax update of (acc, m_i, l_i) over keys [start, stop).

    Key j lives at row j - shift of k_base / v_base. Scores are in the log2 domain.
    """
    for block in range(start, stop, BLOCK_N):
        cols = block + tl.arange(0, BLOCK_N)
        col_mask = cols < stop
        kv_mask = col_mask[:, None] & d_mask[None, :]
        k = tl.load(
            k_base + (cols - shift)[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0
        )
        # Masked keys load as zeros, never as whatever the cache holds (it may be garbage).
        v = tl.load(
            v_base + (cols - shift)[:, None] * stride_vn + offs_d[None, :], mask=kv_mask, other=0.0
        )
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        allowed = col_mask[None, :]
        if APPLY_CAUSAL:
            allowed = allowed & (cols[None, :] <= offset + rows[:, None])
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return acc, m_i, l_i


# Tuned per chunk length too (rounded up to a power of two, so a run's few chunk lengths
# and a test's many random ones tune a handful of times): short chunks need small query
# blocks to fill the GPU.
# Autotuning reruns the kernel on the caller's tensors. That is safe: the store writes the
# same values every time, and no program reads the cache rows that are stored.
@triton.autotune(
    configs=_configs(),
    key=["n_bucket", "HEAD_DIM_PAD", "CAUSAL"],
    prune_configs_by={"early_config_prune": _prune},
)
# Offsets change with every chunk: specializing on their divisibility would only recompile.
# Head counts and the head dim are plain arguments, not constants: one compiled kernel per
# padded head dim serves every model (compiling per head count cost seconds per shape).
@triton.jit(do_not_specialize=["offset", "kv_len", "n_bucket"])
def _fused_kv_attention_kernel(
    q_ptr, k_ptr, v_ptr, kc_ptr, vc_ptr, out_ptr,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_kcb, stride_kch, stride_kcn,
    stride_vcb, stride_vch, stride_vcn,
    stride_ob, stride_oh, stride_on,
    n, n_bucket, offset, kv_len, qk_scale, hq, group, head_dim,
    HEAD_DIM_PAD: tl.constexpr,
    CAUSAL: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Store this block's chunk rows into the cache (one head per group), then attend."""
    row_lo = tl.program_id(0) * BLOCK_M
    # int64 so that batch/head offsets of long caches cannot overflow.
    b = (tl.program_id(1) // hq).to(tl.int64)
    h = (tl.program_id(1) % hq).to(tl.int64)
    kvh = h // group

    rows = row_lo + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = offs_d < head_dim
    row_mask = (rows < n)[:, None] & d_mask[None, :]

    k_base = k_ptr + b * stride_kb + kvh * stride_kh
    v_base = v_ptr + b * stride_vb + kvh * stride_vh
    kc_base = kc_ptr + b * stride_kcb + kvh * stride_kch
    vc_base = vc_ptr + b * stride_vcb + kvh * stride_vch

    if h % group == 0:
        k_rows = tl.load(k_base + rows[:, None] * stride_kn + offs_d[None, :], mask=row_mask)
        v_rows = tl.load(v_base + rows[:, None] * stride_vn + offs_d[None, :], mask=row_mask)
        cache_rows = (offset + rows)[:, None]
        tl.store(kc_base + cache_rows * stride_kcn + offs_d[None, :], k_rows, mask=row_mask)
        tl.store(vc_base + cache_rows * stride_vcn + offs_d[None, :], v_rows, mask=row_mask)

    q_base = q_ptr + b * stride_qb + h * stride_qh
    q = tl.load(q_base + rows[:, None] * stride_qn + offs_d[None, :], mask=row_mask, other=0.0)

    key_hi = kv_len
    if CAUSAL:
        key_hi = tl.minimum(kv_len, offset + tl.minimum(row_lo + BLOCK_M, n))
    fresh_hi = tl.minimum(offset + n, key_hi)

    # A finite start keeps exp2(m_i - m_new) defined when a whole block of a row is masked.
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    # Earlier keys from the cache, then the chunk's own keys from k/v, then later cache keys.
    acc, m_i, l_i = _attend_range(
        acc, m_i, l_i, q, rows, offset, offs_d, d_mask, qk_scale,
        kc_base, vc_base, stride_kcn, stride_vcn, 0, 0, tl.minimum(offset, key_hi),
        False, PRECISION, BLOCK_N,
    )  # fmt: skip
    acc, m_i, l_i = _attend_range(
        acc, m_i, l_i, q, rows, offset, offs_d, d_mask, qk_scale,
        k_base, v_base, stride_kn, stride_vn, offset, offset, fresh_hi,
        CAUSAL, PRECISION, BLOCK_N,
    )  # fmt: skip
    acc, m_i, l_i = _attend_range(
        acc, m_i, l_i, q, rows, offset, offs_d, d_mask, qk_scale,
        kc_base, vc_base, stride_kcn, stride_vcn, 0, offset + n, key_hi,
        False, PRECISION, BLOCK_N,
    )  # fmt: skip

    out = acc / l_i[:, None]
    out_base = out_ptr + b * stride_ob + h * stride_oh
    tl.store(
        out_base + rows[:, None] * stride_on + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask,
    )


def _check_args(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
    v_cache: torch.Tensor, offset: int, kv_len: int,
) -> None:  # fmt: skip
    """Raise TokpipeError naming the first argument whose shape, dtype or device is wrong."""
    named = {"q": q, "k": k, "v": v, "k_cache": k_cache, "v_cache": v_cache}
    for name, t in named.items():
        if t.dim() != 4:
            raise TokpipeError(f"{name} must be 4-D [B, H, tokens, D], got shape {tuple(t.shape)}")
        if t.dtype != q.dtype:
            raise TokpipeError(f"{name} has dtype {t.dtype}, but q has {q.dtype}")
        if t.device != q.device:
            raise TokpipeError(f"{name} is on {t.device}, but q is on {q.device}")
    if q.dtype not in SUPPORTED_DTYPES:
        raise TokpipeError(f"q has dtype {q.dtype}; supported: {SUPPORTED_DTYPES}")
    b, hq, n, d = q.shape
    hkv, length = k_cache.shape[1], k_cache.shape[2]
    expected = {
        "k": (b, hkv, n, d),
        "v": (b, hkv, n, d),
        "v_cache": (b, hkv, length, d),
        "k_cache": (b, hkv, length, d),
    }
    for name, shape in expected.items():
        if tuple(named[name].shape) != shape:
            raise TokpipeError(
                f"{name} has shape {tuple(named[name].shape)}, expected {shape} "
                f"(from q {tuple(q.shape)} and k_cache {tuple(k_cache.shape)})"
            )
    if n < 1:
        raise TokpipeError(f"q must hold at least one token, got shape {tuple(q.shape)}")
    if hq % hkv:
        raise TokpipeError(f"q has {hq} heads, not a multiple of the {hkv} K/V heads of k")
    if not 0 <= offset <= length - n:
        raise TokpipeError(
            f"offset={offset} with {n} chunk tokens does not fit a cache of length {length}"
        )
    if not 1 <= kv_len <= length:
        raise TokpipeError(f"kv_len={kv_len} must be in [1, {length}] (the cache length)")


def _new_output(q: torch.Tensor) -> torch.Tensor:
    """The output buffer; every element is written by the kernel (tests fill it with NaN)."""
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    """The kernel addresses head dims with stride 1; copy only if a view breaks that."""
    return t if t.stride(-1) == 1 else t.contiguous()


def fused_kv_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
    v_cache: torch.Tensor, offset: int, kv_len: int, causal: bool, scale: float | None = None,
) -> torch.Tensor:  # fmt: skip
    """Write k, v into the caches at `offset` (in place) and attend q over the caches.

    q [B, Hq, n, D]; k, v [B, Hkv, n, D]; caches [B, Hkv, L, D] contiguous; Hq % Hkv == 0.
    causal=False: every query sees keys [0, kv_len). causal=True: query i sees keys
    j <= offset + i with j < kv_len. Softmax in fp32; returns [B, Hq, n, D] in q's dtype.
    """
    _check_args(q, k, v, k_cache, v_cache, offset, kv_len)
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not cache.is_contiguous():
            raise TokpipeError(f"{name} must be contiguous (it is written in place)")
    if q.device.type != "cuda" and not INTERPRETED:
        raise TokpipeError(f"fused_kv_attention needs CUDA tensors, got q on {q.device}")
    q, k, v = (_unit_last_stride(t) for t in (q, k, v))
    batch, hq, n, d = q.shape
    out = _new_output(q)
    scale = 1.0 / math.sqrt(d) if scale is None else scale

    def grid(meta: dict) -> tuple[int, int]:
        return triton.cdiv(n, meta["BLOCK_M"]), batch * hq

    _fused_kv_attention_kernel[grid](
        q, k, v, k_cache, v_cache, out,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
        *k_cache.stride()[:3], *v_cache.stride()[:3], *out.stride()[:3],
        n, triton.next_power_of_2(n), offset, kv_len, scale * _LOG2E, hq, hq // k.shape[1], d,
        # tl.dot needs every block dim >= 16; pad D up to a power of two and mask the rest.
        HEAD_DIM_PAD=max(16, triton.next_power_of_2(d)), CAUSAL=causal,
        # float32 callers get float32 products, not TF32 (16-bit types ignore this).
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )  # fmt: skip
    return out


def reference_kv_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
    v_cache: torch.Tensor, offset: int, kv_len: int, causal: bool, scale: float | None = None,
) -> torch.Tensor:  # fmt: skip
    """Same contract as `fused_kv_attention`, computed in float64 with plain torch."""
    _check_args(q, k, v, k_cache, v_cache, offset, kv_len)
    n, d = q.shape[2], q.shape[3]
    k_cache[:, :, offset : offset + n] = k
    v_cache[:, :, offset : offset + n] = v
    # Keys past the last attended one are sliced off: they may hold anything, even NaN.
    end = min(kv_len, offset + n) if causal else kv_len
    group = q.shape[1] // k.shape[1]
    keys = k_cache[:, :, :end].double().repeat_interleave(group, dim=1)
    values = v_cache[:, :, :end].double().repeat_interleave(group, dim=1)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    scores = (q.double() @ keys.transpose(-1, -2)) * scale
    if causal:
        positions = torch.arange(end, device=q.device)
        queries = offset + torch.arange(n, device=q.device)
        scores = scores.masked_fill(positions[None, :] > queries[:, None], float("-inf"))
    return (scores.softmax(dim=-1) @ values).to(q.dtype)
