"""A pipeline call whose denoising loop runs as one ring.

The pipeline's own `__call__` runs as written: prompt encoding, latent preparation,
`scheduler.set_timesteps`, the loop, the VAE. Three hooks turn its loop into a ring:

- the transformer, at the first step, answers with random probes (shapes from a fake-tensor
  run) and records how it was called;
- `scheduler.step` at the first step sees what the pipeline made of the probes, which
  identifies the step (`glue.identify`); it then runs every step of the generation in ring
  mode from the latents it was given, and keeps the result (where the first step leaves
  two ways of making the timestep input that differ at a later step, the ring starts at
  the step that tells them apart, from the same first latents);
- later steps answer with probes again, each checked against the identified step (so a
  pipeline that changes its step mid-generation raises instead of going wrong), and the
  last `scheduler.step` returns the ring's latents. Everything after the loop is the
  pipeline's own.

A call the ring cannot take (see `table`, and the scheduler's step table) runs per call,
with one warning that says why.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from tokpipe_compiler.config import Config
from tokpipe_compiler.core.errors import TokpipeError
from tokpipe_compiler.pipelines import cfg_parallel
from tokpipe_compiler.pipelines.glue import (
    Glue,
    GlueNotFound,
    condition_part,
    first_tensor,
    guide,
    identify,
    model_timesteps,
)
from tokpipe_compiler.pipelines.loop_schedule import (
    LoopSchedule,
    announced_begin,
    loop_schedule,
    step_of,
)
from tokpipe_compiler.pipelines.probes import bind_call, output_structure, probe, with_probe
from tokpipe_compiler.pipelines.ring_step import (
    carry_condition,
    fixed_inputs,
    make_step,
    same,
    split_fixed,
)
from tokpipe_compiler.pipelines.scheduler_route import route, step_arguments, with_sample
from tokpipe_compiler.pipelines.schedulers import StepTable
from tokpipe_compiler.pipelines.table import per_call_reasons
from tokpipe_compiler.ring import Ring
from tokpipe_compiler.runtime.branch_exchange import exchanging


class UnpipelinedStep(TokpipeError):
    """Found at the first step: the ring cannot take this generation. The compiler cannot
    pipeline the step function (raised only with option fallback=True, where the backend
    then runs such graphs unpipelined), or the loop, found to start inside the schedule,
    has one step left. The first step is computed for real and the generation goes on per
    call."""


@dataclass
class Generation:
    """One pipeline call in progress."""

    reasons: list[str]  # why it runs per call (empty: ring)
    guidance_candidates: list[float]
    step: int = 0
    calls: list[dict[str, Any]] = field(default_factory=list)
    probes: list[torch.Tensor] = field(default_factory=list)
    table: StepTable | None = None
    timesteps: torch.Tensor | None = None  # the pipeline's own, as its loop iterates them
    glue: Glue | None = None
    first_calls: list[dict[str, Any]] = field(default_factory=list)
    start: Callable[[], torch.Tensor] | None = None  # runs the prepared ring (or cfg=2 loop)
    result: torch.Tensor | None = None

    @property
    def ring(self) -> bool:
        return not self.reasons


class RingCalls:
    """Installed on one pipeline by `parallelize`: its calls run as rings where they can."""

    def __init__(self, pipe: Any, denoiser: torch.nn.Module, per_call: Callable[..., Any],
                 options: dict[str, Any], cfg: int = 1,
                 branches: cfg_parallel.Branches | None = None):
        self.pipe, self.denoiser, self.per_call = pipe, denoiser, per_call
        self.options, self.cfg, self.branches = options, cfg, branches
        self.config = Config.from_options(options)
        self._branch_forward: Callable[..., Any] | None = None
        self.generation: Generation | None = None
        self.timestep_args: tuple = ((), {})
        self.rings: dict[Any, Ring] = {}
        self.shapes: dict[Any, Any] = {}  # call signature -> output structure (fake run)
        self.warned: set[str] = set()

    @contextlib.contextmanager
    def generation_of(self, kwargs: dict[str, Any]) -> Iterator[None]:
        """A pipeline call: a generation, per call or ring, for its duration."""
        candidates = [float(v) for v in kwargs.values()
                      if isinstance(v, (int, float)) and not isinstance(v, bool)]
        candidates.append(float(getattr(self.pipe, "_guidance_scale", 1.0) or 1.0))
        self.generation = Generation(per_call_reasons(self.pipe, kwargs), candidates)
        # the pipeline's scheduler may have been replaced since the last call
        route(self.pipe.scheduler, self, self.set_timesteps, self.step)
        if self.generation.reasons:
            self._warn_per_call(self.generation.reasons)
        try:
            yield
        finally:
            self.generation = None

    # -- hooks ------------------------------------------------------------------------------

    def set_timesteps(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        self.timestep_args = (args, kwargs)
        return original(*args, **kwargs)

    def transformer(self, *args: Any, **kwargs: Any) -> Any:
        gen = self.generation
        if gen is None or not gen.ring:
            return self.per_call(*args, **kwargs)
        if gen.step == 0 and not gen.calls:
            self._start(gen)
            if not gen.ring:
                return self.per_call(*args, **kwargs)
        call = bind_call(self.denoiser.forward, args, kwargs)
        if gen.step > 0:
            if gen.start is not None:  # not started: this step's timestep may settle its form
                t = gen.timesteps[gen.step: gen.step + 1]
                gen.glue = gen.glue.narrowed(call[gen.glue.timestep_arg], t)
                if not gen.glue.timestep_forms:
                    self._changed(gen, f"the timestep input {gen.glue.timestep_arg!r}")
            self._check_call(gen, call, len(gen.calls))
        gen.calls.append(call)
        structure = self._output_structure(call)
        answer = probe(structure, gen.step, len(gen.calls))
        gen.probes.append(answer)
        return with_probe(structure, answer)

    def step(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        gen = self.generation
        if gen is None or not gen.ring or not gen.calls:
            return original(*args, **kwargs)
        noise_pred, t, sample = step_arguments(original, args, kwargs)
        if gen.step == 0:
            reasons = self._follow_first_timestep(gen, t)
            self._identify(gen, noise_pred, sample, t)
            try:
                if reasons:
                    raise UnpipelinedStep("; ".join(reasons))
                self._prepare_ring(gen, sample)
            except UnpipelinedStep as err:
                return self._per_call_from_here(gen, original, args, kwargs, err)
        else:
            self._check_prediction(gen, noise_pred)
        if gen.start is not None and gen.glue.settled(gen.timesteps):
            gen.result, gen.start = gen.start(), None
        output = original(*args, **kwargs)  # the scheduler's own bookkeeping, on probes
        last = gen.step == len(gen.timesteps) - 1
        gen.step, gen.calls, gen.probes = gen.step + 1, [], []
        return with_sample(output, gen.result) if last else output

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
            raise TokpipeError(f"{type(self.pipe).__name__}'s first step passes timestep "
                               f"{torch.as_tensor(t).flatten()[0].item()}, which is not in its "
                               "scheduler's schedule; ring mode replays the schedule: run it "
                               "per call with parallelize(pipe, ring=False)")
        schedule = loop_schedule(self.pipe.scheduler, self.timestep_args, begin)
        if schedule.table is None:
            raise TokpipeError(f"ring mode cannot run {type(self.pipe).__name__}'s loop from "
                               f"step {begin}: {'; '.join(schedule.reasons)}; run it per call "
                               "with parallelize(pipe, ring=False)")
        return self._use(gen, schedule)

    def _identify(self, gen: Generation, noise_pred: torch.Tensor, sample: torch.Tensor,
                  t: Any) -> None:
        """What the pipeline does around the transformer in a step (`gen.glue`)."""
        try:
            gen.glue = identify(gen.calls, gen.probes, noise_pred, sample, t,
                                float(gen.table.input_scale[0]), gen.guidance_candidates)
        except GlueNotFound as err:
            raise TokpipeError(f"ring mode could not replay {type(self.pipe).__name__}'s "
                               f"denoising step: {err}; run it per call with "
                               "parallelize(pipe, ring=False)") from err

    def _prepare_ring(self, gen: Generation, sample: torch.Tensor) -> None:
        """Plans the identified step's ring; `gen.start` then runs the generation from
        `sample`, once the timestep's form is settled."""
        table = gen.table
        gen.first_calls = gen.calls
        fixed = fixed_inputs(gen.glue, gen.calls, sample.shape[0])
        batch = sample.shape[0] * gen.glue.copies
        if self.cfg == 2 and gen.glue.combine == "none":
            raise TokpipeError("cfg=2: this call runs no classifier-free guidance (one "
                               "branch); use cfg=1")
        if self.cfg == 2 and self.config.stages == 1:
            gen.start = lambda: cfg_parallel.run(self._forward_per_branch(), gen.glue, table,
                                                 sample, fixed, gen.timesteps,
                                                 self.config.timeout)
            return
        branch = None if self.branches is None else self.branches.branch
        if branch is not None:
            fixed = cfg_parallel.half(fixed, branch, batch)
        carried, fixed = carry_condition(gen.glue, sample, fixed)
        tensors, spec, constants = split_fixed(fixed)
        ring = self._ring(gen.glue, spec, constants, table, branch)
        inputs = {"sample": carried, "guidance": torch.tensor(gen.glue.guidance), **tensors}
        state_dtype = torch.promote_types(sample.dtype, torch.float32)
        for i in range(table.state_size):  # zeros before the first step, as diffusers starts
            inputs[f"state_{i}"] = torch.zeros_like(carried, dtype=state_dtype)
        def per_step() -> dict[str, torch.Tensor]:  # the timesteps as the glue makes them
            return {"timestep": model_timesteps(gen.glue, gen.timesteps, batch).to(sample.device),
                    "scale": table.input_scale.to(sample.device),
                    "coeffs": table.rows.to(sample.device)}

        try:
            ring.prepare(inputs, per_step())
        except TokpipeError as err:  # the compiler cannot pipeline this step
            if not self.options.get("fallback"):
                raise
            raise UnpipelinedStep(f"the ring's step cannot be pipelined: {err}") from err

        def start() -> torch.Tensor:
            with self._exchange():
                out = ring.run(inputs, per_step(),
                               progress=self._progress(len(gen.timesteps)))[0]
            if not gen.glue.condition_positions:
                return out
            dim = gen.glue.condition_dim  # the carried condition's positions dropped
            return out.narrow(dim, 0, sample.shape[dim])

        gen.start = start

    def _exchange(self) -> contextlib.AbstractContextManager:
        """Hybrid cfg=2: the rings' last stages swap predictions over the peer group."""
        if self.branches is None:
            return contextlib.nullcontext()
        return exchanging(self.branches.peer_group, self.config.timeout)

    def _progress(self, steps: int) -> Callable[[int], None] | None:
        """A bar for the ring's steps (the pipeline's own bar waits at its first step while
        the ring runs them all), shown where the pipeline shows its own, on one rank."""
        config = getattr(self.pipe, "_progress_bar_config", {}) or {}
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        if config.get("disable") or rank != 0:
            return None
        from tqdm.auto import tqdm

        bar = tqdm(total=steps, desc="tokpipe ring", unit="step", leave=False)

        def report(step: int) -> None:
            bar.update(step + 1 - bar.n)
            if bar.n >= steps:
                bar.close()

        return report

    def _forward_per_branch(self) -> Callable[..., Any]:
        """The whole transformer for one guidance branch (cfg=2): eager, or compiled by
        Inductor as the `compiler` option says."""
        if self._branch_forward is None:
            forward = self.denoiser.forward
            if self.config.compiler == "inductor":
                forward = torch.compile(forward, dynamic=False)
            self._branch_forward = forward
        return self._branch_forward

    def _per_call_from_here(self, gen: Generation, original: Callable[..., Any], args: tuple,
                            kwargs: dict, err: Exception) -> Any:
        """The first step as the pipeline meant it (the transformer called for real, the
        identified guidance applied), and the rest of the generation per call."""
        gen.reasons.append(str(err))
        self._warn_per_call(gen.reasons)
        outs = [first_tensor(self.per_call(**call)) for call in gen.calls]
        noise_pred = guide(gen.glue, torch.cat(outs) if len(outs) == 2 else outs[0],
                           gen.glue.guidance)
        bound = inspect.signature(original).bind(*args, **kwargs)
        bound.arguments["model_output"] = noise_pred
        gen.step, gen.calls, gen.probes = 1, [], []
        return original(*bound.args, **bound.kwargs)

    def _ring(self, glue: Glue, spec: Any, constants: list[Any], table: StepTable,
              branch: int | None) -> Ring:
        """The ring for this form of step (hybrid cfg=2: of this rank's guidance branch,
        over its branch's ranks)."""
        # the guidance scale and the timesteps are inputs of the step, not constants
        glue = dataclasses.replace(glue, guidance=0.0, timestep_forms=())
        key = (glue, str(spec), repr(constants), table.state_size, table.pattern, branch)
        if key not in self.rings:
            step = make_step(self.denoiser.forward, glue, spec, constants, table, branch)
            carry = ["sample", *(f"state_{i}" for i in range(table.state_size))]
            group = None if self.branches is None else self.branches.stage_group
            self.rings[key] = Ring(step, carry=carry, group=group, **self.options)
        return self.rings[key]

    # -- checks of the later steps ----------------------------------------------------------

    def _check_call(self, gen: Generation, call: dict[str, Any], index: int) -> None:
        glue, first = gen.glue, gen.first_calls
        if index >= len(first) or call.keys() != first[index].keys():
            self._changed(gen, "the transformer calls")
        expected = model_timesteps(glue, gen.timesteps[gen.step: gen.step + 1],
                                   call[glue.timestep_arg].shape[0])[0]
        if not torch.equal(call[glue.timestep_arg], expected.to(call[glue.timestep_arg])):
            self._changed(gen, f"the timestep input {glue.timestep_arg!r}")
        for name, value in call.items():
            if name not in (glue.latent_arg, glue.timestep_arg) and \
                    not same(value, first[index][name]):
                self._changed(gen, f"the transformer input {name!r}")
        if glue.condition_dim is not None and not same(
                condition_part(glue, call[glue.latent_arg]),
                condition_part(glue, first[index][glue.latent_arg])):
            self._changed(gen, f"the condition joined to the latent in {glue.latent_arg!r}")

    def _check_prediction(self, gen: Generation, noise_pred: torch.Tensor) -> None:
        probe = torch.cat(gen.probes) if len(gen.probes) == 2 else gen.probes[0]
        if len(gen.probes) != gen.glue.calls or \
                not same(guide(gen.glue, probe, gen.glue.guidance), noise_pred, 1e-6):
            self._changed(gen, "the guidance")

    def _changed(self, gen: Generation, what: str) -> None:
        raise TokpipeError(f"{type(self.pipe).__name__} changed {what} at step {gen.step}; "
                           "the ring computed every step ahead from the first step's form, so "
                           "this generation cannot be trusted: run it per call with "
                           "parallelize(pipe, ring=False)")

    def _output_structure(self, call: dict[str, Any]) -> Any:
        """The transformer's output for this call, as Specs (cached per signature)."""
        key = tuple((k, (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else repr(v))
                    for k, v in call.items())
        if key not in self.shapes:
            self.shapes[key] = output_structure(self.denoiser.forward, call)
        return self.shapes[key]

    def _warn_per_call(self, reasons: list[str]) -> None:
        if self.cfg == 2:
            raise TokpipeError(f"cfg=2: {type(self.pipe).__name__} cannot run its guidance "
                               f"branches in parallel: {'; '.join(reasons)}")
        self._warn(f"tokpipe: {type(self.pipe).__name__} runs per call (each step fills and "
                   f"drains the pipeline), not as a ring: {'; '.join(reasons)}")

    def _warn(self, message: str) -> None:
        if message not in self.warned:
            self.warned.add(message)
            warnings.warn(message, stacklevel=4)
