"""Joint attention's text tokens computed by every chunk against once a step.

    python benchmarks/text_chunks.py [--text 512] [--side 64] [--chunks 2 4 8]
        [--double 2] [--single 4] [--heads 4] [--reps 3] [--rounds 3]
        [--device cuda --dtype bfloat16]

A Flux structure (`FluxTransformer2DModel`: double-stream blocks, then single-stream blocks
over text and image joined) with its released text length (512 T5 tokens) and the image
tokens of a `side` x `side` latent grid after 2x2 patches (side 64: 1024 tokens, 512 px;
side 128: 4096 tokens, 1024 px), fewer blocks and narrower heads so that a step takes a
fraction of a second on a CPU core (on a GPU, `--heads 24` is FLUX.1's width). One
process (one thread on the CPU): tokpipe's stages run in turn, so a step costs the work of
all of them and the ratio to serial is what chunking adds.

Runs serial eager and tokpipe 2 stages x M chunks (stale, eager stage graphs) with
`text_chunks="every"` (each chunk computes the text stream) and `"first"` (the step's first
chunk does; the later ones attend to its cached K/V), timed in interleaved rounds. The work
ratio the text adds is (image + M x text) / (image + text) with "every" and 1 with "first".
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks.host_overhead

import tokpipe_compiler as tp
from benchmarks._args import parser_for, positive_int
from benchmarks.host_overhead import interleaved_ms

POOLED, T5, CHANNELS = 768, 4096, 64


def flux(double: int, single: int, heads: int) -> torch.nn.Module:
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    return FluxTransformer2DModel(
        patch_size=1, in_channels=CHANNELS, num_layers=double, num_single_layers=single,
        attention_head_dim=128, num_attention_heads=heads, joint_attention_dim=T5,
        pooled_projection_dim=POOLED, guidance_embeds=True, axes_dims_rope=(16, 56, 56),
    ).eval()


def call_of(model: torch.nn.Module, text: int, side: int, device: str,
            dtype: torch.dtype) -> Callable[[], object]:
    """One denoising call (waited for on a GPU): packed latents of a side x side grid
    (Flux's 2x2 packing)."""
    gen = torch.Generator().manual_seed(1)
    image = (side // 2) ** 2
    ids = torch.zeros(side // 2, side // 2, 3)
    ids[..., 1] += torch.arange(side // 2)[:, None]
    ids[..., 2] += torch.arange(side // 2)[None, :]
    kwargs = {"hidden_states": torch.randn(1, image, CHANNELS, generator=gen),
              "encoder_hidden_states": torch.randn(1, text, T5, generator=gen),
              "pooled_projections": torch.randn(1, POOLED, generator=gen),
              "timestep": torch.tensor([0.5]), "guidance": torch.tensor([3.5]),
              "img_ids": ids.reshape(-1, 3), "txt_ids": torch.zeros(text, 3),
              "return_dict": False}
    kwargs = {k: v.to(device, dtype if v.is_floating_point() else v.dtype)
              if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    if device == "cpu":
        return lambda: model(**kwargs)
    return lambda: (model(**kwargs), torch.cuda.synchronize())


def tokpipe_call(model: torch.nn.Module, chunks: int, text_chunks: str,
                 *shape: object) -> Callable[[], object]:
    backend = tp.backend(stages=2, chunks=chunks, mode="stale", warmup_steps=1,
                         compiler="eager", text_chunks=text_chunks)
    call = call_of(torch.compile(model, backend=backend, dynamic=False), *shape)
    for _ in range(2):  # the warmup step, then a chunked one
        call()
    return call


def arguments() -> argparse.ArgumentParser:
    parser = parser_for(__doc__)
    parser.add_argument("--text", type=positive_int, default=512, help="text tokens")
    parser.add_argument("--side", type=positive_int, default=64,
                        help="latent grid side (image tokens: (side / 2)^2)")
    parser.add_argument("--chunks", type=positive_int, nargs="+", default=[2, 4, 8],
                        help="chunk counts M, each with text every chunk and once a step")
    parser.add_argument("--double", type=positive_int, default=2, help="double-stream blocks")
    parser.add_argument("--single", type=positive_int, default=4, help="single-stream blocks")
    parser.add_argument("--heads", type=positive_int, default=4, help="attention heads of 128")
    parser.add_argument("--rounds", type=positive_int, default=3,
                        help="interleaved timing rounds")
    parser.add_argument("--reps", type=positive_int, default=3, help="steps per call and round")
    parser.add_argument("--device", default="cpu", help="the torch device")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="the model's dtype")
    return parser


def main() -> None:
    args = arguments().parse_args()
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    model = flux(args.double, args.single, args.heads)
    if (args.device, dtype) != ("cpu", torch.float32):  # diffusers warns on any cast
        model = model.to(args.device, dtype)
    image = (args.side // 2) ** 2
    shape = (args.text, args.side, args.device, dtype)
    with torch.no_grad():
        calls = {"serial eager": call_of(model, *shape)}
        for chunks in args.chunks:
            for text_chunks in ("every", "first"):
                calls[f"2x{chunks} text {text_chunks}"] = tokpipe_call(
                    model, chunks, text_chunks, *shape)
        steps = interleaved_ms(calls, args.rounds, args.reps)
    base = statistics.median(steps["serial eager"])
    print(f"\nFlux structure, {args.double} double + {args.single} single blocks, "
          f"{args.heads} heads x 128, {args.text} text + {image} image tokens, batch 1, "
          f"{args.dtype} on {args.device}; "
          f"ms per step (median of {args.rounds} x {args.reps}, interleaved); "
          "'text work' is the text stream's share as counted in tokens")
    print(f"{'run':<20} {'step':>9} {'vs serial':>10} {'text work':>10}")
    for name, times in steps.items():
        step = statistics.median(times)
        work = 1.0
        if "every" in name:
            chunks = int(name.split("x")[1].split()[0])
            work = (image + chunks * args.text) / (image + args.text)
        print(f"{name:<20} {step:>9.1f} {step / base:>9.2f}x {work:>9.2f}x")


if __name__ == "__main__":
    main()
