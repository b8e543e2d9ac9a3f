"""Check and time the fused K/V-cache attention kernel on a CUDA GPU.

    python benchmarks/gpu_kernels.py [--quick]

1. Checks `fused_kv_attention` against the float64 reference (outputs and cache writes).
2. Times, for the last chunk of a sequence (offset = L - n, the longest causal context):
     fused      the Triton kernel (cache store + attention in one launch)
     unfused    k/v copied into the cache, then SDPA over the cache
     sdpa       SDPA over the cache alone (no copy): the library attention kernel
   SDPA uses the fastest backend that accepts the case (cuDNN, flash, memory-efficient);
   causal chunks use a bottom-right aligned causal mask. TFLOP/s count attended pairs only.
Without CUDA it says so and exits 0.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks._args

from benchmarks._args import parser_for

BACKENDS = ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION")
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 5e-3}  # atol = rtol, against float64


@dataclass(frozen=True)
class Case:
    """One kernel call: the chunk [offset, offset + n) of a cache of `length` tokens."""

    batch: int
    heads: int
    kv_heads: int
    head_dim: int
    length: int
    n: int
    offset: int
    kv_len: int
    causal: bool
    dtype: torch.dtype

    def flops(self) -> float:
        """2 matmuls x 2 flops per multiply-add over every attended (query, key) pair."""
        if self.causal:
            pairs = sum(min(self.kv_len, self.offset + i + 1) for i in range(self.n))
        else:
            pairs = self.n * self.kv_len
        return 4.0 * self.batch * self.heads * self.head_dim * pairs

    def inputs(self) -> tuple[torch.Tensor, ...]:
        """Random q, k, v and caches on the GPU."""
        b, d = self.batch, self.head_dim

        def rand(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, device="cuda", dtype=self.dtype)

        return (
            rand(b, self.heads, self.n, d),
            rand(b, self.kv_heads, self.n, d),
            rand(b, self.kv_heads, self.n, d),
            rand(b, self.kv_heads, self.length, d),
            rand(b, self.kv_heads, self.length, d),
        )

    def args(self) -> tuple[int, int, bool]:
        return self.offset, self.kv_len, self.causal


def check_cases(quick: bool) -> list[Case]:
    """Grouped heads, padded head dims, chunks mid-cache, kv_len short of the cache."""
    cases = []
    for dtype in (torch.bfloat16, torch.float16):
        for causal in (False, True):
            cases += [
                Case(1, 8, 2, 72, 1024, 256, 512, 1024, causal, dtype),
                Case(2, 4, 4, 96, 2048, 500, 1100, 1800, causal, dtype),
                Case(1, 4, 1, 64, 777, 129, 600, 777, causal, dtype),
            ]
            if not quick:
                cases.append(Case(1, 24, 24, 128, 4096, 1024, 3072, 4096, causal, dtype))
    return cases


def check(case: Case) -> str | None:
    """None if the kernel matches the reference, else what went wrong."""
    from tokpipe_compiler.runtime.triton_attention import fused_kv_attention, reference_kv_attention

    q, k, v, k_cache, v_cache = case.inputs()
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    expected = reference_kv_attention(q, k, v, ref_k, ref_v, *case.args())
    out = fused_kv_attention(q, k, v, k_cache, v_cache, *case.args())
    if not (torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)):
        return "cache contents differ from the reference store"
    tol = TOLERANCE[case.dtype]
    try:
        torch.testing.assert_close(out.double(), expected.double(), atol=tol, rtol=tol)
    except AssertionError as err:
        return str(err).splitlines()[0]
    return None


def median_ms(fn: Callable[[], object], warmup: int, reps: int) -> float:
    """Median GPU time between CUDA events recorded around fn, in milliseconds."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def sdpa_over_cache(
    case: Case, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
) -> Callable[[], torch.Tensor]:
    """SDPA of the chunk's queries over the attended part of the cache."""
    from torch.nn.attention.bias import causal_lower_right

    end = min(case.kv_len, case.offset + case.n) if case.causal else case.kv_len
    keys, values = k_cache[:, :, :end], v_cache[:, :, :end]
    # Valid only when the chunk ends the attended range, as in every timed case.
    mask = causal_lower_right(case.n, end) if case.causal else None
    return lambda: F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)


def fastest_backend(attend: Callable[[], torch.Tensor], warmup: int, reps: int) -> str:
    """The SDPA backend that runs `attend` fastest."""
    timings = {}
    for backend in BACKENDS:
        # A backend that cannot run the case warns why, then raises; the reason is not news.
        with sdpa_kernel(getattr(SDPBackend, backend)), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                attend()
            except RuntimeError:  # this backend does not support the case
                continue
            timings[backend] = median_ms(attend, warmup, reps)
    if not timings:
        raise RuntimeError("no SDPA backend runs this case")
    return min(timings, key=timings.__getitem__)


def time_case(case: Case, warmup: int, reps: int) -> dict[str, float | str]:
    """Fused, unfused and SDPA-only timings of one case, as TFLOP/s."""
    from tokpipe_compiler.runtime.triton_attention import fused_kv_attention

    tensors = case.inputs()
    q, k, v, k_cache, v_cache = tensors
    attend = sdpa_over_cache(case, q, k_cache, v_cache)
    span = slice(case.offset, case.offset + case.n)

    def unfused() -> torch.Tensor:
        k_cache[:, :, span].copy_(k)
        v_cache[:, :, span].copy_(v)
        return attend()

    def fused() -> torch.Tensor:
        return fused_kv_attention(*tensors, *case.args())

    fused()  # autotunes once per configuration key
    fused_ms = median_ms(fused, warmup, reps)
    backend = fastest_backend(attend, warmup, reps)
    # The backend context is entered outside the timed calls: its cost is host-side only.
    with sdpa_kernel(getattr(SDPBackend, backend)):
        unfused_ms = median_ms(unfused, warmup, reps)
        sdpa_ms = median_ms(attend, warmup, reps)
    gflop = case.flops() / 1e9  # GFLOP per ms is TFLOP/s
    return {
        "fused": gflop / fused_ms,
        "unfused": gflop / unfused_ms,
        "sdpa": gflop / sdpa_ms,
        "backend": backend.split("_")[0].lower(),
    }


def bench_cases(quick: bool) -> list[Case]:
    """24 heads x 128 dims, bf16, batch 1; the last chunk of each (length, chunk length)."""
    lengths = (1024,) if quick else (4096, 16384, 65536)
    divisors = (2, 4) if quick else (2, 4, 8)
    return [
        Case(1, 24, 24, 128, length, length // div, length - length // div, length, causal,
             torch.bfloat16)
        for length in lengths
        for div in divisors
        for causal in (False, True)
    ]  # fmt: skip


def arguments() -> argparse.ArgumentParser:
    parser = parser_for(__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny shapes, few repetitions")
    return parser


def main() -> int:
    quick = arguments().parse_args().quick
    if not torch.cuda.is_available():
        print("gpu_kernels: no CUDA device; nothing to check or time.")
        return 0
    torch.manual_seed(0)
    print(f"device: {torch.cuda.get_device_name()}")

    cases = check_cases(quick)
    failures = [(case, err) for case in cases if (err := check(case))]
    for case, err in failures:
        print(f"MISMATCH {case}: {err}")
    print(f"correctness: {len(cases) - len(failures)}/{len(cases)} cases match float64")

    warmup, reps = (2, 5) if quick else (3, 10)
    header = f"{'L':>6} {'n':>6} {'mode':>6} {'backend':>9} {'fused':>7} {'unfused':>8} {'sdpa':>7}"
    print("\nTFLOP/s (median of", reps, "reps)")
    print(f"{header} {'fused/unfused':>14} {'fused/sdpa':>11}")
    for case in bench_cases(quick):
        r = time_case(case, warmup, reps)
        mode = "causal" if case.causal else "stale"
        print(
            f"{case.length:>6} {case.n:>6} {mode:>6} {r['backend']:>9} {r['fused']:>7.1f} "
            f"{r['unfused']:>8.1f} {r['sdpa']:>7.1f} {r['fused'] / r['unfused']:>14.2f} "
            f"{r['fused'] / r['sdpa']:>11.2f}"
        )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
