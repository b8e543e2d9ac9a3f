"""Ring mode: the runtime owns the denoising loop, so no pipeline bubble between steps.

The user writes one denoising step as a function (model call, guidance, scheduler update)
whose outputs feed its next inputs. The scheduler update is token-wise, so the compiler
places it in the last stage; each chunk's updated latents go straight back to stage 0 for
the next step while later chunks of this step are still in flight (PipeFusion's schedule).

    ring = tp.Ring(step, carry=["latents"], stages=2, chunks=4, warmup_steps=1)
    (latents,) = ring.run({"latents": x, "labels": y}, per_step={"t": timesteps})

The numbers equal the per-call loop `for k: latents = compiled(latents, t[k], ...)` with the
same options where a step's model calls share one timestep: every K/V has the same
freshness in both.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from tokpipe_compiler.config import Config
from tokpipe_compiler.core.errors import TokpipeError
from tokpipe_compiler.core.logs import LOG as log
from tokpipe_compiler.core.warn import warn
from tokpipe_compiler.planning.argument_reads import read_arguments
from tokpipe_compiler.planning.capture import Captured
from tokpipe_compiler.planning.driver import build_plan
from tokpipe_compiler.planning.free_values import free_values
from tokpipe_compiler.planning.traced_modules import TracedModules
from tokpipe_compiler.ring_carry import check_carry
from tokpipe_compiler.ring_inputs import (
    carry_names,
    check_carried_inputs,
    check_per_step,
    check_steps,
    input_signature,
)
from tokpipe_compiler.ring_returns import ONE_PER_CARRY, Feeds, check_returns
from tokpipe_compiler.ring_trace import StepGraphBreak, trace_step
from tokpipe_compiler.runtime.chunking import Chunk
from tokpipe_compiler.stage_programs.distributed import make_program, planned_alike
from tokpipe_compiler.stage_programs.step_watch import Watch

KEPT_SIGNATURES = 8  # input signatures (shapes, dtypes) whose programs a ring keeps


class Ring:
    """A step function compiled once and run for whole generations.

    The step is traced once per input signature, with the weights it reads: values written
    into them in place reach the ring; where the modules it read them from changed
    otherwise since (a parameter assigned anew, another module in their place, a processor
    swapped), the next run warns and traces anew (`planning.traced_modules`).

    carry: names of the inputs that the step's outputs become, in output order.
    group: the torch.distributed group whose ranks run the stages (default: the world).
    follow_modules: look for changed modules before each run (a caller that follows them
    itself and makes a new Ring on a change, as `parallelize` does, passes False).
    options: the backend's options (stages, chunks, mode, warmup_steps, compiler, timeout).
    """

    def __init__(self, step_fn: Callable[..., Any], carry: Sequence[str], group: Any = None,
                 *, follow_modules: bool = True, **options: Any):
        self.step_fn = step_fn
        self.follow_modules = follow_modules
        self.carry = carry_names(carry)
        self.group = group
        if options.get("fallback"):
            raise TokpipeError("Ring: fallback=True does not apply to a ring, which runs the "
                               "whole loop pipelined or not at all; to run a step the "
                               "compiler cannot pipeline, call it per step, unpipelined "
                               "(torch.compile(step, backend='tokpipe', "
                               "options={'fallback': True}) or eagerly)")
        self.config = Config.from_options({"token_input": self.carry[0], **options})
        if self.config.mode == "stale" and self.config.warmup_steps < 1:
            raise ValueError("ring mode in 'stale' needs option 'warmup_steps' >= 1, got 0: "
                             "the first step must fill the K/V caches")
        self.program = None  # the program of the latest run
        self._traced: Captured | None = None
        # One trace per input signature (another batch or resolution traces anew), a plan
        # per signature and step count where chunks="auto" chooses for it, and a program
        # per signature and chunk table; those of the KEPT_SIGNATURES used last are kept.
        self._traces: dict[tuple, Captured] = {}
        self._chosen: dict[tuple, tuple[Chunk, ...]] = {}  # (signature, steps) -> chunk table
        self._programs: dict[tuple, Any] = {}  # (signature, chunk table) -> program
        self._modules: dict[tuple, TracedModules] = {}  # signature -> what its trace read
        self._feeds_by_signature: dict[tuple, Feeds | None] = {}  # `ring_returns`
        # signature -> Dynamo's break of its step, where the caller follows the modules (a
        # parallelized pipeline drops its rings when the transformer changes): not traced
        # again at every generation
        self._broken: dict[tuple, StepGraphBreak] = {}
        self._carry_feeds: Feeds | None = None  # of the latest run's signature

    def run(self, inputs: dict[str, Any], per_step: dict[str, torch.Tensor] | None = None,
            steps: int | None = None, progress: Callable[[int], None] | None = None,
            each_step: Callable[[int, torch.Tensor], None] | None = None) -> tuple:
        """Runs `steps` steps (default: the length of the per-step tensors) from `inputs`
        (the carried inputs' first values and the inputs fixed for the generation).
        `per_step[name][k]` is input `name` at step k. Returns the carried values after the
        last step, in `carry` order.

        progress(k): this rank finished step k. each_step(k, value): the first carried
        value (the token input) after step k, whole, on every rank: as the step's last
        chunk is computed on the rank that computes it, after the run on the others."""
        per_step = per_step or {}
        check_per_step(per_step, self.carry)
        steps = check_steps(steps, per_step)
        check_carried_inputs(inputs, self.carry)
        if steps == 0:  # no step taken: the carried values stay as they came
            return tuple(inputs[name] for name in self.carry)
        values = {**inputs, **{k: v[0] for k, v in per_step.items()}}
        program = self.prepare(inputs, per_step, steps)
        program.reset()
        program.ring_steps = steps  # the ranks agree on it at the generation's first call
        try:  # a sampling loop: its outputs carry no gradients, grad mode or not
            with torch.no_grad():
                outputs = self._steps(program, values, per_step, steps, progress, each_step)
        finally:  # the generation is over: its K/V caches are of no further use
            program.end_generation()
        return tuple(self._carried_values(outputs, values).values())

    def _steps(self, program, values: dict[str, Any], per_step: dict[str, torch.Tensor],
               steps: int, progress: Callable[[int], None] | None,
               each_step: Callable[[int, torch.Tensor], None] | None) -> tuple:
        """The warmup steps one call each, then the rest as one ring; the last outputs."""
        carried = self._carried_outputs(program)
        warmup = min(self.config.warmup_steps, steps)
        outputs: tuple = ()
        for k in range(warmup):
            outputs = program(*self._args(values, per_step, k))
            values.update(self._carried_values(outputs, values))
            if progress is not None:
                progress(k)
            if each_step is not None:
                _see_warmup_step(program, each_step, k, values[self.carry[0]], k + 1 == steps)
        if steps > warmup:
            step_args = [self._args(values, per_step, k) for k in range(warmup, steps)]
            feeds = self._feeds(program)  # carry[0]'s next value is this output
            first_output = program.plan.graphs.outputs[feeds[0]].source
            watch = None if each_step is None else Watch(first_output, each_step)
            outputs = program.run_ring(step_args, carried, progress=progress, first=warmup,
                                       watch=watch)
        return outputs

    def prepare(self, inputs: dict[str, Any], per_step: dict[str, torch.Tensor],
                steps: int | None = None):
        """The program `run` would use for these inputs, traced and planned now (a model
        the compiler cannot pipeline raises here, before anything runs)."""
        values = {**inputs, **{k: v[0] for k, v in per_step.items()}}
        # what "auto" chunking plans for: the whole generation the per-step values describe
        generation = min((len(v) for v in per_step.values()), default=steps or 1)
        program = self._program(values, generation - self.config.warmup_steps)
        self._carried_outputs(program)  # a carry the program cannot feed raises here too
        return program

    def programs(self) -> list:
        """Every program this ring has made (one per input signature and chunk table)."""
        return list(self._programs.values())

    def _program(self, values: dict[str, Any], ring_steps: int):
        """The program for these inputs' shapes and dtypes, traced once; with chunks="auto",
        planned for this generation's ring steps (planning once per step count), a new
        program only where the chosen chunks differ."""
        signature = (*input_signature(values), *free_values(self.step_fn))
        if self.follow_modules:
            self._follow_the_modules(signature, values)
        if signature in self._traces:  # the latest used last
            self._traces[signature] = self._traces.pop(signature)
        else:
            self._forget_the_oldest()
            traced = self._trace(signature, values)
            # before planning: in every mode alike
            self._feeds_by_signature[signature] = check_returns(traced, self.carry,
                                                               self.step_fn, values)
            self._traces[signature] = traced
            self._warn_of_writes(self._traces[signature])
            if self.follow_modules:
                self._modules[signature] = TracedModules(self.step_fn,
                                                         self._traces[signature].gm, values)
        self._traced = self._traces[signature]
        self._carry_feeds = self._feeds_by_signature[signature]
        steps = max(ring_steps, 1) if self.config.chunks == "auto" else None
        if (signature, steps) not in self._chosen:
            with planned_alike(self.group, self.config.timeout):
                plan = build_plan(self._traced.gm, self.config, ring_steps=steps or 1)
            table = self._chosen[signature, steps] = tuple(plan.chunks)
            if (signature, table) not in self._programs:
                self._programs[signature, table] = make_program(plan, None, group=self.group)
        self.program = self._programs[signature, self._chosen[signature, steps]]
        return self.program

    def _trace(self, signature: tuple, values: dict[str, Any]) -> Captured:
        """The step traced for `signature`; a break Dynamo found in it before raises again
        at once (the modules unchanged: see `_broken`)."""
        if signature in self._broken:
            raise StepGraphBreak(str(self._broken[signature]))
        try:
            return trace_step(self.step_fn, values)
        except StepGraphBreak as err:
            if not self.follow_modules:
                self._broken[signature] = err
            raise

    def _forget_the_oldest(self) -> None:
        """Before a new signature's trace: drop the traces, plans and programs of the one
        used least recently where KEPT_SIGNATURES are held (a server drawing at many sizes
        would keep every size's, tens of MB each at released depths). Every rank makes the
        same calls, so every rank forgets the same one."""
        if len(self._traces) < KEPT_SIGNATURES:
            return
        oldest = next(iter(self._traces))
        log.info("tokpipe ring: dropping the programs of an input signature used %d "
                 "signatures ago; it is traced and planned again if it returns",
                 KEPT_SIGNATURES)
        del self._traces[oldest]
        self._modules.pop(oldest, None)
        self._feeds_by_signature.pop(oldest, None)
        self._chosen = {k: v for k, v in self._chosen.items() if k[0] != oldest}
        self._programs = {k: v for k, v in self._programs.items() if k[0] != oldest}

    def _follow_the_modules(self, signature: tuple, values: dict[str, Any]) -> None:
        """Drop every trace (each holds the weights as they were) where the modules this
        signature's trace read its weights from changed other than in place."""
        traced = self._modules.get(signature)
        change = None if traced is None else traced.changed(values)
        if change is not None:
            warn(f"tokpipe: Ring: the step function's weights changed since it was traced "
                 f"({change}): tracing and planning it anew, so this run compiles again")
            for table in (self._traces, self._chosen, self._programs, self._modules,
                          self._feeds_by_signature):
                table.clear()

    def _warn_of_writes(self, traced: Captured) -> None:
        """A step that writes Python state (a counter on a module, a global, a list) has
        those writes replayed by Dynamo after each call of its graph; a ring runs the
        graph alone, every step with the values the first trace saw."""
        if traced.mutations and self.follow_modules:  # parallelize's own step writes none
            warn(f"tokpipe: Ring: the step function writes Python state "
                 f"({', '.join(traced.mutations)}), which a ring does not replay: every step "
                 "runs with the values it had when traced, and the writes are lost. Keep "
                 "the step free of such writes: pass what changes per step in per_step, "
                 "and carry what a step hands the next")

    def _args(self, values: dict[str, Any], per_step: dict[str, torch.Tensor], k: int) -> tuple:
        current = {**values, **{name: v[k] for name, v in per_step.items()}}
        args = self._traced.with_arguments(current, strict=False)
        for index, value in read_arguments(self._traced.reads, self.step_fn, current):
            args[index] = value  # a tensor inside an input (a dict's, an object's)
        return tuple(args)

    def _feeds(self, program) -> Feeds:
        """For each carried input, the position among the program's outputs of the value
        that feeds it; None where the step returns the input unchanged (Dynamo's graph
        outputs only what it computes: `ring_returns`)."""
        if self._carry_feeds is not None:
            return self._carry_feeds
        outputs = program.plan.graphs.outputs  # Dynamo did not say: the outputs, in order
        if len(outputs) != len(self.carry):
            raise TokpipeError(f"the step function returns {len(outputs)} tensors but "
                               f"carry names {len(self.carry)}. {ONE_PER_CARRY}")
        return list(range(len(self.carry)))

    def _carried_outputs(self, program) -> dict[str, str]:
        """Placeholder name of each carried input -> name of the output value it becomes."""
        outputs = program.plan.graphs.outputs
        carried = {}
        for name, feed in zip(self.carry, self._feeds(program), strict=True):
            if feed is None:  # returned unchanged: nothing to carry
                continue
            spec = outputs[feed]
            placeholder = self._traced.placeholder(name)
            if placeholder is None:
                read = [a for a in dict.fromkeys(self._traced.arguments) if a is not None]
                raise TokpipeError(f"carried input {name!r} is not an input the step "
                                   f"function reads (it reads {read}): carry names inputs "
                                   "that each step reads and returns the next value of; to "
                                   "look at the latents after each step, pass each_step= "
                                   "to run")
            if spec.source != placeholder:
                check_carry(name, self._traced, self.carry[0], placeholder, spec,
                            program.plan)
                carried[placeholder] = spec.source
        return carried

    def _carried_values(self, outputs: tuple, values: dict[str, Any]) -> dict[str, Any]:
        """Each carried input's value after a step whose program returned `outputs`, from
        `values` where the step returns it unchanged."""
        return {name: values[name] if feed is None else outputs[feed]
                for name, feed in zip(self.carry, self._feeds(self.program), strict=True)}


def _see_warmup_step(program, each_step: Callable[[int, torch.Tensor], None], k: int,
                     value: torch.Tensor, last: bool) -> None:
    """`each_step(k, value)`; an error it raises on this rank before the last step stops
    the next step's run on every rank, where it is raised (the peers, gone on into that
    run, would wait `timeout` for this rank's messages, then lose the group)."""
    try:
        each_step(k, value)
    except BaseException as error:
        if last or not program.stop_next_run(error):
            raise
