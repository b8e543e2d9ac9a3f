"""A step that raises on one rank (an out-of-memory, a cancel) mid-run: every rank stops
that call at once, the raising rank with its own error, the others with PeerStopped naming
it, and the process group carries the next call, which gives the clean call's numbers.
Before, the others waited `timeout` for a message never sent, and gloo then closed the
group for good (`runtime/run_stops.py`). And a ring whose step callback one rank alone
passes: every rank takes part in sharing the steps."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

import tokpipe_compiler as tp
from tests.fixtures.models import TinyDiT, dit_inputs
from tests.fixtures.rings import per_step, step_ring
from tokpipe_compiler.core.errors import PeerStopped
from tokpipe_compiler.runtime.launch import launch

pytestmark = [pytest.mark.slow, pytest.mark.ranks]

# Long enough that a peer left waiting for a message fails the time bound below.
TIMEOUT = 60.0
OPTIONS = {"chunks": 2, "mode": "stale", "warmup_steps": 1, "compiler": "eager",
           "timeout": TIMEOUT}
STEPS = 4
# (rank that raises, what raises, the stage call of the run it raises at); the last fault
# raises before any compute, in the per-call values (the prelude's part of the rank)
FAULTS = [(1, "stage", 3), (0, "cancel", 2), (1, "prelude", 1), (1, "sigint", 2)]


class Injected(RuntimeError):
    """Stands in for a CUDA out-of-memory raised inside a stage."""


def arm(program, what: str, at: int, faulty: bool) -> None:
    """On the faulty rank, `program`'s next run (or, `program` a class, its programs' next)
    raises `what` at its `at`-th stage call (or making of per-call values). A "sigint" is a
    real Ctrl-C, 0.3 s later, while the faulty rank waits for the other, whose next stage
    call takes a second."""
    calls = {"n": 0}
    name = "_call_env" if what == "prelude" else "_run_stage"
    original = getattr(program, name)
    if not faulty and what != "sigint":
        return

    def fault(*args):
        calls["n"] += 1
        if calls["n"] == at + (what == "sigint" and not faulty):
            setattr(program, name, original)
            if what == "sigint" and faulty:
                threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
            elif what == "sigint":  # the call after the one the faulty rank waits for
                time.sleep(1.0)
            elif what == "late":  # after the call's work (and a hybrid ring's exchange)
                original(*args)
                time.sleep(1.0)  # the other branch's output rank is done by now
                raise Injected("out of memory")
            else:
                raise KeyboardInterrupt if what == "cancel" else Injected("out of memory")
        return original(*args)

    setattr(program, name, fault)


def python_sigint() -> None:
    """Ctrl-C raises KeyboardInterrupt, as in a script (a pytest-xdist worker, whose fork
    the ranks are, ignores SIGINT)."""
    signal.signal(signal.SIGINT, signal.default_int_handler)


def faulty_runs(rank: int, generate, program_of, faults=FAULTS) -> list[tuple[str, float]]:
    """A clean generation, then per fault: the faulty one and the next. Returns (outcome,
    seconds) per generation: "same" where it equals the clean one bit for bit."""
    python_sigint()
    clean = generate()
    outcomes: list[tuple[str, float]] = []
    for faulty, what, at in faults:
        arm(program_of(), what, at, rank == faulty)
        for _ in range(2):
            start = time.monotonic()
            try:
                outcome = "same" if torch.equal(generate(), clean) else "differs"
            except (Injected, KeyboardInterrupt) as err:
                told = any("other ranks were told" in n for n in getattr(err, "__notes__", []))
                outcome = f"own {type(err).__name__}{' told' if told else ''}"
            except PeerStopped as err:
                outcome = f"stopped: {err}"
            outcomes.append((outcome, time.monotonic() - start))
    return outcomes


def direct_compile(rank: int, world: int) -> list[tuple[str, float]]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = TinyDiT(depth=2, width=32, heads=2, grid=8).eval()
    compiled = torch.compile(model, backend=tp.backend(stages=world, **OPTIONS), dynamic=False)
    latents, _, labels = dit_inputs(model, 8)

    def generate() -> torch.Tensor:
        x = latents
        try:
            for t in torch.linspace(900, 100, STEPS).long():
                x = x - 0.1 * compiled(x, t[None], labels)
        finally:
            tp.reset(compiled)
        return x

    with torch.no_grad():
        return faulty_runs(rank, generate, lambda: tp.programs(compiled)[0])


def ring(rank: int, world: int) -> list[tuple[str, float]]:
    torch.set_num_threads(1)
    loop, first = step_ring(world, **OPTIONS)
    steps = per_step(STEPS)
    return faulty_runs(rank, lambda: loop.run(first, per_step=steps)[0],
                       lambda: loop.program)


def pipeline(rank: int, world: int) -> list[tuple[str, float]]:
    """A parallelized diffusers pipeline (its loop one ring), PixArt-Sigma with guidance."""
    from tests.fixtures.pipelines import pixart_sigma
    from tokpipe_compiler.stage_programs.distributed import DistributedProgram

    torch.set_num_threads(1)
    pipe, kwargs = pixart_sigma()
    tp.parallelize(pipe, stages=world, **OPTIONS)

    def generate() -> torch.Tensor:
        return pipe(**kwargs, num_inference_steps=STEPS,
                    generator=torch.Generator().manual_seed(0)).images

    return faulty_runs(rank, generate, lambda: DistributedProgram)


@pytest.mark.parametrize("runs", [direct_compile, ring, pipeline])
def test_a_step_raising_on_one_rank_stops_every_rank_at_once(runs):
    check_stopped_alike(launch(runs, 2, timeout=600), FAULTS)


# cfg=2 x stages=2: ranks 0-1 run branch 0's ring, 2-3 branch 1's, and 1 and 3 (the last
# stages) swap each chunk's prediction. Faults on either branch, first and last stage; the
# last, in rank 1's last stage call of the generation, after its last exchange.
HYBRID_FAULTS = [(0, "stage", 3), (3, "stage", 5), (2, "prelude", 1), (1, "cancel", 2),
                 (1, "late", 7)]


def hybrid_pipeline(rank: int, world: int) -> list[tuple[str, float]]:
    from tests.fixtures.pipelines import dit, generate
    from tokpipe_compiler.stage_programs.distributed import DistributedProgram

    torch.set_num_threads(1)
    pipe, kwargs = dit()
    tp.parallelize(pipe, cfg=2, stages=world // 2, **OPTIONS)
    return faulty_runs(rank, lambda: generate(pipe, kwargs, steps=STEPS),
                       lambda: DistributedProgram, HYBRID_FAULTS)


def test_a_step_raising_in_a_hybrid_cfg_ring_stops_both_branches_at_once():
    """The other branch's last stage waited `timeout` inside the guidance exchange, which
    no stop reached, and gloo then closed the groups. The branches' rings now share their
    stop keys, and a stopped last stage makes its remaining exchanges with zeros. A stop
    after the last exchange ended one branch's call and not the other's: the output ranks
    now tell each other before they share the outputs."""
    check_stopped_alike(launch(hybrid_pipeline, 4, timeout=600), HYBRID_FAULTS)


def check_stopped_alike(every: list, faults: list) -> None:
    """Per fault: the faulty rank raised its own error, told the others; each other rank
    raised PeerStopped naming it, well within the timeout; the next call gave the clean
    call's numbers bit for bit."""
    for index, (faulty, what, _) in enumerate(faults):
        own = "KeyboardInterrupt" if what in ("cancel", "sigint") else "Injected"
        for rank, outcomes in enumerate(every):
            (stopped, seconds), (after, _) = outcomes[2 * index: 2 * index + 2]
            if rank == faulty:
                assert stopped == f"own {own} told", (what, rank, outcomes)
            else:
                assert stopped.startswith(f"stopped: rank {faulty}: {own}"), (what, outcomes)
            assert seconds < TIMEOUT / 4, (what, rank, outcomes)  # not a peer's timeout
            assert after == "same", (what, rank, outcomes)  # the group carries on, exactly


def callback_on_rank_0(rank: int, world: int) -> tuple[torch.Tensor, int]:
    """Rank 0 alone passes a step callback (a service reporting progress from one rank);
    rank 1's stage computes the latents. Returns the image and the steps rank 0 saw."""
    from tests.fixtures.pipelines import pixart_sigma

    torch.set_num_threads(1)
    pipe, kwargs = pixart_sigma()
    tp.parallelize(pipe, stages=world, **{**OPTIONS, "timeout": 20.0})
    seen: list[int] = []
    extra = {"callback": lambda i, t, latents: seen.append(i)} if rank == 0 else {}
    image = pipe(**kwargs, num_inference_steps=STEPS,
                 generator=torch.Generator().manual_seed(0), **extra).images
    return image, seen


def test_a_step_callback_on_one_rank_only():
    """The rank with the callback waited `timeout` for steps the other never sent, and gloo
    then closed the group: the ranks now tell each other who watches at the ring's start."""
    (image, seen), (other, unseen) = launch(callback_on_rank_0, 2, timeout=300)
    assert seen == list(range(STEPS)) and unseen == []
    assert torch.equal(image, other)


def ring_watch_raising_on_rank_0(rank: int, world: int, in_warmup: bool) -> list[str]:
    """A Ring whose `each_step` raises on rank 0 at a warmup step (seen on each rank as its
    call returns) or a ring step (seen after the run on rank 0: rank 1 computes them), then
    clean runs: each run's outcome per rank."""
    torch.set_num_threads(1)

    def watch(k: int, value: torch.Tensor) -> None:
        if rank == 0 and (k < OPTIONS["warmup_steps"]) == in_warmup:
            raise ValueError("the callback failed")

    loop, first = step_ring(world, **{**OPTIONS, "timeout": 20.0})
    steps = per_step(STEPS)
    clean = loop.run(first, per_step=steps)[0]
    outcomes = []
    for each_step in (watch, None, None):
        start = time.monotonic()
        try:
            out = loop.run(first, per_step=steps, each_step=each_step)[0]
            outcomes.append("same" if torch.equal(out, clean) else "differs")
        except ValueError as err:
            outcomes.append(str(err))
        except PeerStopped as err:
            outcomes.append(f"stopped: {err}")
        assert time.monotonic() - start < 10, outcomes
    return outcomes


def test_a_ring_watch_raising_on_one_rank_leaves_the_step_counts_alike():
    """Rank 0's raise skipped its step count's advance: its next run's messages were
    numbered 4 steps behind rank 1's, and both waited `timeout` (then gloo closed)."""
    first, second = launch(ring_watch_raising_on_rank_0, 2, timeout=300, args=(False,))
    assert first == ["the callback failed", "same", "same"], first
    assert second == ["same", "same", "same"], second


def test_a_warmup_step_watch_raising_on_one_rank_stops_the_next_run_on_every_rank():
    """Raised between two runs, the error left rank 1 waiting in the ring's run for rank
    0's messages for `timeout`: now rank 0 runs the ring hollow, and both stop it."""
    first, second = launch(ring_watch_raising_on_rank_0, 2, timeout=300, args=(True,))
    assert first == ["the callback failed", "same", "same"], first
    assert second[0].startswith("stopped: rank 0: ValueError: the callback failed"), second
    assert second[1:] == ["same", "same"], second


def per_call_cancel_after_the_run(rank: int, world: int) -> list[tuple[str, float]]:
    """A parallelized pipeline run per call; rank 0 (not the stage that sends the outputs)
    gets a Ctrl-C while it waits for a step's outputs, once, then the service goes on."""
    from tests.fixtures.pipelines import pixart_sigma
    from tokpipe_compiler.stage_programs.distributed import DistributedProgram

    torch.set_num_threads(1)
    python_sigint()
    pipe, kwargs = pixart_sigma()
    tp.parallelize(pipe, stages=world, ring=False, **{**OPTIONS, "timeout": 20.0})
    gather, armed = DistributedProgram._gather, {"calls": 0}

    def interrupted(program, *args):  # a SIGINT that came while this rank waits
        armed["calls"] += 1
        if rank == 0 and armed["calls"] == 2 and program.interrupts is not None:
            program.interrupts.pending = True
        return gather(program, *args)

    def generate() -> torch.Tensor:
        return pipe(**kwargs, num_inference_steps=STEPS,
                    generator=torch.Generator().manual_seed(0)).images

    clean = generate()
    DistributedProgram._gather = interrupted
    outcomes = []
    for _ in range(2):
        start = time.monotonic()
        try:
            outcome = "same" if torch.equal(generate(), clean) else "differs"
        except KeyboardInterrupt:
            outcome = "own KeyboardInterrupt"
        except PeerStopped as err:
            outcome = f"stopped: {err}"
        outcomes.append((outcome, time.monotonic() - start))
    return outcomes


def test_a_cancel_after_a_per_call_run_tells_the_others_at_their_next_step():
    """Held past the run, the Ctrl-C is raised as the call returns on that rank alone; the
    pipeline's leave then reaches the others (it was skipped: the call looked mid-run)."""
    (own, again), (told, after) = launch(per_call_cancel_after_the_run, 2, timeout=300)
    assert own[0] == "own KeyboardInterrupt" and again[0] == after[0] == "same", (own, again)
    assert told[0].startswith("stopped: rank(s) [0] left this pipeline call"), told
    assert max(own[1], told[1]) < 10, (own, told)
