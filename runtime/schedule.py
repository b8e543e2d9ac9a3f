"""The schedule: data, not control flow. A list of actions per rank, a compact string form,
its parser, and a checker of the rules every schedule obeys.

    rank 0: C0.0 S0.0>1 C0.1 S0.1>1 ...      compute stage 0 chunk 0, send it to rank 1, ...
    rank 1: R0.0<0 C1.0 R0.1<0 C1.1 ...      receive stage 0's chunk 0 from rank 0, ...

Steps are prefixed when there are several: `2:C1.3` is step 2, stage 1, chunk 3. In ring
mode the last stage's output of a chunk goes straight back to the first stage as the next
step's input: `S1.3>>0` sends it, `1:R1.3<<1` receives it.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

from tokpipe_compiler.core.errors import TokpipeError

COMPUTE, SEND, RECV = "C", "S", "R"


@dataclass(frozen=True)
class Action:
    kind: str  # COMPUTE, SEND or RECV
    stage: int  # the stage computed, or the stage whose output travels
    chunk: int
    step: int = 0
    peer: int | None = None  # the other rank of a SEND or RECV
    carry: bool = False  # ring mode: an output that becomes the next step's input

    def __str__(self) -> str:
        prefix = f"{self.step}:" if self.step else ""
        arrow = {SEND: ">", RECV: "<"}.get(self.kind, "")
        arrow = arrow * 2 if self.carry else arrow
        peer = "" if self.peer is None else f"{arrow}{self.peer}"
        return f"{prefix}{self.kind}{self.stage}.{self.chunk}{peer}"


@dataclass(frozen=True)
class Schedule:
    stages: int
    chunks: int
    steps: int
    ranks: tuple[tuple[Action, ...], ...]  # ranks[r]: what rank r does, in order
    stage_rank: tuple[int, ...]  # stage -> rank that runs it

    def __str__(self) -> str:
        return "\n".join(f"rank {r}: " + " ".join(map(str, acts))
                         for r, acts in enumerate(self.ranks))


def build_schedule(
    stages: int, chunks: int, world: int = 1, steps: int = 1,
    consumers: dict[int, set[int]] | None = None,
    carries: dict[int, set[int]] | None = None,
) -> Schedule:
    """The pipelined schedule for `steps` steps of `chunks` chunks.

    world == 1: every stage in one process, chunk by chunk (the same order each stage sees
    in the distributed run). world == stages: rank r runs stage r. `consumers[s]`: stages
    that read stage s's output (default: the next one); skip connections add more.
    `carries[s]`: stages that read, at the next step, what stage s outputs (ring mode).
    """
    if world not in (1, stages):
        raise TokpipeError(f"world size {world} must be 1 or the number of stages ({stages})")
    consumers = consumers or {s: {s + 1} for s in range(stages - 1)}
    carries = carries or {}
    producers = _inverse(consumers, stages)
    carriers = _inverse(carries, stages)
    stage_rank = tuple(range(stages)) if world > 1 else (0,) * stages
    ranks: list[list[Action]] = [[] for _ in range(world)]
    for step in range(steps):
        for chunk in range(chunks):
            for stage in range(stages):
                rank = stage_rank[stage]
                acts = ranks[rank]
                for src in carriers[stage] if step else ():
                    if stage_rank[src] != rank:
                        acts.append(Action(RECV, src, chunk, step, stage_rank[src], carry=True))
                for src in producers[stage]:
                    if stage_rank[src] != rank:
                        acts.append(Action(RECV, src, chunk, step, stage_rank[src]))
                acts.append(Action(COMPUTE, stage, chunk, step))
                for dst in sorted(consumers.get(stage, ())):
                    if stage_rank[dst] != rank:
                        acts.append(Action(SEND, stage, chunk, step, stage_rank[dst]))
                for dst in sorted(carries.get(stage, ())) if step < steps - 1 else ():
                    if stage_rank[dst] != rank:
                        acts.append(Action(SEND, stage, chunk, step, stage_rank[dst], carry=True))
    schedule = Schedule(stages, chunks, steps, tuple(map(tuple, ranks)), stage_rank)
    check_schedule(schedule)
    return schedule


def check_schedule(schedule: Schedule) -> None:
    """Every chunk passes every stage once per step, in chunk order, and every send has its
    receive. Raises naming the step, with the failing rank's actions and the culprit marked."""
    _check_computes(schedule)
    _check_messages(schedule)


def parse_schedule(text: str, stages: int, chunks: int, steps: int = 1) -> Schedule:
    """The schedule `str(schedule)` printed, one 'rank r: ...' line per rank; unchecked (a
    hand-written one goes through `check_schedule`). A stage runs on the rank that computes
    it."""
    ranks = tuple(tuple(_parse_action(word) for word in line.partition(":")[2].split())
                  for line in text.strip().splitlines())
    stage_rank = tuple(next((r for r, acts in enumerate(ranks) for a in acts
                             if a.kind == COMPUTE and a.stage == s), 0) for s in range(stages))
    return Schedule(stages, chunks, steps, ranks, stage_rank)


_ACTION = re.compile(r"(?:(\d+):)?([CSR])(\d+)\.(\d+)(?:(>>|<<|>|<)(\d+))?")


def _parse_action(word: str) -> Action:
    match = _ACTION.fullmatch(word)
    if match is None:
        raise TokpipeError(f"{word!r} is not a schedule action (like C0.1, S0.1>1, 2:R1.3<<1)")
    step, kind, stage, chunk, arrow, peer = match.groups()
    return Action(kind, int(stage), int(chunk), int(step or 0),
                  None if peer is None else int(peer), carry=arrow in (">>", "<<"))


def _check_computes(schedule: Schedule) -> None:
    seen: dict[tuple[int, int], int] = {}
    for rank, actions in enumerate(schedule.ranks):
        for i, action in enumerate(actions):
            if action.kind != COMPUTE:
                continue
            key = (action.step, action.stage)
            expected = seen.get(key, -1) + 1
            if action.chunk != expected or schedule.stage_rank[action.stage] != rank:
                _fail(schedule, rank, i, f"step {action.step}: expected chunk {expected} of "
                      f"stage {action.stage} on rank {schedule.stage_rank[action.stage]}")
            seen[key] = action.chunk
    for step in range(schedule.steps):
        for stage in range(schedule.stages):
            last = seen.get((step, stage), -1)
            if last != schedule.chunks - 1:
                raise TokpipeError(f"bad schedule: step {step}: stage {stage} runs chunks "
                                   f"0..{last} of 0..{schedule.chunks - 1}\n{schedule}")


def _check_messages(schedule: Schedule) -> None:
    """Each send is received (a carried one at the next step), and nothing else is."""
    sends = Counter(_message(a, r) for r, acts in enumerate(schedule.ranks) for a in acts
                    if a.kind == SEND)
    recvs = Counter(_message(a, r) for r, acts in enumerate(schedule.ranks) for a in acts
                    if a.kind == RECV)
    if sends == recvs:
        return
    for rank, actions in enumerate(schedule.ranks):
        for i, a in enumerate(actions):
            key = _message(a, rank)
            if a.kind == SEND and sends[key] > recvs[key]:
                _fail(schedule, rank, i, f"step {a.step}: no rank receives this send")
            if a.kind == RECV and recvs[key] > sends[key]:
                _fail(schedule, rank, i, f"step {a.step}: no rank sends what this receives")


def _message(action: Action, rank: int) -> tuple:
    """(step received, stage, chunk, from rank, to rank, carried) of a send or receive."""
    if action.kind == SEND:
        return (action.step + action.carry, action.stage, action.chunk, rank, action.peer,
                action.carry)
    return action.step, action.stage, action.chunk, action.peer, rank, action.carry


def _inverse(edges: dict[int, set[int]], stages: int) -> dict[int, list[int]]:
    return {s: sorted(p for p, targets in edges.items() if s in targets) for s in range(stages)}


def _fail(schedule: Schedule, rank: int, index: int, why: str) -> None:
    actions = list(map(str, schedule.ranks[rank]))
    actions[index] = f">>{actions[index]}<<"
    raise TokpipeError(f"bad schedule at rank {rank}: {why}\nrank {rank}: " + " ".join(actions))
