"""Memory of a call whose transformer unpacks its weights in its forward (diffusers' GGUF
linears dequantize theirs): serial against parallelized.

    pip install gguf
    python benchmarks/unpacked_weights.py [--model sd3-medium] [--layers 4] [--steps 3]

A released-width transformer (`--layers` blocks, a 16x16 grid) inside its diffusers
pipeline, with guidance, its random weights written to a GGUF file (Q8_0: int8 blocks of
32 with a scale each, the 2-d weights whose rows the blocks tile) and loaded back with
diffusers' GGUFQuantizationConfig, as a user loads a released GGUF. One thread, each row
in a process of its own (a row run after others would reuse their freed heap): the
pipeline serial, then parallelized (2 stages x 2 chunks, eager stages) as a ring in sync
and stale mode and per call in stale mode. Each row: the resident set before a call
(after a first call, `gc.collect()` and `malloc_trim`), its peak during the call (the
kernel's high-water mark, exact), and what the per-call prelude computes and hands to the
stages, held for the whole call (exact): a pipeline that unpacked every weight ahead of
its stages holds all of them there, against the float weights the model unpacks. The
allocator's free lists make the peak vary by some 100 MB from run to run.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.fixtures, benchmarks._args

import tokpipe_compiler as tp
from benchmarks._args import parser_for, positive_int
from tests.fixtures.pipelines import generate
from tokpipe_compiler.released import NAMES
from tokpipe_compiler.released.pipelines import pipeline

RUNS = {"serial": None, "sync ring": ("sync", True), "stale ring": ("stale", True),
        "stale per call": ("stale", False)}


def status_mb(field: str) -> float:
    """A /proc/self/status field (VmRSS, VmHWM) in MB."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024 / 1e6
    raise KeyError(field)


def call_peak(pipe, kwargs: dict, steps: int) -> tuple[float, float]:
    """(resident MB before a call, MB more at its peak)."""
    generate(pipe, kwargs, steps=steps)  # traces, plans
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # the high-water mark starts again from the resident set
    base = status_mb("VmRSS")
    generate(pipe, kwargs, steps=steps)
    return base, status_mb("VmHWM") - base


def prelude_held_mb(pipe) -> float:
    """MB of the values the parallelized pipeline's prelude computes for its stages."""
    from tokpipe_compiler.core.fx import example_value

    held = 0
    for program in tp.pipelines.programs(pipe):
        output = program.plan.graphs.prelude.graph.output_node()
        for node in output.all_input_nodes:
            value = example_value(node)
            if node.op != "placeholder" and isinstance(value, torch.Tensor):
                held += value.numel() * value.element_size()
    return held / 1e6


def gguf_pipeline(name: str, layers: int, folder: Path):
    """The released pipeline with its transformer written to a Q8_0 GGUF file in `folder`
    and loaded back from it; the float32 bytes of the weights it holds quantized."""
    import gguf
    from diffusers import GGUFQuantizationConfig

    pipe, kwargs = pipeline(name, layers=layers, grid=(16, 16))
    transformer = pipe.transformer
    transformer.save_config(folder / "transformer")
    writer = gguf.GGUFWriter(str(folder / "model.gguf"), arch="tokpipe")
    block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_0][0]
    unpacked = 0
    for key, value in transformer.state_dict().items():
        array = value.detach().float().numpy()
        if array.ndim == 2 and array.shape[-1] % block == 0 and key.endswith(".weight"):
            writer.add_tensor(key, gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            unpacked += 4 * array.size
        else:
            writer.add_tensor(key, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    pipe.transformer = type(transformer).from_single_file(
        str(folder / "model.gguf"), config=str(folder), subfolder="transformer",
        local_files_only=True, torch_dtype=torch.float32,
        quantization_config=GGUFQuantizationConfig(compute_dtype=torch.float32))
    return pipe, kwargs, unpacked


def arguments() -> argparse.ArgumentParser:
    parser = parser_for(__doc__)
    parser.add_argument("--model", default="sd3-medium", choices=NAMES,
                        help="the released transformer")
    parser.add_argument("--layers", type=positive_int, default=4, help="its blocks")
    parser.add_argument("--steps", type=positive_int, default=3, help="steps a generation")
    parser.add_argument("--row", choices=RUNS, help="run this row alone and print it as JSON "
                        "(what the script does for each row in a process of its own)")
    return parser


def measure_row(args: argparse.Namespace) -> dict:
    """One row, in this process."""
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        pipe, kwargs, unpacked = gguf_pipeline(args.model, args.layers, Path(folder))
        how = RUNS[args.row]
        if how is not None:
            mode, ring = how
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a few blocks over 2 stages are unbalanced
                tp.pipelines.parallelize(pipe, stages=2, chunks=2, mode=mode, ring=ring,
                                         compiler="eager")
        base, extra = call_peak(pipe, kwargs, args.steps)
        prelude = None if how is None else prelude_held_mb(pipe)
    return {"base": base, "extra": extra, "prelude": prelude, "unpacked": unpacked}


def main() -> None:
    args = arguments().parse_args()
    if args.row is not None:
        print(json.dumps(measure_row(args)))
        return
    print(f"{args.model}, {args.layers} blocks, 16x16 grid, {args.steps} steps, guidance")
    print(f"{'run':>16} {'resident MB':>12} {'peak +MB':>9} {'prelude MB':>11}")
    unpacked = 0
    for label in RUNS:
        command = [sys.executable, __file__, "--model", args.model, "--layers",
                   str(args.layers), "--steps", str(args.steps), "--row", label]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"the {label!r} row failed:\n{done.stderr}")
        row = json.loads(done.stdout.strip().splitlines()[-1])
        unpacked = row["unpacked"]
        prelude = "-" if row["prelude"] is None else f"{row['prelude']:.0f}"
        print(f"{label:>16} {row['base']:>12.0f} {row['extra']:>9.0f} {prelude:>11}",
              flush=True)
    print(f"float32 weights the model unpacks: {unpacked / 1e6:.0f} MB")


if __name__ == "__main__":
    main()
