"""A plan's run predicted on hardware this machine does not have: serial and pipelined
seconds, stage imbalance and memory per GPU, in stale mode and for a causal variant.

    device = target_device("h200")
    plan = plan_for(gm, stages=4, device=device, ring_steps=19)   # chunks="auto" at its rates
    stale = predict(plan, "stale", device, LINKS["nvlink4"], steps=20, outside_s=0.04)
    causal = predict(plan, "causal", device, LINKS["nvlink4"], steps=20, outside_s=0.04)

The causal variant is the same model with causal self-attention (`is_causal=True`), which
mode="causal" runs exactly with TeraPipe's uneven chunks; a bidirectional model is refused
by that mode, so its costs come from the stale plan's stages with every self-attention
counted causally (the cost pass's rule for is_causal).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cache

import sympy
import torch
import torch.fx

from tokpipe_compiler.config import Config
from tokpipe_compiler.costmodel.calibrate import assume_rates, time_fn
from tokpipe_compiler.costmodel.chunk_choice import choose_causal
from tokpipe_compiler.costmodel.cost import TILE, C, Cost, N
from tokpipe_compiler.costmodel.hardware import ACHIEVABLE, DEVICES, DeviceModel, LinkModel
from tokpipe_compiler.costmodel.host import EAGER_LAUNCHES, NO_HOST, HostModel, assume_host
from tokpipe_compiler.costmodel.published import PUBLISHED, fit_device
from tokpipe_compiler.costmodel.simulator import simulate_chunks
from tokpipe_compiler.planning.driver import build_plan
from tokpipe_compiler.planning.plan import Plan

# A device without a published run of its own borrows the sustained share fitted for this
# one: the A100 is the other HBM data-centre part with a published PipeFusion run, and its
# fit (52%) is what large bf16 GEMMs and FlashAttention-2 reach on Ampere/Hopper SXM parts;
# the L20's fit (89%) is above what its GEMMs sustain, so only the L20 uses it
# (BENCHMARKS.md).
CALIBRATED_LIKE = "a100-pcie"


@cache
def fitted_share(name: str = CALIBRATED_LIKE) -> float:
    """The sustained share of the spec-sheet matmul peak fitted to `name`'s published run."""
    serial = next(run[3] for run in PUBLISHED if run[0] == name)
    preset = DEVICES[name]
    return ACHIEVABLE * fit_device(preset, serial).matmul_flops / preset.matmul_flops


def target_device(name: str = "h200", like: str = CALIBRATED_LIKE,
                  dtype: torch.dtype = torch.bfloat16) -> DeviceModel:
    """`name`'s preset computing in `dtype`: as measured on the device where it was, else
    at the share of its peak fitted to its own published run (the A100's, the L20's), else
    at `like`'s (`DeviceModel.for_dtype`: float32 at the non-tensor FP32 peak)."""
    preset = DEVICES[name]
    if not preset.measured:
        share = fitted_share(name if any(run[0] == name for run in PUBLISHED) else like)
        preset = replace(preset, matmul_flops=preset.matmul_flops / ACHIEVABLE * share)
    return preset.for_dtype(dtype)


def plan_for(gm: torch.fx.GraphModule, stages: int, device: DeviceModel,
             ring_steps: int | None, token_input: str = "hidden_states",
             host: HostModel = NO_HOST) -> Plan:
    """The stale plan of `gm` (traced on "meta") with chunks="auto" chosen at `device`'s
    rates and `host`'s time per call for a ring of `ring_steps` steps."""
    config = Config(stages=stages, chunks="auto", mode="stale", compiler="eager",
                    token_input=token_input)
    with assume_rates("meta", device.rates()), assume_host(host):
        return build_plan(gm, config, ring_steps=ring_steps)


@dataclass(frozen=True)
class Memory:
    """Bytes one rank holds: its weights, its K/V caches and the boundary values it keeps
    (what it received and sent, for the two steps the runtime keeps)."""

    weights: int
    kv: int
    boundary: int

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.boundary


@dataclass(frozen=True)
class Prediction:
    mode: str
    stages: int
    chunks: list[int]  # tokens per chunk
    serial_s: float
    pipelined_s: float
    imbalance: float  # the busiest stage's seconds per step over the mean
    bubble: float
    memory: list[Memory]

    @property
    def speedup(self) -> float:
        return self.serial_s / self.pipelined_s

    @property
    def peak_memory(self) -> Memory:
        return max(self.memory, key=lambda m: m.total)


def causal_cost(cost: Cost) -> Cost:
    """`cost` with its self-attention causal: a chunk of N tokens reads C - N/2 keys per
    query, plus half a tile on its diagonal block (context enters only attention FLOPs)."""
    keys = C - N / 2 + sympy.Min(N, TILE) / 2

    def sub(expr: sympy.Expr) -> sympy.Expr:
        return sympy.sympify(expr).subs(C, keys)

    return replace(cost, flops=sub(cost.flops), attention_flops=sub(cost.attention_flops),
                   attention_scores=sub(cost.attention_scores),
                   attention_padded=sub(cost.attention_padded))


def chunk_table(plan: Plan, mode: str, device: DeviceModel, host: HostModel = NO_HOST
                ) -> list[tuple[int, int, float]]:
    """(tokens, context tokens, share of the text segments) of each chunk: the plan's own
    (stale), or TeraPipe's slicing at `device`'s rates and `host`'s time per call over the
    causal costs, as chunks="auto" chooses in causal mode (every chunk with the whole
    text)."""
    if mode == "stale":
        return [(plan.chunk_tokens(c), plan.tokens, float(c.segments)) for c in plan.chunks]
    times = [host.bound(time_fn(cost, device.rates()), cost.launches_at)
             for cost in (causal_cost(s.cost) for s in plan.stages)]
    table = choose_causal(plan.units, plan.tokens, times)
    return [(c.units * plan.tokens // plan.units, c.stop * plan.tokens // plan.units, 1.0)
            for c in table]


def memory(plan: Plan) -> list[Memory]:
    """Per stage's rank: weights and K/V as the plan predicts them, and the boundary values
    of two steps (received from the stage before, sent to the next)."""
    sends = [s.send_bytes_per_unit * plan.units + s.send_text_bytes for s in plan.stages]
    return [Memory(s.param_bytes, s.kv_cache_bytes,
                   2 * (sends[i] + (sends[i - 1] if i else 0)))
            for i, s in enumerate(plan.stages)]


def predict(plan: Plan, mode: str, device: DeviceModel, link: LinkModel, steps: int,
            outside_s: float = 0.0, warmup_steps: int = 1,
            host: HostModel = EAGER_LAUNCHES) -> Prediction:
    """Serial and pipelined seconds of `steps` steps of `plan` on one `device` per stage,
    as the calibrated simulator runs PipeFusion: sends on the compute stream, and each
    chunk at least its `host` time (by default 5 us a launch, as eager PyTorch; tokpipe's
    runtime: costmodel/host.py). Stale mode runs `warmup_steps` steps stage after stage;
    causal mode needs none."""
    costs = [s.cost if mode == "stale" else causal_cost(s.cost) for s in plan.stages]
    table = chunk_table(plan, mode, device, host)
    per_token = plan.tokens / plan.units
    sends = [s.send_bytes_per_unit / per_token for s in plan.stages]
    warmup = warmup_steps if mode == "stale" else 0
    sim = simulate_chunks(costs, sends, plan.tokens, table, steps, warmup, device, link,
                          len(costs), outside_s=outside_s, overlap_sends=False, host=host,
                          text_bytes=[s.send_text_bytes for s in plan.stages])
    step = _step_seconds(costs, table, device, host)
    imbalance = max(step) * len(step) / sum(step)
    return Prediction(mode, len(costs), [n for n, _, _ in table], sim.serial_s, sim.pipelined_s,
                      imbalance, sim.bubble_fraction, memory(plan))


def _step_seconds(costs: list[Cost], table: list[tuple[int, int, float]],
                  device: DeviceModel, host: HostModel) -> list[float]:
    """Each stage's seconds over one step's chunks, each chunk at least its host time."""
    rates = device.rates()
    out = []
    for cost in costs:
        fn = time_fn(cost, rates)
        out.append(sum(host.chunk_seconds(fn(*chunk), cost.launches_at(chunk[2]))
                       for chunk in table))
    return out


def one_device_step(plan: Plan, device: DeviceModel, host: HostModel = EAGER_LAUNCHES
                    ) -> tuple[float, float]:
    """(whole pass, chunked step): seconds of one step of stale `plan` with every stage on
    one `device` in turn, unchunked (one call of the whole model, as serial Inductor runs
    it) and in the plan's chunks with `host`'s time per stage-chunk call and its set-up a
    call (one step a call, as the in-process pipeline runs it). Their ratio is what
    chunking costs; running both on one GPU measures it (benchmarks/gpu_pipeline.py)."""
    costs = [s.cost for s in plan.stages]
    whole = _step_seconds([sum(costs, Cost(0, 0))], [(plan.tokens, plan.tokens, 1.0)],
                          device, replace(host, per_call_s=0.0))
    chunked = _step_seconds(costs, chunk_table(plan, "stale", device), device, host)
    return sum(whole), host.per_model_call_s + sum(chunked)
