"""What chunking costs: M chunk passes of a stage against one whole pass of the same stage.

    python benchmarks/overhead.py [--tokens 256 1024] [--chunks 1 2 4 8 16] [--device cuda]
        [--cuda-graphs]

One process, one thread (on the CPU), one pipeline stage holding a DiT-S sized model (hidden
384, 6 heads, patch 2, --layers blocks), stale mode. The whole pass is the program's warmup
step (the same stage graph over every token); a chunked step runs the stage once per chunk
against the K/V caches. The ratio (chunked step / whole step) is the price of chunking on
one device: a pipeline of S stages can at best reach S / ratio. With --cuda-graphs both the
whole and the chunked step replay CUDA graphs (the `cuda_graphs` option); the breakdown
then shows host time only (a replay runs no Python op).

Breakdown of a chunked step (the runtime's timeline and a profiled step, scaled to the
timed median):
  compute    inside the stage functions, the attention op excluded
  attention  the `tokpipe::kv_attention` op: its cache writes and the attention itself
  writes     the part of `attention` spent writing chunks into the K/V caches
  dispatch   the part of `attention` spent dispatching the op to its kernel: the op's
             calls in the step times the cost of one call beyond its kernel's, measured
             on a one-token call
  executor   everything outside the stage functions: the prelude (run once per step),
             scheduling, slicing inputs to chunks, assembling the output
  sends      boundary values handed between stages (none here: one stage, one process)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks._args

import tokpipe_compiler as tp
from benchmarks._args import parser_for, positive_int
from tokpipe_compiler.runtime.kv_attention import _kv_attention as kv_attention_kernel

HIDDEN_HEADS, HEAD_DIM = 6, 64
KV_OP = "tokpipe::kv_attention"
CACHE_WRITE = "tokpipe/kv_cache_write"  # the runtime's profiler range around cache writes


@dataclass
class Row:
    tokens: int
    chunks: int
    whole_ms: float
    chunked_ms: float
    parts: dict[str, float]

    @property
    def ratio(self) -> float:
        return self.chunked_ms / self.whole_ms


def dit(tokens: int, layers: int, device: str, dtype: torch.dtype) -> torch.nn.Module:
    """A DiT-S wide DiTTransformer2DModel whose latent makes `tokens` patches of 2x2."""
    from diffusers import DiTTransformer2DModel

    side = 2 * round(tokens**0.5)
    torch.manual_seed(0)
    model = DiTTransformer2DModel(
        num_attention_heads=HIDDEN_HEADS, attention_head_dim=HEAD_DIM, in_channels=4,
        out_channels=8, num_layers=layers, sample_size=side, patch_size=2,
        num_embeds_ada_norm=1000, norm_type="ada_norm_zero",
    ).to(device).eval()
    return model if dtype == torch.float32 else model.to(dtype)


def synced(device: str) -> Callable[[], None]:
    return torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)


def timed_ms(fn: Callable[[], object], sync: Callable[[], None]) -> float:
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return 1e3 * (time.perf_counter() - start)


def paired_ms(call: Callable[[], object], reset: Callable[[], None], reps: int,
              sync: Callable[[], None]) -> tuple[float, float]:
    """Median whole and chunked step times, measured in alternation (a whole step right
    after a reset, then a chunked step on the caches it filled) so that drift in the
    machine's speed falls on both alike."""
    whole, chunked = [], []
    for _ in range(reps):
        reset()
        whole.append(timed_ms(call, sync))
        chunked.append(timed_ms(call, sync))
    return statistics.median(whole), statistics.median(chunked)


def measure(tokens: int, chunks: int, args) -> Row:
    torch._dynamo.reset()  # each point compiles a fresh model: no recompile limit across them
    dtype = getattr(torch, args.dtype)
    model = dit(tokens, args.layers, args.device, dtype)
    side = model.config.sample_size
    gen = torch.Generator().manual_seed(1)
    latents = torch.randn(1, 4, side, side, generator=gen).to(args.device, dtype)
    t, label = torch.tensor([500], device=args.device), torch.tensor([1], device=args.device)
    options = {"stages": 1, "chunks": chunks, "mode": "stale", "warmup_steps": 1,
               "compiler": args.compiler, "cuda_graphs": args.cuda_graphs}
    compiled = torch.compile(model, backend=tp.backend(**options), dynamic=False)
    sync = synced(args.device)

    def call():
        return compiled(latents, timestep=t, class_labels=label)

    with torch.no_grad():
        for _ in range(2):  # compiles both lengths; with graphs, captures both
            call()
            call()
            tp.reset(compiled)
        whole_ms, chunked_ms = paired_ms(call, lambda: tp.reset(compiled), args.reps, sync)
        parts = breakdown(compiled, call, sync, chunked_ms)
    return Row(tokens, chunks, whole_ms, chunked_ms, parts)


def breakdown(compiled, call: Callable[[], object], sync, chunked_ms: float) -> dict:
    """Where one chunked step's time goes. Stage and executor times come from the runtime's
    own timeline of an unprofiled step, scaled to the median `chunked_ms`; the attention
    op's share of the stage time comes from a second, profiled step (the profiler slows
    every op, so only its shares are used)."""
    (program,) = tp.programs(compiled)
    events = program.timeline.events
    events.clear()
    sync()
    start = time.perf_counter()
    call()
    sync()
    wall = 1e3 * (time.perf_counter() - start)
    stage = 1e3 * sum(e.duration for e in events if e.kind == "compute")
    sends = 1e3 * sum(e.duration for e in events if e.kind != "compute")
    events.clear()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        call()
        sync()
    ops = prof.events()
    profiled_stage = 1e3 * sum(e.duration for e in events if e.kind == "compute")
    attention = sum(e.cpu_time_total for e in ops if e.name == KV_OP) / 1e3
    writes = sum(e.cpu_time_total for e in ops if e.name == CACHE_WRITE) / 1e3
    calls = sum(1 for e in ops if e.name == KV_OP)
    share = stage / profiled_stage if profiled_stage else 0.0  # profiled ms -> real ms
    scale = chunked_ms / wall if wall else 0.0
    return {"compute": scale * max(stage - share * attention, 0.0),
            "attention": scale * share * attention, "writes": scale * share * writes,
            "dispatch": calls * dispatch_ms(),
            "executor": scale * max(wall - stage - sends, 0.0), "sends": scale * sends}


def dispatch_ms(reps: int = 2000) -> float:
    """What one `tokpipe::kv_attention` call costs beyond its kernel: a one-token call
    through the dispatcher against the kernel called directly, in alternation."""
    q, kv = torch.randn(1, 1, 1, 8), torch.zeros(1, 1, 4, 8)
    args = (q, q, q, kv, kv.clone(), torch.tensor([0, 1, 1]), 1, False)
    op, kernel = torch.ops.tokpipe.kv_attention, kv_attention_kernel
    through, direct = [], []
    for _ in range(5):
        for fn, times in ((op, through), (kernel, direct)):
            start = time.perf_counter()
            for _ in range(reps // 5):
                fn(*args)
            times.append(time.perf_counter() - start)
    return max(min(through) - min(direct), 0.0) * 1e3 / (reps // 5)


def report(rows: list[Row], args) -> None:
    print(f"\nDiT-S width, {args.layers} blocks, 1 stage, stale, {args.device} {args.dtype}, "
          f"stages compiled with {args.compiler}"
          f"{', CUDA graphs' if args.cuda_graphs else ''}; times in ms (median of {args.reps})")
    print(f"{'tokens':>6} {'M':>3} {'whole':>8} {'chunked':>8} {'ratio':>6} | "
          f"{'compute':>8} {'attn':>7} {'writes':>7} {'dispatch':>8} {'executor':>8} "
          f"{'sends':>6}")
    for row in rows:
        p = row.parts
        print(f"{row.tokens:>6} {row.chunks:>3} {row.whole_ms:>8.2f} {row.chunked_ms:>8.2f} "
              f"{row.ratio:>6.3f} | {p['compute']:>8.2f} {p['attention']:>7.2f} "
              f"{p['writes']:>7.2f} {p['dispatch']:>8.2f} {p['executor']:>8.2f} {p['sends']:>6.2f}")


def arguments() -> argparse.ArgumentParser:
    parser = parser_for(__doc__)
    parser.add_argument("--tokens", type=positive_int, nargs="+", default=[256, 1024],
                        help="token counts, each a set of rows")
    parser.add_argument("--chunks", type=positive_int, nargs="+", default=[1, 2, 4, 8, 16],
                        help="chunk counts M")
    parser.add_argument("--layers", type=positive_int, default=4, help="DiT blocks in the stage")
    parser.add_argument("--reps", type=positive_int, default=9, help="timed steps (the median)")
    parser.add_argument("--device", default="cpu", help="the torch device")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="the model's dtype")
    parser.add_argument("--compiler", default="eager", choices=["eager", "inductor"],
                        help="how tokpipe compiles the stage")
    parser.add_argument("--threads", type=positive_int, default=1, help="CPU threads")
    parser.add_argument("--cuda-graphs", action="store_true", help="the cuda_graphs option")
    return parser


def main() -> None:
    args = arguments().parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for tokens in args.tokens:
        for chunks in args.chunks:
            rows.append(measure(tokens, chunks, args))
            print(f"tokens {tokens} chunks {chunks}: ratio {rows[-1].ratio:.3f}", flush=True)
    report(rows, args)


if __name__ == "__main__":
    main()
