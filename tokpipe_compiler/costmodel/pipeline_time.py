"""How long a pipelined run takes: the one time model of the cost model, the plan and charts.

Given what each stage takes per chunk (`compute[stage][chunk]`, and optionally what sending
its output takes, `send[stage][chunk]`), replay a schedule's actions (runtime/schedule.py)
rank by rank: a compute takes its time, a send keeps its rank busy for the send time, and a
receive waits until its send has ended. Per call (`ring=False`), every step is a call of its
own that starts when the last one has ended (the caller runs the scheduler between calls).
As a ring, the last stage's output of a chunk goes straight back to the first stage for the
next step, so steps overlap.

S stages, M chunks of time t each: one call takes (M + S - 1) t; a ring of K steps takes
K M t + (S - 1) t when M >= S, and (K S + M - 1) t when fewer chunks than stages leave the
ring waiting for its chunks to come round.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

from tokpipe_compiler.runtime.schedule import COMPUTE, RECV, SEND, Action, Schedule, build_schedule

Times = Sequence[Sequence[float]]  # times[stage][chunk]
Edges = dict[int, set[int]]
# (steps, ring edges) -> a schedule with one rank per stage; the plan passes its cached one.
ScheduleFor = Callable[[int, Edges | None], Schedule]
# A ring's steps repeat: the first has no carried input, the last sends none back and the
# steps between are alike, so a schedule of 3 steps replays a ring of any length.
RING_TEMPLATE_STEPS = 3


@dataclass(frozen=True)
class Box:
    """One compute of the replayed schedule: `rank` runs `stage` on `chunk` of `step`."""

    rank: int
    stage: int
    chunk: int
    step: int
    start: float
    end: float


def seconds(compute: Times, steps: int = 1, ring: bool = False, send: Times | None = None,
            schedule_for: ScheduleFor | None = None) -> float:
    """Time from the first compute to the last of `steps` steps (0 for no steps)."""
    if steps < 1:
        return 0.0
    if ring:
        return max(box.end for box in _replay(_ring_schedule(compute, steps, schedule_for),
                                              compute, send, steps))
    return steps * max(box.end for box in _replay(_call_schedule(compute, schedule_for),
                                                  compute, send, 1))


def boxes(compute: Times, steps: int = 1, ring: bool = False, send: Times | None = None,
          schedule_for: ScheduleFor | None = None) -> list[Box]:
    """Every compute of `steps` steps with its start and end, in the order replayed."""
    if steps < 1:
        return []
    if ring:
        return list(_replay(_ring_schedule(compute, steps, schedule_for), compute, send, steps))
    call = list(_replay(_call_schedule(compute, schedule_for), compute, send, 1))
    span = max(box.end for box in call)
    return [replace(box, step=k, start=box.start + k * span, end=box.end + k * span)
            for k in range(steps) for box in call]


def chain(stages: int, chunks: int) -> ScheduleFor:
    """Schedules of one rank per stage, each stage feeding the next."""
    return lambda steps, carries: build_schedule(stages, chunks, world=stages, steps=steps,
                                                 carries=carries)


def ring_edges(stages: int) -> Edges:
    """The ring's carried output: from the last stage back to the first."""
    return {stages - 1: {0}}


def _call_schedule(compute: Times, schedule_for: ScheduleFor | None) -> Schedule:
    return (schedule_for or chain(len(compute), len(compute[0])))(1, None)


def _ring_schedule(compute: Times, steps: int, schedule_for: ScheduleFor | None) -> Schedule:
    build = schedule_for or chain(len(compute), len(compute[0]))
    return build(min(steps, RING_TEMPLATE_STEPS), ring_edges(len(compute)))


def _replay(schedule: Schedule, compute: Times, send: Times | None,
            steps: int) -> Iterator[Box]:
    """Each rank takes its actions in order, as far as its receives allow; round by round."""
    streams = [_stream(actions, schedule.steps, steps) for actions in schedule.ranks]
    heads = [next(stream, None) for stream in streams]
    clocks = [0.0] * len(streams)
    arrivals: defaultdict[tuple, deque[float]] = defaultdict(deque)  # channel -> send ends
    while any(head is not None for head in heads):
        moved = False
        for rank, stream in enumerate(streams):
            while heads[rank] is not None:
                step, action = heads[rank]
                channel = (action.peer, rank, action.carry)
                if action.kind == RECV and not arrivals[channel]:
                    break  # its send has not been replayed yet: another rank goes first
                start = clocks[rank]
                if action.kind == COMPUTE:
                    clocks[rank] += compute[action.stage][action.chunk]
                    yield Box(rank, action.stage, action.chunk, step, start, clocks[rank])
                elif action.kind == SEND:
                    clocks[rank] += send[action.stage][action.chunk] if send else 0.0
                    arrivals[(rank, action.peer, action.carry)].append(clocks[rank])
                else:
                    clocks[rank] = max(start, arrivals[channel].popleft())
                heads[rank], moved = next(stream, None), True
        if not moved:
            raise ValueError(f"the schedule deadlocks:\n{schedule}")


def _stream(actions: Sequence[Action], have: int, steps: int) -> Iterator[tuple[int, Action]]:
    """A rank's actions over `steps` steps from a schedule of `have` steps: the same steps,
    or a ring's first, middle (repeated) and last step."""
    if have != steps and have != RING_TEMPLATE_STEPS:
        raise ValueError(f"a {have}-step schedule cannot replay {steps} steps")
    by_step: list[list[Action]] = [[] for _ in range(have)]
    for action in actions:
        by_step[action.step].append(action)
    for step in range(steps):
        template = step if have == steps else 0 if step == 0 else 2 if step == steps - 1 else 1
        for action in by_step[template]:
            yield step, action
