"""What `tokpipe generate` passes to a pipeline's __call__: a class label (DiT) or a prompt,
with the options the pipeline takes, each refused by name where it takes none."""

from __future__ import annotations

import argparse
import inspect
from typing import Any

from tokpipe_compiler.core.errors import TokpipeError


def call_kwargs(pipe: Any, args: argparse.Namespace) -> dict[str, Any]:
    """What the pipeline's __call__ takes: a class label (DiT) or a prompt."""
    kwargs: dict[str, Any] = {"num_inference_steps": args.steps, "output_type": "np"}
    if type(pipe).__name__ == "DiTPipeline":
        check_class_label_args(args)
        classes = getattr(pipe.transformer.config, "num_embeds_ada_norm", None)
        kwargs["class_labels"] = [class_label(args, classes)] * args.images
    elif args.class_label is not None:
        raise TokpipeError(f"{type(pipe).__name__} draws what a prompt says, not a class "
                           "label; leave out --class-label")
    elif args.prompt is None:
        raise TokpipeError(f"{type(pipe).__name__} needs --prompt")
    else:
        kwargs["prompt"] = args.prompt
        kwargs.update(_per_prompt(pipe, args.images))
        kwargs.update(_negative_prompt(pipe, args))
        if args.size is not None:
            kwargs["height"], kwargs["width"] = args.size
        kwargs.update(_taken(pipe, "num_frames", args.frames, "--frames", "frames"))
        kwargs.update(_taken(pipe, "max_sequence_length", args.text_length, "--text-length",
                             "text length"))
    if args.guidance_scale is not None:
        kwargs["guidance_scale"] = args.guidance_scale
    return kwargs


def _taken(pipe: Any, name: str, value: int | None, flag: str, what: str) -> dict[str, int]:
    """`{name: value}` for the pipeline's __call__, refused where it takes no `name`."""
    if value is None:
        return {}
    if name not in inspect.signature(type(pipe).__call__).parameters:
        raise TokpipeError(f"{type(pipe).__name__} takes no {what} ({name}); leave out "
                           f"{flag}")
    return {name: value}


def _negative_prompt(pipe: Any, args: argparse.Namespace) -> dict[str, Any]:
    """The negative prompt, and true_cfg_scale for the pipelines that guide over it only
    with one above 1 (Flux: without it the negative prompt is dropped without a word)."""
    true_cfg = "true_cfg_scale" in inspect.signature(type(pipe).__call__).parameters
    name = type(pipe).__name__
    if args.true_cfg_scale is not None and not true_cfg:
        raise TokpipeError(f"{name} takes no true_cfg_scale; leave out --true-cfg-scale "
                           "(--guidance-scale sets its guidance)")
    if args.negative_prompt is None:
        if args.true_cfg_scale is not None:
            raise TokpipeError("--true-cfg-scale guides over a negative prompt: give "
                               "--negative-prompt too")
        return {}
    if true_cfg and (args.true_cfg_scale or 1.0) <= 1.0:
        raise TokpipeError(f"{name} uses --negative-prompt only with true classifier-free "
                           "guidance: pass --true-cfg-scale above 1 (4.0, say), or leave out "
                           "--negative-prompt")
    scale = {"true_cfg_scale": args.true_cfg_scale} if true_cfg else {}
    return {"negative_prompt": args.negative_prompt, **scale}


def check_class_label_args(args: argparse.Namespace) -> None:
    for given, flag in ((args.prompt, "--prompt"), (args.negative_prompt, "--negative-prompt"),
                        (args.size, "--size"), (args.frames, "--frames"),
                        (args.text_length, "--text-length")):
        if given is not None:
            raise TokpipeError(f"DiTPipeline draws a class label (--class-label) at its one "
                               f"size; leave out {flag}")


def class_label(args: argparse.Namespace, classes: int | None) -> int:
    """The class label a DiT pipeline of `classes` classes draws (1 where none is given);
    one outside [0, classes) is refused (DiT's label `classes` is its unconditional one)."""
    label = 1 if args.class_label is None else args.class_label
    if classes is not None and not 0 <= label < classes:
        raise TokpipeError(f"--class-label {label}: the pipeline's DiT draws classes 0 to "
                           f"{classes - 1}")
    return label


def _per_prompt(pipe: Any, images: int) -> dict[str, int]:
    """The pipeline's own argument for `images` images (or videos) of one prompt."""
    if images == 1:
        return {}
    takes = inspect.signature(type(pipe).__call__).parameters
    for name in ("num_images_per_prompt", "num_videos_per_prompt"):
        if name in takes:
            return {name: images}
    raise TokpipeError(f"{type(pipe).__name__} takes no number of images per prompt; "
                       "leave out --images")
