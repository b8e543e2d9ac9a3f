"""A ring run's view of one carried output after each step (a pipeline's step-end callbacks
see the latents through it).

In a ring no rank holds a step's whole output as a value: each chunk's piece goes on to the
next step as soon as it is computed. `StepPieces` sits on the rank whose stage computes the
output and assembles each step's pieces as they come; the step is seen as its last chunk
is computed. Other ranks see the steps after the run, from one message that holds them all
(`DistributedProgram`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokpipe_compiler.runtime.chunking import Chunk
from tokpipe_compiler.runtime.schedule import Action


@dataclass(frozen=True)
class Watch:
    """`see(step, value)` with output `output`'s whole value after each step, counted from
    the run's `first`."""

    output: str
    see: Callable[[int, torch.Tensor], None]


class StepPieces:
    """Collects `watch.output`'s chunk pieces per step and shows each step once whole.
    keep: also keep the whole values, in step order, for the ranks that do not compute them."""

    def __init__(self, watch: Watch, chunks: list[Chunk],
                 assemble: Callable[[list[torch.Tensor]], torch.Tensor], first: int,
                 keep: bool = False):
        self.watch, self.chunks, self.assemble = watch, chunks, assemble
        self.first, self.keep = first, keep
        self.kept: list[torch.Tensor] = []
        self._pieces: dict[int, dict[int, torch.Tensor]] = {}

    def __call__(self, action: Action, values: dict[str, torch.Tensor]) -> None:
        value = values.get(self.watch.output)
        if value is None:  # another stage's compute
            return
        # a copy: the piece may live in a buffer the next chunk writes (CUDA graphs)
        pieces = self._pieces.setdefault(action.step, {})
        pieces[action.chunk] = value.clone()
        if len(pieces) < len(self.chunks):
            return
        whole = self.assemble([pieces[c.index] for c in self.chunks])
        del self._pieces[action.step]
        if self.keep:
            self.kept.append(whole)
        self.watch.see(self.first + action.step, whole)
