"""The simulator against published PipeFusion runs: PixArt-alpha 1024px, 20 steps.

    python -m tokpipe_compiler.costmodel.simulator --pixart

A published run times the whole pipeline call: the text encoder (T5-XXL, prompt and
negative prompt) and the VAE decode run once, on one GPU, in the serial and the pipelined
run alike; the transformer's 20 steps are what the pipeline splits. Each device's
sustained fraction of its spec-sheet peak is fitted to the published serial time (the one
number a spec sheet cannot give); the pipelined time is then a prediction: the warmup
step, the ring's fill and drain, sends that do not overlap compute (PipeFusion sends on
the compute stream), the stale K/V reads of every chunk and launch-bound chunks included.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import sympy
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from tokpipe_compiler.costmodel.calibrate import DeviceRates
from tokpipe_compiler.costmodel.cost import C, Cost, N
from tokpipe_compiler.costmodel.hardware import ACHIEVABLE, DEVICES, LINKS, DeviceModel
from tokpipe_compiler.costmodel.host import EAGER_LAUNCHES
from tokpipe_compiler.costmodel.symbolic import Gemm, padded_head

PIXART = {"layers": 28, "hidden": 1152, "heads": 16, "tokens": 4096, "text": 120, "mlp": 4}
# Classifier-free guidance runs the conditional and unconditional batch together.
PIXART_BATCH = 2
BF16 = 2
STEPS, WARMUP = 20, 1

# T5 v1.1 XXL encoder (PixArt's text encoder): 4.76e9 parameters, bf16; the prompt and the
# negative prompt, 120 tokens each.
T5_XXL_PARAMS, TEXT_TOKENS, PROMPTS = 4.76e9, 120, 2
# The VAE decoder (AutoencoderKL, Stable Diffusion's config) from a 128 x 128 latent to a
# 1024 x 1024 image, batch 1, counted on the meta device by `count_vae_decoder()`:
# FLOPs, and bytes of every op's outputs (each written once and read once).
VAE_DECODE_FLOPS, VAE_DECODE_OUTPUT_BYTES = 10.470e12, 22.456e9

PUBLISHED = [
    # PipeFusion paper / xDiT README: PixArt-alpha 1024px, 20 steps, 1 warmup step.
    ("a100-pcie", "pcie4", 4, 2.085, 0.866),
    ("l20", "pcie4", 8, 3.34, 1.35),
]


def pixart_alpha_1024_costs(batch: int = PIXART_BATCH) -> tuple[Cost, float, int]:
    """(Cost of one transformer layer for a chunk of N tokens over C tokens of context,
    boundary bytes per token, layers). Text K/V projections are per step, not per token."""
    d, heads, text, mlp = PIXART["hidden"], PIXART["heads"], PIXART["text"], PIXART["mlp"]
    n, c = batch * N, batch * C  # rows of the chunk, and of the context, over the batch
    per_token_matmul = 2 * d * (3 * d + d + d + d + 2 * mlp * d)  # qkv, out, cross q/out, mlp
    text_kv = 2 * batch * text * d * 2 * d
    self_attn = heads * n * C * (4 * d // heads + 5)
    cross_attn = heads * n * text * (4 * d // heads + 5)
    scores = heads * n * (C + text)
    weights = BF16 * d * d * (3 + 1 + 1 + 2 + 1 + 2 * mlp)
    # About twenty token-sized reads/writes per layer (norms, modulation, residuals, gelu),
    # the q/k/v/out traffic of the two attentions, and the K/V of the whole context that
    # every chunk reads (fresh and stale) from the cache.
    activations = BF16 * d * (20 * n + 8 * n + 2 * c)
    flops = per_token_matmul * n + text_kv + self_attn + cross_attn
    rows, text_rows = sympy.sympify(n), sympy.Integer(batch * text)
    gemms = (Gemm(rows, d, d, 6),  # q, k, v, out; cross q, cross out
             Gemm(rows, mlp * d, d), Gemm(rows, d, mlp * d),
             Gemm(text_rows, d, d, 2))  # cross k, v of the text
    layer = Cost(
        flops=sympy.sympify(flops),
        bytes=sympy.sympify(weights + activations),
        matmul_flops=sympy.sympify(per_token_matmul * n + text_kv),
        attention_flops=sympy.sympify(self_attn + cross_attn),
        launches=30,
        gemms=gemms,
        attention_scores=sympy.sympify(scores),
        attention_padded=sympy.sympify(scores * 4 * padded_head(d // heads)),
    )
    return layer, float(BF16 * d * batch), PIXART["layers"]


def pixart_stage_costs(world: int) -> tuple[list[Cost], list[float]]:
    """Layers split as evenly as possible over `world` stages."""
    layer, boundary, layers = pixart_alpha_1024_costs()
    counts = [layers // world + (1 if s < layers % world else 0) for s in range(world)]
    return [layer.times(k) for k in counts], [boundary] * world


def outside_seconds(rates: DeviceRates) -> float:
    """Text encoding and VAE decoding of one 1024 px image: matmul/convolution FLOPs at
    the device's rate plus their memory traffic at its bandwidth."""
    text_flops = 2 * T5_XXL_PARAMS * TEXT_TOKENS * PROMPTS
    text_bytes = BF16 * T5_XXL_PARAMS  # weights read once; activations are small
    flops, nbytes = text_flops + VAE_DECODE_FLOPS, text_bytes + 2 * VAE_DECODE_OUTPUT_BYTES
    return flops / rates.matmul_flops + nbytes / rates.mem_bandwidth


@dataclass(frozen=True)
class Comparison:
    setting: str
    fraction: float  # fitted sustained share of the spec-sheet matmul peak
    outside_s: float
    serial_s: float
    pipelined_s: float
    published_serial_s: float
    published_pipelined_s: float
    bubble: float


def compare(chunks: int = 4) -> list[Comparison]:
    """Each published run: the fitted device, then the predicted pipelined time."""
    rows = []
    for device_name, link_name, world, serial, pipelined in PUBLISHED:
        device = fit_device(DEVICES[device_name], serial)
        sim = simulate_pixart(device, LINKS[link_name], world, chunks)
        rows.append(Comparison(f"{world} x {device_name} over {link_name}, {chunks} chunks",
                               ACHIEVABLE * device.matmul_flops / DEVICES[device_name].matmul_flops,
                               outside_seconds(device.rates()), sim.serial_s, sim.pipelined_s,
                               serial, pipelined, sim.bubble_fraction))
    return rows


def simulate_pixart(device: DeviceModel, link, world: int, chunks: int):
    from tokpipe_compiler.costmodel.simulator import simulate_model

    stages, boundary = pixart_stage_costs(world)
    return simulate_model(stages, boundary, PIXART["tokens"], chunks, STEPS, WARMUP, device,
                          link, world, outside_s=outside_seconds(device.rates()),
                          overlap_sends=False, host=EAGER_LAUNCHES)


def fit_device(device: DeviceModel, published_serial_s: float) -> DeviceModel:
    """`device` with its compute rate scaled so the predicted serial run (transformer and
    the work outside it) takes the published time."""
    from tokpipe_compiler.costmodel.simulator import simulate_model

    stages, boundary = pixart_stage_costs(1)

    def serial(scale: float) -> float:
        scaled = replace(device, matmul_flops=device.matmul_flops * scale)
        return simulate_model(stages, boundary, PIXART["tokens"], 1, STEPS, WARMUP, scaled,
                              LINKS["pcie4"], 1,
                              outside_s=outside_seconds(scaled.rates())).serial_s

    low, high = 0.05, 20.0  # serial time falls as the scale grows: bisect on it
    for _ in range(60):
        mid = (low * high) ** 0.5
        low, high = (mid, high) if serial(mid) > published_serial_s else (low, mid)
    return replace(device, matmul_flops=device.matmul_flops * low)


def report(chunks: int = 4) -> None:
    for row in compare(chunks):
        print(f"{row.setting}: sustained {row.fraction:.0%} of peak (fitted to serial "
              f"{row.published_serial_s} s), outside the transformer {row.outside_s:.3f} s; "
              f"pipelined {row.pipelined_s:.3f} s (published {row.published_pipelined_s}, "
              f"ratio {row.pipelined_s / row.published_pipelined_s:.2f}); speedup "
              f"{row.serial_s / row.pipelined_s:.2f} (published "
              f"{row.published_serial_s / row.published_pipelined_s:.2f}); bubble "
              f"{row.bubble:.1%}")


def count_vae_decoder() -> tuple[float, float]:
    """(FLOPs, bytes of op outputs) of the SD VAE decoder, 128 x 128 latent, bf16, counted
    on the meta device (needs diffusers): where VAE_DECODE_* come from."""
    from diffusers import AutoencoderKL
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"):
        vae = AutoencoderKL(down_block_types=["DownEncoderBlock2D"] * 4,
                            up_block_types=["UpDecoderBlock2D"] * 4,
                            block_out_channels=[128, 256, 512, 512], layers_per_block=2,
                            latent_channels=4).to(torch.bfloat16)
        latent = torch.empty(1, 4, 128, 128, dtype=torch.bfloat16)
    counted = OutputBytes()
    with FlopCounterMode(display=False) as flops, counted, torch.no_grad():
        vae.decode(latent)
    return float(flops.get_total_flops()), float(counted.total)


class OutputBytes(TorchDispatchMode):
    """Counts the bytes of every op's outputs while active."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.total += sum(t.numel() * t.element_size() for t in tree_flatten(out)[0]
                          if isinstance(t, torch.Tensor))
        return out
