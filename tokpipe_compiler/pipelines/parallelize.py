"""`parallelize(pipe)`: an unmodified diffusers pipeline, its transformer pipelined.

    pipe = tp.pipelines.parallelize(DiTPipeline(...), stages=2, chunks=4)
    images = pipe(class_labels=[207], num_inference_steps=20).images

The denoiser (`pipe.transformer`) is compiled in place with the tokpipe backend, so the
pipeline's own loop, prompt encoding, guidance, scheduler, callbacks and VAE run as they
are, and each call of the transformer is one pipelined step (per-call mode: each step fills
and drains the pipeline). A generation ends with the pipeline call: diffusers resets the
stateful caches of its components when a call finishes (`maybe_free_model_hooks`), and the
transformer's K/V caches go with them, so two calls with one seed give one image twice.
Under torchrun (or the project's launcher) every rank calls the pipeline with the same
arguments and gets the whole result.
"""

from __future__ import annotations

from typing import Any

import torch

from tokpipe_compiler.backend import TokpipeBackend
from tokpipe_compiler.core.errors import TokpipeError

DENOISERS = ("transformer",)  # the attribute that holds a pipeline's denoising transformer
_RESET = "_reset_stateful_cache"  # what DiffusionPipeline calls on each component at the end


def parallelize(pipe: Any, *, cfg: int = 1, **options: Any) -> Any:
    """Compile `pipe`'s transformer with the tokpipe backend in place; returns `pipe`.

    options: those of the backend (stages, chunks, mode, warmup_steps, compiler, ...),
    checked at once. cfg: ranks per guidance branch group; only 1 (both branches on every
    rank, as the pipeline batches them) is available.
    """
    if cfg != 1:
        raise TokpipeError(f"cfg={cfg}: running the guidance branches on separate groups of "
                           "ranks is not available; use cfg=1 (the pipeline batches both "
                           "branches and every stage runs them together)")
    denoiser = find_denoiser(pipe)
    backend = TokpipeBackend(**options)
    if getattr(denoiser, "_compiled_call_impl", None) is not None:
        raise TokpipeError(f"{type(pipe).__name__}.transformer is compiled already; "
                           "parallelize the pipeline before compiling its transformer")
    denoiser.compile(backend=backend, dynamic=False)
    _reset_with_the_pipeline(denoiser)
    return pipe


def find_denoiser(pipe: Any) -> torch.nn.Module:
    """The pipeline's denoising transformer, or an error naming what the pipeline has."""
    for name in DENOISERS:
        module = getattr(pipe, name, None)
        if isinstance(module, torch.nn.Module):
            return module
    components = getattr(pipe, "components", None)
    have = sorted(components) if isinstance(components, dict) else type(pipe).__name__
    raise TokpipeError(f"{type(pipe).__name__} has no denoising transformer "
                       f"(looked for {', '.join(DENOISERS)}; it has {have}); tokpipe "
                       "pipelines transformer denoisers, not UNets")


def _reset_with_the_pipeline(denoiser: torch.nn.Module) -> None:
    """End the generation when the pipeline call ends: DiffusionPipeline calls each
    component's `_reset_stateful_cache` there (diffusers' own stateful hooks too)."""
    from tokpipe_compiler.api import programs

    own = getattr(denoiser, _RESET, None)

    def reset_caches(*args: Any, **kwargs: Any) -> None:
        if own is not None:
            own(*args, **kwargs)
        try:
            found = programs(denoiser)
        except TokpipeError:  # the transformer never ran (no steps): nothing to drop
            found = []
        for program in found:
            program.reset()

    object.__setattr__(denoiser, _RESET, reset_caches)
