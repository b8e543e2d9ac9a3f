"""The ring's step function, built from a pipeline's identified step (`glue.Glue`).

The transformer inputs that stay fixed over a generation become the step's inputs (their
tensor leaves, `input_<i>`) or constants (everything else); two calls per step (one per
guidance branch) become one batched call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from tokpipe_compiler.core.errors import TokpipeError
from tokpipe_compiler.pipelines.glue import Glue, first_tensor, guide, model_input
from tokpipe_compiler.pipelines.schedulers import StepTable, update_state
from tokpipe_compiler.runtime.branch_exchange import cfg_gather


class _Tensor:
    """Marks where a fixed input's tensor leaves go (a step-function input each)."""

    def __repr__(self) -> str:
        return "<tensor>"


TENSOR = _Tensor()


def make_step(forward: Callable[..., Any], glue: Glue, spec: Any, constants: list[Any],
              table: StepTable, branch: int | None = None) -> Callable[..., Any]:
    """The ring's step function: the transformer call, guidance and scheduler update.
    Inputs: the carried `sample` and `state_<i>`, per step `timestep`, `scale` and
    `coeffs` (a row of the table), and the fixed `guidance` and `input_<i>`.
    branch: this ring's guidance branch (hybrid cfg=2): the transformer runs on that half
    of the batch (the fixed inputs come halved) and the other half's prediction comes from
    the other branch's ring (`cfg_gather`)."""
    pattern, states = table.pattern, [f"state_{i}" for i in range(table.state_size)]

    def step(sample, timestep, scale, coeffs, guidance, **tensors):
        leaves = [tensors[f"input_{i}"] if c is TENSOR else c for i, c in enumerate(constants)]
        inputs = pytree.tree_unflatten(leaves, spec)
        inputs[glue.latent_arg] = model_input(glue, sample, scale)
        inputs[glue.timestep_arg] = timestep
        if branch is None:
            out = first_tensor(forward(**inputs))
        else:
            for name in (glue.latent_arg, glue.timestep_arg):
                inputs[name] = inputs[name].chunk(2)[branch]
            out = cfg_gather(first_tensor(forward(**inputs)))
        state = [tensors[name] for name in states]
        x, state = update_state(sample, guide(glue, out, guidance), state, coeffs, pattern)
        return (x, *state)

    return step


def fixed_inputs(glue: Glue, calls: list[dict[str, Any]], batch: int) -> dict[str, Any]:
    """The transformer inputs that stay fixed over the generation; two calls (one per
    guidance branch) become one batched call, cond first."""
    names = [n for n in calls[0] if n not in (glue.latent_arg, glue.timestep_arg)]
    if len(calls) == 1:
        return {n: calls[0][n] for n in names}
    fixed = {}
    for name in names:
        cond, uncond = calls[0][name], calls[1][name]
        fixed[name] = pytree.tree_map(functools.partial(_batched, name, batch=batch), cond, uncond)
    return fixed


def _batched(name: str, cond: Any, uncond: Any, *, batch: int) -> Any:
    if isinstance(cond, torch.Tensor) and cond.dim() and cond.shape[0] == batch:
        return torch.cat([cond, uncond])
    if same(cond, uncond):
        return cond
    raise TokpipeError(f"the two guidance branches pass different {name!r} that is not "
                       "batched along the latent's batch; ring mode cannot batch them: run it "
                       "per call with parallelize(pipe, ring=False)")


def split_fixed(fixed: dict[str, Any]) -> tuple[dict[str, torch.Tensor], Any, list[Any]]:
    """The step's tensor inputs (`input_<i>`), the tree spec, and the leaves with TENSOR
    where a tensor input goes."""
    leaves, spec = pytree.tree_flatten(fixed)
    tensors = {f"input_{i}": v for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)}
    return tensors, spec, [TENSOR if isinstance(v, torch.Tensor) else v for v in leaves]


def same(a: Any, b: Any, rtol: float = 0.0) -> bool:
    """Equal values (tensors exactly, or within `rtol` of b's largest), through nested
    containers."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        if rtol == 0.0:
            return bool(torch.equal(a, b))
        scale = max(b.abs().max().item(), 1e-30)
        return (a - b).abs().max().item() <= rtol * scale
    if isinstance(a, (dict, list, tuple)) and type(a) is type(b):
        la, sa = pytree.tree_flatten(a)
        lb, sb = pytree.tree_flatten(b)
        return sa == sb and all(same(x, y, rtol) for x, y in zip(la, lb, strict=True))
    try:
        return bool(a == b)
    except (RuntimeError, TypeError, ValueError):
        return False
