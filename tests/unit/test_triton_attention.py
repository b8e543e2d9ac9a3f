"""The fused K/V-cache attention kernel against the float64 reference.

On a CUDA machine the compiled kernel runs on the GPU. Elsewhere the Triton interpreter
runs it on CPU (TRITON_INTERPRET=1, set for this whole process before triton is imported),
so shapes stay tiny. The interpreter's tl.dot multiplies the raw bit patterns of bfloat16
blocks, so bfloat16 is checked on GPU only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from tokpipe_compiler import TokpipeError  # noqa: E402
from tokpipe_compiler.runtime import triton_attention as ta  # noqa: E402

if DEVICE == "cpu" and not ta.INTERPRETED:
    pytest.skip(
        "no CUDA, and the kernel was imported without TRITON_INTERPRET=1 (run this file alone)",
        allow_module_level=True,
    )

# Examples per property test. On a GPU each new shape class (the divisibility of the
# strides and sizes Triton specializes on) is a compile of its own, and 50 examples make
# about 27 of them: scripts/gpu_check.sh runs fewer to fit its time.
EXAMPLES = int(os.environ.get("TOKPIPE_KERNEL_EXAMPLES", "50"))
# atol = rtol, against the float64 reference.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@dataclass(frozen=True)
class Case:
    batch: int
    kv_heads: int
    group: int
    head_dim: int
    length: int
    n: int
    offset: int
    kv_len: int
    causal: bool
    scale: float | None
    heads_last: bool  # q/k/v as transposed views of [B, n, H, D], as a model produces them
    seed: int

    def attended_end(self) -> int:
        """One past the last cache position any query attends to."""
        return min(self.kv_len, self.offset + self.n) if self.causal else self.kv_len


@st.composite
def cases(draw: st.DrawFn, causal: bool) -> Case:
    length = draw(st.integers(1, 48))
    n = draw(st.integers(1, length))
    offset = draw(st.integers(0, length - n))
    return Case(
        batch=draw(st.integers(1, 2)),
        kv_heads=draw(st.integers(1, 2)),
        group=draw(st.integers(1, 2)),
        head_dim=draw(st.sampled_from([8, 16, 72])),
        length=length,
        n=n,
        offset=offset,
        kv_len=draw(st.one_of(st.just(length), st.integers(1, length))),
        causal=causal,
        scale=draw(st.sampled_from([None, 0.3])),
        heads_last=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


def _inputs(case: Case, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """q, k, v and caches poisoned with NaN wherever the kernel must not read them."""
    g = torch.Generator().manual_seed(case.seed)
    b, hkv, d = case.batch, case.kv_heads, case.head_dim

    def chunk(heads: int) -> torch.Tensor:
        if case.heads_last:
            return torch.randn(b, case.n, heads, d, generator=g).to(dtype).transpose(1, 2)
        return torch.randn(b, heads, case.n, d, generator=g).to(dtype)

    q, k, v = chunk(hkv * case.group), chunk(hkv), chunk(hkv)
    caches = torch.randn(2, b, hkv, case.length, d, generator=g).to(dtype)
    pos = torch.arange(case.length)
    written = (pos >= case.offset) & (pos < case.offset + case.n)
    caches[:, :, :, written | (pos >= case.attended_end())] = float("nan")
    return tuple(t.to(DEVICE) for t in (q, k, v, caches[0], caches[1]))


@pytest.fixture(scope="module", autouse=True)
def nan_output_buffer():
    """Every output element must be written: start each output buffer full of NaN."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ta, "_new_output", lambda q: torch.full_like(q, float("nan")).contiguous())
        yield


def _check(case: Case, dtype: torch.dtype) -> None:
    q, k, v, k_cache, v_cache = _inputs(case, dtype)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    args = (case.offset, case.kv_len, case.causal, case.scale)
    expected = ta.reference_kv_attention(q, k, v, ref_k, ref_v, *args)
    out = ta.fused_kv_attention(q, k, v, k_cache, v_cache, *args)

    assert out.shape == q.shape and out.dtype == dtype
    assert not out.isnan().any()
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), expected.double(), atol=tol, rtol=tol)
    # The reference wrote the chunk with plain indexing: the caches must match it bit for bit,
    # NaN poison included (untouched outside the chunk).
    torch.testing.assert_close(k_cache, ref_k, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, ref_v, atol=0, rtol=0, equal_nan=True)
    span = slice(case.offset, case.offset + case.n)
    assert torch.equal(k_cache[:, :, span], k) and torch.equal(v_cache[:, :, span], v)


@settings(max_examples=EXAMPLES, deadline=None)
@given(cases(causal=False))
def test_stale_matches_reference(case: Case) -> None:
    _check(case, torch.float32)


@settings(max_examples=EXAMPLES, deadline=None)
@given(cases(causal=True))
def test_causal_matches_reference(case: Case) -> None:
    _check(case, torch.float32)


@pytest.mark.parametrize("causal", [False, True])
def test_float16(causal: bool) -> None:
    _check(Case(2, 2, 2, 16, 40, 19, 13, 37, causal, None, True, seed=7), torch.float16)


@pytest.mark.skipif(DEVICE == "cpu", reason="the interpreter's tl.dot is wrong for bfloat16")
@pytest.mark.parametrize("causal", [False, True])
def test_bfloat16(causal: bool) -> None:
    _check(Case(2, 2, 2, 16, 40, 19, 13, 37, causal, None, True, seed=7), torch.bfloat16)


def test_chunk_spanning_blocks_with_padded_head_dim() -> None:
    # Several query and key blocks, a chunk that starts mid-block, D padded from 72 to 128.
    _check(Case(1, 1, 2, 72, 48, 35, 5, 48, False, None, False, seed=3), torch.float32)
    _check(Case(1, 1, 2, 72, 48, 35, 5, 48, True, None, False, seed=3), torch.float32)


def _valid() -> dict[str, object]:
    return {
        "q": torch.zeros(1, 4, 8, 16),
        "k": torch.zeros(1, 2, 8, 16),
        "v": torch.zeros(1, 2, 8, 16),
        "k_cache": torch.zeros(1, 2, 32, 16),
        "v_cache": torch.zeros(1, 2, 32, 16),
        "offset": 0,
        "kv_len": 32,
        "causal": False,
    }


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"offset": 25}, "offset=25"),
        ({"offset": -1}, "offset=-1"),
        ({"kv_len": 0}, "kv_len=0"),
        ({"kv_len": 33}, "kv_len=33"),
        ({"q": torch.zeros(1, 3, 8, 16)}, "q has 3 heads"),
        ({"v_cache": torch.zeros(1, 2, 32, 16, dtype=torch.float16)}, "v_cache has dtype"),
        ({"k": torch.zeros(1, 2, 7, 16)}, "k has shape"),
        ({"v": torch.zeros(2, 8, 16)}, "v must be 4-D"),
        ({"k_cache": torch.zeros(1, 2, 16, 32).transpose(2, 3)}, "k_cache must be contiguous"),
    ],
)
def test_bad_arguments_are_named(change: dict[str, object], named: str) -> None:
    with pytest.raises(TokpipeError, match=named):
        ta.fused_kv_attention(**{**_valid(), **change})


def test_float32_autotunes_only_the_smallest_tile() -> None:
    triton = pytest.importorskip("triton")
    configs = [triton.Config({"BLOCK_M": m, "BLOCK_N": n}) for m, n in [(128, 64), (64, 32)]]
    assert ta._prune(configs, {"q_ptr": torch.zeros(1)}) == [configs[1]]
    assert ta._prune(configs, {"q_ptr": torch.zeros(1, dtype=torch.bfloat16)}) == configs
