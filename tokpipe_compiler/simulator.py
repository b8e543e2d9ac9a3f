"""Predict pipelined time on hardware we may not have, from stage costs and spec sheets.

python -m tokpipe_compiler.simulator --pixart   # predicted vs published PipeFusion runs
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

import sympy

from tokpipe_compiler.calibrate import DeviceRates, load_or_measure, seconds
from tokpipe_compiler.passes.cost import C, Cost, N
from tokpipe_compiler.passes.slicing import pipeline_time

# Presets run dense bf16/fp16 matmuls at ACHIEVABLE of the spec-sheet peak: large DiT
# matmuls and FlashAttention-2 reach 50-70% of peak on these parts; chunked layers less.
ACHIEVABLE = 0.5


@dataclass(frozen=True)
class DeviceModel:
    """One accelerator: sustained matmul FLOP/s, memory B/s, and the matmul size (rows)
    at which a skinny matmul reaches half its rate."""

    name: str
    matmul_flops: float
    mem_bandwidth: float
    matmul_half: float = 64.0

    def rates(self) -> DeviceRates:
        # Launch cost is left out: GPU launches are asynchronous and hide behind
        # kernels of a few hundred tokens or more.
        return DeviceRates(
            matmul_flops=self.matmul_flops,
            mem_bandwidth=self.mem_bandwidth,
            attention_flops=self.matmul_flops,
            per_op_overhead=0.0,
            matmul_half=self.matmul_half,
        )


@dataclass(frozen=True)
class LinkModel:
    """A point-to-point link between neighbouring stages (one direction)."""

    name: str
    bandwidth: float
    latency: float

    def seconds(self, nbytes: float) -> float:
        return self.latency + nbytes / self.bandwidth


TERA, GIGA = 1e12, 1e9
DEVICES: dict[str, DeviceModel | None] = {
    # H200 SXM: 989 TFLOP/s dense BF16, 4.8 TB/s HBM3e (NVIDIA H200 product brief).
    "h200": DeviceModel("h200", ACHIEVABLE * 989 * TERA, 0.8 * 4800 * GIGA),
    # A100 PCIe 80GB: 312 TFLOP/s dense BF16, 1935 GB/s HBM2e (NVIDIA A100 datasheet).
    "a100-pcie": DeviceModel("a100-pcie", ACHIEVABLE * 312 * TERA, 0.8 * 1935 * GIGA),
    # L20: 119.5 TFLOP/s dense FP16/BF16 tensor, 864 GB/s GDDR6 (NVIDIA L20 datasheet).
    "l20": DeviceModel("l20", ACHIEVABLE * 119.5 * TERA, 0.8 * 864 * GIGA),
    # The local CPU has no spec sheet: see cpu_device(), which measures it.
    "cpu": None,
}
LINKS: dict[str, LinkModel] = {
    # NVLink 4 (H100/H200 SXM): 900 GB/s total, 450 GB/s each way; ~80% reached by NCCL.
    "nvlink4": LinkModel("nvlink4", 0.8 * 450 * GIGA, 5e-6),
    # PCIe 4.0 x16: 31.5 GB/s each way; ~25 GB/s reached with peer-to-peer copies.
    "pcie4": LinkModel("pcie4", 25 * GIGA, 10e-6),
    # PCIe 4.0 without peer-to-peer (staged through host memory): about half the rate.
    "pcie4-no-p2p": LinkModel("pcie4-no-p2p", 12 * GIGA, 25e-6),
}


def cpu_device(threads: int | None = None) -> DeviceModel:
    """The local CPU as a DeviceModel, from the calibration cache (measured if missing)."""
    rates = load_or_measure("cpu", threads)
    return DeviceModel("cpu", rates.matmul_flops, rates.mem_bandwidth, rates.matmul_half)


@dataclass(frozen=True)
class SimResult:
    """serial_s: one device, `steps` full-sequence steps. pipelined_s: `world` devices.
    per_stage_s: seconds of one chunk on each stage. bubble_fraction: idle share of the
    devices over the pipelined (post-warmup) part."""

    serial_s: float
    pipelined_s: float
    speedup: float
    per_stage_s: list[float]
    bubble_fraction: float


def simulate_model(
    stage_costs: list[Cost],
    boundary_bytes_per_token: list[float],
    tokens: int,
    chunks: int,
    steps: int,
    warmup_steps: int,
    device: DeviceModel,
    link: LinkModel,
    world: int,
) -> SimResult:
    """Predict a PipeFusion (stale) run: stage s holds stage_costs[s] on its own device and
    sends boundary_bytes_per_token[s] per token to the next stage (the last stage's entry
    is what goes back to stage 0 around the ring). Chunks of tokens/chunks tokens attend
    over all `tokens` (fresh and stale K/V)."""
    if len(stage_costs) != world or len(boundary_bytes_per_token) != world:
        raise ValueError(f"need one stage cost and one boundary size per rank ({world})")
    rates = device.rates()
    serial = steps * seconds(sum(stage_costs, Cost(0, 0)), rates, tokens, tokens)
    n = max(tokens // chunks, 1)
    per_stage = [seconds(cost, rates, n, tokens) for cost in stage_costs]
    chunk_link = max(link.seconds(b * n) for b in boundary_bytes_per_token) if world > 1 else 0
    sync = sum(seconds(cost, rates, tokens, tokens) for cost in stage_costs) + sum(
        link.seconds(b * tokens) for b in boundary_bytes_per_token[:-1]
    )
    total = pipeline_time(per_stage, chunks, steps, warmup_steps, sync, chunk_link)
    pipelined_steps = max(steps - warmup_steps, 0)
    span = total - min(steps, warmup_steps) * sync
    busy = pipelined_steps * chunks * sum(per_stage)
    bubble = 1 - busy / (world * span) if span > 0 else 0.0
    return SimResult(serial, total, serial / total, per_stage, bubble)


def simulate(plan: Any, device: str | DeviceModel = "h200", link: str | LinkModel = "nvlink4",
             world: int | None = None, steps: int = 20) -> SimResult:
    """Predicted serial and pipelined time of `steps` steps of `plan` (from explain()) on
    `world` devices (default: one per stage) joined by `link`; names pick the presets in
    DEVICES and LINKS."""
    device = DEVICES[device] if isinstance(device, str) else device
    link = LINKS[link] if isinstance(link, str) else link
    if device is None:
        device = cpu_device()
    world = world or len(plan.stages)
    if world != len(plan.stages):
        raise ValueError(f"world={world} but the plan has {len(plan.stages)} stages; "
                         f"explain() with stages={world}")
    per_token = plan.tokens / plan.units
    sends = [s.send_bytes_per_unit / per_token for s in plan.stages]
    return simulate_model([s.cost for s in plan.stages], sends, plan.tokens, len(plan.chunks),
                          steps, plan.config.warmup_steps, device, link, world)


# ---- PixArt-alpha 1024px, to check the simulator against published PipeFusion numbers ----

PIXART = {"layers": 28, "hidden": 1152, "heads": 16, "tokens": 4096, "text": 120, "mlp": 4}
# Classifier-free guidance runs the conditional and unconditional batch together.
PIXART_BATCH = 2
BF16 = 2


def pixart_alpha_1024_costs(batch: int = PIXART_BATCH) -> tuple[Cost, float, int]:
    """(Cost of one transformer layer for a chunk of N tokens over C tokens of context,
    boundary bytes per token, layers). Text K/V projections are per step, not per token."""
    d, heads, text, mlp = PIXART["hidden"], PIXART["heads"], PIXART["text"], PIXART["mlp"]
    n, c = batch * N, batch * C  # rows of the chunk, and of the context, over the batch
    per_token_matmul = 2 * d * (3 * d + d + d + d + 2 * mlp * d)  # qkv, out, cross q/out, mlp
    text_kv = 2 * batch * text * d * 2 * d
    self_attn = heads * n * C * (4 * d // heads + 5)
    cross_attn = heads * n * text * (4 * d // heads + 5)
    weights = BF16 * d * d * (3 + 1 + 1 + 2 + 1 + 2 * mlp)
    # About twenty token-sized reads/writes per layer (norms, modulation, residuals, gelu),
    # plus q/k/v/out traffic of the two attentions.
    activations = BF16 * d * (20 * n + 8 * n + 2 * c)
    flops = per_token_matmul * n + text_kv + self_attn + cross_attn
    layer = Cost(
        flops=sympy.sympify(flops),
        bytes=sympy.sympify(weights + activations),
        matmul_flops=sympy.sympify(per_token_matmul * n + text_kv),
        attention_flops=sympy.sympify(self_attn + cross_attn),
        launches=30,
    )
    return layer, float(BF16 * d * batch), PIXART["layers"]


PUBLISHED = [
    # PipeFusion paper / xDiT README: PixArt-alpha 1024px, 20 steps, 1 warmup step.
    ("a100-pcie", "pcie4", 4, 2.085, 0.866),
    ("l20", "pcie4", 8, 3.34, 1.35),
]


def pixart_stage_costs(world: int) -> tuple[list[Cost], list[float]]:
    """Layers split as evenly as possible over `world` stages."""
    layer, boundary, layers = pixart_alpha_1024_costs()
    counts = [layers // world + (1 if s < layers % world else 0) for s in range(world)]
    return [_times(layer, k) for k in counts], [boundary] * world


def _times(cost: Cost, k: int) -> Cost:
    return Cost(k * cost.flops, k * cost.bytes, k * cost.matmul_flops,
                k * cost.attention_flops, k * cost.launches)  # fmt: skip


def pixart_comparison(chunks: int = 4) -> list[tuple[str, SimResult, float, float]]:
    """(setting, prediction, published serial s, published pipelined s) per published run."""
    rows = []
    for device, link, world, serial, pipelined in PUBLISHED:
        stages, boundary = pixart_stage_costs(world)
        sim = simulate_model(stages, boundary, PIXART["tokens"], chunks, 20, 1,
                             DEVICES[device], LINKS[link], world)  # fmt: skip
        rows.append((f"{world} x {device} over {link}, {chunks} chunks", sim, serial, pipelined))
    return rows


def _report_pixart(chunks: int) -> None:
    for setting, sim, serial, pipelined in pixart_comparison(chunks):
        print(
            f"{setting}: serial {sim.serial_s:.3f} s (published {serial}, "
            f"ratio {sim.serial_s / serial:.2f}); pipelined {sim.pipelined_s:.3f} s "
            f"(published {pipelined}, ratio {sim.pipelined_s / pipelined:.2f}); "
            f"speedup {sim.speedup:.2f} (published {serial / pipelined:.2f}); "
            f"bubble {sim.bubble_fraction:.1%}"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pixart", action="store_true", help="PixArt-alpha vs published")
    parser.add_argument("--chunks", type=int, default=4)
    args = parser.parse_args(argv)
    if args.pixart:
        _report_pixart(args.chunks)
    else:
        parser.print_help()


if __name__ == "__main__":
    main()
