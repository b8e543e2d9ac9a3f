"""The `tokpipe` command.

    tokpipe inspect SPEC --stages N --chunks M --mode MODE --out DIR

prints the plan the backend would run for SPEC (a released model by name, a diffusers
class, or a function of yours) and writes its dump (plan.save) to DIR.
With --run K it also runs K denoising calls in this process and prints the
measured-against-predicted time per stage (and writes trace.json, a Chrome trace, to DIR).

    tokpipe generate (--tiny NAME | --released NAME | --model DIR) ...

runs a diffusers pipeline pipelined, on --ranks processes (see tokpipe_compiler.generate).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

import torch

from tokpipe_compiler.cli_models import EXAMPLES, SpecError, load_spec
from tokpipe_compiler.cli_released import (
    TARGET_LINKS,
    ReleasedBuild,
    plan_for_ring,
    planned_for,
    predicted,
    target_run,
)
from tokpipe_compiler.config import COMPILERS, MODES, parse_chunks
from tokpipe_compiler.core.errors import TokpipeError
from tokpipe_compiler.released import NAMES as RELEASED_NAMES
from tokpipe_compiler.run_device import DEVICES
from tokpipe_compiler.runtime.transport import MAX_TIMEOUT

DTYPES = ("float32", "bfloat16", "float16")  # --dtype: names of torch dtypes
MODE_HELP = ("stale (default): PipeFusion, chunks attend to the previous step's K/V; causal: "
             "TeraPipe, for models whose attention is causal; sync: whole steps, exact")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:  # Ctrl-C: the ranks are stopped by then
        print("tokpipe: interrupted", file=sys.stderr)
        return 130
    except (SpecError, TokpipeError, ValueError) as err:
        print(f"tokpipe: error: {err}", file=sys.stderr)
    except SyntaxError as err:
        print(f"tokpipe: error: {err.filename}, line {err.lineno}: {err.msg}", file=sys.stderr)
    except OSError as err:  # a missing --config, an unwritable --out
        print(f"tokpipe: error: {err.strerror or err}: {err.filename or ''}", file=sys.stderr)
    return 2


def _count(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text!r}")
        return value

    return parse


def _folder(text: str) -> Path:
    """An output folder, made now (with its parents) so that a bad one fails before a run
    whose results it would lose."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a file, not a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise argparse.ArgumentTypeError(f"cannot make folder {text!r}: "
                                         f"{err.strerror or err}") from err
    if not os.access(path, os.W_OK):
        raise argparse.ArgumentTypeError(f"folder {text!r} is not writable")
    return path


def _number(text: str) -> float:
    """`text` as a float; NaN where it is none (NaN fails every range check)."""
    try:
        return float(text)
    except ValueError:
        return math.nan


def _finite(text: str) -> float:
    value = _number(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def _seconds(text: str) -> float:
    """A positive, finite number of seconds, at most the longest wait tokpipe allows."""
    value = _number(text)
    if not 0 < value <= MAX_TIMEOUT:  # NaN fails every comparison
        raise argparse.ArgumentTypeError(f"must be seconds in (0, {MAX_TIMEOUT:.0f}], got "
                                         f"{text!r}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokpipe", description="Inspect what the tokpipe compiler makes of a model "
        "(inspect),\nor run a diffusers pipeline pipelined over ranks (generate: "
        "tokpipe generate --help).",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(required=True, metavar="COMMAND")
    inspect = commands.add_parser(
        "inspect", help="print the plan and write its dump", epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    inspect.add_argument("spec", metavar="SPEC",
                         help="released:name (or released:config.json), diffusers:ClassName, "
                              "module:function or file.py:function")
    inspect.add_argument("--config", help="JSON config of a diffusers:ClassName model")
    inspect.add_argument("--layers", type=_count(1), metavar="N",
                         help="released models: N blocks of each kind (default: as released)")
    inspect.add_argument("--grid", type=_count(1), nargs="+", metavar="SIZE",
                         help="released models: the latent grid, H W or F H W (default: as "
                              "released)")
    inspect.add_argument("--dtype", choices=DTYPES, default="float32",
                         help="released models: the weights' dtype (default float32)")
    inspect.add_argument("--for", dest="target", choices=tuple(TARGET_LINKS),
                         help="released models, planned without --run: choose chunks=auto at "
                              "this GPU's rates in --dtype (float32 without tensor cores) for "
                              "a ring of --steps steps and print its predicted times, warning "
                              "where its memory is short")
    inspect.add_argument("--steps", type=_count(1), metavar="N",
                         help="with --for: the denoising steps of the predicted run "
                              "(default: the released pipeline's default, as BENCHMARKS.md's "
                              "table; 20 for another config)")
    inspect.add_argument("--stages", type=_count(1), default=2,
                         help="pipeline stages, one a rank (default %(default)s)")
    inspect.add_argument("--chunks", type=parse_chunks, default=4,
                        help="a count, auto, or token lengths like 1728,960,768,640 "
                             "(default %(default)s)")
    inspect.add_argument("--mode", choices=MODES, default="stale", help=MODE_HELP)
    inspect.add_argument("--warmup-steps", type=_count(0), default=1,
                         help="synchronous calls after each reset (default %(default)s)")
    inspect.add_argument("--compiler", choices=COMPILERS, default="eager",
                         help="for --run (default eager)")
    inspect.add_argument("--cuda-graphs", action="store_true",
                         help="the cuda_graphs option: with --for, plan and predict a chunk's "
                              "host time as a graph's replay, not kernel launches")
    inspect.add_argument("--out", type=_folder,
                         help="folder for the dump, made with its parents (default: none)")
    inspect.add_argument("--run", type=_count(0), default=0, metavar="K",
                         help="run K calls in-process, print each stage's measured time "
                              "against the predicted one (over steady steps: K >= warmup "
                              "steps + 4 gives a figure) and write trace.json to --out")
    inspect.add_argument("--threads", type=_count(1), metavar="N",
                         help="for --run: CPU threads (default: torch's, "
                              f"{torch.get_num_threads()} here); a figure measured on cores "
                              "that other work shares is slow by that work")
    inspect.set_defaults(func=_inspect)
    _add_generate(commands)
    return parser


def _add_generate(commands) -> None:
    from tokpipe_compiler import generate as generate_module
    from tokpipe_compiler.generate import TINY, generate

    gen = commands.add_parser(
        "generate", help="run a diffusers pipeline pipelined and save its images",
        description=(generate_module.__doc__ or "").strip(),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="a local diffusers pipeline folder")
    source.add_argument("--tiny", choices=TINY, help="a small built-in pipeline")
    source.add_argument("--released", metavar="NAME",
                        help="a released model in its pipeline, random weights: "
                             f"{', '.join(RELEASED_NAMES)}")
    gen.add_argument("--layers", type=_count(1), metavar="N",
                     help="--released: N blocks of each kind (default: --stages)")
    gen.add_argument("--grid", type=_count(1), nargs="+", metavar="SIZE",
                     help="--released: the latent grid, H W or F H W (default 16 16, "
                          "2 16 16 for video)")
    gen.add_argument("--prompt", help="the text of a --model pipeline with a text encoder "
                                      "(needed there; --released and --tiny take none)")
    gen.add_argument("--negative-prompt",
                     help="the negative prompt of a --model pipeline that takes one")
    gen.add_argument("--size", type=_count(1), nargs=2, metavar=("HEIGHT", "WIDTH"),
                     help="--model: the image size in pixels (default: the pipeline's)")
    gen.add_argument("--frames", type=_count(1), metavar="N",
                     help="--model, video pipelines: frames per video (default: the "
                          "pipeline's, 81 for Wan)")
    gen.add_argument("--text-length", type=_count(1), metavar="N",
                     help="--model: the prompt's tokens, for pipelines that take "
                          "max_sequence_length (default: the pipeline's, 512 for Wan)")
    gen.add_argument("--class-label", type=int,
                     help="DiT pipelines: the class label drawn (default 1)")
    gen.add_argument("--guidance-scale", type=_finite,
                     help="the pipeline's guidance_scale (default: the pipeline's)")
    gen.add_argument("--true-cfg-scale", type=float, metavar="SCALE",
                     help="pipelines with true_cfg_scale (Flux): guidance over "
                          "--negative-prompt at SCALE, a second transformer call a step "
                          "(their --guidance-scale is the distilled guidance embedding)")
    gen.add_argument("--images", type=_count(1), default=1, metavar="N",
                     help="images (or videos) from the one prompt, batched (default 1)")
    gen.add_argument("--steps", type=_count(1), default=20,
                     help="denoising steps (default %(default)s)")
    gen.add_argument("--seed", type=int, default=0,
                     help="the generation's random seed; --released: its weights' and "
                          "prompt embeddings' too (default %(default)s)")
    gen.add_argument("--stages", type=_count(1), default=2,
                     help="pipeline stages (default %(default)s)")
    gen.add_argument("--chunks", type=parse_chunks, default=4,
                     help="a count, auto, or token lengths like 512,512 (default 4)")
    gen.add_argument("--mode", choices=MODES, default="stale", help=MODE_HELP)
    gen.add_argument("--warmup-steps", type=_count(0), default=1,
                     help="whole steps before the stale ring (default 1)")
    gen.add_argument("--cfg", type=_count(1), default=1,
                     help="2: each guidance branch on its own ranks (default 1)")
    gen.add_argument("--per-call", action="store_true",
                     help="every step a pipelined call (default: the loop as one ring)")
    gen.add_argument("--compiler", choices=COMPILERS, default="inductor",
                     help="how stages are compiled: inductor (default), max-autotune "
                          "(Inductor's autotuning: slower compiles) or eager (none)")
    gen.add_argument("--dtype", choices=DTYPES, default="float32",
                     help="the pipeline's dtype (default %(default)s)")
    gen.add_argument("--device", choices=DEVICES, default="auto",
                     help="where each rank runs (default auto: a GPU a rank where there "
                          "are GPUs, over NCCL; else the CPU, over gloo)")
    gen.add_argument("--cuda-graphs", action="store_true",
                     help="the cuda_graphs option: each chunk replayed from a CUDA graph")
    gen.add_argument("--ranks", type=_count(1), default=1,
                     help="processes to start here (default 1: this one, or torchrun's)")
    gen.add_argument("--threads", type=_count(1), default=1,
                     help="CPU threads per rank (default %(default)s)")
    gen.add_argument("--timeout", type=_seconds, default=3600.0,
                     help="seconds the command's ranks may take (default %(default).0f): "
                          "--ranks ends them after it, and the other ranks wait this long "
                          "for rank 0's --compare run; not the backend's timeout option")
    gen.add_argument("--quiet", action="store_true",
                     help="no progress bars (the pipeline's and the ring's)")
    gen.add_argument("--compare", action="store_true",
                     help="first time the serial pipeline, eager (and with compiled stages "
                          "compiled alike), on rank 0 while the other ranks wait: the "
                          "speedups and the largest difference")
    # const is no string: argparse would pass a string const through `type`
    gen.add_argument("--profile", nargs="?", const=True, metavar="DIR", type=_folder,
                     help="write a torch.profiler trace per rank, profile_rank<R>.json, to "
                          "DIR (default: --out, else the current folder) and print each "
                          "rank's path")
    gen.add_argument("--out", type=_folder,
                     help="folder for the images, made with its parents (default: none)")
    gen.set_defaults(func=generate)


def _inspect(args: argparse.Namespace) -> int:
    from tokpipe_compiler.api import explain, programs

    if args.target is not None and args.mode != "stale":
        raise SpecError(f"--for predicts stale-mode (PipeFusion) runs, not {args.mode}")
    if args.target is not None and args.run:  # checked before a run's weights are made
        raise SpecError(_FOR_META)
    if args.steps is not None and args.target is None:
        raise SpecError("--steps sets the steps of the run --for predicts: give --for too")
    if args.threads is not None and not args.run:
        raise SpecError("--threads sets the CPU threads of --run: give --run too")
    build = ReleasedBuild(args.layers, tuple(args.grid) if args.grid else None,
                          getattr(torch, args.dtype))
    model, call_args, call_kwargs = load_spec(args.spec, args.config, build, bool(args.run))
    options = {"stages": args.stages, "chunks": args.chunks, "mode": args.mode,
               "warmup_steps": args.warmup_steps, "compiler": args.compiler,
               "cuda_graphs": args.cuda_graphs}
    if args.target is not None and not _on_meta(model):
        raise SpecError(_FOR_META)
    run = None if args.target is None else target_run(_config_name(args), args.steps)
    print(f"tokpipe: tracing {args.spec} with Dynamo and planning {args.stages} stage(s)"
          + (" on the meta device (at full depth: a minute or so on a CPU)"
             if _on_meta(model) else "") + " ...", file=sys.stderr, flush=True)
    with planned_for(args.target, args.cuda_graphs, build.dtype):
        plan = explain(model, call_args, call_kwargs, **options) if run is None else \
            plan_for_ring(model, call_args, call_kwargs, options, run.steps - args.warmup_steps)
    print(plan)
    if args.chunks == "auto" and run is None and _on_meta(model):
        print("chunks='auto' chose the chunks at this machine's CPU rates: --for h200 (or "
              "a100-pcie, l20) chooses them for a GPU")
    if run is not None:
        line, warnings = predicted(plan, args.target, run)
        print(line)
        for warning in warnings:
            print(f"tokpipe: warning: {warning}", file=sys.stderr)
    program = None
    if args.run:
        if args.threads is not None:
            torch.set_num_threads(args.threads)
        program = _run(model, call_args, call_kwargs, options, args.run, programs)
        plan = program.plan
    if args.out is not None:
        files = plan.save(args.out, program)
        if program is not None:
            from tokpipe_compiler.inspection.timeline import write_chrome_trace

            files.append(write_chrome_trace(program.timeline, args.out / "trace.json"))
        print(f"\nwrote {len(files)} files to {args.out}/: "
              + ", ".join(f.name for f in files))
    elif program is not None:
        print("\n(--out DIR also writes the run's timeline, trace.json, and the plan's files)")
    return 0


_FOR_META = "--for plans a released model on the meta device: give a released:name spec, " \
    "without --run"


def _config_name(args: argparse.Namespace) -> str:
    """The released config a --for spec names: released:NAME, or diffusers:Class --config
    FILE in the released format."""
    return args.config if args.config is not None else args.spec.partition(":")[2]


def _on_meta(model: torch.nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def _run(model, call_args, call_kwargs, options, calls: int, programs):
    from tokpipe_compiler.api import backend
    from tokpipe_compiler.inspection.timeline import compare, format_comparison

    compiled = torch.compile(model, backend=backend(**options), dynamic=False)
    with torch.no_grad():
        for _ in range(calls):
            compiled(*call_args, **call_kwargs)
    program = programs(compiled)[0]
    on_cpu = all(p.device.type == "cpu" for p in model.parameters())
    threads = f" on {torch.get_num_threads()} CPU thread(s)" if on_cpu else ""
    print(f"\nmeasured against predicted, {calls} call(s){threads}:")
    print(format_comparison(compare(program.plan, program.timeline),
                            program.plan.config.compiler))
    return program


if __name__ == "__main__":
    sys.exit(main())
