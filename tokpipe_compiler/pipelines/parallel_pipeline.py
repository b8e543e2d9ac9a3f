"""`parallelize(pipe)`: an unmodified diffusers pipeline, its denoising loop pipelined.

    pipe = tp.pipelines.parallelize(PixArtAlphaPipeline(...), stages=2, chunks=4)
    images = pipe(prompt_embeds=..., num_inference_steps=20).images

The pipeline's own `__call__` runs as written (prompt encoding, latents, guidance, the
scheduler's timesteps, the VAE). Its denoising loop runs as one ring (`ring_call`): no
pipeline bubble between steps, each chunk's updated latents going straight back to the
first stage; step callbacks see each step's latents as the ring completes it
(`step_callbacks`). A call the ring cannot take (a pipeline outside `table`, a scheduler
without a token-wise step, diffusers' cutoff callbacks, guidance rescaling, a step the
first step's probes show the ring cannot replay: that call starts again from the same
random state) runs per call instead, with a warning that says why: the transformer,
compiled in place with the tokpipe backend, is then one pipelined step per call. Under
torchrun (or the project's launcher) every rank calls the pipeline with the same arguments
and gets the whole result.

A generation ends with the pipeline call: diffusers resets the stateful caches of its
components when a call finishes (`maybe_free_model_hooks`), and the transformer's K/V
caches go with them, so two calls with one seed give one image twice.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch._dynamo.eval_frame import OptimizedModule

from tokpipe_compiler.config import Config
from tokpipe_compiler.core.errors import TokpipeError
from tokpipe_compiler.core.warn import warn
from tokpipe_compiler.dynamo_backend import TokpipeBackend
from tokpipe_compiler.pipelines.cfg_parallel import Branches, branch_groups, check_world
from tokpipe_compiler.pipelines.denoiser_rings import DenoiserRings
from tokpipe_compiler.pipelines.guiders import warn_hooked_guider
from tokpipe_compiler.pipelines.marks import (
    CALLED,
    FRESH,
    PARALLELIZED,
    RESET,
    RING,
    calling,
    find_denoisers,
    programs,
    reset_programs,
    reset_with_the_pipeline,
)
from tokpipe_compiler.pipelines.probes import RingUnavailable, refusals_unlogged
from tokpipe_compiler.pipelines.random_states import (
    call_generators,
    random_states,
    restore_random_states,
)
from tokpipe_compiler.pipelines.ring_call import RingCalls
from tokpipe_compiler.pipelines.scheduler_route import route
from tokpipe_compiler.pipelines.step_callbacks import interruptible
from tokpipe_compiler.planning.compile_calls import own_recompiles
from tokpipe_compiler.planning.graph_share import GraphTally, summary
from tokpipe_compiler.stage_programs.generations import PIPELINE_STEPS, StepMarks, count_step
from tokpipe_compiler.stage_programs.model_clock import ModelClock, clocked

# Input signatures (resolutions, batch sizes) a transformer is compiled for per call before
# Dynamo runs it unpipelined: PixArt's and Sana's pipelines bin resolutions into dozens of
# aspect ratios, and each is one recompile.
RECOMPILES = 64
# A parallelized transformer's lock, held by the pipeline call running it (not an attribute:
# a copy or pickle of the transformer would fail on a lock).
_CALLS_LOCKS: weakref.WeakKeyDictionary[torch.nn.Module, threading.RLock] = \
    weakref.WeakKeyDictionary()


def parallelize(pipe: Any, *, ring: bool = True, cfg: int = 1, **options: Any) -> Any:
    """Pipeline `pipe`'s transformers in place (Wan 2.2 has two); returns `pipe`.

    options: those of the backend (stages, chunks, mode, warmup_steps, compiler, timeout),
    checked at once. ring: run each call's denoising loop as one ring where the pipeline
    and scheduler allow (False: every step is a pipelined call). cfg: 1 (every stage runs
    both guidance branches, as the pipeline batches them) or 2 (each branch on its own
    ranks: `cfg_parallel`; world = cfg x stages). Without a process group, cfg=2 computes
    the same generation in this process: the branches in turn (stages=1), or one ring over
    both branches batched (stages > 1).
    """
    config = checked_options(ring=ring, cfg=cfg, **options)
    _check_loop_options(pipe, ring, cfg)
    denoisers = find_denoisers(pipe)
    for name, denoiser in denoisers.items():
        _check_denoiser(pipe, name, denoiser, config)
    for denoiser in denoisers.values():  # each with its own programs and recompile limit
        if getattr(denoiser, PARALLELIZED, None) is None:
            backend = TokpipeBackend(**options)
            backend.session.outside_call = (
                f"tokpipe: {type(denoiser).__name__}, parallelized with {type(pipe).__name__}, "
                "is called outside a parallelized pipeline's call (by a pipeline made from it "
                "with from_pipe and not parallelized itself, or directly): it runs per call, "
                "each step filling and draining the pipeline, and on several ranks without "
                "the checks a parallelized call makes (a rank whose call raises leaves the "
                "others waiting `timeout`); parallelize that pipeline too (with the same "
                "options) to run its loop as a ring")
            denoiser.compile(backend=backend, dynamic=False, **own_recompiles(RECOMPILES))
            clock = ModelClock(denoiser.forward, config.timestep_input, backend.session)
            per_call = clocked(denoiser._compiled_call_impl, clock)
            object.__setattr__(denoiser, "_compiled_call_impl", per_call)
            object.__setattr__(denoiser, PARALLELIZED,
                               Parallelized(config, per_call, backend.session.graphs))
            reset_with_the_pipeline(denoiser)
            _CALLS_LOCKS[denoiser] = threading.RLock()
    if ring:
        hybrid = cfg == 2 and config.stages > 1
        _install_ring(pipe, denoisers, options, cfg,
                      branch_groups(config.stages) if hybrid else None)
    elif getattr(pipe, FRESH, None) is None:
        _install_fresh_start(pipe)
    return pipe


def checked_options(*, ring: bool = True, cfg: int = 1, **options: Any) -> Config:
    """`parallelize`'s options checked without a pipeline: bad ones fail here, before a
    first step (or a serial run a caller makes first) costs anything."""
    config = Config.from_options(options)
    if not isinstance(ring, bool):  # "no" would be truthy: a ring the user turned off
        raise ValueError(f"option 'ring' must be True or False, got {ring!r}")
    check_world(cfg, config.stages)
    if cfg == 2 and not ring:
        raise TokpipeError("cfg=2 runs the denoising loop itself; it cannot be combined with "
                           "ring=False")
    if ring and config.mode == "stale" and config.warmup_steps < 1:
        raise TokpipeError("the ring's first step fills the K/V caches: in 'stale' mode it "
                           "needs warmup_steps >= 1; pass warmup_steps=1, or ring=False for "
                           "per-call steps (the first one's chunks then see only the chunks "
                           "before them)")
    return config


@dataclass(frozen=True)
class Parallelized:
    """What `parallelize` leaves on a transformer: its options, and its per-call path (the
    module compiled with the tokpipe backend), which every pipeline sharing it uses."""

    config: Config
    per_call: Callable[..., Any]
    graphs: GraphTally  # the per-call path's graphs (several where Dynamo split the model)


def _check_loop_options(pipe: Any, ring: bool, cfg: int) -> None:
    """A pipeline parallelized already keeps how its loop runs (`ring`, `cfg`): its call is
    routed once, and a second routing over the first would lose the ring."""
    calls = getattr(pipe, RING, None)
    if calls is None and getattr(pipe, FRESH, None) is None:
        return
    had = {"ring": calls is not None, "cfg": 1 if calls is None else calls.cfg}
    asked = {"ring": ring, "cfg": cfg}
    differ = [name for name in had if had[name] != asked[name]]
    if differ:
        raise TokpipeError(f"{type(pipe).__name__} is parallelized already, with "
                           f"{_changes(differ, had, asked)}; a pipeline keeps how its loop "
                           "runs: load the pipeline again for others")


def _changes(names: list[str], had: dict[str, Any], asked: dict[str, Any]) -> str:
    return ", ".join(f"{name}={had[name]!r} (asked: {asked[name]!r})" for name in names)


def _check_denoiser(pipe: Any, name: str, denoiser: torch.nn.Module, config: Config) -> None:
    """A transformer parallelize can take: not compiled otherwise; one parallelized for a
    pipeline that shares it (diffusers' `from_pipe`) with the same options."""
    shared = getattr(denoiser, PARALLELIZED, None)
    if shared is not None:
        names = [f.name for f in dataclasses.fields(config)
                 if getattr(shared.config, f.name) != getattr(config, f.name)]
        differ = _changes(names, vars(shared.config), vars(config))
        if names and any(getattr(pipe, mark, None) is not None for mark in (RING, FRESH)):
            raise TokpipeError(f"{type(pipe).__name__} is parallelized already, with "
                               f"{differ}; a transformer keeps the options it was "
                               "parallelized with: load the pipeline again for others")
        if names:
            raise TokpipeError(f"{type(pipe).__name__}.{name} is parallelized already, for "
                               f"a pipeline that shares it (as from_pipe shares components), "
                               f"with {differ}; parallelize this one with the same options")
        return
    if getattr(denoiser, "_compiled_call_impl", None) is not None:
        raise TokpipeError(f"{type(pipe).__name__}.{name} is compiled already; "
                           "parallelize the pipeline before compiling its transformer")
    if isinstance(denoiser, OptimizedModule):
        raise TokpipeError(f"{type(pipe).__name__}.{name} is a torch.compile wrapper; "
                           f"parallelize the pipeline with the module itself "
                           f"(pipe.{name} = pipe.{name}._orig_mod)")


def _install_ring(pipe: Any, denoisers: dict[str, torch.nn.Module], options: dict[str, Any],
                  cfg: int, branches: Branches | None) -> None:
    """Route the pipeline's call, its transformers and its scheduler through `RingCalls`."""
    rings = {name: DenoiserRings(pipe, name, module, getattr(module, PARALLELIZED).per_call,
                                 options, cfg, branches) for name, module in denoisers.items()}
    calls = RingCalls(pipe, rings, cfg)
    calls.take_transformers()
    cls, running = type(pipe), threading.Lock()

    @functools.wraps(cls.__call__)  # the pipeline's own signature and docstring
    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(self, RING, None) is not calls:  # made from this one (from_pipe)
            return cls.__call__(self, *args, **kwargs)
        _warn_replaced(self)
        _warn_hooked_guider(self)
        generators = call_generators(cls.__call__, self, args, kwargs)
        states = random_states(generators)
        with _one_call_at_a_time(self, running), calling(calls):
            try:
                with calls.generation_of(kwargs) as call_kwargs, _steps_counted(self), \
                        refusals_unlogged():
                    return cls.__call__(self, *args, **call_kwargs)
            except RingUnavailable as err:  # only probes ran: the same call again, per call
                restore_random_states(generators, states)
                again = f"{err}; the call started again per call, from the same random state"
                with calls.generation_of(kwargs, [again]) as call_kwargs, \
                        _steps_counted(self):
                    return cls.__call__(self, *args, **call_kwargs)

    extra = {"interrupt": _interrupt_after_probes(calls)} if interruptible(pipe) else {}
    _with_call(pipe, __call__, RING, calls, extra)


def _interrupt_after_probes(calls: RingCalls) -> property:
    """The pipeline's `interrupt`, but False while a ring generation's loop runs on probes:
    a cancel set then (from another thread) is seen by the ring at its next step, which
    hands the loop that step's latents (`StepCallbacks.see`); the loop skipping its steps
    then would have returned probes."""

    def interrupt(self: Any) -> bool:
        generation = calls.generation
        if getattr(self, RING, None) is calls and generation is not None and \
                generation.probing:
            return False
        return bool(getattr(self, "_interrupt", False))

    return property(interrupt)


def _install_fresh_start(pipe: Any) -> None:
    """Per call: every pipeline call starts a new generation, also after a call that raised
    (diffusers resets its transformer only when a call returns)."""
    cls, marker, running = type(pipe), object(), threading.Lock()

    @functools.wraps(cls.__call__)
    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(self, FRESH, None) is not marker:  # a pipeline made from this one
            return cls.__call__(self, *args, **kwargs)
        _warn_replaced(self)
        _warn_hooked_guider(self)
        with _one_call_at_a_time(self, running):
            for denoiser in find_denoisers(self).values():
                reset_programs(denoiser)
            route(self.scheduler, marker, {"step": _counted_step})  # it may be replaced
            with _steps_counted(self):
                return cls.__call__(self, *args, **kwargs)

    _with_call(pipe, __call__, FRESH, marker)


@contextlib.contextmanager
def _one_call_at_a_time(pipe: Any, running: threading.Lock) -> Iterator[None]:
    """A call while another runs (a second thread) raises: the generation's state (its
    ring, the routed scheduler, the K/V caches) is the pipeline's, and two calls at once
    would each run with the other's, silently wrong. diffusers' pipelines are no safer."""
    if not running.acquire(blocking=False):
        raise TokpipeError(
            f"{type(pipe).__name__} is running a call already (in another thread): a "
            "parallelized pipeline runs one call at a time, since its generation's state "
            "(ring, scheduler, K/V caches) is the pipeline's. Serialise the calls with a "
            "lock, or load a pipeline per thread")
    try:
        with _transformers_held(pipe):
            setattr(pipe, CALLED, True)
            yield
    finally:
        running.release()


@contextlib.contextmanager
def _transformers_held(pipe: Any) -> Iterator[None]:
    """The pipeline's transformers for the call: a pipeline sharing one with this one
    (made by from_pipe, or from its components) raises while this call runs in another
    thread, since a transformer's K/V caches and step count are its own. In this thread
    (a step callback calling the other pipeline) it may."""
    held: list[threading.RLock] = []
    try:
        for name, denoiser in find_denoisers(pipe).items():
            lock = _CALLS_LOCKS.get(denoiser)
            if lock is None:  # a transformer put in after parallelize
                continue
            if not lock.acquire(blocking=False):
                raise TokpipeError(
                    f"{type(pipe).__name__}.{name} is running a call of another pipeline "
                    "that shares it (in another thread): a parallelized transformer runs "
                    "one pipeline's call at a time, since its K/V caches and step count "
                    "are its own. Serialise the calls with a lock, or give each thread a "
                    "pipeline with a transformer of its own")
            held.append(lock)
        yield
    finally:
        for lock in held:
            lock.release()


def _with_call(pipe: Any, call: Callable[..., Any], mark: str, owner: object,
               extra: dict[str, Any] | None = None) -> None:
    """`pipe` as an instance of a subclass of its class with `call` for its `__call__`
    (only this instance's calls go through it; pipelines made from it by from_pipe, of
    the subclass, lack the `mark` attribute naming `owner`, and `call` passes them on),
    and the `extra` attributes."""
    cls = type(pipe)
    pipe.__class__ = type(cls.__name__, (cls,), {"__call__": call,
                                                 "__module__": cls.__module__,
                                                 "__doc__": cls.__doc__, **(extra or {})})
    setattr(pipe, mark, owner)


@contextlib.contextmanager
def _steps_counted(pipe: Any) -> Iterator[None]:
    """The scheduler steps of one call of `pipe` counted (`StepMarks`): they tell a
    transformer's per-call clock where each step ends, and the ranks how many to expect."""
    marks = StepMarks(scheduler=getattr(pipe, "scheduler", None))
    token = PIPELINE_STEPS.set(marks)
    try:
        yield
    except BaseException as err:
        marks.leave(err, _distributed(pipe))  # the other ranks stop at their next exchange
        _end_call(pipe)
        raise
    finally:
        PIPELINE_STEPS.reset(token)
    _summarize_graphs(pipe)


def _distributed(pipe: Any) -> list:
    """The pipeline's programs that run over several ranks (`leave_call`)."""
    try:
        return [p for p in programs(pipe) if hasattr(p, "leave_call")]
    except TokpipeError:  # nothing has run yet
        return []


def _end_call(pipe: Any) -> None:
    """A call that raised ends as diffusers ends one that returns: each transformer's
    `_reset_stateful_cache` (`reset_with_the_pipeline`), which resets its step caches
    (First Block Cache and its kind) and its programs' generations. Left midway, the ranks'
    caches would skip blocks differently, and their programs would start the next
    generation apart (a from_pipe sibling's call, say)."""
    for denoiser in find_denoisers(pipe).values():
        reset = getattr(denoiser, RESET, None)
        if callable(reset):
            reset()


def _summarize_graphs(pipe: Any) -> None:
    """After a call that planned the graphs of a transformer split at graph breaks: how
    many there are and how much of it is pipelined, in one line."""
    for denoiser in find_denoisers(pipe).values():
        parallelized = getattr(denoiser, PARALLELIZED, None)
        if parallelized is not None:
            line = summary(type(denoiser).__name__, parallelized.graphs.take_new())
            if line is not None:
                warn(line)


def _counted_step(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    count_step()
    return original(*args, **kwargs)


def _warn_hooked_guider(pipe: Any) -> None:
    """A guider that hooks the transformer for one branch, in stale or causal mode."""
    for denoiser in find_denoisers(pipe).values():
        parallelized = getattr(denoiser, PARALLELIZED, None)
        if parallelized is not None:
            warn_hooked_guider(pipe, parallelized.config.mode)
            return


def _warn_replaced(pipe: Any) -> None:
    """A transformer set on the pipeline after `parallelize` runs as it is: say so."""
    for name, denoiser in find_denoisers(pipe).items():
        if getattr(denoiser, PARALLELIZED, None) is None:
            warn(f"tokpipe: {type(pipe).__name__}.{name} was replaced after parallelize and "
                 "runs unpipelined; call tp.pipelines.parallelize(pipe, ...) again to "
                 "pipeline it")
