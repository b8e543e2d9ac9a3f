"""Every released transformer predicted on 2, 4 and 8 H200s over NVLink, stale and causal.

    python benchmarks/predict_h200.py                    # every config: a markdown table
    python benchmarks/predict_h200.py flux1-dev --stages 2 4

Each released config (tokpipe_compiler/released/configs/, the shared config folder's files) is built
at full size and depth on the meta device in bf16, traced once at its released input shape
(batch 2 where the pipeline runs classifier-free guidance) and planned once per stage count
(stale mode, chunks="auto" chosen at the H200's rates for the ring); causal mode reuses
that plan's stages (costmodel/predict.py). Each is planned and predicted for each --host
(costmodel/host.py): "launches", tokpipe's runtime launching each kernel from Python as
measured on one H200 machine; "graphs", the same with the cuda_graphs option; "none", a
host that always keeps ahead. Times are per image or video at the pipeline's
default step count, the text encoders and the VAE decode included
(costmodel/released_runs.py). Progress goes to stderr, the table to stdout.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._args import one_of, parser_for, positive_int  # noqa: E402
from tokpipe_compiler import released  # noqa: E402
from tokpipe_compiler.core.errors import TokpipeError  # noqa: E402
from tokpipe_compiler.costmodel.hardware import LINKS, DeviceModel  # noqa: E402
from tokpipe_compiler.costmodel.host import (  # noqa: E402
    NO_HOST,
    TOKPIPE_H200,
    TOKPIPE_H200_GRAPHS,
    HostModel,
)
from tokpipe_compiler.costmodel.predict import (  # noqa: E402
    Prediction,
    fitted_share,
    plan_for,
    predict,
    target_device,
)
from tokpipe_compiler.costmodel.released_runs import RUNS, outside_seconds  # noqa: E402
from tokpipe_compiler.planning.capture import capture  # noqa: E402

MODES = ("stale", "causal")
HOSTS = {"launches": TOKPIPE_H200, "graphs": TOKPIPE_H200_GRAPHS, "none": NO_HOST}
HEADER = ("| model | GPUs | mode | host | chunks (tokens) | serial s | pipelined s | speedup | "
          "imbalance | memory/GPU GiB: total (weights + K/V + boundary) |\n"
          "|---|---:|---|---|---|---:|---:|---:|---:|---|")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def trace(name: str, batch: int) -> torch.fx.GraphModule:
    """Dynamo's graph of the whole released model, bf16 on meta, at its released inputs;
    cast as its weights load (`released.cast`: Wan keeps some modules in float32), as
    `tokpipe inspect --for` casts it."""
    model = released.cast(released.build(name, layers=None, device="meta"), torch.bfloat16)
    inputs = {k: v.to(torch.bfloat16) if isinstance(v, torch.Tensor) and v.is_floating_point()
              else v for k, v in released.inputs(name, batch=batch, device="meta").items()}
    (graph,) = capture(model, (), inputs, fresh=True)
    return graph.gm


def gib(n: float) -> str:
    return f"{n / 2**30:.1f}"


def chunks_text(tokens: list[int]) -> str:
    """'4 x 1024' (even), '512 + 3 x 1195 (last 1194)' (a lighter first chunk, which also
    computes the text), '12: 384..256' (TeraPipe's, longer first)."""
    def even(ts: list[int]) -> bool:
        return len(set(ts[:-1])) <= 1 and ts[-1] <= ts[0]

    def shown(ts: list[int]) -> str:
        last = "" if ts[-1] == ts[0] else f" (last {ts[-1]})"
        return f"{len(ts)} x {ts[0]}{last}"

    if even(tokens):
        return shown(tokens)
    if len(tokens) > 1 and even(tokens[1:]) and tokens[0] < tokens[1]:
        return f"{tokens[0]} + {shown(tokens[1:])}"
    return f"{len(tokens)}: {tokens[0]}..{tokens[-1]}"


def row(name: str, p: Prediction, device: DeviceModel, host: str) -> str:
    m = p.peak_memory
    over = " (!)" if device.memory and m.total > device.memory else ""
    return (f"| {name} | {p.stages} | {p.mode} | {host} | {chunks_text(p.chunks)} | "
            f"{p.serial_s:.2f} | "
            f"{p.pipelined_s:.2f} | {p.speedup:.2f}x | {p.imbalance:.2f} | "
            f"{gib(m.total)} ({gib(m.weights)} + {gib(m.kv)} + {gib(m.boundary)}){over} |")


def model_rows(name: str, stages: list[int], device: DeviceModel,
               hosts: dict[str, HostModel]) -> list[str]:
    """The table rows of one config (one row per failure)."""
    run = RUNS[name]
    outside = outside_seconds(run, device.rates())
    start = time.perf_counter()
    try:
        gm = trace(name, run.batch)
    except TokpipeError as err:
        return [f"| {name} | - | - | - | trace failed: {_first_line(err)} | | | | | |"]
    log(f"{name}: traced in {time.perf_counter() - start:.0f} s (batch {run.batch}, "
        f"{run.steps} steps, outside the transformer {outside:.3f} s)")
    rows = []
    for count, (label, host) in itertools.product(stages, hosts.items()):
        start = time.perf_counter()
        try:
            plan = plan_for(gm, count, device, ring_steps=run.steps - 1, host=host)
        except TokpipeError as err:
            rows.append(f"| {name} | {count} | - | {label} | plan failed: {_first_line(err)} "
                        f"| | | | | |")
            log(f"  {count} stages ({label}): plan failed")
            continue
        for mode in MODES:
            p = predict(plan, mode, device, LINKS["nvlink4"], run.steps, outside, host=host)
            rows.append(row(name, p, device, label))
            log(f"  {count} stages {mode} ({label}): {len(p.chunks)} chunks, {p.serial_s:.2f} "
                f"s -> {p.pipelined_s:.2f} s ({p.speedup:.2f}x)")
        log(f"  {count} stages ({label}) planned and predicted in "
            f"{time.perf_counter() - start:.0f} s")
    return rows


def _first_line(err: Exception) -> str:
    return str(err).strip().splitlines()[0].replace("|", "/")[:100]


def arguments() -> argparse.ArgumentParser:
    parser = parser_for(__doc__)
    parser.add_argument("names", nargs="*", type=one_of(released.NAMES, "released config"),
                        metavar="NAME",
                        help=f"configs (default: all): {', '.join(released.NAMES)}")
    parser.add_argument("--stages", type=positive_int, nargs="+", default=[2, 4, 8],
                        help="GPU counts, one stage each")
    parser.add_argument("--host", nargs="+", choices=list(HOSTS), default=["launches", "graphs"],
                        help="the host's time per call each prediction assumes")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = arguments().parse_args(argv)
    device = target_device("h200")
    log(f"h200: {device.matmul_flops / 1e12:.0f} TFLOP/s in full waves of GEMM tiles over "
        f"{device.sms} SMs, attention {device.rates().attention_flops / 1e12:.0f} TFLOP/s "
        f"({device.measured or f'the A100 fit: {fitted_share():.0%} of peak'})")
    start = time.perf_counter()
    print(HEADER, flush=True)
    for name in args.names or released.NAMES:  # each model's rows as soon as they are known
        hosts = {label: HOSTS[label] for label in args.host}
        print("\n".join(model_rows(name, args.stages, device, hosts)), flush=True)
    log(f"done in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
