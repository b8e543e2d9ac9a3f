"""A causal language model's prefill, serial and pipelined (TeraPipe) on this CPU, in one run.

    python benchmarks/llm_prefill.py [--tokens 1024 2048] [--chunks 2 4 8 auto] [--quick]
        [--calls 5]

Model: a Llama of transformers with random weights (8 layers, hidden 512, 8 heads, 4 K/V
heads, MLP 1408, vocabulary 4096; --quick: 4 layers, hidden 256), one prompt of `tokens`
token ids, called as its users call it (`model(input_ids)`, the K/V cache returned).
Competitors: serial eager on 1 thread, and tokpipe in causal mode on 2 ranks of 1 thread
each for each chunk count, its stages run eagerly (`compiler="eager"`; the serial model is
eager too). Each prefill is timed `calls` times after one untimed call (planning); the
median is kept. Prints each time, its speedup over serial, TeraPipe's bound for even
stages and even chunks, S / (1 + (S - 1) / M), and the fraction of it reached.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks._args

import tokpipe_compiler as tp
from benchmarks._args import at_least, chunk_count, parser_for
from tokpipe_compiler.run_device import say_if_busy
from tokpipe_compiler.runtime.launch import launch

FULL = {"layers": 8, "hidden": 512, "heads": 8, "kv_heads": 4, "mlp": 1408}
QUICK = {"layers": 4, "hidden": 256, "heads": 4, "kv_heads": 2, "mlp": 704}
VOCAB, RANKS = 4096, 2


def llama(shape: dict) -> torch.nn.Module:
    """The benchmark model, seeded: the same weights in every process."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(num_hidden_layers=shape["layers"], hidden_size=shape["hidden"],
                         num_attention_heads=shape["heads"],
                         num_key_value_heads=shape["kv_heads"],
                         intermediate_size=shape["mlp"], vocab_size=VOCAB,
                         max_position_embeddings=8192)
    return LlamaForCausalLM(config).eval()


def prompt(tokens: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, tokens), generator=torch.Generator().manual_seed(1))


def timed(fn, calls: int) -> float:
    """The median of `calls` timed calls of `fn`, after one untimed."""
    fn()
    seconds = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def serial(shape: dict, tokens: int, calls: int) -> float:
    torch.set_num_threads(1)
    model, ids = llama(shape), prompt(tokens)
    with torch.no_grad():
        return timed(lambda: model(ids), calls)


def pipelined(rank: int, world: int, shape: dict, tokens: int, chunks: int | str,
              calls: int) -> tuple[float, int]:
    """This rank's median prefill time and the chunk count the plan runs."""
    model, ids = llama(shape), prompt(tokens)
    compiled = torch.compile(model, backend="tokpipe", dynamic=False, options={
        "stages": world, "chunks": chunks, "mode": "causal", "compiler": "eager",
        "timeout": 1800.0})

    def call() -> None:
        dist.barrier()  # every rank starts each call together
        compiled(ids)

    with torch.no_grad():
        seconds = timed(call, calls)
    return seconds, len(tp.programs(compiled)[0].plan.chunks)


def bound(stages: int, chunks: int) -> float:
    """TeraPipe's speedup for even stages and chunks: the pipeline fills and drains."""
    return stages / (1 + (stages - 1) / chunks)


def arguments() -> argparse.ArgumentParser:
    parser = parser_for(__doc__)
    parser.add_argument("--tokens", type=at_least(16), nargs="+", default=[1024, 2048],
                        help="prompt lengths")
    parser.add_argument("--chunks", type=chunk_count, nargs="+", default=[2, 4, 8, "auto"],
                        help="chunk counts, or auto (TeraPipe's slicing, longer chunks first)")
    parser.add_argument("--calls", type=at_least(1), default=5,
                        help="timed prefills per competitor (the median is kept)")
    parser.add_argument("--quick", action="store_true", help="a small model, for a smoke run")
    return parser


def main() -> None:
    args = arguments().parse_args()
    say_if_busy()  # the ranks' speedups need the cores to themselves
    shape = QUICK if args.quick else FULL
    print(f"model {shape}, vocabulary {VOCAB}, {RANKS} ranks x 1 thread, eager stages",
          flush=True)
    print(f"{'tokens':>6} {'run':<26} {'time s':>8} {'speedup':>8} {'bound':>6} "
          f"{'of bound':>8}", flush=True)
    for tokens in args.tokens:
        base = serial(shape, tokens, args.calls)
        print(f"{tokens:>6} {'serial eager':<26} {base:>8.3f} {1:>7.2f}x", flush=True)
        for chunks in args.chunks:
            results = launch(pipelined, RANKS, timeout=3600,
                             args=(shape, tokens, chunks, args.calls))
            seconds, used = max(r[0] for r in results), results[0][1]
            label = f"tokpipe causal, {chunks}" + (f" ({used})" if chunks == "auto" else "")
            speedup, limit = base / seconds, bound(RANKS, used)
            print(f"{tokens:>6} {label:<26} {seconds:>8.3f} {speedup:>7.2f}x {limit:>6.2f} "
                  f"{speedup / limit:>8.0%}", flush=True)


if __name__ == "__main__":
    main()
