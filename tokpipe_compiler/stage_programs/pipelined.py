"""The callable a Dynamo graph becomes: one call = one denoising step (or one guidance
branch of a step) through the pipeline.

Generations: the first `warmup_steps` steps of a generation run the whole sequence stage
after stage (exact) and fill the K/V caches; later steps run chunk by chunk with the mode's
semantics. Each guidance branch (the calls of one step with one timestep) keeps its own
caches. A new generation starts by itself when the timestep goes back up
(`generations.StepClock`), and when a program takes over its role (its token input) from
another program of the same model with other shapes.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from tokpipe_compiler.core.errors import TokpipeError
from tokpipe_compiler.core.stage_graph import OutputKind
from tokpipe_compiler.core.warn import warn
from tokpipe_compiler.planning.plan import Plan
from tokpipe_compiler.runtime.caches import KVCaches, Released, held_bytes
from tokpipe_compiler.runtime.chunking import Chunk, chunk_table
from tokpipe_compiler.runtime.executor import Executor
from tokpipe_compiler.runtime.run_stops import DeferredInterrupts
from tokpipe_compiler.runtime.stage_feeds import StageFeeds
from tokpipe_compiler.runtime.timeline_events import Timeline
from tokpipe_compiler.stage_programs.generations import StepClock, Tick, timestep_index
from tokpipe_compiler.stage_programs.model_clock import MODEL_CALL
from tokpipe_compiler.stage_programs.outputs import (
    assemble_output,
    refusing_backward,
    restrided,
    traced_strides,
    warn_no_gradients,
)
from tokpipe_compiler.stage_programs.plan_reads import (
    carry_edges,
    input_arguments,
    input_labels,
    persistent_inputs,
)
from tokpipe_compiler.stage_programs.prelude import Prelude
from tokpipe_compiler.stage_programs.session import MANY_BRANCHES, Session
from tokpipe_compiler.stage_programs.stage import StageProgram
from tokpipe_compiler.stage_programs.step_watch import StepPieces, Watch


class PipelinedProgram:
    """Runs a Plan in one process: every stage, on the same chunk schedule as the ranks.

    Subclasses run one stage per rank (`rank`, `world`, `transport`); the step logic here is
    shared, so both give the same numbers.
    """

    rank, world, transport = 0, 1, None

    _made = itertools.count()  # tells the order programs were made in (`made_order`)

    def __init__(self, plan: Plan, session: Session | None = None, owner: int | None = None):
        self.made = next(PipelinedProgram._made)
        self.plan = plan
        self.session = session
        self.owner = owner  # id of the weight that tells the model this program runs
        self.stage_programs = [
            StageProgram(g, plan.config.compiler, plan.config.cuda_graphs, persistent_inputs(plan))
            for g in plan.graphs.stages
        ]
        self.cache_specs = plan.caches
        self.branches: dict[int, KVCaches] = {}  # guidance branch -> its K/V caches
        self.released: Released | None = None  # the last generation's, once freed
        self.branch = 0
        self.last_chunk_count: int | None = None  # chunks the last call ran as
        arguments = input_arguments(plan)
        # the call's argument the token input holds: its role in the session (the graph's
        # placeholder name differs between a static graph and a symbolic one's copy)
        token = arguments[plan.graphs.input_names.index(plan.token_input)]
        self.token_argument = plan.token_input if token is None else token
        self.clock = StepClock(timestep_index(arguments, plan.config.timestep_input),
                               [i for i, name in enumerate(input_labels(plan)) if name])
        self.calls = 0  # steps run by this program, for the timeline
        self.token_shape: tuple | None = None  # its token input's shape, once called
        self.ring_steps: int | None = None  # the steps of the ring run being run, if any
        self.peak_values_held = 0  # the last run's most (step, chunk) value sets at once
        # what stopped the last run on every rank, and its number (`runtime.run_stops`)
        self.stopped: BaseException | None = None
        self.run_number = 0
        self._stop_next: BaseException | None = None  # see stop_next_run
        self.interrupts: DeferredInterrupts | None = None  # a Ctrl-C held during a call
        self.timeline = Timeline()
        self._running = threading.RLock()  # held by the thread whose call runs
        self.whole = chunk_table(plan.units, 1)
        self.prelude = Prelude(plan.graphs.prelude, plan.graphs.prelude_outputs,
                               plan.config.compiler)
        self.feeds = StageFeeds(plan.graphs.stages)
        self.strides = traced_strides(plan)
        if session is not None:
            session.programs.add(self)

    @property
    def caches(self) -> KVCaches:
        """The K/V caches of the guidance branch being run."""
        if self.branch not in self.branches:
            self.branches[self.branch] = KVCaches(self.cache_specs)
        return self.branches[self.branch]

    def reset(self) -> None:
        """A new generation: every branch's K/V dropped, warmup runs again."""
        self._new_generation()
        self.branch = 0
        self.clock.reset()

    def end_generation(self) -> None:
        """The generation is over (a ring ran its last step): its K/V buffers are freed, so
        that what the pipeline runs next (the VAE decode, its memory peak) has the memory;
        `released` keeps what they held, for the memory report. Under CUDA graphs they
        stay: the graphs read and write them in place."""
        buffers = [t for caches in self.branches.values() for t in caches.buffers.values()]
        if self.plan.config.cuda_graphs or not buffers:  # a stage without attention has none
            return
        self.released = Released(held_bytes(self.branches), len(self.branches),
                                 buffers[0].device)
        self.branches.clear()

    def stop_next_run(self, error: BaseException) -> bool:
        """`error`, raised on this rank between two runs of a generation (a ring's step
        callback in a warmup step), stops the next run from its start on every rank
        (`runtime.run_stops`): the peers, gone on into it, are not left waiting for this
        rank's messages. False where there are no peers to tell: raise it at once."""
        if getattr(self.transport, "stops", None) is None:
            return False
        self._stop_next = error
        return True

    def _new_generation(self) -> None:
        """Every branch's K/V forgotten. Under CUDA graphs the buffers stay (zeroed): the
        graphs use them in place, and new buffers would make every chunk capture again."""
        if self.plan.config.cuda_graphs:
            for caches in self.branches.values():
                caches.restart()
        else:
            self.branches.clear()

    def __repr__(self) -> str:
        """The plan's first line: stages, chunks, mode (`print(program.plan)` has it all)."""
        return f"<{type(self).__name__}: {str(self.plan).splitlines()[0]}>"

    def __call__(self, *args: torch.Tensor) -> Any:
        """One step: warmup (whole sequence) or chunked, by the mode and the step."""
        with self._one_call_at_a_time():
            return self._call(*args)

    @contextlib.contextmanager
    def _one_call_at_a_time(self) -> Iterator[None]:
        """A call (or ring run) while another thread's runs raises: the generation's state
        (its step clock, the stale K/V caches, the executor's values) is the program's, and
        two calls at once each run with the other's, silently wrong in stale mode."""
        if not self._running.acquire(blocking=False):
            raise TokpipeError(
                "tokpipe: this pipelined program is running a call already, in another "
                "thread: a program runs one call at a time, since a generation's state (its "
                "step clock, stale K/V caches) is the program's. Run one generation at a "
                "time (a lock around all of its steps), or give each thread its own model")
        try:
            yield
        finally:
            self._running.release()

    def _call(self, *args: torch.Tensor) -> Any:
        if self.session is not None:
            if self.token_shape is None:
                position = self.plan.graphs.input_names.index(self.plan.token_input)
                self.token_shape = tuple(args[position].shape)
            self.session.claim(self, self.owner)
        if torch.is_grad_enabled():
            warn_no_gradients(args, self.session.warned if self.session is not None else set())
        tick = self._tick(args)
        if tick.new_generation:
            self._new_generation()
            self._generation_starts(args)
        else:
            self._step_starts(args, tick.step)
        self.branch = tick.branch
        self._call_begins(tick)
        if tick.branch == MANY_BRANCHES:
            self._warn_many_branches(tick)
        envs: dict[int, dict] = {}

        def env_for(_: int) -> dict:  # made at the first compute: a run can stop there
            if not envs:
                envs[0] = self._call_env(args)
            return envs[0]

        with torch.no_grad():
            chunks = self._step_chunks(tick.step)
            self.last_chunk_count = len(chunks)  # how the last call ran (testing reads it)
            values = self._run(env_for, chunks)
            outputs = self._assemble(values, chunks, env_for, step=0)
        self._run_ends()
        self._advance(1)
        return refusing_backward(outputs, args) if torch.is_grad_enabled() else outputs

    def _tick(self, args: tuple) -> Tick:
        """Where this call falls: the model call's place where one is clocked (the
        model's graphs numbered alike: `model_clock`), else counted by this program."""
        model = MODEL_CALL.get()
        if model is not None and model.session is self.session:
            return self.clock.adopt(model.generation, model.tick, model.timestep)
        return self.clock.tick(args)

    def _warn_many_branches(self, tick: Tick) -> None:
        """Calls at one timestep with other inputs each get a branch and its caches, kept
        until the generation ends: past what guidance takes, say what they hold."""
        held = sum(held_bytes({0: self.branches[0]}).values()) if 0 in self.branches else 0
        warn(f"tokpipe: {tick.branch + 1} calls in a row at one timestep, with other inputs, "
             f"are taken for {tick.branch + 1} guidance branches of step {tick.step}, each "
             f"with K/V caches of its own ({held / 2**20:.1f} MiB each here), kept until the "
             "generation ends. If they are separate generations at one timestep (a one-step "
             "sampler, requests at a fixed t), call tp.reset(compiled) between them")

    def _generation_starts(self, args: tuple) -> None:
        """A generation's first call, with `args`, is about to run (one process: nothing to
        agree on)."""

    def _step_starts(self, args: tuple, step: int) -> None:
        """A later call of the generation, with `args`, is about to run (one process:
        nothing to agree on)."""

    def _call_begins(self, tick: Tick) -> None:
        """The call `tick` tells is about to run (one process: nothing to say)."""

    def run_ring(self, step_args: list[tuple], carried: dict[str, str],
                 progress: Callable[[int], None] | None = None, first: int = 0,
                 watch: Watch | None = None) -> tuple:
        """Steps after warmup as one ring: each chunk's carried outputs (input name ->
        output name) feed the same chunk of the next step as soon as they are computed.
        `progress(k)` is called as this rank finishes step `first + k`; `watch` sees an
        output's whole value after each step."""
        envs: dict[int, dict] = {}

        def env_for(step: int) -> dict:
            if step not in envs:
                envs.clear()  # one step's values at a time: steps run in order per rank
                self.feeds.forget()  # it holds the last step's values too
                envs[step] = self._call_env(step_args[step])
            return envs[step]

        steps = len(step_args)
        pieces = None if watch is None else self._step_pieces(watch, first)
        with self._one_call_at_a_time(), torch.no_grad():
            report = None if progress is None else (lambda k: progress(first + k))
            values = self._run(env_for, self.plan.chunks, steps, carried, report, pieces)
            outputs = self._assemble(values, self.plan.chunks, env_for, steps - 1)
            try:
                if pieces is not None:  # a rank's `watch` may raise as it sees the steps
                    self._share_steps(pieces, steps)
            finally:  # the ranks ran the steps alike: their counts move on alike
                self._advance(steps)
                self.clock.advance(steps)
        self._run_ends()
        return outputs

    def _step_pieces(self, watch: Watch, first: int) -> StepPieces:
        """What assembles `watch.output` per step on this rank (every stage is local here)."""
        spec = self._output_spec(watch.output)
        chunks = self.plan.chunks
        return StepPieces(watch, chunks, lambda p: assemble_output(self.plan, spec, p, chunks),
                          first)

    def _share_steps(self, pieces: StepPieces, steps: int) -> None:
        """Where another rank computed the watched output, its steps are seen here after
        the run (one process: every step was seen as it was computed)."""

    def _output_spec(self, name: str):
        for spec in self.plan.graphs.outputs:
            if spec.kind == OutputKind.TOKEN and spec.source == name:
                return spec
        raise TokpipeError(f"the step's output {name!r} is not a token-wise output of the "
                           "pipelined graph: a ring cannot show it step by step")

    def _advance(self, steps: int) -> None:
        self.calls += steps
        self.caches.filled = True  # every chunk has written its K/V once

    def _step_chunks(self, step: int) -> list[Chunk]:
        """The whole sequence as one chunk (sync mode, warmup steps), or the chunk table.
        A guidance branch first seen after the warmup steps warms up its own caches."""
        mode, warmup = self.plan.config.mode, self.plan.config.warmup_steps
        warm = mode == "stale" and (step < warmup or (warmup > 0 and not self.caches.filled))
        return self.whole if mode == "sync" or warm else self.plan.chunks

    def _run(self, env_for, chunks: list[Chunk], steps: int = 1,
             carried: dict[str, str] | None = None, progress=None,
             computed: StepPieces | None = None) -> dict:
        actions = self._actions(len(chunks), steps, carried or {})
        executor = Executor(self.plan.graphs.stages, self._run_stage, rank=self.rank,
                            transport=self.transport, timeline=self.timeline, carried=carried,
                            progress=progress, feeds=self.feeds, computed=computed,
                            interrupts=self.interrupts)
        stop, self._stop_next = self._stop_next, None
        values = executor.run(actions, chunks, env_for, self._visible(chunks),
                              step_base=self.calls, stopped=stop)
        self.stopped, self.run_number = executor.stopped, executor.run_number
        self.peak_values_held = executor.peak_held  # (step, chunk) value sets, at most
        if self.transport is not None:
            self.transport.flush()
        return values

    def _actions(self, chunks: int, steps: int, carried: dict[str, str]) -> tuple:
        """This rank's actions, from the plan's schedule (built and checked once per layout)."""
        schedule = self.plan.schedule(chunks, steps, self.world, carry_edges(self.plan, carried))
        return schedule.ranks[self.rank]

    def _visible(self, chunks: list[Chunk]):
        """Cache units a chunk may attend to: the whole cache once it holds a full step
        (stale), else what this call has written so far (causal, or a first call)."""
        units = self.plan.units
        full = self.plan.config.mode == "stale" and self.caches.filled

        def visible(chunk: Chunk) -> int:
            return units if full or len(chunks) == 1 else chunk.stop

        return visible

    def _call_env(self, args: tuple[torch.Tensor, ...]) -> dict[str, Any]:
        graphs = self.plan.graphs
        env = dict(zip(graphs.input_names, args, strict=True))
        env.update(self.prelude(*args))
        env.update(self.caches.tensors(self._device(args)))
        return env

    def _device(self, args: tuple) -> torch.device:
        """Where the K/V caches live: with the inputs."""
        return device_of(args)

    def _run_stage(self, stage: int, chunk: Chunk, inputs: list[torch.Tensor]):
        return self.stage_programs[stage](chunk, inputs)

    def _assemble(self, values: dict, chunks: list[Chunk], env_for: Callable[[int], dict],
                  step: int) -> tuple:
        """The outputs of `step`; of a stopped run, only the token outputs' messages."""
        out = []
        for spec in self.plan.graphs.outputs:
            if spec.kind == OutputKind.TOKEN:
                whole = self._gather(spec, [values[(step, c.index)].get(spec.source)
                                            for c in chunks], chunks)
                out.append(restrided(whole, self.strides.get(spec.source)))
            elif self.stopped is not None:
                out.append(None)
            elif spec.kind == OutputKind.CONST:
                out.append(spec.source)
            else:
                out.append(env_for(step)[spec.source])
        return tuple(out)

    def _run_ends(self) -> None:
        """After a run's outputs are shared: one process has nothing to look for (an error
        raised where it arose)."""

    def _gather(self, spec, pieces: list[torch.Tensor], chunks: list[Chunk]) -> torch.Tensor:
        return assemble_output(self.plan, spec, pieces, chunks)


def device_of(args: tuple) -> torch.device:
    for arg in args:
        if isinstance(arg, torch.Tensor):
            return arg.device
    return torch.device("cpu")


def made_order(program: PipelinedProgram) -> int:
    """Sort key: programs in the order they were made (weak sets keep no order)."""
    return program.made
