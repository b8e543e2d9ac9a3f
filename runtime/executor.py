"""The executor: a small interpreter over one rank's schedule, recording what ran when.

It knows nothing of graphs: a stage is a function from its inputs to its outputs, and the
wiring (which value each stage reads, from where) comes from the split pass's StageInputs.

Under torch.profiler each action is a `record_function` range (see `range_name`), so a
Kineto or Chrome trace of a run shows the pipeline: `tokpipe/stage1/chunk2/step5` for a
chunk's compute, `tokpipe/stage1/whole/step0` for a whole-sequence step (the warmup steps of
stale mode, every step of sync mode), and each send and receive with its peer and value count.
Steps count across calls (the run's `step_base` plus the action's own step).

An action that raises (not a message that failed) stops the run on every rank: the rest of
this rank's actions run hollow, and its peers' too once they see it (`run_stops`).
"""

from __future__ import annotations

import time
import traceback
from collections import defaultdict
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext

import torch
from torch.autograd import _profiler_enabled

from tokpipe_compiler.core.fx import example_value
from tokpipe_compiler.core.stage_graph import BOUNDARY, SLICED, StageGraph
from tokpipe_compiler.runtime import branch_exchange
from tokpipe_compiler.runtime.chunking import Chunk
from tokpipe_compiler.runtime.run_stops import (
    DeferredInterrupts,
    RunStops,
    peer_stopped,
)
from tokpipe_compiler.runtime.schedule import COMPUTE, RECV, SEND, Action
from tokpipe_compiler.runtime.stage_feeds import StageFeeds
from tokpipe_compiler.runtime.timeline_events import Timeline
from tokpipe_compiler.runtime.transport import SEND_LAG_STEPS, MessageKey, TensorSpec
from tokpipe_compiler.runtime.transport_errors import TransportError

KINDS = {COMPUTE: "compute", SEND: "send", RECV: "recv"}
RANGE_PREFIX = "tokpipe/"
_NO_RANGE = nullcontext()  # reusable: entering it does nothing

StageRunner = Callable[[int, Chunk, list[torch.Tensor]], Sequence[torch.Tensor]]


class Executor:
    """Runs one rank's actions for one call, or for a whole ring of steps.

    env_for(step): per-step values by name (user inputs, prelude outputs, K/V caches).
    visible(chunk): cache units the chunk may attend to (the mode's semantics).
    carried: input name -> output name fed back as that input at the next step (ring mode).
    transport: moves values between ranks (None when every stage is local).
    computed(action, values): called after each compute with the chunk's values (a ring's
    per-step view of an output, `stage_programs.step_watch`).
    interrupts: where a Ctrl-C is held during the run, raised between two actions.
    """

    def __init__(self, stages: list[StageGraph], run_stage: StageRunner, rank: int = 0,
                 transport=None, timeline: Timeline | None = None,
                 carried: dict[str, str] | None = None,
                 progress: Callable[[int], None] | None = None, *, feeds: StageFeeds,
                 computed: Callable[[Action, dict], None] | None = None,
                 interrupts: DeferredInterrupts | None = None):
        self.stages = stages
        self.run_stage = run_stage
        self.rank = rank
        self.transport = transport
        self.timeline = timeline if timeline is not None else Timeline()
        self.carried = carried or {}
        self.progress = progress
        self.computed = computed
        self.feeds = feeds  # built once per program, not per run (see StageFeeds)
        self.peak_held = 0  # the most (step, chunk) value sets held at once in a run
        # What stopped the last run (its own error, or a peer's PeerStopped), and its number
        # over the group (`run_stops`); `_sent`: the values of the send being made sent so far.
        self.stopped: BaseException | None = None
        self.run_number = 0
        self._sent = 0
        self.interrupts = interrupts

    def run(self, actions: Sequence[Action], chunks: Sequence[Chunk],
            env_for: Callable[[int], dict], visible: Callable[[Chunk], int],
            step_base: int = 0, stopped: BaseException | None = None,
            ) -> dict[tuple[int, int], dict[str, torch.Tensor]]:
        """Returns, per (step, chunk), the values this rank computed or received for the
        last two steps (earlier steps' are dropped as the run goes).

        `step_base` numbers this run's messages (with each action's own step) so that
        messages of different calls never match, and its timeline events and profiler ranges
        so that steps count across calls. `stopped`: an error raised on this rank between
        runs, which stops this one from its start on every rank (raised at once where the
        peers cannot be told).
        """
        try:
            return self._run(actions, chunks, env_for, visible, step_base, stopped)
        finally:
            # The run's per-call values (weights among them) are not kept past it: a weight
            # held here would keep its model's programs alive after the model is gone.
            self.feeds.forget()

    def _run(self, actions: Sequence[Action], chunks: Sequence[Chunk],
             env_for: Callable[[int], dict], visible: Callable[[Chunk], int],
             step_base: int, stopped: BaseException | None,
             ) -> dict[tuple[int, int], dict[str, torch.Tensor]]:
        values: dict[tuple[int, int], dict[str, torch.Tensor]] = defaultdict(dict)
        # Checked once per run: range names are built only while a profiler is running.
        profiling = _profiler_enabled()
        whole = len(chunks) == 1
        posting = f"{RANGE_PREFIX}post_receives" if profiling else ""
        receives = _Receives(actions)
        posted: dict[Action, list] = {}
        step_ends = {max(i for i, a in enumerate(actions) if a.kind == COMPUTE and a.step == s)
                     for s in {a.step for a in actions}}
        last_step = max((a.step for a in actions), default=0)
        stops = getattr(self.transport, "stops", None)
        self.stopped, self.run_number = None, stops.begin() if stops is not None else 0
        if stopped is not None:
            if stops is None:
                raise stopped
            self._stop(stops, stopped)
        for index, action in enumerate(actions):
            if receives.due(action.step):
                with self._range(profiling, posting):
                    for recv in receives.take(action.step):
                        posted[recv] = self._post_receive(recv, chunks[recv.chunk], step_base)
            start = time.perf_counter()
            here = values[(action.step, action.chunk)]
            name = self._range_name(action, step_base, whole, posted) if profiling else ""
            with self._range(profiling, name):
                self._guarded(stops, self._act, action, chunks, env_for, visible, here,
                              values, posted, step_base)
                if self.stopped is not None:
                    self._hollow(action, chunks[action.chunk], posted, step_base)
            self.timeline.record(KINDS[action.kind], self.rank, action, start,
                                 chunks[action.chunk].units, step_base, whole)
            if index in step_ends:
                self._step_ends(stops, action.step, last_step)
        return values

    def _guarded(self, stops: RunStops | None, act: Callable[..., None], *args) -> None:
        """Runs `act(*args)` unless the run stopped; where it raises (not a message's
        failure), the run stops on every rank (`run_stops`), not leaving the peers waiting."""
        if self.stopped is not None:
            return
        try:
            if self.interrupts is not None:
                self.interrupts.raise_pending()
            act(*args)
        except TransportError:
            raise  # the peers meet failures of their own: nothing more reaches them
        except BaseException as error:
            if stops is None:
                raise
            # The failed step's tensors (what an out-of-memory left) go before the hollow
            # run allocates; the traceback keeps its lines.
            traceback.clear_frames(error.__traceback__)
            self._stop(stops, error)

    def _stop(self, stops: RunStops, error: BaseException) -> None:
        """This rank stops the run with `error`: said to every rank, the rest run hollow."""
        stops.stop(self.run_number, self.rank, error)
        self.stopped = error

    def _step_ends(self, stops: RunStops | None, step: int, last_step: int) -> None:
        """A ring's step before the last looks for a peer's stop (the run's end is looked
        at once its outputs are shared); progress is reported while the run goes on."""
        if self.stopped is None and stops is not None and step != last_step:
            seen = stops.seen(self.run_number)
            if seen is not None:
                self.stopped = peer_stopped(seen, stops.named(self.rank), mid_run=True)
        if self.progress is not None:
            self._guarded(stops, self.progress, step)

    def _act(self, action: Action, chunks: Sequence[Chunk], env_for: Callable[[int], dict],
             visible: Callable[[Chunk], int], here: dict, values: dict, posted: dict,
             step_base: int) -> None:
        if action.kind == COMPUTE:
            chunk = chunks[action.chunk]
            # the guidance exchanges this action makes are counted, so that a stop inside it
            # makes the rest hollow; made whole, it owes none (a stop seen at a step's end
            # must not skip the next action's)
            branch_exchange.start_action()
            self._compute(action, chunk, env_for(action.step), here, visible(chunk))
            branch_exchange.start_action()
            self._keep_carries(action, here, values)
            if self.computed is not None:
                self.computed(action, here)
            # Two steps back this chunk's values are sent and carried: a ring of any
            # length holds about two steps of them, not all.
            values.pop((action.step - 2, action.chunk), None)
            self.peak_held = max(self.peak_held, len(values))
        elif action.kind == SEND:
            for key, value in self._outgoing(action, here, step_base):
                self.transport.send(key, value, action.peer)
                self._sent += 1
            self._sent = 0  # kept only where a send is cut short, for `_act_hollow`
        elif action.kind == RECV:
            for key, handle in posted[action]:
                here[key.name] = handle.wait()
            del posted[action]

    def _hollow(self, action: Action, chunk: Chunk, posted: dict, step_base: int) -> None:
        """`_act_hollow`; where a message fails (a peer gone), what stopped the run is
        raised, with the failure in a note."""
        try:
            self._act_hollow(action, chunk, posted, step_base)
        except TransportError as failed:
            stopped = self.stopped
            stopped.add_note(f"tokpipe: finishing the run without computing failed: {failed}")
            raise stopped from failed

    def _act_hollow(self, action: Action, chunk: Chunk, posted: dict, step_base: int) -> None:
        """An action of a stopped run: no compute; the receives still taken (waiting again
        for one already taken returns it), the sends made with zeros of their shapes (those
        of an action cut short, from where it stopped), and the guidance branches'
        exchanges made with zeros (`branch_exchange`)."""
        if action.kind == COMPUTE and branch_exchange.exchanging_now():
            branch_exchange.hollow_exchanges(
                branch_exchange.exchange_shapes(self.stages[action.stage], chunk),
                self.transport.device)
        elif action.kind == SEND:
            for key, spec in self._outgoing_specs(action, chunk, step_base)[self._sent:]:
                zeros = torch.zeros(spec.shape, dtype=spec.dtype, device=self.transport.device)
                self.transport.send(key, zeros, action.peer)
            self._sent = 0
        elif action.kind == RECV:
            for _, handle in posted.pop(action, ()):
                handle.wait()

    @staticmethod
    def _range(profiling: bool, name: str) -> AbstractContextManager:
        return torch.profiler.record_function(name) if profiling else _NO_RANGE

    def _range_name(self, action: Action, step_base: int, whole: bool, posted: dict) -> str:
        if action.kind == COMPUTE:
            values = 0
        elif action.kind == RECV:
            values = len(posted[action])
        else:
            values = len(self._outgoing_names(action))
        return range_name(action, step_base + action.step, whole, values)

    def _post_receive(self, action: Action, chunk: Chunk, base: int) -> list:
        """(key, handle) of each value the receive brings, posted now."""
        handles = []
        for name, spec in self._incoming(action, chunk):
            key = MessageKey(base + action.step, self.rank, action.chunk, name)
            handles.append((key, self.transport.post_recv(key, action.peer, spec)))
        return handles

    def _incoming(self, action: Action, chunk: Chunk) -> list[tuple[str, TensorSpec]]:
        producer = self.stages[action.stage]
        if action.carry:
            return [(name, value_spec(producer, self.carried[name], chunk))
                    for name in carried_names(self.stages, self.carried, action.stage, self.rank)]
        return [(name, value_spec(producer, name, chunk))
                for name in boundary_names(self.stages, action.stage, self.rank)]

    def _outgoing(self, action: Action, here: dict, base: int):
        names = self._outgoing_names(action)
        if action.carry:
            return [(MessageKey(base + action.step + 1, action.peer, action.chunk, name),
                     here[self.carried[name]]) for name in names]
        return [(MessageKey(base + action.step, action.peer, action.chunk, name), here[name])
                for name in names]

    def _outgoing_specs(self, action: Action, chunk: Chunk,
                        base: int) -> list[tuple[MessageKey, TensorSpec]]:
        """The keys and shapes of `_outgoing`'s messages, without their values."""
        producer = self.stages[action.stage]
        step = base + action.step + action.carry
        return [(MessageKey(step, action.peer, action.chunk, name),
                 value_spec(producer, self.carried[name] if action.carry else name, chunk))
                for name in self._outgoing_names(action)]

    def _outgoing_names(self, action: Action) -> list[str]:
        if action.carry:
            return carried_names(self.stages, self.carried, action.stage, action.peer)
        return boundary_names(self.stages, action.stage, action.peer)

    def _keep_carries(self, action: Action, here: dict, values: dict) -> None:
        """Outputs that feed the next step's inputs on this same rank stay here."""
        for name, output in self.carried.items():
            if output in here:
                values[(action.step + 1, action.chunk)][name] = here[output]

    def _compute(self, action: Action, chunk: Chunk, env: dict,
                 chunk_values: dict[str, torch.Tensor], visible: int) -> None:
        inputs = self.feeds.inputs(action.stage, chunk, visible, env, chunk_values)
        outputs = self.run_stage(action.stage, chunk, inputs)
        chunk_values.update(zip(self.stages[action.stage].outputs, outputs, strict=True))


class _Receives:
    """A run's receives, posted ahead of need by a window of steps: those of the steps up
    to SEND_LAG_STEPS after the one being run. A sender waits for its sends of SEND_LAG_STEPS
    steps back to complete (gloo: to be received), which the window has posted, since a
    chunk reaches step s only after every stage ran step s - 1 (the window includes
    whole per-call runs, of one step). Posting the whole run at once would hold receive
    buffers for every step of a long ring. Receives are posted in schedule order: under
    NCCL that is the order the senders send in."""

    def __init__(self, actions: Sequence[Action]):
        self._waiting = [a for a in actions if a.kind == RECV]
        self._next = 0

    def due(self, step: int) -> bool:
        return self._next < len(self._waiting) and \
            self._waiting[self._next].step <= step + SEND_LAG_STEPS

    def take(self, step: int) -> list[Action]:
        """The receives not yet posted of steps up to `step` + SEND_LAG_STEPS."""
        start = self._next
        while self.due(step):
            self._next += 1
        return self._waiting[start:self._next]


def range_name(action: Action, step: int, whole: bool, values: int = 0) -> str:
    """The profiler range of one action. Computes: `tokpipe/stage{s}/chunk{c}/step{k}`, or
    `tokpipe/stage{s}/whole/step{k}` when the step runs the whole sequence as one chunk.
    Sends and receives (`stage` is the producing stage; `carry`: a ring step's output fed
    to the next step): `tokpipe/stage0/chunk2/step5/send->rank1/3 values`,
    `tokpipe/stage0/chunk2/step5/recv<-rank0/3 values`."""
    where = "whole" if whole else f"chunk{action.chunk}"
    name = f"{RANGE_PREFIX}stage{action.stage}/{where}/step{step}"
    if action.kind == COMPUTE:
        return name
    arrow = "send->" if action.kind == SEND else "recv<-"
    carry = "carry " if action.carry else ""
    return f"{name}/{carry}{arrow}rank{action.peer}/{values} values"


def value_spec(stage: StageGraph, name: str, chunk: Chunk) -> TensorSpec:
    """Shape and dtype of a boundary value for one chunk, as both ends know it."""
    node = next(n for n in stage.gm.graph.nodes if n.name == name)
    value = example_value(node)
    info = stage.output_infos[name]
    shape = list(value.shape)
    if info.axis is None:  # a whole scalar: the same in every chunk
        return TensorSpec(tuple(shape), value.dtype)
    # text segments travel whole, in each outer block, with the chunks that compute them
    shape[info.axis] = info.extent(chunk.units, chunk.segments)
    return TensorSpec(tuple(shape), value.dtype)


def boundary_names(stages: list[StageGraph], producer: int, consumer_stage: int) -> list[str]:
    """Values of `producer` that stage `consumer_stage` reads, in a fixed order."""
    wanted = {i.name for i in stages[consumer_stage].inputs
              if i.kind == BOUNDARY and i.producer == producer}
    return [name for name in stages[producer].outputs if name in wanted]


def carried_names(stages: list[StageGraph], carried: dict[str, str], producer: int,
                  consumer_stage: int) -> list[str]:
    """Carried inputs that `consumer_stage` reads and whose outputs `producer` computes."""
    reads = {i.source for i in stages[consumer_stage].inputs if i.kind == SLICED}
    made = set(stages[producer].outputs)
    return [name for name, out in carried.items() if name in reads and out in made]
