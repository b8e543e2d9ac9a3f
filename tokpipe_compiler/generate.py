"""`tokpipe generate`: run a diffusers pipeline with its transformer pipelined, save images.

    tokpipe generate --model PATH --prompt "a cat" --stages 2 --ranks 2 --out out/
    tokpipe generate --tiny dit --steps 4 --ranks 2 --compare
    tokpipe generate --released flux1-dev --layers 1 --steps 4 --ranks 2 --compare

--model takes a local pipeline folder (DiffusionPipeline.from_pretrained; nothing is
downloaded); --tiny builds a small pipeline with seeded random weights; --released NAME
puts a released transformer (released widths, random weights, --layers blocks, a small
--grid) into its family's pipeline, guided, with random prompt embeddings at the released
text length and no VAE: it makes latents, to time and compare, not images to save.
--ranks N runs N processes on this machine (under torchrun, leave it out: each process is
one rank). Each rank runs on a GPU of its own where there are GPUs (over NCCL), else on the
CPU (over gloo); --device chooses.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path
from typing import Any

import torch

from tokpipe_compiler.core.errors import TokpipeError
from tokpipe_compiler.generate_call import call_kwargs, check_class_label_args, class_label
from tokpipe_compiler.generate_ranks import (
    command_group,
    gathered,
    one_line_warnings,
    print_on,
)
from tokpipe_compiler.generate_serial import compare_lines, serial_runs
from tokpipe_compiler.released import cast as cast_model
from tokpipe_compiler.released import load as load_released_spec
from tokpipe_compiler.released.pipelines import pipeline, small_grid
from tokpipe_compiler.run_device import clock, rank_device, resolve_device, to_device

TINY = ("dit",)


def tiny_dit_pipeline() -> Any:
    """A DiTPipeline of small seeded random components: the same weights in every process."""
    import diffusers

    torch.manual_seed(0)
    vae = diffusers.AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(32, 32),
        latent_channels=4, norm_num_groups=8, sample_size=64).eval()
    transformer = diffusers.DiTTransformer2DModel(
        num_attention_heads=4, attention_head_dim=32, in_channels=4, out_channels=8,
        num_layers=4, sample_size=32, patch_size=2, num_embeds_ada_norm=1000,
        norm_type="ada_norm_zero").eval()
    return diffusers.DiTPipeline(transformer=transformer, vae=vae,
                                 scheduler=diffusers.DDIMScheduler(clip_sample=False),
                                 id2label={i: str(i) for i in range(10)})


def check_args(args: argparse.Namespace) -> None:
    """Raises on options that do not go with the pipeline's source, before any is built;
    resolves --device."""
    launched = [f"{v}={os.environ[v]}" for v in ("WORLD_SIZE", "RANK") if v in os.environ]
    if args.ranks > 1 and launched:  # each launched process would start --ranks more
        raise TokpipeError(f"--ranks {args.ranks} starts processes here, but a launcher "
                           f"(torchrun) started this one as a rank ({', '.join(launched)}): "
                           "leave out --ranks under torchrun, each process it starts is one "
                           "rank (--nproc-per-node sets how many)")
    args.device = resolve_device(args.device, args.ranks, args.cuda_graphs)
    needed = args.cfg * args.stages
    if args.ranks > 1 and args.ranks != needed:
        other = "" if needed == 1 else " (or --ranks 1: every stage in this process)"
        raise TokpipeError(f"--ranks {args.ranks} starts {args.ranks} processes, but --stages "
                           f"{args.stages} x --cfg {args.cfg} runs on {needed}: pass --ranks "
                           f"{needed}{other}")
    # (a pipeline guided by --true-cfg-scale takes --guidance-scale for a distilled embedding)
    if args.cfg == 2 and args.true_cfg_scale is None and args.guidance_scale is not None \
            and args.guidance_scale <= 1.0:
        raise TokpipeError(f"--cfg 2 runs the two guidance branches apart, but --guidance-scale "
                           f"{args.guidance_scale:g} runs one (no classifier-free guidance): "
                           "pass --cfg 1, or a --guidance-scale above 1")
    _check_options(args)
    if args.released is None:
        for given, flag in ((args.layers, "--layers"), (args.grid, "--grid")):
            if given is not None:
                raise TokpipeError(f"{flag} sizes a --released pipeline; --model and --tiny "
                                   "pipelines come as they are")
        if args.tiny == "dit":
            check_class_label_args(args)
        return
    spec = load_released_spec(args.released)  # an unknown name fails here, naming them
    classes = spec["inputs"].get("class_labels")
    if classes:
        class_label(args, classes)
    elif args.class_label is not None:
        raise TokpipeError(f"{args.released} draws what its prompt embeddings say, not a "
                           "class label; leave out --class-label")
    for given, flag in ((args.prompt, "--prompt"), (args.negative_prompt, "--negative-prompt")):
        if given is not None and classes:
            raise TokpipeError(f"{args.released} draws a class label (--class-label); leave "
                               f"out {flag}")
        if given is not None:
            raise TokpipeError("--released pipelines have no text encoder: their prompts are "
                               "random embeddings at the released text length; leave out "
                               f"{flag}")
    for given, flag in ((args.size, "--size"), (args.frames, "--frames")):
        if given is not None:
            raise TokpipeError("--released pipelines are sized by --grid (in latent units, "
                               f"frames first for video); leave out {flag}")
    if args.text_length is not None:
        raise TokpipeError("--released pipelines' prompts are random embeddings at the "
                           "released text length; leave out --text-length")
    if args.out is not None:
        raise TokpipeError("--released pipelines have no VAE: they make latents, not "
                           "images; leave out --out (--compare times and compares them)")
    from tokpipe_compiler.cli_released import ReleasedBuild, check_memory

    # every rank holds the whole pipeline: --ranks copies here (under torchrun, one)
    build = ReleasedBuild(released_layers(args), args.grid and tuple(args.grid), _dtype(args))
    check_memory(args.released, build, copies=args.ranks, on_gpu=args.device == "cuda")


def load_pipeline(args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    """The pipeline and the keyword arguments of its call."""
    if args.released is not None:
        pipe, kwargs = pipeline(args.released, layers=released_layers(args), grid=args.grid,
                                seed=args.seed, dtype=_dtype(args))
        if args.guidance_scale is not None:
            kwargs["guidance_scale"] = args.guidance_scale
        if "class_labels" in kwargs:  # DiT
            classes = load_released_spec(args.released)["inputs"]["class_labels"]
            kwargs["class_labels"] = [class_label(args, classes)] * args.images
        else:  # the prompt's rows repeated, as a text encoder repeats them per image
            kwargs = {name: value.repeat(args.images, *(1,) * (value.dim() - 1))
                      if "prompt" in name and isinstance(value, torch.Tensor) else value
                      for name, value in kwargs.items()}
        return pipe, {**kwargs, "num_inference_steps": args.steps}
    pipe = _load_weights(args)
    return pipe, call_kwargs(pipe, args)


def released_layers(args: argparse.Namespace) -> int:
    """--layers, by default a block a stage."""
    return args.stages if args.layers is None else args.layers


def _load_weights(args: argparse.Namespace) -> Any:
    if args.tiny:
        pipe = tiny_dit_pipeline()
        for component in pipe.components.values():
            if isinstance(component, torch.nn.Module):  # in place, quietly: released.cast
                cast_model(component, _dtype(args))
        return pipe
    import diffusers

    path = Path(args.model)
    if not (path / "model_index.json").is_file():
        raise TokpipeError(f"--model {path}: no model_index.json there; pass a local "
                           "diffusers pipeline folder (save_pretrained writes one)")
    from tokpipe_compiler.pipelines.loading import from_pretrained

    return from_pretrained(diffusers.DiffusionPipeline, path, _dtype(args))


def _dtype(args: argparse.Namespace) -> torch.dtype:
    return getattr(torch, args.dtype)


def run(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    """One rank's part: an optional serial generation (rank 0's), then the pipelined one.
    Rank 0's result carries every rank's memory table and profile path."""
    with one_line_warnings(rank, world), command_group(world, args) as group:
        result = _run(rank, args, group)
        if group is not None:
            result.update(gathered(result, group))
        return result


def parallelize_options(args: argparse.Namespace) -> dict[str, Any]:
    return dict(stages=args.stages, chunks=args.chunks, mode=args.mode,
                warmup_steps=args.warmup_steps, compiler=args.compiler, cfg=args.cfg,
                ring=not args.per_call, cuda_graphs=args.cuda_graphs)


def _check_options(args: argparse.Namespace) -> None:
    """parallelize's own checks of the options, before any rank starts or --compare's
    serial run spends its time, in the command line's words."""
    from tokpipe_compiler.pipelines.parallel_pipeline import checked_options

    try:
        checked_options(**parallelize_options(args))
    except TokpipeError as err:
        said = re.sub(r"\b(warmup_steps|stages|cfg|chunks|mode)(=| >= )",
                      lambda m: f"--{m[1].replace('_', '-')}{' ' if m[2] == '=' else m[2]}",
                      str(err).replace("ring=False", "--per-call"))
        raise TokpipeError(said) from None


def _run(rank: int, args: argparse.Namespace, group: Any) -> dict[str, Any]:
    from tokpipe_compiler.pipelines.parallel_pipeline import parallelize

    options = parallelize_options(args)
    torch.set_num_threads(args.threads)
    pipe, kwargs = load_pipeline(args)
    if args.quiet:  # the ring's own bar follows the pipeline's configuration
        pipe.set_progress_bar_config(disable=True)
    kwargs = to_device(pipe, kwargs, rank_device(args.device))
    say = print_on(rank)
    if args.released is not None:
        say(_describe_released(args, pipe, kwargs))
    # Short calls first, to trace and compile; two steps, since PixArt-alpha's pipeline
    # takes a one-step call for its one-step (DMD) scheduler's.
    short = {**kwargs, "num_inference_steps": min(2, args.steps)}
    serial = None
    if args.compare:
        also = "" if args.compiler == "eager" else f", then compiled by {args.compiler}"
        say(f"serial: a {short['num_inference_steps']}-step call, then the timed one (eager"
            f"{also}{'; on rank 0 while the other ranks wait' if group is not None else ''})")
        serial = serial_runs(pipe, kwargs, short, args, rank, group,
                             lambda p, k: _timed(p, k, args.seed))
    say(f"pipelined: a first call traces, plans and compiles the stages ({args.compiler}), "
        "then the timed one")
    parallelize(pipe, **options)
    # A ring with chunks="auto" chooses its chunks for the generation's length: a shorter
    # warmup would make (and compile) a program the timed call does not use.
    by_length = args.chunks == "auto" and not args.per_call
    _timed(pipe, kwargs if by_length else short, args.seed)
    result: dict[str, Any] = {}
    if args.profile is not None:
        result["traces"] = [_profiled(pipe, kwargs, args, rank)]
    made = len(_programs(pipe))
    result["pipelined_s"], images = _timed(pipe, kwargs, args.seed)
    result["made"] = len(images)
    after = _programs(pipe)
    result["made_while_timed"] = len(after) - made
    result["chunks"] = sorted({len(p.plan.chunks) for p in after})
    result["memory"] = _memory(after, rank)
    if serial is not None:
        result["difference"] = _relative(images, serial.pop("serial_images"))
        result.update(serial)
    if rank == 0 and args.out is not None:
        result["files"] = save(images, Path(args.out))
    return result


def _describe_released(args: argparse.Namespace, pipe: Any, kwargs: dict[str, Any]) -> str:
    """One line: what --released built."""
    text = kwargs.get("prompt_embeds")
    grid = " x ".join(map(str, args.grid or small_grid(args.released)))
    return (f"{args.released} in {type(pipe).__name__}: {type(pipe.transformer).__name__} at its "
            f"released widths, {released_layers(args)} block(s) of each kind, latent grid "
            f"{grid}{f', {text.shape[1]} text tokens' if text is not None else ''}, guidance "
            f"{kwargs['guidance_scale']}, {args.dtype} on {args.device}, random weights")


def _programs(pipe: Any) -> list:
    """The pipelined programs behind `pipe`: none where CFG parallelism runs each guidance
    branch whole on its own rank (--cfg 2 --stages 1)."""
    from tokpipe_compiler.pipelines.marks import programs

    try:
        return programs(pipe)
    except TokpipeError:
        return []


def _memory(made: list, rank: int) -> str:
    from tokpipe_compiler.inspection.memory import format_memory, memory_report

    if not made:
        return f"rank {rank}: no pipelined program (each guidance branch runs whole)"
    return "\n".join(format_memory(memory_report(p)) for p in made)


def _timed(pipe: Any, kwargs: dict, seed: int) -> tuple[float, list]:
    start = clock()
    out = pipe(**kwargs, generator=torch.Generator().manual_seed(seed))
    return clock() - start, list(out.images if hasattr(out, "images") else out.frames)


def _profiled(pipe: Any, kwargs: dict, args: argparse.Namespace, rank: int) -> str:
    from torch.profiler import ProfilerActivity, profile

    path = profile_folder(args) / f"profile_rank{rank}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        _timed(pipe, kwargs, args.seed)
    prof.export_chrome_trace(str(path))
    return str(path)


def profile_folder(args: argparse.Namespace) -> Path:
    """Where --profile writes: its DIR, else --out, else the current folder."""
    given = args.profile if isinstance(args.profile, Path) else None  # True: no DIR
    return Path(given or args.out or ".")


def _relative(a: list, b: list) -> float:
    """The largest difference of a from b over b's largest magnitude (images: arrays;
    latents: tensors)."""
    x = torch.stack([torch.as_tensor(item).float() for item in a])
    y = torch.stack([torch.as_tensor(item).float() for item in b])
    return float((x - y).abs().max() / y.abs().max().clamp_min(1e-12))


def save(images: list, out: Path) -> list[str]:
    """Each image (or video frame) as out/image_{i}.png."""
    from PIL import Image

    out.mkdir(parents=True, exist_ok=True)
    files = []
    for i, image in enumerate(images):
        frames = image if image.ndim == 4 else image[None]
        for f, frame in enumerate(frames):
            name = out / (f"image_{i}.png" if len(frames) == 1 else f"video_{i}_frame_{f}.png")
            Image.fromarray((frame * 255).round().clip(0, 255).astype("uint8")).save(name)
            files.append(str(name))
    return files


def generate(args: argparse.Namespace) -> int:
    """The command: in this process (one rank, or torchrun's), or on --ranks processes."""
    check_args(args)
    if args.ranks > 1:
        from tokpipe_compiler.runtime.launch import launch

        results = launch(run, args.ranks, args=(args,), timeout=args.timeout,
                         device=args.device)
        report(results[0], args)  # rank 0's result holds every rank's tables and traces
        return 0
    rank = int(os.environ.get("RANK", "0"))
    result = run(rank, int(os.environ.get("WORLD_SIZE", "1")), args)
    if rank == 0:  # under torchrun, rank 0 speaks for all
        report(result, args)
    return 0


def chunks_ran(counts: list[int], args: argparse.Namespace) -> str:
    """The chunk counts the programs ran, with what was asked where they differ (sync mode
    runs each step as one chunk)."""
    asked = ",".join(map(str, args.chunks)) if isinstance(args.chunks, tuple) else str(args.chunks)
    if not counts:
        return f"{asked} chunks"
    ran = " or ".join(map(str, counts))
    if args.chunks == "auto":
        return f"auto ({ran}) chunks"
    if isinstance(args.chunks, int) and counts == [args.chunks]:
        return f"{ran} chunks"
    if isinstance(args.chunks, tuple) and args.mode != "sync":
        return f"{ran} chunks ({asked} tokens)"
    why = ": sync mode runs each step whole" if args.mode == "sync" else ""
    return f"{ran} chunk{'s' if counts != [1] else ''} ({asked} asked{why})"


def report(result: dict[str, Any], args: argparse.Namespace) -> None:
    cfg = f", guidance branches on {args.cfg} rank groups" if args.cfg > 1 else ""
    graphs = ", CUDA graphs" if args.cuda_graphs else ""
    layout = (f"{args.stages} stages x {chunks_ran(result['chunks'], args)}, {args.mode}"
              if result["chunks"] or args.cfg == 1 else "each branch whole")
    made = result["made"]
    compiled = "eager" if args.compiler == "eager" else f"compiled by {args.compiler}"
    print(f"pipelined ({layout}{cfg}, {compiled}, {args.device}{graphs}): "
          f"{result['pipelined_s']:.2f} s for {args.steps} steps"
          f"{f', {made} images' if args.images > 1 else ''}")
    if made < args.images:
        print(f"warning: {args.images} images asked, the pipeline made {made}: it does not "
              "batch its number per prompt (CogVideoX's pipelines make one video)",
              file=sys.stderr)
    if result["made_while_timed"]:
        print(f"warning: the timed call made {result['made_while_timed']} new program(s); "
              "its time includes planning and compiling them", file=sys.stderr)
    if "serial_s" in result:
        print("\n".join(compare_lines(result, args)))
    print(result["memory"])
    if result.get("traces"):
        print(f"profile: {', '.join(result['traces'])}")
    if result.get("files"):
        print(f"saved {len(result['files'])} file(s) to {args.out}/")
