"""One scheduler step as token-wise arithmetic: a row of a step table applied.

A row holds M_k row-major (see `schedulers`): output rows x_next, state_0..; input columns
x, out, state_0... `pattern` lists, per output row, the columns that are ever nonzero, so
only those terms are computed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

Pattern = tuple[tuple[int, ...], ...]  # per output row, the input columns that are ever used


def update_state(
    latents: torch.Tensor,
    model_output: torch.Tensor,
    state: Sequence[torch.Tensor],
    row: torch.Tensor,
    pattern: Pattern | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """One scheduler step as token-wise arithmetic, with `row` one row of StepTable.rows,
    `state` StepTable.state_size tensors shaped like the latents (zeros before the first step)
    and `pattern` StepTable.pattern (default: every term).

    Returns (x_next in latents' dtype, the new state). Like diffusers, the arithmetic runs in at
    least float32; the state stays in that precision.
    """
    dtype = torch.promote_types(latents.dtype, torch.float32)
    inputs = [t.to(dtype) for t in (latents, model_output, *state)]
    width = len(inputs)
    if pattern is None:
        pattern = tuple(tuple(range(width)) for _ in range(width - 1))
    outputs = [_combine(inputs, row[i * width:(i + 1) * width], columns)
               for i, columns in enumerate(pattern)]
    return outputs[0].to(latents.dtype), tuple(outputs[1:])


def _combine(inputs: list[torch.Tensor], weights: torch.Tensor,
             columns: Sequence[int]) -> torch.Tensor:
    """sum_j weights[j] * inputs[j] over `columns`; zeros when there are none (a state
    position that a schedule never fills)."""
    if not columns:
        return torch.zeros_like(inputs[0])
    value = weights[columns[0]] * inputs[columns[0]]
    for j in columns[1:]:
        value = value + weights[j] * inputs[j]
    return value
