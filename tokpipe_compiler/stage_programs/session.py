"""The programs of one backend (one torch.compile call, or one `tp.backend` object): the
session that resets them together and hands a model's role (its token input) from one
program to another as input shapes change."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

from tokpipe_compiler.planning.graph_share import GraphTally
from tokpipe_compiler.stage_programs.generations import SharedTimesteps

if TYPE_CHECKING:
    from tokpipe_compiler.stage_programs.pipelined import PipelinedProgram

# Guidance runs 2 branches a step, skip-layer guidance 3: past this, calls at one timestep
# are more likely separate generations, each holding a set of caches.
MANY_BRANCHES = 4


class Session:
    """The programs of one backend (one torch.compile call, or one `tp.backend` object),
    for reset()."""

    def __init__(self) -> None:
        self.programs: weakref.WeakSet[PipelinedProgram] = weakref.WeakSet()
        # (model, role) -> the programs that serve it now, of one set of input shapes
        # (weakly: models come and go), each with the role's call it last served
        self.holders: dict[tuple[int | None, str], dict[weakref.ref, int]] = {}
        self.calls: dict[tuple[int | None, str], int] = {}  # calls served per role
        self.timesteps = SharedTimesteps()  # of graphs split at graph breaks
        self.warned: set[str] = set()  # the warnings given once per compile
        # Set by parallelize: what to say, once, when its transformer is called outside the
        # pipeline's call (a pipeline made from it with from_pipe and not parallelized).
        self.outside_call: str | None = None
        self.graphs = GraphTally()  # each graph's outcome, for a split model's summary
        self.block_traces: dict[int | None, int] = {}  # per block: times traced alone
        self.block_round_said = 0  # the last such time whose cost a warning said

    def block_traced(self, block: int | None) -> int:
        """Counts a trace of the block `block` (its id) on its own; returns which one it is:
        the blocks' second traces (Dynamo still skipping their model's forward after a hook
        came and went, or at a new input shape) warn again."""
        self.block_traces[block] = self.block_traces.get(block, 0) + 1
        return self.block_traces[block]

    def reset(self) -> None:
        for program in list(self.programs):
            program.reset()
        self.holders.clear()
        self.calls.clear()

    def claim(self, program: PipelinedProgram, owner: int | None) -> None:
        """Called per call: a program of another token input shape than its role's holders
        (for the same model) takes the role over: it starts afresh, and theirs' K/V are
        freed (a process drawing at many sizes holds the caches of one). Programs of the
        same token input shape share the role, each with its caches, while they alternate:
        Dynamo made several graphs of one call (a step cache's hooks trace each guidance
        branch apart), or the calls of a step differ in their other inputs (guidance whose
        unconditional call passes no mask, or a shorter text). One
        not called in the role's last MANY_BRANCHES calls is let go (a graph Dynamo made
        again for a new Python value would otherwise keep the old one's K/V)."""
        role = (owner, program.token_argument)
        calls = self.calls[role] = self.calls.get(role, 0) + 1
        holders = {p: last for ref, last in self.holders.get(role, {}).items()
                   if (p := ref()) is not None}
        if program not in holders:
            program.reset()
            if holders and next(iter(holders)).token_shape != program.token_shape:
                holders = self._let_go(holders)
        holders[program] = calls
        kept = {p: last for p, last in holders.items() if calls - last <= MANY_BRANCHES}
        self._let_go({p: last for p, last in holders.items() if p not in kept})
        self.holders[role] = {weakref.ref(p): last for p, last in kept.items()}

    @staticmethod
    def _let_go(programs: dict) -> dict:
        """End the programs' generations (their K/V freed; each starts afresh if it claims
        its role again); an empty holding."""
        for previous in programs:
            previous.end_generation()
        return {}
