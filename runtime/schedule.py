"""The schedule: data, not control flow. A list of actions per rank, a compact string form,
and a checker of the rules every schedule obeys.

    rank 0: C0.0 S0.0>1 C0.1 S0.1>1 ...      compute stage 0 chunk 0, send it to rank 1, ...
    rank 1: R1.0<0 C1.0 R1.1<0 C1.1 ...

Steps are prefixed when there are several: `2:C1.3` is step 2, stage 1, chunk 3. In ring
mode the last stage's output of a chunk goes straight back to the first stage as the next
step's input: `S1.3>>0` sends it, `1:R1.3<<1` receives it.
"""

from __future__ import annotations

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
    receive. Raises with the schedule printed and the failing action marked."""
    seen: dict[tuple[int, int], int] = {}
    for rank, actions in enumerate(schedule.ranks):
        for i, action in enumerate(actions):
            if action.kind != COMPUTE:
                continue
            key = (action.step, action.stage)
            expected = seen.get(key, -1) + 1
            if action.chunk != expected or schedule.stage_rank[action.stage] != rank:
                _fail(schedule, rank, i, f"expected chunk {expected} of stage {action.stage}")
            seen[key] = action.chunk
    for (step, stage), last in seen.items():
        if last != schedule.chunks - 1:
            raise TokpipeError(f"stage {stage} runs chunks 0..{last} of step {step} only")
    if len(seen) != schedule.stages * schedule.steps:
        raise TokpipeError("some stage never runs in some step")
    sends = sorted((a.step + a.carry, a.stage, a.chunk, r, a.peer, a.carry)
                   for r, acts in enumerate(schedule.ranks) for a in acts if a.kind == SEND)
    recvs = sorted((a.step, a.stage, a.chunk, a.peer, r, a.carry)
                   for r, acts in enumerate(schedule.ranks) for a in acts if a.kind == RECV)
    if sends != recvs:
        raise TokpipeError(f"sends and receives do not match:\n{schedule}")


def _inverse(edges: dict[int, set[int]], stages: int) -> dict[int, list[int]]:
    return {s: sorted(p for p, targets in edges.items() if s in targets) for s in range(stages)}


def _fail(schedule: Schedule, rank: int, index: int, why: str) -> None:
    actions = list(map(str, schedule.ranks[rank]))
    actions[index] = f">>{actions[index]}<<"
    raise TokpipeError(f"bad schedule at rank {rank}: {why}\nrank {rank}: " + " ".join(actions))
