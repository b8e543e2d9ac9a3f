"""Predict pipelined time on hardware we may not have, from stage costs and spec sheets.

python -m tokpipe_compiler.costmodel.simulator --pixart   # predicted vs published PipeFusion runs
"""

from __future__ import annotations

import argparse
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from tokpipe_compiler.core.fx import example_value, is_parameter
from tokpipe_compiler.costmodel import pipeline_time
from tokpipe_compiler.costmodel.calibrate import load_or_measure, seconds
from tokpipe_compiler.costmodel.cost import Cost
from tokpipe_compiler.costmodel.hardware import DEVICES, LINKS, DeviceModel, LinkModel
from tokpipe_compiler.costmodel.host import NO_HOST, HostModel


def cpu_device(threads: int | None = None) -> DeviceModel:
    """The local CPU as a DeviceModel, from the calibration cache (measured if missing), in
    float32, the dtype it is calibrated in."""
    rates = load_or_measure("cpu", threads)
    return DeviceModel("cpu", rates.matmul_flops, rates.mem_bandwidth, rates.matmul_half,
                       dtype=torch.float32)


def plan_dtype(plan: Any) -> torch.dtype:
    """The dtype of most of `plan`'s weight bytes (float32 when it has no floating ones):
    what its matrix products compute in."""
    weights: Counter[torch.dtype] = Counter()
    for node in plan.graphs.prelude.graph.nodes:
        value = example_value(node)
        if is_parameter(node) and isinstance(value, torch.Tensor) \
                and value.is_floating_point():
            weights[value.dtype] += value.numel() * value.element_size()
    return weights.most_common(1)[0][0] if weights else torch.float32


@dataclass(frozen=True)
class SimResult:
    """serial_s: one device, `steps` full-sequence steps. pipelined_s: `world` devices.
    per_stage_s: seconds of a chunk on each stage (the mean of a step's chunks, where they
    differ: joint attention's first chunk also computes the text). bubble_fraction: idle
    share of the devices over the pipelined (post-warmup) part."""

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
    *,
    outside_s: float = 0.0,
    overlap_sends: bool = True,
    host: HostModel = NO_HOST,
) -> SimResult:
    """Predict a PipeFusion (stale) run: stage s holds stage_costs[s] on its own device and
    sends boundary_bytes_per_token[s] per token to the next stage (the last stage's entry
    is what goes back to stage 0 around the ring). Chunks of tokens/chunks tokens attend
    over all `tokens` (fresh and stale K/V). Warmup steps run stage after stage; the rest
    run as one ring (`pipeline_time`).

    outside_s: serial work outside the transformer (text encoder, VAE), in both runs.
    overlap_sends=False: a stage is busy while it sends (sends on the compute stream).
    host: the host's time per launch and stage-chunk call (costmodel/host.py); a chunk
    takes at least its host time. A ring's set-up is paid once, and left out.
    """
    if not 1 <= chunks <= tokens:
        raise ValueError(f"chunks={chunks}: need 1 <= chunks <= tokens ({tokens}), so that "
                         "every chunk holds a token")
    n = tokens // chunks
    return simulate_chunks(stage_costs, boundary_bytes_per_token, tokens,
                           [(n, tokens, 1.0)] * chunks,
                           steps, warmup_steps, device, link, world, outside_s=outside_s,
                           overlap_sends=overlap_sends, host=host)


def simulate_chunks(
    stage_costs: list[Cost],
    boundary_bytes_per_token: list[float],
    tokens: int,
    chunks: list[tuple[int, int, float]],
    steps: int,
    warmup_steps: int,
    device: DeviceModel,
    link: LinkModel,
    world: int,
    *,
    outside_s: float = 0.0,
    overlap_sends: bool = True,
    host: HostModel = NO_HOST,
    text_bytes: list[float] | None = None,
) -> SimResult:
    """`simulate_model` with any chunk table: `chunks` holds each chunk's (tokens, context
    tokens, share of the text segments it computes), e.g. TeraPipe's uneven causal chunks,
    each attending over those before it, or a step whose first chunk alone computes joint
    attention's text. text_bytes[s]: what stage s sends of the text rows, scaled by a
    chunk's share (the first chunk's send carries the text)."""
    if len(stage_costs) != world or len(boundary_bytes_per_token) != world:
        raise ValueError(f"need one stage cost and one boundary size per rank ({world})")
    _check_steps(steps, warmup_steps)
    if not chunks:
        raise ValueError("need at least one chunk")
    rates = device.rates()

    text_bytes = text_bytes or [0.0] * world

    def stage_seconds(cost: Cost, n: int, c: int, text: float = 1.0) -> float:
        return host.chunk_seconds(seconds(cost, rates, n, c, text), cost.launches_at(text))

    serial = steps * stage_seconds(sum(stage_costs, Cost(0, 0)), tokens, tokens) + outside_s
    compute = [[stage_seconds(cost, *chunk) for chunk in chunks] for cost in stage_costs]
    links = [[link.seconds(b * n + t * share) if world > 1 else 0.0 for n, _, share in chunks]
             for b, t in zip(boundary_bytes_per_token, text_bytes, strict=True)]
    if not overlap_sends:  # the sender waits for its send: it is part of its stage time
        compute = [[t + send for t, send in zip(ts, ss, strict=True)]
                   for ts, ss in zip(compute, links, strict=True)]
        links = [[0.0] * len(chunks) for _ in range(world)]
    sync = sum(stage_seconds(cost, tokens, tokens) for cost in stage_costs)
    sync += sum(link.seconds(b * tokens + t)
                for b, t in zip(boundary_bytes_per_token[:-1], text_bytes, strict=False))
    pipelined_steps = max(steps - warmup_steps, 0)
    span = pipeline_time.seconds(compute, pipelined_steps, ring=True, send=links)
    total = min(steps, warmup_steps) * sync + span + outside_s
    busy = pipelined_steps * sum(sum(ts) for ts in compute)
    bubble = 1 - busy / (world * span) if span > 0 else 0.0
    per_chunk = [sum(ts) / len(ts) for ts in compute]
    return SimResult(serial, total, serial / total, per_chunk, bubble)


def _check_steps(steps: int, warmup_steps: int) -> None:
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps={steps!r}: need a whole number of denoising steps >= 1")
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) \
            or warmup_steps < 0:
        raise ValueError(f"warmup_steps={warmup_steps!r}: need a whole number >= 0")


def simulate(plan: Any, device: str | DeviceModel = "h200", link: str | LinkModel = "nvlink4",
             world: int | None = None, steps: int = 20) -> SimResult:
    """Predicted serial and pipelined time of `steps` steps of `plan` (from explain()) on
    `world` devices (default and only choice: one per stage) joined by `link`. `device`
    names a preset of DEVICES ("cpu": this machine's calibrated rates) or is a
    DeviceModel; `link` names a preset of LINKS or is a LinkModel.

    Counted: each stage's kernels per chunk at `device`'s rates in the plan's dtype (its
    weights'; float32 at the non-tensor FP32 rate, PyTorch's default), the plan's warmup
    steps stage after stage, the stale ring after them, and each chunk's boundary values
    over `link`, overlapping compute. Left out: the host's time (kernel launches, the
    runtime's bookkeeping per chunk and per call), the work outside the transformer (text
    encoders, VAE) and memory. So it predicts less time than `tokpipe inspect --for`, which
    adds the runtime's host time per chunk (costmodel/host.py) and puts sends on the
    compute stream (costmodel/predict.py): for PixArt-alpha on 4 x h200 in 4 chunks,
    0.24 s against 0.32 s in bfloat16, where the host bounds the chunks, and 2.28 s for
    both in float32, where the kernels are slow enough to hide it."""
    device = _preset(device, DEVICES, "device")
    link = _preset(link, LINKS, "link")
    _check_steps(steps, plan.config.warmup_steps)
    stages = len(plan.stages)
    if world is not None and (isinstance(world, bool) or not isinstance(world, int)
                              or world < 1):
        raise ValueError(f"world={world!r}: need a whole number of devices >= 1, one a "
                         f"stage (the plan has {stages}), or None")
    if world is not None and world != stages:
        raise ValueError(f"world={world} but the plan has {stages} stages; explain() with "
                         f"stages={world}")
    device = (cpu_device() if device is None else device).for_dtype(plan_dtype(plan))
    per_token = plan.tokens / plan.units
    sends = [s.send_bytes_per_unit / per_token for s in plan.stages]
    chunks = [(plan.chunk_tokens(c), plan.context_tokens(c), float(c.segments))
              for c in plan.chunks]
    return simulate_chunks([s.cost for s in plan.stages], sends, plan.tokens, chunks, steps,
                           plan.config.warmup_steps, device, link, stages,
                           text_bytes=[s.send_text_bytes for s in plan.stages])


def _preset(value: Any, presets: dict[str, Any], what: str) -> Any:
    """The preset `value` names in `presets` (a model passes through)."""
    if not isinstance(value, str):
        return value
    if value not in presets:
        raise ValueError(f"unknown {what} {value!r}: use one of {', '.join(presets)}, or "
                         f"pass a {'DeviceModel' if what == 'device' else 'LinkModel'} "
                         "(costmodel/hardware.py)")
    return presets[value]


def _chunk_count(text: str) -> int:
    """--chunks: a count of PixArt's chunks, 1 to its tokens."""
    from tokpipe_compiler.costmodel.published import PIXART

    tokens = PIXART["tokens"]
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= tokens:
        raise argparse.ArgumentTypeError(f"must be a whole number from 1 to {tokens} "
                                         f"(PixArt's tokens), got {text!r}")
    return value


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pixart", action="store_true", help="PixArt-alpha vs published")
    parser.add_argument("--chunks", type=_chunk_count, default=4,
                        help="chunks a step is cut into (default 4, as published)")
    args = parser.parse_args(argv)
    if not args.pixart:
        parser.error("nothing to predict: pass --pixart (the published PixArt-alpha runs)")
    from tokpipe_compiler.costmodel.published import report

    report(args.chunks)


if __name__ == "__main__":
    main()
