"""Predict pipelined time on hardware we may not have, from stage costs and spec sheets.

python -m tokpipe_compiler.costmodel.simulator --pixart   # predicted vs published PipeFusion runs
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

import sympy

from tokpipe_compiler.costmodel import pipeline_time
from tokpipe_compiler.costmodel.calibrate import load_or_measure, seconds
from tokpipe_compiler.costmodel.cost import C, Cost, N
from tokpipe_compiler.costmodel.hardware import DEVICES, LINKS, DeviceModel, LinkModel


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
    over all `tokens` (fresh and stale K/V). Warmup steps run stage after stage; the rest
    run as one ring (`pipeline_time`)."""
    if len(stage_costs) != world or len(boundary_bytes_per_token) != world:
        raise ValueError(f"need one stage cost and one boundary size per rank ({world})")
    rates = device.rates()
    serial = steps * seconds(sum(stage_costs, Cost(0, 0)), rates, tokens, tokens)
    n = max(tokens // chunks, 1)
    per_stage = [seconds(cost, rates, n, tokens) for cost in stage_costs]
    links = [link.seconds(b * n) if world > 1 else 0.0 for b in boundary_bytes_per_token]
    sync = sum(seconds(cost, rates, tokens, tokens) for cost in stage_costs) + sum(
        link.seconds(b * tokens) for b in boundary_bytes_per_token[:-1]
    )
    pipelined_steps = max(steps - warmup_steps, 0)
    span = pipeline_time.seconds([[t] * chunks for t in per_stage], pipelined_steps, ring=True,
                                 send=[[t] * chunks for t in links])
    total = min(steps, warmup_steps) * sync + span
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
