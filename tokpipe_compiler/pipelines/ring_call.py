"""A pipeline call whose denoising loop runs as a ring.

The pipeline's own `__call__` runs as written: prompt encoding, latent preparation,
`scheduler.set_timesteps`, the loop, the VAE. Three hooks turn its loop into a ring:

- the transformer, at the first step, answers with random probes (shapes from a fake-tensor
  run) and records how it was called;
- `scheduler.step` at the first step sees what the pipeline made of the probes, which
  identifies the step (`glue.identify`), and plans its ring from the latents it was given;
- later steps answer with probes again, each checked against the identified step (so a
  pipeline that changes its step mid-generation raises instead of going wrong), and narrow
  the form of the timestep input where the first step left two; the last `scheduler.step`
  runs the ring over every step and returns its latents. Everything after the loop is the
  pipeline's own.

Step callbacks are recorded on the probes and called with each step's real latents as the
ring computes them (`step_callbacks`).

A loop that hands its later steps to another transformer (Wan 2.2's low-noise expert) runs
as one ring per transformer (`denoiser_rings`): at the first call of the next transformer
the steps so far run, and its own step, identified at its first step like the first one,
runs on from their latents and scheduler state.

A call the ring cannot take (see `table`, and the scheduler's step table) runs per call,
with one warning that says why.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from tokpipe_compiler.core.errors import TokpipeError
from tokpipe_compiler.core.warn import warn
from tokpipe_compiler.pipelines.blends import BlendNotFound
from tokpipe_compiler.pipelines.call_state import Generation, guidance_candidates
from tokpipe_compiler.pipelines.denoiser_rings import (
    Carried,
    DenoiserRings,
    UnpipelinedStep,
)
from tokpipe_compiler.pipelines.drawn_noise import drawn_noise, with_noise
from tokpipe_compiler.pipelines.glue import GlueNotFound, as_stacked, guide, identify, same
from tokpipe_compiler.pipelines.loop_schedule import (
    LoopSchedule,
    announced_begin,
    loop_schedule,
    step_of,
)
from tokpipe_compiler.pipelines.output_tensors import output_tensors, second_latent
from tokpipe_compiler.pipelines.probes import RingUnavailable, bind_call, probe, with_probe
from tokpipe_compiler.pipelines.ring_step import check_combinable
from tokpipe_compiler.pipelines.scheduler_route import (
    prev_sample,
    route,
    step_arguments,
    step_option_reasons,
    with_sample,
)
from tokpipe_compiler.pipelines.segment_ends import agree_on_the_end
from tokpipe_compiler.pipelines.step_callbacks import (
    LEGACY,
    ON_STEP_END,
    StepCallbacks,
    StopRing,
    interruptible,
)
from tokpipe_compiler.pipelines.step_checks import changed, check_call, check_prediction
from tokpipe_compiler.pipelines.table import call_reasons
from tokpipe_compiler.stage_programs.generations import count_step


class RingCalls:
    """Installed on one pipeline by `parallelize`: its calls run as rings where they can.
    denoisers: the rings of each transformer the pipeline may call, by attribute name."""

    def __init__(self, pipe: Any, denoisers: dict[str, DenoiserRings], cfg: int = 1):
        self.pipe, self.denoisers, self.cfg = pipe, denoisers, cfg
        self.generation: Generation | None = None
        self.timestep_args: tuple = ((), {})
        self.warned: set[str] = set()
        self._routes = {name: functools.partial(self.transformer, name) for name in denoisers}

    def take_transformers(self) -> None:
        """Route the transformers' calls here. A transformer shared with another
        parallelized pipeline (diffusers' `from_pipe`) goes to the pipeline called last;
        outside its calls, a generation of neither, it runs per call."""
        for name, rings in self.denoisers.items():
            object.__setattr__(rings.denoiser, "_compiled_call_impl", self._routes[name])

    @contextlib.contextmanager
    def generation_of(self, kwargs: dict[str, Any],
                      reasons: Sequence[str] = ()) -> Iterator[dict[str, Any]]:
        """A pipeline call: a generation, per call or ring, for its duration (per call where
        `reasons` say why). Yields the call's arguments, its step callbacks replaced by the
        generation's stand-in (`step_callbacks`) where it is a ring."""
        candidates = guidance_candidates(self.pipe, kwargs)
        denoisers = {name: rings.denoiser for name, rings in self.denoisers.items()}
        self.generation = Generation([*call_reasons(self.pipe, kwargs, denoisers), *reasons],
                                     candidates)
        self.take_transformers()
        # the pipeline's scheduler may have been replaced since the last call
        route(self.pipe.scheduler, self, {"set_timesteps": self.set_timesteps,
                                          "step": self.step, "scale_noise": self.noised,
                                          "add_noise": self.noised})
        gen = self.generation
        if gen.reasons:
            self._warn_per_call(gen.reasons)
        elif kwargs.get(ON_STEP_END) is not None or kwargs.get(LEGACY) is not None or \
                (interruptible(self.pipe) and not torch.distributed.is_initialized()):
            # without callbacks too in one process: another thread's cancel reaches the
            # ring through it (on several ranks each would see it at another step)
            gen.callbacks = StepCallbacks(self.pipe, kwargs, lambda: gen.step,
                                          lambda: gen.probing)
            kwargs = gen.callbacks.call_kwargs(kwargs)
        try:
            yield kwargs
        finally:
            self.generation = None
        if gen.ring:  # a per-call generation after this ring says so again
            self.warned.clear()

    # -- hooks ------------------------------------------------------------------------------

    def set_timesteps(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        self.timestep_args = (args, kwargs)
        return original(*args, **kwargs)

    def noised(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """The scheduler noising an image inside the loop: a blend to come (inpainting)."""
        out = original(*args, **kwargs)
        gen = self.generation
        if gen is not None and gen.ring and gen.denoiser is not None:
            gen.blends.noised[gen.step] = out
        return out

    def transformer(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """Transformer `name`'s call: a probe answer in a ring generation, else per call."""
        gen = self.generation
        if gen is None:  # outside this pipeline's calls: the backend's per-call path
            return self.denoisers[name].per_call(*args, **kwargs)
        if not gen.ring:
            return self.denoisers[name].unpipelined(*args, **kwargs)
        if gen.finished and gen.interrupted is None:
            # the loop ran its last step, and the pipeline calls the transformer again: a
            # denoising loop after it in the same call (Helios' windows, each with its own
            # set_timesteps), a ring of its own from its first step
            gen.next_loop()
        if gen.denoiser is None:  # the loop's first call
            self._start(gen)
            if not gen.ring:
                return self.denoisers[name].unpipelined(*args, **kwargs)
            gen.denoiser = name
        elif name != gen.denoiser:
            self._switch(gen, name)
        call = bind_call(self.denoisers[name].denoiser.forward, args, kwargs)
        if gen.step > gen.begin:
            # this step's timestep may settle the form of the timestep input
            t = gen.timesteps[gen.step: gen.step + 1]
            gen.glue = gen.glue.narrowed(call[gen.glue.timestep_arg], t)
            if not gen.glue.timestep_forms:
                self._changed(gen, f"the timestep input {gen.glue.timestep_arg!r}")
            check_call(self.pipe, gen, call, len(gen.calls))
        gen.calls.append(call)
        structure = self.denoisers[name].output_structure(call)
        answer = probe(structure, gen.step, len(gen.calls))
        gen.probes.append(answer)
        return with_probe(structure, answer)

    def step(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        count_step()  # for the steps that run per call
        gen = self.generation
        if gen is not None and gen.interrupted is not None:
            # a callback ended the generation where one transformer handed over to another:
            # the loop skips the steps after this one
            return with_sample(original(*args, **kwargs), gen.interrupted)
        if gen is None or not gen.ring or not gen.calls:
            return original(*args, **kwargs)
        noise_pred, t, sample = step_arguments(original, args, kwargs)
        if gen.step == gen.begin:
            reasons = [*self._follow_first_timestep(gen, t),
                       *step_option_reasons(original, args, kwargs)] if gen.step == 0 else []
            self._identify(gen, noise_pred, sample, t)
            try:
                if reasons:
                    raise UnpipelinedStep("; ".join(reasons))
                self._prepare_segment(gen, gen.carried or Carried(sample))
            except UnpipelinedStep as err:
                return self._per_call_from_here(gen, original, args, kwargs, err)
        else:
            check_prediction(self.pipe, gen, noise_pred)
        # the pipeline may keep its latents in another dtype between steps
        if gen.previous is not None and not same(sample, gen.previous.to(sample.dtype)):
            self._blended(gen, sample)
        # the scheduler's own bookkeeping, on probes; the noise it draws, the pipeline's
        noisy = gen.table.noise is not None
        with drawn_noise(self.pipe.scheduler) if noisy else contextlib.nullcontext([]) as drawn:
            output = original(*args, **kwargs)
        if drawn:
            gen.noises[gen.step] = gen.table.noise[gen.step].item() * drawn[0]
        gen.previous = prev_sample(output)
        last = gen.step == len(gen.timesteps) - 1
        gen.step, gen.calls, gen.probes = gen.step + 1, [], []
        if not last:
            return output
        latents = self._end_segment(gen).sample
        gen.finished = True
        return with_sample(output, latents if gen.interrupted is None else gen.interrupted)

    # -- the generation ---------------------------------------------------------------------

    def _start(self, gen: Generation) -> None:
        """At the first transformer call: ring or per call, decided before any probe."""
        scheduler = self.pipe.scheduler
        gen.reasons += self._use(gen, loop_schedule(scheduler, self.timestep_args,
                                                    announced_begin(scheduler)))
        if gen.reasons:
            self._warn_per_call(gen.reasons)

    @staticmethod
    def _use(gen: Generation, schedule: LoopSchedule) -> list[str]:
        """The generation runs `schedule`; why it cannot be a ring (empty: it can)."""
        gen.table, gen.timesteps = schedule.table, schedule.timesteps
        return schedule.reasons

    def _follow_first_timestep(self, gen: Generation, t: Any) -> list[str]:
        """A loop that starts inside the schedule without telling the scheduler (Wan's
        video-to-video slices the timesteps itself): the schedule from the step it takes
        first; why that cannot make a ring (empty: it can)."""
        if step_of(gen.timesteps[:1], t) == 0:
            return []
        begin = step_of(self.pipe.scheduler.timesteps, t)
        if begin is None:
            raise RingUnavailable(f"{type(self.pipe).__name__}'s first step passes timestep "
                                  f"{torch.as_tensor(t).flatten()[0].item()}, which is not in "
                                  "its scheduler's schedule (ring mode replays the schedule)")
        schedule = loop_schedule(self.pipe.scheduler, self.timestep_args, begin)
        if schedule.table is None:
            raise RingUnavailable(f"ring mode cannot run {type(self.pipe).__name__}'s loop "
                                  f"from step {begin}: {'; '.join(schedule.reasons)}")
        return self._use(gen, schedule)

    def _identify(self, gen: Generation, noise_pred: torch.Tensor, sample: torch.Tensor,
                  t: Any) -> None:
        """What the pipeline does around the transformer in a step (`gen.glue`)."""
        check_combinable(type(self.pipe).__name__, noise_pred, sample)
        scale = float(gen.table.input_scale[gen.step])
        try:
            gen.glue = identify(gen.calls, gen.probes, noise_pred, sample, t, scale,
                                gen.guidance_candidates)
        except GlueNotFound as err:
            raise RingUnavailable(f"ring mode could not replay {type(self.pipe).__name__}'s "
                                  f"denoising step: {err}") from err
        why = second_latent(self._output_structure(gen), gen.calls[0], gen.glue.latent_arg)
        if why is not None:
            raise RingUnavailable(f"{type(self.pipe).__name__}: {why}")

    def _output_structure(self, gen: Generation) -> Any:
        return self.denoisers[gen.denoiser].output_structure(gen.calls[0])

    def _prepare_segment(self, gen: Generation, start: Carried) -> None:
        """Plans the ring of the segment that starts at this step, from `start`."""
        gen.first_calls = gen.calls
        rings = self.denoisers[gen.denoiser]
        try:
            gen.run = rings.prepare(gen.glue, gen.calls, gen.table.steps(gen.step), start)
        except UnpipelinedStep as err:
            if gen.step == 0:
                raise
            cfg = "" if self.cfg == 1 else "cfg=1, "
            raise TokpipeError(f"{type(self.pipe).__name__}'s {gen.denoiser} takes over at "
                               f"step {gen.step}, and {err}; run the pipeline per call with "
                               f"parallelize(pipe, {cfg}ring=False)") from err

    def _end_segment(self, gen: Generation) -> Carried:
        """Runs the current segment's ring over its steps (up to the one before
        `gen.step`): the latents and scheduler state after them."""
        steps, begin, callbacks = gen.step - gen.begin, gen.begin, gen.callbacks
        each_step = None if callbacks is None else (
            lambda k, latents: callbacks.see(begin + k, latents))
        try:
            blends = with_noise(gen.blends.per_step(gen.begin, steps, gen.previous),
                                gen.noises, gen.begin, steps, gen.previous)
            gen.carried = gen.run(gen.glue, steps, blends, each_step)
        except StopRing:  # a callback ended the generation (raise_error raises its error)
            gen.carried = Carried(gen.interrupted)
        gen.run = None
        if torch.distributed.is_initialized():
            self._agree_on_the_end(gen)
        if callbacks is not None:
            callbacks.raise_error()
        elif gen.agreed_end is None and interruptible(self.pipe) and \
                getattr(self.pipe, "_interrupt", False):
            warn(f"tokpipe: {type(self.pipe).__name__}'s interrupt was set while its ring ran "
                 "on several ranks, which each would see at another step: the ring ran to "
                 "its end. To end a generation early on several ranks, interrupt it from a "
                 "step callback (callback_on_step_end) that every rank passes")
        return gen.carried

    def _agree_on_the_end(self, gen: Generation) -> None:
        """Several ranks: the segment ends alike on every rank, where a step callback
        interrupted it on one or raised on one (`segment_ends`). An interrupt agreed on is
        set on the pipeline too, so that its loop skips the steps left on every rank."""
        timeout = self.denoisers[gen.denoiser].config.timeout
        latents = agree_on_the_end(gen.callbacks, gen.carried.sample, timeout)
        if latents is None:
            return
        dtype = gen.interrupted.dtype if gen.interrupted is not None else \
            gen.previous.dtype if gen.previous is not None else latents.dtype
        gen.agreed_end = latents.to(dtype)
        gen.carried = Carried(gen.agreed_end)
        self.pipe._interrupt = True

    def _blended(self, gen: Generation, sample: torch.Tensor) -> None:
        """The pipeline changed the latents after the last step: a blend the ring can apply
        (inpainting), or an error."""
        if gen.step == gen.begin:  # the segment before ran already
            self._changed(gen, f"the latents where {gen.denoiser} takes over")
        try:
            gen.blends.observe(gen.step, gen.previous, sample)
        except BlendNotFound as err:
            self._changed(gen, str(err))

    def _switch(self, gen: Generation, name: str) -> None:
        """The loop calls another transformer from this step on (Wan 2.2's low-noise
        expert): the segment so far runs now, and the next starts from its result."""
        if gen.calls:
            self._changed(gen, f"the transformer within a step (to {name})")
        self._end_segment(gen)
        gen.denoiser, gen.begin, gen.glue, gen.first_calls = name, gen.step, None, []

    def _per_call_from_here(self, gen: Generation, original: Callable[..., Any], args: tuple,
                            kwargs: dict, err: Exception) -> Any:
        """The first step as the pipeline meant it (the transformer called for real, the
        identified guidance applied), and the rest per call; the call again per call where
        the step used probes for outputs besides the prediction."""
        tensors = len(output_tensors(self._output_structure(gen)))
        if tensors > 1:
            raise RingUnavailable(f"{err}; the transformer returns {tensors} tensors, whose "
                                  "probes the first step used beside the prediction") from err
        gen.reasons.append(str(err))
        self._warn_per_call(gen.reasons)
        per_call = self.denoisers[gen.denoiser].unpipelined
        outs = [as_stacked(gen.glue.per_item, per_call(**call)) for call in gen.calls]
        noise_pred = guide(gen.glue, torch.cat(outs) if len(outs) == 2 else outs[0],
                           gen.glue.guidance)
        bound = inspect.signature(original).bind(*args, **kwargs)
        bound.arguments["model_output"] = noise_pred
        gen.step, gen.calls, gen.probes = 1, [], []
        return original(*bound.args, **bound.kwargs)

    def _changed(self, gen: Generation, what: str) -> None:
        raise changed(self.pipe, gen.step, what)

    def _warn_per_call(self, reasons: list[str]) -> None:
        if self.cfg == 2:
            self._warn(f"tokpipe: cfg=2: {type(self.pipe).__name__} cannot run this call's "
                       f"guidance branches apart ({'; '.join(reasons)}): it runs "
                       "unparallelized, the whole transformer on every rank at every step; "
                       "parallelize with cfg=1 to pipeline such calls")
            return
        self._warn(f"tokpipe: {type(self.pipe).__name__} runs per call (each step fills and "
                   f"drains the pipeline), not as a ring: {'; '.join(reasons)}")

    def _warn(self, message: str) -> None:
        if message not in self.warned:
            self.warned.add(message)
            warn(message)
