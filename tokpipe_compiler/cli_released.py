"""Released models on the command line: `released:NAME` specs, and diffusers specs whose
--config is in the released format (class, config, inputs), built at their released widths
and called with the inputs their pipeline passes.

Planned only, a model is built on the meta device: full size and depth cost no memory
(FLUX.1-dev's 12B parameters plan in seconds). Run (`--run`), it gets random weights on
the CPU, so a full-size model that would not fit is refused with the way out (--layers).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tokpipe_compiler import released
from tokpipe_compiler.core.errors import TokpipeError
from tokpipe_compiler.costmodel.released_runs import RUNS, Run

# The link a target device's ranks are joined by: NVLink on SXM parts, PCIe on the others.
TARGET_LINKS = {"h200": "nvlink4", "a100-pcie": "pcie4", "l20": "pcie4"}
TARGET_STEPS = 20  # steps of a predicted run of a config without a released pipeline
# A run may take at most this share of the memory available now for the model's weights
# (activations, K/V caches and the eager reference need the rest).
RUN_MEMORY_SHARE = 0.4


@dataclass(frozen=True)
class ReleasedBuild:
    """How to build a released model: `layers` blocks per depth field (None: as released),
    the latent `grid`, (H, W) or (F, H, W) (None: as released), and the weights' `dtype`
    (released models run in bfloat16; diffusers builds float32)."""

    layers: int | None = None
    grid: tuple[int, ...] | None = None
    dtype: torch.dtype = torch.float32


def is_released_file(path: str) -> bool:
    """Whether the JSON file at `path` is in the released format."""
    try:
        return released.is_released_format(json.loads(Path(path).read_text()))
    except (OSError, ValueError):
        return False  # the diffusers loader reports an unreadable file


def check_same_class(class_name: str, path: str) -> None:
    """Raises unless the released config at `path` is of `class_name`."""
    found = released.load(path)["class"]
    if found != class_name:
        raise TokpipeError(f"--config {path} is a {found} config, not {class_name}: name "
                           f"diffusers:{found}, or use released:{path}")


def load_released(name: str, build: ReleasedBuild,
                  run: bool) -> tuple[torch.nn.Module, tuple, dict]:
    """(model, args, kwargs) of a released model: on the meta device to plan, on the CPU
    with random weights to run."""
    spec = released.load(name)
    pipeline = run_of(name)
    batch = pipeline.batch if pipeline is not None else 2
    device = "cpu" if run else "meta"
    if run:
        check_memory(name, build, way_out="or plan without --run (the meta device holds no "
                     "weights)")
    model = released.build(name, build.layers, device, build.grid)
    model = released.cast(model, build.dtype)
    kwargs = {key: value.to(build.dtype) if _floating(value) else value
              for key, value in released.inputs(name, batch=batch, grid=build.grid,
                                                device=device).items()}
    grid = build.grid or released.full_grid(name)
    depth = "released depth" if build.layers is None else f"{build.layers} block(s) per kind"
    print(f"{name}: {spec['class']} at its released widths, {depth}, latent grid "
          f"{' x '.join(map(str, grid))}, batch {batch}"
          f"{' (guidance)' if batch == 2 else ''}, {str(build.dtype).removeprefix('torch.')}"
          f" on {device}", file=sys.stderr)
    return model, (), kwargs


def run_of(name: str) -> Run | None:
    """How the released pipeline of config `name` runs (a file named as a bundled config
    runs as that model's pipeline does); None for another config."""
    return RUNS.get(Path(name).stem if name.endswith(".json") else name)


def _floating(value: object) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point()


def check_memory(name: str, build: ReleasedBuild, copies: int = 1, way_out: str = "",
                 on_gpu: bool = False) -> None:
    """Raises, naming --layers, unless `copies` of the model's weights (one a process) fit
    in this machine's available memory with room to run; `on_gpu`: one copy on each GPU as
    well (its whole memory: asking for the free memory would start a context on every GPU)."""
    model = released.build(name, build.layers, "meta", build.grid)
    one = sum(p.numel() for p in model.parameters()) * build.dtype.itemsize
    if on_gpu:
        gpu = min(torch.cuda.get_device_properties(i).total_memory
                  for i in range(torch.cuda.device_count()))
        _check_fits(f"{name} {_depth(build)}", one, f"a GPU has {gpu / 2**30:.1f} GiB",
                    gpu, way_out)
    held = f" {_depth(build)}, in {copies} processes," if copies > 1 else f" {_depth(build)}"
    available = available_memory()
    _check_fits(name + held, one * copies, f"{available / 2**30:.1f} GiB is available",
                available, way_out)


def _depth(build: ReleasedBuild) -> str:
    return ("at its released depth" if build.layers is None
            else f"with {build.layers} block(s) of each kind")


def _check_fits(what: str, size: int, room: str, available: int, way_out: str) -> None:
    if size > RUN_MEMORY_SHARE * available:
        raise TokpipeError(
            f"{what} holds {size / 2**30:.1f} GiB of weights; {room}: pass --layers (e.g. "
            f"--layers 2) to run fewer blocks{', ' + way_out if way_out else ''}")


def available_memory() -> int:
    """Bytes of memory available to a new allocation now (Linux's MemAvailable; free
    pages elsewhere)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@contextmanager
def planned_for(target: str | None, cuda_graphs: bool = False,
                dtype: torch.dtype = torch.bfloat16) -> Iterator[None]:
    """Planning on the meta device as for `target` (a preset of costmodel.hardware)
    computing in `dtype`: chunks="auto" chooses at its rates and the runtime's host time per
    call on a GPU (launching kernels, or replaying graphs); without a target, at this CPU's
    rates."""
    if target is None:
        yield
        return
    from tokpipe_compiler.costmodel.calibrate import assume_rates
    from tokpipe_compiler.costmodel.host import assume_host, runtime_host
    from tokpipe_compiler.costmodel.predict import target_device

    with assume_rates("meta", target_device(target, dtype=dtype).rates()), \
            assume_host(runtime_host("cuda", cuda_graphs)):
        yield


@dataclass(frozen=True)
class TargetRun:
    """The run a --for prediction is of: `steps` denoising steps (`why`: where the count
    comes from), and `run`, the released pipeline's, whose text encoders and VAE decode
    are counted too (None: a config without one, the transformer alone)."""

    steps: int
    why: str
    run: Run | None


def target_run(name: str, steps: int | None) -> TargetRun:
    """The run to predict for config `name`: its pipeline's default step count, as
    BENCHMARKS.md's table has it, unless `steps` (--steps) is given."""
    run = run_of(name)
    if steps is not None:
        return TargetRun(steps, "--steps", run)
    if run is not None:
        return TargetRun(run.steps, "the pipeline's default; --steps sets another", run)
    return TargetRun(TARGET_STEPS, "no released pipeline to take a default from; --steps "
                     "sets another", None)


def plan_for_ring(model: torch.nn.Module, args: tuple, kwargs: dict, options: dict,
                  ring_steps: int) -> Any:
    """The plan of a released model (one graph) with chunks="auto" chosen for a ring of
    `ring_steps` steps, as its pipeline runs it and BENCHMARKS.md's table plans it."""
    from tokpipe_compiler.api import capture_graphs
    from tokpipe_compiler.config import Config
    from tokpipe_compiler.planning.driver import build_plan

    graphs = capture_graphs(model, args, kwargs)
    if len(graphs) != 1:
        raise TokpipeError(f"--for predicts a model Dynamo traces as one graph; this one has "
                           f"{len(graphs)} (graph breaks): plan it without --for")
    return build_plan(graphs[0], Config.from_options(options), ring_steps=max(ring_steps, 1))


def predicted(plan: Any, target: str, run: TargetRun) -> tuple[str, list[str]]:
    """One line: serial and pipelined seconds of `run` of stale `plan` on one `target` per
    stage in the plan's dtype, as the calibrated simulator predicts the released runs
    (BENCHMARKS.md), and the busiest GPU's memory; and warnings (the busiest GPU's memory
    over the target's)."""
    from tokpipe_compiler.costmodel.hardware import LINKS
    from tokpipe_compiler.costmodel.host import runtime_host
    from tokpipe_compiler.costmodel.predict import predict, target_device
    from tokpipe_compiler.costmodel.released_runs import encoder_bytes, outside_seconds
    from tokpipe_compiler.costmodel.simulator import plan_dtype

    link, graphs = TARGET_LINKS[target], plan.config.cuda_graphs
    dtype = plan_dtype(plan)
    device = target_device(target, dtype=dtype)
    outside = 0.0 if run.run is None else outside_seconds(run.run, device.rates())
    result = predict(plan, "stale", device, LINKS[link], run.steps, outside,
                     warmup_steps=plan.config.warmup_steps, host=runtime_host("cuda", graphs))
    host = "chunks replayed from CUDA graphs" if graphs else "kernels launched one by one"
    name = str(dtype).removeprefix("torch.")
    if dtype == torch.float32:  # say why it is slow: the default --dtype is float32
        name += (f" (no tensor cores, as PyTorch runs it by default: "
                 f"{device.peak(dtype) / 1e12:.1f} TFLOP/s peak against "
                 f"{device.peak(torch.bfloat16) / 1e12:.0f} in bfloat16)")
    peak = result.peak_memory.total
    encoders = 0.0 if run.run is None else encoder_bytes(run.run, dtype.itemsize)
    extra = "" if run.run is None else \
        f", plus {outside:.3f} s of text encoders and VAE decode"
    held = "" if not encoders else f", and {encoders / 2**30:.1f} GiB of text encoders"
    line = (f"predicted on {len(plan.stages)} x {target} ({link}, {host}), {run.steps} steps "
            f"({run.why}) of the transformer in {name}{extra}: serial {result.serial_s:.2f} "
            f"s, pipelined {result.pipelined_s:.2f} s ({result.speedup:.2f}x, the GPUs idle "
            f"{result.bubble:.0%} of the ring's chunked steps, by the device model: each "
            f"chunk's own rate, sends and launches, where the plan's bubble counts FLOPs); "
            f"the busiest GPU holds "
            f"{peak / 2**30:.1f} GiB (weights, K/V, boundary values){held}")
    if result.speedup < 1:
        line += (f"; slower than one GPU: this model's chunks are too short for "
                 f"{len(plan.stages)} {target}s (fewer stages"
                 + (")" if graphs else ", or --cuda-graphs)"))
    warning = over_memory(peak, encoders, device, len(plan.stages), dtype)
    return line, [warning] if warning else []


# Of a GPU's memory, the share a plan may fill with weights, K/V, boundary values and the
# text encoders: the rest holds activations, the VAE decode and the CUDA context.
FILLED = 0.85


def over_memory(peak: float, encoders: float, device: Any, stages: int,
                dtype: torch.dtype) -> str:
    """The warning for a busiest GPU that would hold `peak` bytes of the transformer and
    `encoders` bytes of text encoders, more than FILLED of `device`'s memory, with the ways
    out ("" where it fits)."""
    held, room = peak + encoders, FILLED * device.memory if device.memory else 0.0
    if not room or held <= room:
        return ""
    ways = []
    if room > encoders:  # the transformer's bytes spread evenly over more stages
        more = -(-int(peak * stages) // int(room - encoders))
        ways.append(f"plan more stages (--stages {max(more, stages + 1)} or more)")
    if dtype.itemsize > 2:
        ways.append("halve the bytes with --dtype bfloat16")
    if encoders:
        ways.append("encode the prompts beforehand and pass prompt_embeds, so the text "
                    "encoders need not stay on the GPU")
    what = f"{peak / 2**30:.1f} GiB" + (
        f" of the transformer and {encoders / 2**30:.1f} GiB of text encoders (every rank "
        "encodes the prompt)" if encoders else "")
    verdict = ("this plan does not fit" if held > device.memory else
               f"less than {1 - FILLED:.0%} of it is left for activations, the VAE decode "
               "and the CUDA context")
    return (f"the busiest GPU would hold {what}, against the {device.memory / 2**30:.1f} GiB "
            f"({device.memory / 1e9:.0f} GB) of one {device.name}: {verdict}; "
            f"{', '.join(ways[:-1])}{' or ' if len(ways) > 1 else ''}{ways[-1]}")
