"""One process per stage: rank r runs stage r of every chunk and passes its boundary values
to the ranks that read them. Every rank returns the full output (sent by the rank that
computes it), bit for bit what the in-process runtime returns.

Every wait between ranks goes through the transport, so it is bounded by the `timeout`
option and fails with a TokpipeError naming the rank, stage, step and value it waited for.
At each generation's first call and each ring run the ranks exchange a fingerprint
(options, plan, input shapes and dtypes, checksums of the inputs; a ring's length) and stop
with a named error if they disagree, before any message whose size the other side would not
expect; while they plan, they take rank 0's calibrated rates (`agreement.py`).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from tokpipe_compiler.core.errors import PeerStopped, TokpipeError
from tokpipe_compiler.core.fx import example_value
from tokpipe_compiler.core.stage_graph import OutputKind
from tokpipe_compiler.core.warn import warn
from tokpipe_compiler.costmodel import calibrate
from tokpipe_compiler.passes.split import prelude_for
from tokpipe_compiler.planning.plan import Plan
from tokpipe_compiler.runtime.process_group import init_process_group_from_env
from tokpipe_compiler.runtime.transport import (
    WHOLE,
    DistributedTransport,
    MessageKey,
    TensorSpec,
)
from tokpipe_compiler.runtime.transport_errors import GroupClosed
from tokpipe_compiler.stage_programs.agreement import (
    CALL,
    LATE_PEER,
    check_agreement,
    exchange_fingerprints,
    exchange_rates,
    fingerprint,
    pipeline_entry,
    send_leave,
)
from tokpipe_compiler.stage_programs.device_copies import DeviceCopies
from tokpipe_compiler.stage_programs.generations import PIPELINE_STEPS, Tick
from tokpipe_compiler.stage_programs.outputs import assemble_output
from tokpipe_compiler.stage_programs.pipelined import PipelinedProgram, device_of
from tokpipe_compiler.stage_programs.plan_reads import weight_inputs
from tokpipe_compiler.stage_programs.prelude import Prelude
from tokpipe_compiler.stage_programs.run_ends import RunEnds, call_description
from tokpipe_compiler.stage_programs.session import Session
from tokpipe_compiler.stage_programs.step_watch import StepPieces, Watch
from tokpipe_compiler.stage_programs.weight_values import WeightValues


def distributed_world(group: Any = None, timeout: float | None = None
                      ) -> tuple[int, int] | None:
    """(rank, size) in `group` (default: the world) when it has more than one process, else
    None. Under torchrun (WORLD_SIZE > 1 in the environment) the process group is started
    here if the script did not: NCCL when CUDA is available, gloo otherwise; every rank
    must join within `timeout` seconds (the option), which is then the group's own."""
    if not dist.is_available():
        return None
    if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        init_process_group_from_env(timeout=timeout)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        return dist.get_rank(group), dist.get_world_size(group)
    return None


DIVERGED = ("the ranks' latents parted after the generation's start. A scheduler that "
            "draws noise at each step (Euler ancestral, DDPM, stochastic_sampling=True) "
            "draws it from each rank's own random state where the pipeline passes it no "
            "generator. Seed it alike on every rank before each call (torch.manual_seed(seed)"
            ", and torch.cuda.manual_seed on GPUs), or use a scheduler that draws no noise.")


class DistributedProgram(RunEnds, PipelinedProgram):
    """The per-call program on one rank of a `stages`-process group (`group`: the world by
    default; a subgroup runs one pipeline of several, e.g. one per guidance branch)."""

    def __init__(self, plan: Plan, session: Session | None = None, owner: int | None = None,
                 group: Any = None, transport: DistributedTransport | None = None):
        super().__init__(plan, session, owner)
        # `transport`: over other links than torch.distributed's (tests emulate NCCL)
        self.transport = transport or DistributedTransport(timeout=plan.config.timeout,
                                                           group=group)
        self.rank, world = self.transport.rank, self.transport.world_size
        stages = len(plan.stages)
        if world != stages:
            raise TokpipeError(
                f"stages={stages} but torch.distributed runs {world} processes; launch one "
                f"process per stage (torchrun --nproc-per-node {stages}) or set stages={world}"
            )
        self.world = world
        self.cache_specs = plan.stages[self.rank].caches  # this rank's layers only
        graph = plan.graphs.stages[self.rank]
        self.prelude = Prelude(*prelude_for(plan.graphs, {self.rank}), plan.config.compiler)
        self.reads = {i.name for i in graph.inputs} | {i.source for i in graph.inputs}
        self.token_position = plan.graphs.input_names.index(plan.token_input)
        self.weights_here = DeviceCopies(self.device)  # weights that live on another device
        self.warned_far_weights = False
        self.mid_call = False  # inside a call (one that raised stays so)
        self._output_step = 0  # the step whose outputs `_gather` is collecting
        self._looked = False  # whether this run's end looked for a peer's stop
        self.call_run: int | None = None  # the run this rank said which call it is
        self.weight_inputs = weight_inputs(plan)
        self.weight_values = WeightValues()  # compared at each generation's start

    def _new_generation(self) -> None:
        super()._new_generation()
        self.weight_values.stale = True  # weights may change between generations (a LoRA)

    def _generation_starts(self, args: tuple) -> None:
        """Every generation's first call, not only the program's: other latents or prompts
        on a rank in a later generation stop every rank, by name, instead of mixing the
        ranks' inputs (one small exchange a generation)."""
        self.weights_here.clear()  # weights held elsewhere may have changed (a fused LoRA)
        steps = {} if self.ring_steps is None else {"ring steps": self.ring_steps}
        marks = PIPELINE_STEPS.get()  # in a parallelized pipeline: its scheduler's length
        scheduled = None if marks is None else marks.scheduled()
        if scheduled is not None:  # per call, a rank with more steps would wait for them
            steps["scheduler steps"] = scheduled
        if marks is not None and self.ring_steps is None:
            marks.per_call.append(self)  # tells its peers if the call raises (leave_call)
        later = self.calls > 0  # a peer that fails to show may still be in the last one
        self._agree([args], "a generation's first call", steps, LATE_PEER if later else "",
                    {} if marks is None else pipeline_entry(marks.scheduler,
                                                            self.ring_steps is not None))

    def _step_starts(self, args: tuple, step: int) -> None:
        """A parallelized pipeline's later per-call step: the ranks compare its inputs, the
        latents each rank's scheduler stepped included (a fallback path, where a scheduler
        that draws noise from each rank's own random state runs; one small exchange a
        call). A model compiled directly, or a ring, checks at the generation's start."""
        if PIPELINE_STEPS.get() is None or self.ring_steps is not None:
            return
        try:
            with warnings.catch_warnings():  # other inputs that differ: said at the start
                warnings.simplefilter("ignore")
                self._agree([args], f"step {step} of a per-call generation", {})
        except PeerStopped:
            raise
        except TokpipeError as err:
            raise TokpipeError(f"{err}\nAt step {step} of a per-call generation: "
                               f"{DIVERGED}") from err

    def _call_begins(self, tick: Tick) -> None:
        """A call of a model compiled directly: this rank says in the store which call its
        run is, to compare once the run's outputs are shared (`RunEnds._same_call`). A
        parallelized pipeline compares each per-call step's inputs instead (`_step_starts`),
        and a ring run its steps."""
        stops = self.transport.stops
        if stops is None or PIPELINE_STEPS.get() is not None or self.ring_steps is not None:
            return
        self.call_run = stops.runs + 1  # the run the executor begins next
        stops.say_call(self.call_run, self.rank, call_description(tick, self.clock.last))

    def run_ring(self, step_args: list[tuple], carried: dict[str, str],
                 progress: Callable[[int], None] | None = None, first: int = 0,
                 watch: Watch | None = None) -> tuple:
        if step_args:  # later runs too: a rank's other step count or timesteps would wait
            every = self._agree(step_args, "a ring run", {"ring steps": first + len(step_args)},
                                watches=watch is not None)
            if watch is None and any(fp.get("watches") for fp in every):
                # another rank sees the steps (its callback, a progress bar of its own): this
                # one takes part in sharing them, seeing nothing
                watch = Watch(self.plan.graphs.outputs[0].source, _see_nothing)
        caller = self._caller_device(step_args[0]) if step_args else self.device
        if watch is not None and caller != self.device:
            watch = Watch(watch.output, lambda k, v, see=watch.see: see(k, v.to(caller)))
        with self._holding_interrupts():
            outputs = super().run_ring(step_args, carried, progress, first, watch)
        return _on_device(outputs, caller)

    def __call__(self, *args: torch.Tensor) -> Any:
        self.mid_call = True  # left set where the call raises: its peers may be mid-message
        with self._holding_interrupts():
            out = _on_device(super().__call__(*args), self._caller_device(args))
            self.mid_call = False  # a Ctrl-C held past the run is raised after the call
        return out

    def leave_call(self, error: BaseException, call: int) -> None:
        """This rank's pipeline call `call` raised between two per-call steps (a step
        callback, a cancel): the peers, which would wait `timeout` for its next message and
        lose a gloo group, stop at their next exchange instead (`send_leave`)."""
        send_leave(self.transport, f"{type(error).__name__}: {str(error)[:200]}", call)

    def _caller_device(self, args: tuple) -> torch.device:
        """Where the caller keeps the token input (the latents): its outputs go there."""
        latents = args[self.token_position]
        return latents.device if isinstance(latents, torch.Tensor) else device_of(args)

    def _step_pieces(self, watch: Watch, first: int) -> StepPieces:
        pieces = super()._step_pieces(watch, first)
        pieces.keep = self._output_spec(watch.output).producer == self.rank and self.world > 1
        return pieces

    def _share_steps(self, pieces: StepPieces, steps: int) -> None:
        """The rank that computed the watched output sends every step's value to the others
        in one message, after the run (a message per step would hold the ring up); they see
        the steps then."""
        spec = self._output_spec(pieces.watch.output)
        what = f"stage {spec.producer}'s output {spec.source!r} after each of {steps} steps"

        def key(dst: int) -> MessageKey:
            return MessageKey(self.calls, dst, WHOLE, f"{spec.source}/steps", what)

        one = self._spec(spec)
        if spec.producer == self.rank:
            self._take_interrupt()
            every = (self._zeros(TensorSpec((steps, *one.shape), one.dtype))
                     if self.stopped is not None else torch.stack(pieces.kept))
            for dst in range(self.world):
                if dst != self.rank:
                    self.transport.send(key(dst), every, dst)
            self.transport.flush()
            return
        every = self.transport.post_recv(key(self.rank), spec.producer,
                                         TensorSpec((steps, *one.shape), one.dtype)).wait()
        if self._stop_seen() is not None:
            return  # the steps of a stopped run are not shown
        for k in range(steps):
            pieces.watch.see(pieces.first + k, every[k])

    def _agree(self, calls: list[tuple], when: str, plan: dict[str, int],
               absent_hint: str = "", pipeline: dict[str, str] | None = None,
               watches: bool = False) -> list[dict[str, Any]]:
        """Every rank's fingerprint of `calls` (the first's inputs, every call's checksums),
        `plan`'s entries and `pipeline`'s (see pipeline_entry) to every other; raises on all
        ranks alike if they disagree (a TokpipeError that says which rank has what).
        `absent_hint` ends the error of a rank whose peer never sends its fingerprint.
        `watches`: whether this rank sees a ring's steps (told, not compared). Returns every
        rank's fingerprint."""
        mine = fingerprint(self.plan, calls)
        mine["plan"].update(plan)
        mine["pipeline"] = pipeline or {}
        mine["watches"] = watches
        mine["weight values"] = self.weight_values.digest(
            {name: calls[0][i] for i, name in self.weight_inputs})
        marks = PIPELINE_STEPS.get()
        if marks is not None:  # in a parallelized pipeline's call: its number
            mine[CALL] = marks.call
        try:
            every = exchange_fingerprints(self.transport, mine, when)
        except (GroupClosed, PeerStopped):
            raise  # not a peer late or absent: every later message fails alike
        except TokpipeError as err:
            if not absent_hint:
                raise
            raise TokpipeError(f"{err} {absent_hint}") from err
        check_agreement(every, when, self.weight_values.names)
        return every

    def _call_env(self, args: tuple) -> dict:
        """Per-call values; on a GPU, what this rank's stage reads moves to its device (its
        parameters once, and again when they change: a rank holds only its own stage's
        weights there). The prelude runs where the caller keeps the model: its graph holds
        that device wherever the model's code made tensors on its inputs' device."""
        env = super()._call_env(args)
        if self.device.type == "cpu":
            return env
        for name in self.reads & env.keys():
            value = env[name]
            if isinstance(value, torch.Tensor) and value.device != self.device:
                env[name] = self._moved(value)
        return env

    def _moved(self, value: torch.Tensor) -> torch.Tensor:
        if isinstance(value, torch.nn.Parameter):
            if not self.warned_far_weights:
                self.warned_far_weights = True
                warn(f"tokpipe: rank {self.rank}'s stage weights are on {value.device}, not on "
                     f"its device {self.device}: it copies them there at each generation's "
                     "first call. Call torch.cuda.set_device(int(os.environ['LOCAL_RANK'])) "
                     "before moving the model to the GPU")
            return self.weights_here.get(value)
        return value.to(self.device, non_blocking=True)

    def _device(self, args: tuple) -> torch.device:
        return self.device

    @property
    def param_bytes(self) -> int:
        """Bytes of the weights this rank holds on its device (its stage's and its prelude
        part's; the rest of the model stays wherever the caller keeps it): the plan's count."""
        return self.plan.stages[self.rank].param_bytes

    def _assemble(self, values: dict, chunks: list, env_for: Callable[[int], dict],
                  step: int) -> tuple:
        self._output_step = self.calls + step  # numbered as the executor numbers messages
        self._looked = False  # for a peer's stop, once this run's outputs are shared
        if any(spec.kind == OutputKind.TOKEN and spec.producer == self.rank
               for spec in self.plan.graphs.outputs):
            self._take_interrupt()
            self._agree_with_the_other_branch()
        return super()._assemble(values, chunks, env_for, step)

    def _gather(self, spec, pieces: list[torch.Tensor], chunks: list) -> torch.Tensor:
        """The producer concatenates its chunks and sends the whole output to every other
        rank; they wait for it with the transport's timeout."""
        step = self._output_step
        what = f"stage {spec.producer}'s output {spec.source!r} of step {step} (all chunks)"

        def key(dst: int) -> MessageKey:
            return MessageKey(step, dst, WHOLE, spec.source, what)

        if spec.producer != self.rank:
            handle = self.transport.post_recv(key(self.rank), spec.producer, self._spec(spec))
            return handle.wait()
        tensor = (self._zeros(self._spec(spec)) if self.stopped is not None else
                  assemble_output(self.plan, spec, pieces, chunks).contiguous())
        for dst in range(self.world):
            if dst != self.rank:
                self.transport.send(key(dst), tensor, dst)
        self.transport.flush()  # the caller may overwrite the output: finish sending it first
        return tensor

    def _spec(self, spec) -> TensorSpec:
        stage = self.plan.graphs.stages[spec.producer]
        node = next(n for n in stage.gm.graph.nodes if n.name == spec.source)
        value = example_value(node)
        return TensorSpec(tuple(value.shape), value.dtype)

    @property
    def device(self) -> torch.device:
        return self.transport.device

    def close(self) -> None:
        self.transport.close()


def _see_nothing(step: int, value: torch.Tensor) -> None:
    pass


@contextmanager
def planned_alike(group: Any, timeout: float) -> Iterator[None]:
    """Within the block (the planning of a program for `group`), every rank of a group of
    several processes plans with rank 0's calibrated rates. Rates each rank measures or
    caches for itself differ a little, enough for chunks="auto" to pick another table or
    the partition another cut, and ranks with different plans refuse to run together.
    They travel once per group and device (the group's first planning, which every rank
    does): a rank that plans later alone, for inputs the others hold a program for
    already, must not wait for a message from rank 0, which waits for another."""
    if distributed_world(group, timeout) is None:
        yield
        return
    transport = DistributedTransport(timeout=timeout, group=group)
    ranks = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))

    def share(device: str, local: Callable[[], calibrate.DeviceRates]) -> calibrate.DeviceRates:
        if (ranks, device) not in _GROUP_RATES:
            _GROUP_RATES[ranks, device] = exchange_rates(transport, device, local)
        return _GROUP_RATES[ranks, device]

    with calibrate.shared_rates(share):
        yield


# Rank 0's rates each group plans with, by (the group's global ranks, device).
_GROUP_RATES: dict[tuple[tuple[int, ...], str], calibrate.DeviceRates] = {}


def make_program(plan: Plan, session: Session | None, owner: int | None = None,
                 group: Any = None) -> Any:
    """The in-process program, or this rank's part when torch.distributed is running (over
    `group`, default the world). `owner`: the id of the weight that tells which model the
    program runs."""
    if distributed_world(group, plan.config.timeout) is not None:
        return DistributedProgram(plan, session, owner, group)
    if group is not None and len(plan.stages) > 1:  # a group given of one rank
        warn(f"the process group given has one rank, so all stages={len(plan.stages)} run "
             "in this process, one after the other; give a group of one rank per stage "
             "to run them on several")
    return PipelinedProgram(plan, session, owner)


def _on_device(outputs: tuple, device: torch.device) -> tuple:
    """The outputs on the caller's device: a model every rank keeps on GPU 0 gets rank 1's
    outputs there, not on the GPU rank 1 computes on."""
    return tuple(o.to(device) if isinstance(o, torch.Tensor) and o.device != device else o
                 for o in outputs)
