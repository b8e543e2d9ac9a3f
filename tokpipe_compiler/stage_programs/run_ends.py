"""How a distributed program's run ends when one rank stops it (`runtime.run_stops`): the
Ctrl-C held during a call, the look for a peer's stop once the outputs are shared, and the
raise on every rank alike."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from tokpipe_compiler.core.errors import TokpipeError
from tokpipe_compiler.runtime.branch_exchange import other_branch_stopped
from tokpipe_compiler.runtime.run_stops import (
    DeferredInterrupts,
    RunStops,
    peer_stopped,
)
from tokpipe_compiler.runtime.transport import TensorSpec
from tokpipe_compiler.stage_programs.generations import Tick


class RunEnds:
    """A mixin of `DistributedProgram`: it reads the program's transport, rank, plan,
    session, device and its last run's `stopped` and `run_number`."""

    @contextmanager
    def _holding_interrupts(self) -> Iterator[None]:
        """A Ctrl-C during a call waits for the next point where this rank can stop the
        run on every rank (`runtime.run_stops`); one after the call is raised after it."""
        try:
            with DeferredInterrupts() as self.interrupts:
                yield
        finally:
            self.interrupts = None

    @property
    def _stops(self) -> RunStops | None:
        """The group's stops, where the last run took part in them (numbered from 1)."""
        return self.transport.stops if self.run_number else None

    def _take_interrupt(self) -> None:
        """A Ctrl-C held since the run's last action stops the run here, on the rank that
        sends outputs, before it sends them (as zeros): every peer looks for the stop after
        they came, so all stop alike. Elsewhere one held past the run's last action is
        raised as the call returns, on that rank alone (a peer may have looked already)."""
        held, stops = self.interrupts, self._stops
        if held is None or not held.pending or self.stopped is not None or stops is None:
            return
        held.pending = False
        self.stopped = KeyboardInterrupt()
        stops.stop(self.run_number, self.rank, self.stopped)

    def _agree_with_the_other_branch(self) -> None:
        """A hybrid cfg=2 ring's output rank, before it shares the outputs: where the other
        branch's output rank stopped the run, its stop is in the store the branches share
        (`run_stops.share_stops`), written before it said so: seen now, it stops this branch
        too, whose ranks look after the outputs came."""
        if other_branch_stopped(self.stopped is not None, self.device):
            self._stop_seen()

    def _stop_seen(self) -> BaseException | None:
        """What stopped this run on every rank: this rank's error, or a peer's, looked for
        once its outputs are shared (`runtime.run_stops`: one look in the store a run)."""
        stops = self._stops
        if self.stopped is None and stops is not None and not self._looked:
            self._looked = True
            seen = stops.seen(self.run_number)
            if seen is not None:
                self.stopped = peer_stopped(seen, stops.named(self.rank), mid_run=False)
        return self.stopped

    def _run_ends(self) -> None:
        """A stopped run raises on every rank, its error on the rank it arose on and
        PeerStopped on the others, and the generation starts anew at the next call, in
        every program of the compile (as `tp.reset` starts it): this one's K/V caches hold
        what the hollow run left."""
        stopped = self._stop_seen() or self._same_call()
        if stopped is not None:
            for program in self.session.programs if self.session is not None else (self,):
                program.reset()
            raise stopped

    def _same_call(self) -> TokpipeError | None:
        """Where the ranks said other calls for this run (`call_run`: a model compiled
        directly), the error every rank raises: they mixed their inputs."""
        run, self.call_run = self.call_run, None
        stops = self._stops
        if run is None or stops is None or run != self.run_number:
            return None
        said = stops.calls_said(run, self.world, self.plan.config.timeout)
        if said is None or len(set(said)) == 1:
            return None
        calls = "; ".join(f"rank {stops.named(r)}: {what}" for r, what in enumerate(said))
        return TokpipeError(
            f"the ranks ran other calls as one pipelined call ({calls}): each rank's stages "
            "computed on its own inputs, so the outputs mixed them and are not returned. "
            "Call the compiled model on every rank alike: the same timesteps, as many calls "
            "a step, and none run another way on one rank only (a call under "
            "torch.compiler.set_stance('force_eager'), or skipped). The next call starts a "
            "new generation")

    def _zeros(self, spec: TensorSpec) -> torch.Tensor:
        """What a stopped run sends in place of a value it did not compute."""
        return torch.zeros(spec.shape, dtype=spec.dtype, device=self.device)


def call_description(tick: Tick, timestep: float | None) -> str:
    """A call as the ranks compare it: its step and branch in the generation and the
    timestep its host read (no wait for the device)."""
    said = "a generation's first call" if tick.new_generation else f"step {tick.step}"
    at = "" if timestep is None else f" at timestep {timestep:g}"
    return f"{said}{at}, guidance branch {tick.branch}"
