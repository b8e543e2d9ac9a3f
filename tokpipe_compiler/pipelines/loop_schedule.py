"""The part of its scheduler's schedule a pipeline's loop runs, as a step table.

Text-to-image loops run the whole schedule. Image-to-image and video-to-video loops run its
last steps (`strength`): most tell the scheduler with `set_begin_index` before the loop,
some slice the timesteps themselves and leave the scheduler to find its step from the
timestep, so the loop's first step is known only when it reaches `scheduler.step`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from tokpipe_compiler.pipelines.schedulers import StepTable, step_table
from tokpipe_compiler.pipelines.step_structure import widened


@dataclass
class LoopSchedule:
    """The steps a loop runs, their table, and why they cannot make a ring (empty: they
    can)."""

    timesteps: torch.Tensor
    table: StepTable | None
    reasons: list[str] = field(default_factory=list)


def loop_schedule(scheduler: Any, timestep_args: tuple[tuple, dict], begin: int) -> LoopSchedule:
    """The schedule from step `begin`, with `timestep_args` the pipeline's own
    `set_timesteps` arguments."""
    args, kwargs = timestep_args
    kwargs = {k: v for k, v in kwargs.items() if k != "device"}
    timesteps = torch.as_tensor(scheduler.timesteps)[begin:]
    schedule = LoopSchedule(timesteps, None)
    try:
        table = step_table(scheduler, *args, begin_index=begin, noise=True, **kwargs)
        # a multistep update's longest structure: one traced ring step for any step count
        schedule.table = widened(table, scheduler, **kwargs)
    except (ValueError, TypeError) as err:
        schedule.reasons.append(str(err))
    else:
        # the table is made on the CPU; a pipeline sets its timesteps on its device
        if not torch.allclose(schedule.table.timesteps, timesteps.float().cpu(), rtol=1e-6):
            schedule.reasons.append("the scheduler's timesteps differ from its step table's")
    if len(timesteps) < 2:
        schedule.reasons.append(f"{len(timesteps)} step: nothing to overlap")
    return schedule


def announced_begin(scheduler: Any) -> int:
    """The step the loop starts at, where the pipeline told the scheduler (else 0)."""
    return getattr(scheduler, "begin_index", None) or 0


def step_of(timesteps: Any, t: Any) -> int | None:
    """The index of timestep `t` in `timesteps` (its first occurrence), or None where it is
    not there."""
    t = torch.as_tensor(t, dtype=torch.float32).flatten()[:1].cpu()
    found = torch.nonzero(torch.as_tensor(timesteps).float().cpu() == t).flatten()
    return int(found[0]) if len(found) else None
