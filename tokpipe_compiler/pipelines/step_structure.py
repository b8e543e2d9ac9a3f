"""One ring step for every step count.

A multistep scheduler's update carries more state on a longer schedule: UniPC's table
carries no state tensor at 2 steps, 2 at 3 steps and 3 from 8 steps on (its lower-order
first and last steps). The ring's traced step is specialised to the table's state count and
terms (`StepTable.state_size`, `pattern`), so each step count would trace, plan and compile
a program of its own: a pipeline's short first call would compile a program the next call
does not use, and a user who changes `num_inference_steps` would wait for another compile.

`widened` gives a table the structure of the same scheduler's update over a long schedule
(`LONG_STEPS`): the extra state tensors start at zero and the extra terms have weight zero,
so the numbers are the table's own, exactly, and one traced step serves every step count.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from tokpipe_compiler.pipelines.schedulers import StepTable, step_table
from tokpipe_compiler.pipelines.step_rows import Pattern

LONG_STEPS = 50  # a schedule long enough to use every term its update has
Structure = tuple[int, Pattern]  # (state_size, pattern)
_LONG: dict[str, Structure | None] = {}  # per scheduler class, config and set_timesteps args


def widened(table: StepTable, scheduler: Any, **set_timesteps_kwargs: Any) -> StepTable:
    """`table` with at least the state tensors and terms `scheduler`'s update has over a
    long schedule (the union with its own). A custom schedule (sigmas=, timesteps=) has no
    longer version: its table comes back as it is."""
    long = _long_structure(scheduler, set_timesteps_kwargs)
    if long is None:
        return table
    size = max(table.state_size, long[0])
    pattern = tuple(tuple(sorted(set(_row(table.pattern, i)) | set(_row(long[1], i))))
                    for i in range(1 + size))
    if (size, pattern) == (table.state_size, table.pattern):
        return table
    return dataclasses.replace(table, rows=_padded(table.rows, table.state_size, size),
                               state_size=size, pattern=pattern)


def _row(pattern: Pattern, i: int) -> tuple[int, ...]:
    return pattern[i] if i < len(pattern) else ()


def _padded(rows: torch.Tensor, m: int, size: int) -> torch.Tensor:
    """Rows of (1 + m) x (2 + m) matrices as (1 + size) x (2 + size) ones, zeros added: the
    output rows and input columns keep their indices (x, out, state_0.. come first)."""
    steps = len(rows)
    wide = rows.new_zeros(steps, 1 + size, 2 + size)
    wide[:, : 1 + m, : 2 + m] = rows.view(steps, 1 + m, 2 + m)
    return wide.reshape(steps, -1)


def _long_structure(scheduler: Any, kwargs: dict[str, Any]) -> Structure | None:
    if "sigmas" in kwargs or "timesteps" in kwargs:
        return None
    kwargs = {k: v for k, v in kwargs.items() if k != "num_inference_steps"}
    key = f"{type(scheduler).__name__} {dict(scheduler.config)!r} {kwargs!r}"
    if key not in _LONG:
        try:
            long = step_table(scheduler, LONG_STEPS, noise=True, **kwargs)
            _LONG[key] = (long.state_size, long.pattern)
        except ValueError:  # a schedule that cannot be this long: the table stays as it is
            _LONG[key] = None
    return _LONG[key]
