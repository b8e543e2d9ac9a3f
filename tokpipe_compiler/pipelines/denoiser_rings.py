"""The rings of one denoising transformer of a parallelized pipeline.

A generation's loop is one segment per transformer it calls in turn: one for most
pipelines; Wan 2.2 hands the low-noise steps to a second expert. At a segment's first step
`DenoiserRings.prepare` plans the ring of the step identified there (traced and planned
once per form of step and input shapes). The run it returns takes the segment's steps
from the latents and scheduler state the segment starts with (`Carried`) and hands back
both at its end, so that the next segment's ring starts where this one stopped, as the
pipeline's own loop does.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from tokpipe_compiler.config import Config
from tokpipe_compiler.core.errors import OneUnitGrid, TokpipeError
from tokpipe_compiler.core.warn import warn
from tokpipe_compiler.pipelines import cfg_parallel
from tokpipe_compiler.pipelines.glue import Glue, model_timesteps, same
from tokpipe_compiler.pipelines.guidance_forms import PERTURBED
from tokpipe_compiler.pipelines.probes import (
    RingUnavailable,
    fake_run_error,
    fake_run_fits,
    output_structure,
)
from tokpipe_compiler.pipelines.ring_step import (
    batched_call,
    carry_condition,
    fixed_inputs,
    make_step,
    split_fixed,
)
from tokpipe_compiler.pipelines.schedulers import StepTable
from tokpipe_compiler.planning.module_state import ModuleState, changed_parts, module_state
from tokpipe_compiler.ring import KEPT_SIGNATURES, Ring
from tokpipe_compiler.ring_carry import WholeCarry
from tokpipe_compiler.ring_trace import StepGraphBreak
from tokpipe_compiler.runtime.branch_exchange import exchanging

ONE_UNIT = ("the latents' token grid is one unit (an image one row of patches high), which "
            "no chunking cuts")


class UnpipelinedStep(TokpipeError):
    """Found at the first step: the ring cannot take this generation. The compiler cannot
    pipeline the step function (raised only with option fallback=True, where the backend
    then runs such graphs unpipelined), or the loop, found to start inside the schedule,
    has one step left. The first step is computed for real and the generation goes on per
    call."""


@dataclass(frozen=True)
class Carried:
    """The loop's values between two steps: the latents, and the scheduler's state (empty
    before the first step, where it starts at zeros as diffusers starts it)."""

    sample: torch.Tensor
    state: tuple[torch.Tensor, ...] = ()


# The latents after each step of a segment (counted from its first), as the pipeline holds
# them: what its step-end callbacks see.
EachStep = Callable[[int, torch.Tensor], None]
# A prepared segment: (the step's glue as the segment's last step left it, steps, the
# blends after its steps as per-step inputs, if any, what sees each step's latents, if
# anything) -> the values after those steps.
RunSegment = Callable[[Glue, int, dict[str, torch.Tensor], EachStep | None], Carried]


class DenoiserRings:
    """One transformer's rings and its per-call path (`per_call`: the transformer compiled
    with the tokpipe backend, for steps that do not run as a ring; see `unpipelined`)."""

    def __init__(self, pipe: Any, name: str, denoiser: torch.nn.Module,
                 per_call: Callable[..., Any], options: dict[str, Any], cfg: int = 1,
                 branches: cfg_parallel.Branches | None = None):
        self.pipe, self.name, self.denoiser, self.per_call = pipe, name, denoiser, per_call
        self.options, self.cfg, self.branches = options, cfg, branches
        self.config = Config.from_options(options)
        self.rings: dict[Any, Ring] = {}
        self._shapes: dict[Any, Any] = {}  # call signature -> output structure (fake run)
        # calls' signature -> rows_per_sample, the inputs passed once
        self._batching: dict[Any, tuple[bool, frozenset[str]]] = {}
        self._branch_forward: Callable[..., Any] | None = None
        self._state: ModuleState | None = None  # the transformer's `module_state` its rings traced
        # The rings of the state before, where only the processors or settings changed
        # since (the same weights): a pipeline that swaps them back finds them traced.
        self._kept: tuple[ModuleState, tuple] | None = None

    def output_structure(self, call: dict[str, Any]) -> Any:
        """The transformer's output for this call, as Specs (cached per signature)."""
        key = tuple((k, (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else repr(v))
                    for k, v in call.items())
        if key not in self._shapes:
            self._shapes[key] = output_structure(self.denoiser.forward, call)
        return self._shapes[key]

    def prepare(self, glue: Glue, calls: list[dict[str, Any]], table: StepTable,
                start: Carried) -> RunSegment:
        """The ring of the step `glue` identified from `calls`, planned now; `table` holds
        the steps from the segment's first to the loop's last."""
        self._follow_the_module()
        # a copy: the ring runs after the probe steps, and a loop that writes its latents
        # in place (Kandinsky 5's `latents[..., :c] = scheduler.step(...)`) writes the
        # probes' values into the tensor it passed to the first step
        start = dataclasses.replace(start, sample=start.sample.clone())
        sample = start.sample
        fixed = self._fixed(glue, calls, sample.shape[0])
        if self.cfg == 2 and glue.combine == "none":
            raise UnpipelinedStep("the call runs no classifier-free guidance (one branch)")
        if self.cfg == 2 and glue.combine in PERTURBED:
            raise UnpipelinedStep("the call runs perturbed-attention guidance, whose "
                                  "attention processors split the guidance batch inside "
                                  "the transformer")
        whole = passed_whole(calls)
        if self.cfg == 2 and self.config.stages == 1:
            return self._branches_in_turn(table, start, fixed, whole)
        batch = sample.shape[0] * glue.copies
        branch = None if self.branches is None else self.branches.branch
        if branch is not None:
            fixed = cfg_parallel.half(fixed, branch, batch, whole)
        carried, fixed = carry_condition(glue, sample, fixed)
        tensors, spec, constants = split_fixed(fixed)
        ring = self._ring(glue, spec, constants, table, branch, blended=False)
        guidance = torch.tensor(glue.guidance, device=sample.device)  # a stage input: graphed
        inputs = {"sample": carried, "guidance": guidance, **tensors,
                  **_first_state(carried, start.state, table.state_size)}

        def per_step(final: Glue, steps: int) -> dict[str, torch.Tensor]:
            part = table.steps(0, steps)  # the timesteps as the glue makes them
            return {"timestep": model_timesteps(final, part.timesteps, batch).to(sample.device),
                    "scale": part.input_scale.to(sample.device),
                    "coeffs": part.rows.to(sample.device)}

        try:
            ring.prepare(inputs, per_step(glue, len(table.timesteps)))
        except OneUnitGrid as err:
            raise UnpipelinedStep(ONE_UNIT) from err
        except WholeCarry as err:  # sync mode planned an op whole: per call runs it
            raise UnpipelinedStep(str(err)) from err
        except StepGraphBreak as err:  # per call, Dynamo's pieces run as they can
            raise UnpipelinedStep(f"{err}; per call, the transformer runs as the graphs "
                                  "Dynamo splits it into") from err
        except TokpipeError as err:  # the compiler cannot pipeline this step
            if not self.options.get("fallback"):
                raise
            raise UnpipelinedStep(f"the ring's step cannot be pipelined: {err}") from err

        def latents_of(carried_sample: torch.Tensor) -> torch.Tensor:
            if not glue.condition_positions:
                return carried_sample
            # the carried condition's positions dropped
            dim = glue.condition_dim
            return carried_sample.narrow(dim, 0, sample.shape[dim])

        def run(final: Glue, steps: int, blends: dict[str, torch.Tensor],
                each_step: EachStep | None = None) -> Carried:
            blended = ring
            if blends:
                if glue.condition_positions:
                    raise TokpipeError("ring mode cannot blend latents between steps where it "
                                       "carries the condition's positions; run the pipeline "
                                       "per call with parallelize(pipe, ring=False)")
                blended = self._ring(glue, spec, constants, table, branch, blended=True)
            see = None if each_step is None else (
                lambda k, value: each_step(k, latents_of(value)))
            if self.branches is not None:  # the peer rank's ring must run this generation
                cfg_parallel.check_same_generation(start.sample, table.timesteps[:steps],
                                                   final.guidance, self.config.timeout,
                                                   self.branches.peer_group)
            with self._exchange():
                out = blended.run(inputs, {**per_step(final, steps), **blends},
                                  progress=self._progress(steps), each_step=see)
            return Carried(latents_of(out[0]), tuple(out[1:]))

        return run

    def _fixed(self, glue: Glue, calls: list[dict[str, Any]], batch: int) -> dict[str, Any]:
        """The fixed inputs of the ring's step. Two branches' calls become one batched call,
        which the transformer must take: an input both pass alike with rows neither 1 nor
        the batch is passed once, or, where the transformer refuses that (fake tensors
        tell), batched as rows per sample."""
        key = _signature(calls)  # fake runs of the transformer: once per call signature
        if key not in self._batching:
            self._batching[key] = self._batching_of(glue, calls, batch)
        rows_per_sample, once = self._batching[key]
        return fixed_inputs(glue, calls, batch, rows_per_sample=rows_per_sample, once=once)

    def _batching_of(self, glue: Glue, calls: list[dict[str, Any]],
                     batch: int) -> tuple[bool, frozenset[str]]:
        """`rows_per_sample` and the inputs passed `once` for the batched call of `calls`
        (`_fixed`): where batching an input both calls pass alike is refused, that input
        passed once (a row per layer, say, that a batch of one cannot tell from a row per
        sample)."""
        forward = self.denoiser.forward
        if len(calls) != 2 or not fake_run_fits(forward, calls[0]):
            return False, frozenset()  # one call, or a transformer fake tensors cannot judge
        error = fake_run_error(forward, batched_call(glue, calls, fixed_inputs(glue, calls,
                                                                             batch)))
        if error is None:
            return False, frozenset()
        per_sample = fixed_inputs(glue, calls, batch, rows_per_sample=True)
        if fake_run_fits(forward, batched_call(glue, calls, per_sample)):
            return True, frozenset()
        alike = [name for name in calls[0] if name not in (glue.latent_arg, glue.timestep_arg)
                 and same(calls[0][name], calls[1][name])]
        # each alike input alone, then all together, in the calls' order on every rank
        tries = dict.fromkeys([*(frozenset({name}) for name in alike), frozenset(alike)])
        for once in [t for t in tries if t]:
            for rows_per_sample in (False, True):
                tried = fixed_inputs(glue, calls, batch, rows_per_sample, once)
                if fake_run_fits(forward, batched_call(glue, calls, tried)):
                    return rows_per_sample, once
        raise RingUnavailable(f"ring mode batches the two guidance branches' calls into one, "
                              f"which {type(self.denoiser).__name__} refuses ({error})")

    def _follow_the_module(self) -> None:
        """Drop the rings (traced with the transformer's weights and modules as they were)
        when the transformer changed other than in place since: a LoRA loaded, a weight
        assigned anew, a processor swapped. Where only processors or settings changed, the
        rings are kept aside, once, and taken back when the transformer is as it was
        (diffusers' PAG pipelines swap processors with the guidance at every call)."""
        state = module_state(self.denoiser)
        if self._state is None or state == self._state or not (self.rings or self._shapes):
            self._state = state
            return
        kept, bundle = self._kept, (self.rings, self._shapes, self._batching,
                                    self._branch_forward)
        self._kept = (self._state, bundle) if state.weights == self._state.weights else None
        if kept is not None and kept[0] == state:  # back as it was: its rings as traced
            self.rings, self._shapes, self._batching, self._branch_forward = kept[1]
        else:
            warn(f"tokpipe: {type(self.pipe).__name__}.{self.name} changed since its "
                 f"rings were traced (in {_changes(self._state, state)}): tracing and "
                 "planning them anew, so this call compiles again")
            self.rings, self._shapes, self._batching, self._branch_forward = {}, {}, {}, None
        self._state = state

    def _branches_in_turn(self, table: StepTable, start: Carried, fixed: dict[str, Any],
                          whole: frozenset[int]) -> RunSegment:
        """cfg=2 on one stage per branch: the whole transformer per branch (`cfg_parallel`);
        `whole`: the inputs no branch halves (`passed_whole`)."""
        forward = self._forward_per_branch()

        def run(final: Glue, steps: int, blends: dict[str, torch.Tensor],
                each_step: EachStep | None = None) -> Carried:
            part = table.steps(0, steps)
            latents, state = cfg_parallel.run(forward, final, part, start.sample, fixed,
                                              part.timesteps, self.config.timeout, start.state,
                                              blends, each_step, whole)
            return Carried(latents, state)

        return run

    def _ring(self, glue: Glue, spec: Any, constants: list[Any], table: StepTable,
              branch: int | None, blended: bool) -> Ring:
        """The ring for this form of step (hybrid cfg=2: of this rank's guidance branch,
        over its branch's ranks; blended: with the latents blended after each update)."""
        # the guidance scale and the timesteps are inputs of the step, not constants
        glue = dataclasses.replace(glue, guidance=0.0, timestep_forms=())
        key = (glue, str(spec), repr(constants), table.state_size, table.pattern, branch,
               blended)
        if key in self.rings:  # the latest used last
            self.rings[key] = self.rings.pop(key)
        else:
            if len(self.rings) >= KEPT_SIGNATURES:  # a form of step per size (LTX's ints)
                del self.rings[next(iter(self.rings))]
            step = make_step(self.denoiser.forward, glue, spec, constants, table, branch,
                             blended)
            carry = ["sample", *(f"state_{i}" for i in range(table.state_size))]
            group = None if self.branches is None else self.branches.stage_group
            # the transformer is followed here (_follow_the_module), for every ring at once
            # fallback is the per-call path's (prepare falls back to it), not the ring's
            options = {k: v for k, v in self.options.items() if k != "fallback"}
            self.rings[key] = Ring(step, carry=carry, group=group, follow_modules=False,
                                   **options)
        return self.rings[key]

    def _exchange(self) -> contextlib.AbstractContextManager:
        """Hybrid cfg=2: the rings' last stages swap predictions over the peer group."""
        if self.branches is None:
            return contextlib.nullcontext()
        return exchanging(self.branches.peer_group, self.config.timeout)

    def _progress(self, steps: int) -> Callable[[int], None] | None:
        """A bar for the ring's steps (the pipeline's own bar waits at the segment's last
        step while the ring runs them all), shown on one rank unless the pipeline's is
        disabled."""
        pipe_config = getattr(self.pipe, "_progress_bar_config", {}) or {}
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        if pipe_config.get("disable") or rank != 0:
            return None
        from tqdm.auto import tqdm

        label = "tokpipe ring" if self.name == "transformer" else f"tokpipe ring ({self.name})"
        bar = tqdm(total=steps, desc=label, unit="step", leave=False)

        def report(step: int) -> None:
            bar.update(step + 1 - bar.n)
            if bar.n >= steps:
                bar.close()

        return report

    def unpipelined(self, *args: Any, **kwargs: Any) -> Any:
        """A step that does not run as a ring: pipelined per call over the ranks (cfg=1),
        or, where the ranks hold guidance branches (cfg=2) and the call cannot be split
        into them, the whole transformer on every rank."""
        if self.cfg == 2:
            return self._forward_per_branch()(*args, **kwargs)
        return self.per_call(*args, **kwargs)

    def _forward_per_branch(self) -> Callable[..., Any]:
        """The whole transformer for one guidance branch (cfg=2): eager, or compiled by
        Inductor as the `compiler` option says."""
        if self._branch_forward is None:
            forward = self.denoiser.forward
            if self.config.compiler != "eager":
                mode = "max-autotune-no-cudagraphs" if self.config.compiler == "max-autotune" \
                    else None
                forward = torch.compile(forward, dynamic=False, mode=mode)
            self._branch_forward = forward
        return self._branch_forward


def _changes(before: ModuleState, after: ModuleState) -> str:
    """Where a transformer changed, for the warning: its modules, and the attention
    processors swapped for another class."""
    swapped = [f"{name}: {before.processors[name]} -> {kind}"
               for name, kind in after.processors.items()
               if before.processors.get(name) not in (None, kind)]
    more = f" and {len(swapped) - 2} more" if len(swapped) > 2 else ""
    return changed_parts(before, after) + (
        f"; attention processors swapped, {', '.join(swapped[:2])}{more}" if swapped else "")


def _first_state(carried: torch.Tensor, state: tuple[torch.Tensor, ...],
                 size: int) -> dict[str, torch.Tensor]:
    """The ring's first `state_<i>`: the state handed over by the previous segment, or zeros
    before the loop's first step, as diffusers starts it."""
    if not state:
        dtype = torch.promote_types(carried.dtype, torch.float32)
        state = tuple(torch.zeros_like(carried, dtype=dtype) for _ in range(size))
    if len(state) != size or any(s.shape != carried.shape for s in state):
        raise TokpipeError(f"the scheduler's state handed to this transformer's steps "
                           f"({[tuple(s.shape) for s in state]}) does not fit its ring "
                           f"({size} x {tuple(carried.shape)}); run the pipeline per call "
                           "with parallelize(pipe, ring=False)")
    return {f"state_{i}": s for i, s in enumerate(state)}


def _signature(calls: list[dict[str, Any]]) -> tuple:
    """The calls' argument names, tensor shapes and dtypes and other values."""
    leaves = [(name, leaf) for call in calls for name, value in call.items()
              for leaf in pytree.tree_leaves(value)]
    return tuple((name, (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else repr(v))
                 for name, v in leaves)


def passed_whole(calls: list[dict[str, Any]]) -> frozenset[int]:
    """Ids of the tensors the batched call passes as the first branch's call passed them
    (`fixed_inputs` passes once an input both calls pass alike, neither one row nor a
    batch of them): a branch takes them whole. None (empty) where one call ran both
    branches."""
    if len(calls) != 2:
        return frozenset()
    return frozenset(id(leaf) for leaf in pytree.tree_leaves(calls[0])
                     if isinstance(leaf, torch.Tensor))
