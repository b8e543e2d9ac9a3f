"""What a rank did when: the events a program's runs record, one per compute, send and
receive, and the bounded record that holds them."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from tokpipe_compiler.runtime.schedule import Action


@dataclass
class Event:
    """One thing a rank did: compute, send or recv (posted ahead: its time is the wait)."""

    kind: str
    rank: int
    stage: int
    chunk: int
    step: int
    start: float
    duration: float
    units: int | None = None  # grid rows of the chunk (tells warmup calls from chunked ones)
    peer: int | None = None  # the other rank of a send or recv
    carry: bool = False  # ring mode: a step's output sent as the next step's input
    whole: bool = False  # the step ran the whole sequence as one chunk (warmup, sync)

    @property
    def message_step(self) -> int:
        """The step of the message a send or recv moves: a carry goes to the next step."""
        return self.step + (self.carry and self.kind == "send")


TIMELINE_EVENTS = 65536  # about 16 MiB of events: a long-lived service's record stays bounded


@dataclass
class Timeline:
    """What a program ran when: its latest `capacity` events (older ones are dropped, so
    that a process making image after image keeps a bounded record)."""

    capacity: int | None = None  # None: TIMELINE_EVENTS
    events: deque[Event] = field(init=False)

    def __post_init__(self) -> None:
        self.events = deque(maxlen=self.capacity or TIMELINE_EVENTS)

    def record(self, kind: str, rank: int, action: Action, start: float,
               units: int | None = None, step_base: int = 0, whole: bool = False) -> None:
        """An event from `start` until now; `units`: grid rows of the chunk; the step counted
        from `step_base` (the steps of earlier calls)."""
        self.events.append(Event(kind, rank, action.stage, action.chunk,
                                 step_base + action.step, start,
                                 time.perf_counter() - start, units, action.peer,
                                 action.carry, whole))
