"""Guidance branches kept apart, in stale mode: the calls of one step at one timestep with
other inputs (the conditional and unconditional halves of classifier-free guidance) each
attend to K/V caches of their own. A program whose branches shared caches would pass
every single-branch check, so two branches run interleaved, step after step, and each
call must equal the same branch's call run alone, in a generation of its own, by the same
program.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from tokpipe_compiler.config import Config
from tokpipe_compiler.testing.checks import Check, compare
from tokpipe_compiler.testing.inputs import Inputs, changed_input

# A compiled call: inputs -> (output, the chunks it ran as)
Run = Callable[[Inputs], tuple[Any, int | None]]


def branch_calls(model: torch.nn.Module, args: tuple, kwargs: dict, config: Config
                 ) -> list[tuple[Inputs, Inputs]]:
    """Per step (warmup steps, then two stale ones): the given input with its timestep
    moved a step at a time, and a second branch at that timestep with other token inputs
    (none where the input has no floating tensor of rank >= 3 to change)."""
    steps = config.warmup_steps + 2
    moved = [(changed_input(model, args, kwargs, config.timestep_input, k, False, steps - 1),
              changed_input(model, args, kwargs, config.timestep_input, k, True, steps - 1))
             for k in range(steps)]
    given, other = moved[0]
    if all(a is b for a, b in zip(tree_leaves(given), tree_leaves(other), strict=True)):
        return []  # no token input to change: a second call would repeat the first
    return moved


def check_branches(run: Run, new_generation: Callable[[], None],
                   calls: list[tuple[Inputs, Inputs]], first_call: int) -> list[Check]:
    """Each branch's calls, interleaved with the other's, against the branch run alone.
    `first_call`: the number of calls made before (for the checks' call numbers)."""
    new_generation()
    together = [[run(given), run(other)] for given, other in calls]
    alone = []
    for branch in range(2):
        new_generation()
        alone.append([run(pair[branch]) for pair in calls])
    checks = []
    for step, pair in enumerate(together):
        for branch, (actual, chunks) in enumerate(pair):
            call = first_call + 2 * step + branch + 1
            checks.append(compare(f"stale mode, guidance branch {branch} of step {step} "
                                  "against the branch alone", call, alone[branch][step][0],
                                  actual, chunks))
    return checks
