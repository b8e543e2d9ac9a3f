"""`tokpipe::kv_attention` on CPU against attention over the whole sequence in float64.

The causal path attends to the context before a chunk and to the chunk's own block
separately and merges them, so every chunk position, layout and head grouping is checked
against the one-shot masked reference.
"""

from __future__ import annotations

from unittest import mock

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from tokpipe_compiler.runtime import kv_attention as kv_module
from tokpipe_compiler.runtime.kv_attention import kv_attention

# Against the float64 reference, relative to the largest value.
TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 3e-2}


@st.composite
def layouts(draw: st.DrawFn) -> dict:
    kv_heads = draw(st.integers(1, 3))
    chunks = draw(st.lists(st.integers(1, 9), min_size=1, max_size=4))
    return {
        "batch": draw(st.integers(1, 2)),
        "kv_heads": kv_heads,
        "group": draw(st.sampled_from([1, 2])),
        "dim": draw(st.sampled_from([4, 8, 16])),
        "chunks": chunks,
        "scale": draw(st.sampled_from([None, 0.3])),
        "rank": draw(st.sampled_from([3, 4, 5])),
        "seed": draw(st.integers(0, 2**16)),
        "dtype": draw(st.sampled_from(list(TOLERANCE))),
    }


def shaped(t: torch.Tensor, rank: int) -> torch.Tensor:
    """[B, H, L, D] as the rank the model's graph used: [B*H, L, D] or [B, 1, H, L, D]."""
    if rank == 3:
        return t.flatten(0, 1)
    return t.unsqueeze(1) if rank == 5 else t


def reference(q, k, v, group: int, scale: float | None) -> torch.Tensor:
    k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)


@settings(max_examples=60, deadline=None)
@given(layouts())
def test_causal_chunks_equal_one_shot_attention(case):
    check_causal_chunks(case)


@settings(max_examples=30, deadline=None)
@given(layouts())
def test_causal_chunks_through_the_library_attention_as_on_a_gpu(case):
    """Without the CPU flash kernel (as on a GPU) a chunk's causal attention is SDPA with
    a lower-right causal bias: the chunk's queries are the last of the keys."""
    with mock.patch.object(kv_module, "_has_cpu_flash", lambda q: False), \
            mock.patch.object(kv_module, "_visible_mask", no_mask_in_memory):
        check_causal_chunks(case)


def no_mask_in_memory(*args, **kwargs):
    raise AssertionError("a causal chunk ending its keys needs no mask in memory")


def check_causal_chunks(case: dict) -> None:
    gen = torch.Generator().manual_seed(case["seed"])
    total, heads = sum(case["chunks"]), case["kv_heads"] * case["group"]
    b, d, rank = case["batch"], case["dim"], case["rank"]
    q = torch.randn(b, heads, total, d, generator=gen, dtype=torch.float64)
    k, v = (
        torch.randn(b, case["kv_heads"], total, d, generator=gen, dtype=torch.float64)
        for _ in range(2)
    )
    expected = reference(q, k, v, case["group"], case["scale"])
    dtype = case["dtype"]
    caches = [shaped(torch.full_like(k, float("nan")).to(dtype), rank) for _ in range(2)]
    start = 0
    for n in case["chunks"]:
        rows = slice(start, start + n)
        chunk = torch.tensor([start, n, start + n])
        out = kv_attention(
            *(shaped(t[..., rows, :].to(dtype), rank) for t in (q, k, v)),
            *caches,
            chunk,
            1,
            True,
            case["scale"],
        )
        got = out.reshape(b, heads, n, d).double()
        scale = expected.abs().max()
        err = (got - expected[..., rows, :]).abs().max() / scale
        assert out.dtype == dtype
        assert err <= TOLERANCE[dtype], f"chunk at {start} of {case['chunks']}: {err:.2e}"
        start += n
    assert not torch.isnan(caches[0]).any(), "every position of the K cache was written"


def test_causal_chunk_output_is_contiguous_and_shaped_like_q():
    q = torch.randn(2, 3, 4, 8).transpose(1, 2)  # [B, H, n, D] as a view of [B, n, H, D]
    k, v = torch.randn(2, 4, 3, 8), torch.randn(2, 4, 3, 8)
    caches = torch.zeros(2, 4, 9, 8), torch.zeros(2, 4, 9, 8)
    out = kv_attention(q, k, v, *caches, torch.tensor([3, 3, 6]), 1, True)
    assert out.shape == q.shape and out.is_contiguous()


def test_a_chunk_without_the_text_attends_to_the_text_the_first_chunk_cached():
    """Joint attention over [text, image], the text a lead segment. The caches hold the
    whole sequence as a previous step on the same input left them; the first chunk brings
    the text and its image rows, a later chunk (segments=False) only its image rows. Both
    together equal one pass over the whole sequence (float64), and the later chunk writes
    its own rows and no text row."""
    gen = torch.Generator().manual_seed(0)
    text, image, half = 3, 8, 4
    q, k, v = (torch.randn(1, 2, text + image, 4, generator=gen, dtype=torch.float64)
               for _ in range(3))
    expected = F.scaled_dot_product_attention(q, k, v)
    caches = [k.clone(), v.clone()]
    first_rows, later_rows = slice(0, text + half), slice(text + half, text + image)
    first = kv_attention(*(t[..., first_rows, :] for t in (q, k, v)), *caches,
                         torch.tensor([0, half, image]), 1, False, None, None, text, 0)
    for cache in caches:  # the later chunk's rows and the text: unwritten by it, or wrong
        cache[..., later_rows, :] = float("nan")
    caches[0][..., :text, :] += 1.0
    second = kv_attention(*(t[..., later_rows, :] for t in (q, k, v)), *caches,
                          torch.tensor([half, half, image]), 1, False, None, None, text, 0,
                          segments=False)
    assert torch.equal(caches[0][..., later_rows, :], k[..., later_rows, :])
    assert torch.equal(caches[0][..., :text, :], k[..., :text, :] + 1.0)
    caches[0][..., :text, :] -= 1.0
    second = kv_attention(*(t[..., later_rows, :] for t in (q, k, v)), *caches,
                          torch.tensor([half, half, image]), 1, False, None, None, text, 0,
                          segments=False)
    got = torch.cat([first, second], dim=-2)
    assert (got - expected).abs().max() <= 1e-12 * expected.abs().max()
