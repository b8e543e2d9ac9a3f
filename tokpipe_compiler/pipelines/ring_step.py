"""The ring's step function, built from a pipeline's identified step (`glue.Glue`).

The transformer inputs that stay fixed over a generation become the step's inputs (their
tensor leaves, `input_<i>`) or constants (everything else); two calls per step (one per
guidance branch) become one batched call.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from tokpipe_compiler.core.errors import TokpipeError
from tokpipe_compiler.pipelines.glue import (
    CONDITION,
    LATENT_POSITIONS,
    Glue,
    as_stacked,
    carried_input,
    condition_part,
    first_tensor,
    guide,
    latent_positions,
    model_input,
    same,
)
from tokpipe_compiler.pipelines.schedulers import StepTable, update_state
from tokpipe_compiler.runtime.branch_exchange import cfg_gather


@dataclass(frozen=True)
class TensorSlot:
    """Marks where a fixed input's tensor leaf goes: step-function input `name`."""

    name: str


def make_step(forward: Callable[..., Any], glue: Glue, spec: Any, constants: list[Any],
              table: StepTable, branch: int | None = None,
              blended: bool = False) -> Callable[..., Any]:
    """The ring's step function: the transformer call, guidance and scheduler update.
    Inputs: the carried `sample` and `state_<i>`, per step `timestep`, `scale` and
    `coeffs` (a row of the table), and the fixed `guidance` and `input_<i>`. Where the
    condition joined to the latent adds positions, the sample carries them (unchanged by
    the update) and the fixed inputs hold the mask of the latent's own (`LATENT_POSITIONS`).
    branch: this ring's guidance branch (hybrid cfg=2): the transformer runs on that half
    of the batch (the fixed inputs come halved) and the other half's prediction comes from
    the other branch's ring (`cfg_gather`). blended: after the update the latents are
    blended with a noised image (inpainting, `blends`), by per-step `blend_keep` and
    `blend_target`."""
    pattern, states = table.pattern, [f"state_{i}" for i in range(table.state_size)]

    def step(sample, timestep, scale, coeffs, guidance, **tensors):
        leaves = [tensors[c.name] if isinstance(c, TensorSlot) else c for c in constants]
        inputs = pytree.tree_unflatten(leaves, spec)
        positions = inputs.pop(LATENT_POSITIONS, None)
        if positions is None:
            inputs[glue.latent_arg] = model_input(glue, sample, scale, inputs.pop(CONDITION, None))
        else:  # the sample carries the condition's positions (Glue.condition_positions)
            inputs[glue.latent_arg] = carried_input(glue, sample, scale, positions)
        inputs[glue.timestep_arg] = timestep
        if branch is None:
            out = as_stacked(glue.per_item, forward(**inputs))
        else:
            for name in (glue.latent_arg, glue.timestep_arg):
                inputs[name] = inputs[name].chunk(2)[branch]
            out = cfg_gather(first_tensor(forward(**inputs)))
        state = [tensors[name] for name in states]
        noise = guide(glue, out, guidance, every_position=positions is not None)
        x, state = update_state(sample, noise, state, coeffs, pattern)
        if positions is not None:  # the condition stays as it is
            x = torch.where(positions, x, sample)
        if blended:  # in the pipeline's order: (1 - mask) * noised + mask * latents
            x = tensors["blend_target"] + tensors["blend_keep"] * x
        return (x, *state)

    return step


def fixed_inputs(glue: Glue, calls: list[dict[str, Any]], batch: int,
                 rows_per_sample: bool = False,
                 once: frozenset[str] = frozenset()) -> dict[str, Any]:
    """The transformer inputs that stay fixed over the generation, with the condition
    joined to the latent (`CONDITION`) where there is one; two calls (one per guidance
    branch) become one batched call, cond first. `rows_per_sample`: an input both calls
    pass alike, with rows neither 1 nor `batch`, holds rows per sample (Wan's first and
    last frame images: 2 for one sample) and is batched too, not passed once. `once`: the
    inputs both calls pass alike that are passed once whatever their rows (Wan VACE's
    `control_hidden_states_scale`, one row per VACE layer: one row, like a sample's, where
    the model has one VACE layer)."""
    names = [n for n in calls[0] if n not in (glue.latent_arg, glue.timestep_arg)]
    condition = {} if glue.condition_dim is None else \
        {CONDITION: condition_part(glue, calls[0][glue.latent_arg])}
    if len(calls) == 1:
        return {**{n: calls[0][n] for n in names}, **condition}
    pairs = [pair for name in names
             for pair in zip(*(pytree.tree_leaves(call[name]) for call in calls), strict=True)]
    spread = any(_spreads(cond, uncond, batch) for cond, uncond in pairs)
    fixed = {name: torch.cat([value, value]) for name, value in condition.items()}
    for name in names:
        if name in once and same(calls[0][name], calls[1][name]):
            fixed[name] = calls[0][name]
            continue
        if glue.per_item is not None and _item_lists(calls[0][name], calls[1][name], batch):
            fixed[name] = [*calls[0][name], *calls[1][name]]  # per image, as the latent
            continue
        batched = functools.partial(_batched, name, batch=batch, spread=spread,
                                    rows_per_sample=rows_per_sample)
        fixed[name] = pytree.tree_map(batched, calls[0][name], calls[1][name])
    return fixed


# A tensor input with one row where the latent has `batch` is one row for the whole batch,
# which the model broadcasts: a pipeline given one prompt's embeddings and asked for several
# images passes them so, for one branch or both. Batching the branches then needs a row per
# sample of each branch; and once one input has them, every input of one row does (the
# model may join them: Wan's image and text embeddings), as with a batch of one.


def _spreads(cond: Any, uncond: Any, batch: int) -> bool:
    """Whether batching this input needs a one-row input spread to a row per sample."""
    rows = [_rows(cond), _rows(uncond)]
    if batch == 1 or 1 not in rows or not set(rows) <= {1, batch}:
        return False
    return batch in rows or not same(cond, uncond)


def _item_lists(cond: Any, uncond: Any, batch: int) -> bool:
    """Whether both branches pass a list of one tensor per sample (Z-Image's text)."""
    return all(isinstance(v, (list, tuple)) and len(v) == batch
               and all(isinstance(t, torch.Tensor) for t in v) for v in (cond, uncond))


def _batched(name: str, cond: Any, uncond: Any, *, batch: int, spread: bool,
             rows_per_sample: bool = False) -> Any:
    """One input of the two branches' calls as one input of the batched call. `spread`:
    whether any input needs a row per sample (`_spreads`; this one's different rows of
    one, if they differ, made it so)."""
    rows = [_rows(cond), _rows(uncond)]
    if set(rows) <= {1, batch} and (batch in rows or spread):
        return torch.cat([_per_sample(cond, batch), _per_sample(uncond, batch)])
    if rows_per_sample and rows[0] == rows[1] and rows[0] is not None and \
            rows[0] % batch == 0:
        return torch.cat([cond, uncond])
    if same(cond, uncond):
        return cond
    raise TokpipeError(f"the two guidance branches pass different {name!r} that is not "
                       "batched along the latent's batch; ring mode cannot batch them: run it "
                       "per call with parallelize(pipe, ring=False)")


def batched_call(glue: Glue, calls: list[dict[str, Any]],
                 fixed: dict[str, Any]) -> dict[str, Any]:
    """The one call the ring's step makes of the transformer for the branches' `calls`
    (their latent and timestep inputs joined), to check it on fake tensors."""
    call = {k: v for k, v in fixed.items() if k in calls[0]}
    for name in (glue.latent_arg, glue.timestep_arg):
        values = [c[name] for c in calls]
        joined = all(isinstance(v, torch.Tensor) and v.dim() for v in values)
        call[name] = torch.cat(values) if joined else values[0]
    if glue.per_item is not None:  # the latent per image
        call[glue.latent_arg] = [item for c in calls for item in c[glue.latent_arg]]
    return call


def _rows(value: Any) -> int | None:
    return value.shape[0] if isinstance(value, torch.Tensor) and value.dim() else None


def _per_sample(value: torch.Tensor, batch: int) -> torch.Tensor:
    return value.expand(batch, *value.shape[1:])


def carry_condition(glue: Glue, sample: torch.Tensor,
                    fixed: dict[str, Any]) -> tuple[torch.Tensor, dict[str, Any]]:
    """Where the condition adds positions (Glue.condition_positions): the sample joined with
    them, so that the ring chunks the sequence the transformer sees, and the fixed inputs
    with the mask of the latent's own positions in place of the condition. Elsewhere the
    sample and fixed inputs as they are."""
    if not glue.condition_positions:
        return sample, fixed
    fixed = dict(fixed)
    condition = fixed.pop(CONDITION)
    halves = condition.chunk(condition.shape[0] // sample.shape[0])
    if any(not torch.equal(half, halves[0]) for half in halves[1:]):
        raise TokpipeError("the guidance branches join different conditions to the latent; "
                           "ring mode carries one: run it per call with "
                           "parallelize(pipe, ring=False)")
    carried = torch.cat([sample, halves[0].to(sample.dtype)], glue.condition_dim)
    return carried, {**fixed, LATENT_POSITIONS: latent_positions(glue, carried)}


def split_fixed(fixed: dict[str, Any]) -> tuple[dict[str, torch.Tensor], Any, list[Any]]:
    """The step's tensor inputs, named by where they sit in the transformer's call
    (`input_encoder_hidden_states`: what the ranks' agreement names), the tree spec, and the
    leaves with a TensorSlot where a tensor input goes."""
    with_paths, spec = pytree.tree_flatten_with_path(fixed)
    tensors: dict[str, torch.Tensor] = {}
    constants: list[Any] = []
    for i, (path, value) in enumerate(with_paths):
        if not isinstance(value, torch.Tensor):
            constants.append(value)
            continue
        name = "input_" + (re.sub(r"\W+", "_", pytree.keystr(path)).strip("_") or str(i))
        name = name if name not in tensors else f"{name}_{i}"
        tensors[name] = value
        constants.append(TensorSlot(name))
    return tensors, spec, constants


def check_combinable(pipeline: str, noise_pred: torch.Tensor, sample: torch.Tensor) -> None:
    """The scheduler's step combines the prediction with the latents elementwise: shapes
    that do not broadcast fail in the pipeline's own code, and would fail inside the
    ring's traced step, far from the cause."""
    try:
        torch.broadcast_shapes(noise_pred.shape, sample.shape)
    except RuntimeError:
        raise TokpipeError(
            f"{pipeline}'s scheduler step gets a prediction of shape "
            f"{tuple(noise_pred.shape)} for latents of {tuple(sample.shape)}, which do "
            "not combine (the pipeline fails the same without tokpipe): the transformer "
            "returns a grid other than the latents', as a height or width that is not a "
            "multiple of the VAE's scale times the patch size makes it; pass one that "
            "is") from None
