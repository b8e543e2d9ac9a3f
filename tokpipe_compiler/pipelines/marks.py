"""The marks `parallelize` leaves on a pipeline and its transformers, and what reads them
afterwards: the pipelined programs behind a parallelized pipeline (`programs`), a reset
of it or of its transformer (`reset_parallelized`), and the reset diffusers' end of a call
makes (`reset_with_the_pipeline`)."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import torch

from tokpipe_compiler.core.errors import TokpipeError
from tokpipe_compiler.core.warn import warn
from tokpipe_compiler.pipelines.ring_call import RingCalls

# The attributes that hold a pipeline's denoising transformers (Wan 2.2's low-noise expert
# in the second).
DENOISERS = ("transformer", "transformer_2")
RESET = "_reset_stateful_cache"  # what DiffusionPipeline calls on each component at the end
PARALLELIZED = "_tokpipe_parallelized"  # a transformer's `Parallelized`
FRESH = "_tokpipe_fresh_start"  # a per-call pipeline's mark (`_install_fresh_start`)
RING = "_tokpipe_ring"  # a ring pipeline's `RingCalls` (`_install_ring`)
CALLED = "_tokpipe_called"  # set at a parallelized pipeline's first call

def programs(pipe: Any) -> list:
    """The pipelined programs behind a parallelized pipeline: its rings' (one per form of
    step and input shapes) and its transformer's per-call ones; none before its first
    call. Raises where it has none after one (saying why)."""
    from tokpipe_compiler.api import programs as call_programs

    calls = getattr(pipe, RING, None)
    if (calls is not None or hasattr(pipe, FRESH)) and not hasattr(pipe, CALLED):
        return []  # parallelized, not called yet: nothing traced
    found = [] if calls is None else ring_programs(calls)
    for denoiser in find_denoisers(pipe).values():
        with contextlib.suppress(TokpipeError):  # none: never called per call
            found += call_programs(denoiser)
    if not found and calls is not None and all(
            rings.cfg == 2 and rings.config.stages == 1 for rings in calls.denoisers.values()):
        raise TokpipeError(f"{type(pipe).__name__} runs each guidance branch whole on its "
                           "own rank (cfg=2, stages=1): it has no pipelined program")
    if not found:
        raise TokpipeError(f"{type(pipe).__name__} has no pipelined program: it was not "
                           "parallelized and called yet, or every graph of its transformer "
                           "ran unpipelined (a warning at its first call said why)")
    return found


def reset_parallelized(obj: Any) -> bool:
    """`tp.reset` of a parallelized pipeline or of its transformer: drops the K/V of the
    transformer's per-call programs (none where it only ran in rings). A ring's generation
    is the pipeline's call: a reset during one (from a step callback) cannot restart it, and
    says so. False where `obj` is neither."""
    if getattr(obj, PARALLELIZED, None) is not None:
        denoisers = [obj]
    elif hasattr(obj, RING) or hasattr(obj, FRESH):
        denoisers = list(find_denoisers(obj).values())
    else:
        return False
    calls = _CALLING.get()
    generation = None if calls is None else calls.generation
    if generation is not None and generation.ring and (
            obj is calls.pipe or any(d in find_denoisers(calls.pipe).values() for d in denoisers)):
        warn(f"tokpipe: tp.reset({type(obj).__name__}) during a parallelized pipeline's call "
             "has no effect: its denoising loop runs as one ring, whose steps cannot start "
             "again mid-call; the next call starts afresh")
    for denoiser in denoisers:
        reset_programs(denoiser)
    rings = getattr(obj, RING, None)
    # what a ring's last call left (an error), where no call runs now, in any thread
    if rings is not None and rings.generation is None:
        for program in ring_programs(rings):
            program.reset()
    return True


def ring_programs(calls: RingCalls) -> list:
    """The programs of a ring pipeline's rings (one per form of step and input shapes)."""
    return [p for rings in calls.denoisers.values() for ring in rings.rings.values()
            for p in ring.programs()]


# The ring pipeline whose call runs now (`reset_parallelized` tells a reset during it).
_CALLING: contextvars.ContextVar[RingCalls | None] = contextvars.ContextVar(
    "tokpipe_ring_calling", default=None)


@contextlib.contextmanager
def calling(calls: RingCalls) -> Iterator[None]:
    token = _CALLING.set(calls)
    try:
        yield
    finally:
        _CALLING.reset(token)


def find_denoisers(pipe: Any) -> dict[str, torch.nn.Module]:
    """The pipeline's denoising transformers by attribute name (Wan 2.2 has two), or an
    error naming what the pipeline has."""
    found = {name: module for name in DENOISERS
             if isinstance(module := getattr(pipe, name, None), torch.nn.Module)}
    if found:
        return found
    components = getattr(pipe, "components", None)
    have = sorted(components) if isinstance(components, dict) else type(pipe).__name__
    raise TokpipeError(f"{type(pipe).__name__} has no denoising transformer "
                       f"(looked for {', '.join(DENOISERS)}; it has {have}); tokpipe "
                       "pipelines transformer denoisers, not UNets")


def reset_with_the_pipeline(denoiser: torch.nn.Module) -> None:
    """End the generation when the pipeline call ends: DiffusionPipeline calls each
    component's `_reset_stateful_cache` there (diffusers' own stateful hooks too)."""
    own = getattr(denoiser, RESET, None)
    if callable(own):
        # What the end of every pipeline call does, done before the first: diffusers gives
        # the transformer its hook registry there, which `ModelMixin.dtype` looks for; a
        # forward that reads `self.dtype` (Allegro's, OmniGen's), traced without it, would
        # be traced and compiled again at the second call.
        own()

    def reset_caches(*args: Any, **kwargs: Any) -> None:
        if own is not None:
            own(*args, **kwargs)
        reset_programs(denoiser)

    object.__setattr__(denoiser, RESET, reset_caches)


def reset_programs(denoiser: torch.nn.Module) -> None:
    from tokpipe_compiler.api import programs

    try:
        found = programs(denoiser)
    except TokpipeError:  # the transformer never ran (no steps): nothing to drop
        found = []
    for program in found:
        program.reset()
