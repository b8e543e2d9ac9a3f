"""What a pipeline does around its transformer in one denoising step, found by probing.

Every covered diffusers pipeline wraps the transformer call in the same few token-wise
forms: the latent passed once, twice or three times (the guidance batch), maybe cast to the
transformer's dtype, the timestep `t` or `t / 1000` broadcast over the batch,
classifier-free guidance `uncond + g * (cond - uncond)` over the two halves of the batch
(or over two calls), perturbed-attention guidance (PAG: a third part of the batch whose
attention the transformer perturbs, `+ s * (cond - perturbed)`), maybe rescaled to the
conditional prediction's norm per token, in the prediction's dtype or upcast first, and
the learned-variance channels dropped; the latent may be joined with a fixed condition (an
image's latents) after it.
At the first step of a generation the transformer answers with random probes instead of
computing; what reaches `scheduler.step` then says which form the pipeline used, and with
which guidance scale. Nothing about a family is written here: its own loop is observed.

`Glue` is the answer; `model_input`, `model_timesteps` and `guide` replay it inside the
ring's step function, and `guide` also checks every later step against it. The guidance
forms themselves, and fitting them, are `guidance_forms`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from tokpipe_compiler.core.errors import TokpipeError
from tokpipe_compiler.pipelines.guidance_forms import GlueNotFound, close, combine, fit_guidance
from tokpipe_compiler.stage_programs.generations import TIMESTEP_NAMES

DIVISORS = (1.0, 1000.0)  # pipelines pass t, or t / 1000 (flow-matching transformers)
# ... or 1 - t / 1000, rising from step to step (Lumina2: `1 - t / 1000`, Z-Image:
# `(1000 - t) / 1000`, which round otherwise): the form (-1000.0, divide_first), see Glue.
RISING = -1000.0
# How the timestep passed is made from the scheduler's t: (divisor, divide_first), see Glue.
TimestepForm = tuple[float, bool]
# The names the condition joined to the latent (see Glue) takes among the step's fixed inputs,
# and the mask of the latent's own positions where the ring carries the condition's.
CONDITION = "_tokpipe_condition"
LATENT_POSITIONS = "_tokpipe_latent_positions"


@dataclass(frozen=True)
class Glue:
    """One denoising step of a pipeline, as seen from the transformer.

    latent_arg / timestep_arg: the transformer parameters that take the latent and timestep.
    copies: the latent passed once, or twice (the guidance batch; two calls are batched),
        or three times (classifier-free and perturbed-attention guidance together).
    latent_dtype: the dtype the latent is passed in (Sana, Wan, LTX keep float32 latents
        and cast them to the transformer's dtype).
    timestep_forms: the (divisor, divide_first) forms that agree with every timestep passed
        so far, the first one replayed: the timestep passed is `(t / divisor).to(dtype)`,
        or `t.to(dtype) / divisor` when not divide_first, broadcast over the batch; a
        negative divisor -d is a timestep that rises: `1 - t / d` (divide_first, Lumina2's)
        or `(d - t) / d` (Z-Image's), in t's dtype, then cast. In a
        low-precision dtype the two orders round differently, and at t = 1000 they agree,
        so a first step may leave both (later steps narrow them, before the ring runs).
    combine: the guidance form (`guidance_forms.COMBINES`, or `TWO_CALL_COMBINES` where the
        pipeline calls the transformer once per branch); cond_first_both is DiT's, which
        keeps the doubled latent and writes the guided prediction to both halves;
        cond_first_rescaled is QwenImage's, which rescales the guided prediction to the
        conditional one's norm over the last axis (channels, per token); perturbed and
        uncond_first_perturbed are the PAG pipelines' (`guidance_forms.PERTURBED`).
    guidance_dtype / prediction_dtype: the dtype guidance is computed in (CogVideoX and
        Sana upcast the prediction to float32 first), and the one the scheduler gets.
    channels: output channels the scheduler gets (the learned variance dropped), or None.
    guidance: the guidance scale g; PAG's scale s for perturbed, the pair (g, s) for
        uncond_first_perturbed.
    calls: transformer calls per step in the pipeline (2: one per guidance branch).
    condition_dim / condition_size: where the latent is passed joined with a fixed
        condition (an image's latents), the axis they are joined along, latent first, and
        the condition's extent on it (Flux Kontext joins tokens, Wan's image-to-video
        channels); None / 0 where the latent is passed alone.
    condition_positions: whether the condition adds positions the transformer predicts
        too, dropped before the scheduler (Flux Kontext's image tokens), rather than
        features of the latent's positions (Wan's image channels).
    timestep_shape: the timestep input's shape after the batch axis: () for one timestep
        per sample, (tokens,) where the pipeline passes t for every token (Wan 2.2's
        `expand_timesteps`).
    """

    latent_arg: str
    timestep_arg: str
    copies: int
    latent_dtype: torch.dtype
    timestep_forms: tuple[TimestepForm, ...]
    timestep_dtype: torch.dtype
    combine: str
    guidance_dtype: torch.dtype
    prediction_dtype: torch.dtype
    channels: int | None
    guidance: float | tuple[float, float]
    calls: int
    negated: bool = False  # the pipeline negates the (guided) prediction (HiDream, Lumina2)
    condition_dim: int | None = None
    condition_size: int = 0
    condition_positions: bool = False
    timestep_shape: tuple[int, ...] = ()
    # Z-Image: the latent passed as a list of per-sample tensors, each with a new axis at
    # `per_item - 1` (the stacked list's axis `per_item`), and the prediction returned so.
    per_item: int | None = None

    def narrowed(self, passed: torch.Tensor, t: Any) -> Glue:
        """The glue with only the timestep forms that also give `passed` at step `t`
        (none left: the pipeline changed how it passes the timestep)."""
        forms = tuple(f for f in self.timestep_forms if _gives(f, passed, t))
        return dataclasses.replace(self, timestep_forms=forms)


def timestep_arg(arguments: dict[str, Any]) -> str:
    """The transformer parameter that takes the timestep, or an error naming the inputs."""
    for name in TIMESTEP_NAMES:
        if isinstance(arguments.get(name), torch.Tensor):
            return name
    raise GlueNotFound(f"the transformer call has no timestep tensor among {TIMESTEP_NAMES}; "
                       f"its inputs are {sorted(arguments)}")


def identify(calls: Sequence[dict[str, Any]], probes: Sequence[torch.Tensor],
             noise_pred: torch.Tensor, sample: torch.Tensor, t: Any, scale: float,
             guidance_candidates: Sequence[float]) -> Glue:
    """The Glue that turns `probes` (what each call returned) into `noise_pred` and
    `sample` (what the pipeline passed to `scheduler.step` with timestep `t`) into the
    calls' inputs. `scale`: the scheduler's input scale at this step."""
    first = calls[0]
    step_arg = timestep_arg(first)
    latent_arg, copies, (condition_dim, condition_size), per_item = _latent(
        first, sample * scale, step_arg)
    forms = _timestep_forms(first[step_arg], t)
    probes = [as_stacked(per_item, p) for p in probes]
    if len(calls) == 2:
        _check_branch_calls(calls, latent_arg, step_arg)
        copies, probe = 2, torch.cat(list(probes))
    elif len(calls) == 1:
        probe = probes[0]
    else:
        raise GlueNotFound(f"the pipeline called the transformer {len(calls)} times in one "
                           "step; ring mode replays one call, or two (one per guidance branch)")
    form, guidance_dtype, channels, guidance, negated = fit_guidance(
        probe, noise_pred, len(calls), guidance_candidates)
    # the output's axis 1 is the input's joined axis, the condition's part dropped
    positions = condition_dim == 1 and channels is not None and \
        channels + condition_size == probe.shape[1]
    latent = first[latent_arg]
    latent_dtype = latent[0].dtype if per_item is not None else latent.dtype
    return Glue(latent_arg, step_arg, copies, latent_dtype, forms,
                first[step_arg].dtype, form, guidance_dtype, noise_pred.dtype, channels,
                guidance, len(calls), negated, condition_dim, condition_size, positions,
                tuple(first[step_arg].shape[1:]), per_item)


def model_input(glue: Glue, sample: torch.Tensor, scale: torch.Tensor,
                condition: torch.Tensor | None = None) -> torch.Tensor:
    """The latent as the transformer takes it (in the step function), joined with its
    `condition` where the pipeline joins one."""
    x = _copied(glue, (sample * scale).to(glue.latent_dtype))
    if glue.per_item is not None:  # a list of per-sample tensors (Z-Image)
        return list(x.unsqueeze(glue.per_item).unbind(0))
    return x if glue.condition_dim is None else torch.cat([x, condition], glue.condition_dim)


def as_stacked(per_item: int | None, out: Any) -> torch.Tensor:
    """The prediction in the transformer's output `out` as one tensor: its first tensor, or,
    for a list of per-sample predictions (Z-Image's, `per_item`), the list stacked over the
    batch, their added axis dropped."""
    if per_item is None:
        return first_tensor(out)
    return torch.stack(list(first_value(out))).squeeze(per_item)


def first_value(output: Any) -> Any:
    """The first value of a tuple or a diffusers output (itself where it is neither)."""
    while isinstance(output, tuple) or hasattr(output, "to_tuple"):
        output = output[0]
    return output


def carried_input(glue: Glue, carried: torch.Tensor, scale: torch.Tensor,
                  latent_positions: torch.Tensor) -> torch.Tensor:
    """The latent input from a carried latent that holds the condition's positions too
    (`condition_positions`): the latent's positions scaled, the condition's as they are."""
    return _copied(glue, torch.where(latent_positions, carried * scale, carried)
                   .to(glue.latent_dtype))


def _copied(glue: Glue, x: torch.Tensor) -> torch.Tensor:
    """`x` once, or `glue.copies` times along the batch (the guidance batch)."""
    return torch.cat([x] * glue.copies) if glue.copies > 1 else x


def latent_positions(glue: Glue, carried: torch.Tensor) -> torch.Tensor:
    """The mask of the latent's own positions in a carried latent (broadcasts over it)."""
    dim, extent = glue.condition_dim, carried.shape[glue.condition_dim]
    shape = [1] * carried.dim()
    shape[dim] = extent
    mask = torch.arange(extent, device=carried.device) < extent - glue.condition_size
    return mask.reshape(shape)


def condition_part(glue: Glue, latent_input: torch.Tensor) -> torch.Tensor:
    """The fixed condition in a latent input the pipeline passed (see Glue)."""
    dim, size = glue.condition_dim, glue.condition_size
    return latent_input.narrow(dim, latent_input.shape[dim] - size, size)


def model_timesteps(glue: Glue, timesteps: torch.Tensor, batch: int) -> torch.Tensor:
    """[steps, batch, *timestep_shape]: the timestep input of every step, as the pipeline
    computes it."""
    values = _timesteps(glue.timestep_forms[0], timesteps, glue.timestep_dtype)
    shape = (len(timesteps), batch, *glue.timestep_shape)
    return values.reshape(-1, *[1] * (len(shape) - 1)).expand(shape).contiguous()


def _timesteps(form: TimestepForm, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    divisor, divide_first = form
    if divisor < 0:  # rising: 1 - t / d, or (d - t) / d
        d = -divisor
        return (1 - t / d).to(dtype) if divide_first else ((d - t) / d).to(dtype)
    return (t / divisor).to(dtype) if divide_first else t.to(dtype) / divisor


def guide(glue: Glue, out: torch.Tensor, guidance: torch.Tensor | float,
          every_position: bool = False) -> torch.Tensor:
    """The scheduler's model output from the transformer's output (the batched one when the
    pipeline makes two calls), in the pipeline's own arithmetic. every_position: keep the
    condition's positions (the ring carries them, see `condition_positions`)."""
    if glue.channels is not None and not every_position:
        out = out[:, : glue.channels]
    guided = combine(glue.combine, out.to(glue.guidance_dtype), guidance, glue.calls)
    if glue.negated:
        guided = -guided
    return guided.to(glue.prediction_dtype)


def first_tensor(output: Any, leaf: type = torch.Tensor) -> Any:
    """The first `leaf` in a model's output (a tuple, a diffusers output class, a tensor):
    the prediction."""
    for value in pytree.tree_leaves(output):
        if isinstance(value, leaf):
            return value
    raise TokpipeError("the transformer returned no tensor")


def _latent(arguments: dict[str, Any], scaled: torch.Tensor,
            step_arg: str) -> tuple[str, int, tuple[int | None, int], int | None]:
    """The argument that carries the sample, how many times it is passed, where it is
    joined with a condition (axis and extent, see Glue), and the per-item axis where it
    is passed as a list of per-sample tensors (Glue.per_item)."""
    for name, value in arguments.items():
        if name == step_arg:
            continue
        per_item = _per_item(value, scaled)
        if per_item is not None:
            value = torch.stack(list(value)).squeeze(per_item)
        elif not isinstance(value, torch.Tensor):
            continue
        for copies in (1, 2, 3):
            expected = torch.cat([scaled] * copies) if copies > 1 else scaled
            joined = _joined(value, expected)
            if joined is not None and (per_item is None or joined == (None, 0)):
                return name, copies, joined, per_item
    raise GlueNotFound("no transformer input is the latent the pipeline passes to "
                       "scheduler.step (once, or twice for guidance, maybe joined with a "
                       "fixed condition after it): the pipeline changes the latent in a way "
                       "ring mode does not replay")


def _per_item(value: Any, scaled: torch.Tensor) -> int | None:
    """Where `value` is a list of same-shaped tensors, each a sample of `scaled` with one
    axis of 1 added: that axis in the stacked list; else None."""
    if not isinstance(value, (list, tuple)) or not value or not all(
            isinstance(v, torch.Tensor) and v.shape == value[0].shape for v in value):
        return None
    if value[0].dim() != scaled.dim():
        return None
    return next((d + 1 for d in range(value[0].dim()) if value[0].shape[d] == 1
                 and value[0].squeeze(d).shape == scaled.shape[1:]), None)


def _joined(value: torch.Tensor, expected: torch.Tensor) -> tuple[int | None, int] | None:
    """(None, 0) where `value` is `expected`; (axis, extent) where it is `expected` joined
    with more along one axis other than the batch; None where it is neither."""
    if value.dim() != expected.dim() or value.shape[0] != expected.shape[0]:
        return None
    grown = [d for d in range(value.dim()) if value.shape[d] != expected.shape[d]]
    if not grown:
        return (None, 0) if close(value.float(), expected.to(value.dtype).float()) else None
    if len(grown) != 1 or value.shape[grown[0]] < expected.shape[grown[0]]:
        return None
    dim = grown[0]
    head = value.narrow(dim, 0, expected.shape[dim])
    if close(head.float(), expected.to(value.dtype).float()):
        return dim, value.shape[dim] - expected.shape[dim]
    return None


def _timestep_forms(passed: torch.Tensor, t: Any) -> tuple[TimestepForm, ...]:
    forms = tuple((divisor, divide_first) for divisor in (*DIVISORS, RISING)
                  for divide_first in (True, False) if _gives((divisor, divide_first), passed, t))
    if not forms:
        t = torch.as_tensor(t)
        raise GlueNotFound(f"the transformer's timestep input {passed.flatten()[:4].tolist()} "
                           f"is not the scheduler's t = {t.item()} (or t / 1000, or "
                           "1 - t / 1000) over the batch (and tokens)")
    return forms


def _gives(form: TimestepForm, passed: torch.Tensor, t: Any) -> bool:
    # DiT's scheduler keeps its timesteps on the CPU and passes the model a CUDA copy
    value = _timesteps(form, torch.as_tensor(t, device=passed.device), passed.dtype)
    return passed.dim() >= 1 and torch.equal(passed, value.expand(passed.shape))


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


def _check_branch_calls(calls: Sequence[dict[str, Any]], latent_arg: str, step_arg: str):
    first, second = calls
    if first.keys() != second.keys():
        raise GlueNotFound("the two transformer calls of a step take different inputs: "
                           f"{sorted(first)} and {sorted(second)}")
    for name in (latent_arg, step_arg):
        if not same(first[name], second[name]):
            raise GlueNotFound(f"the two transformer calls of a step pass different {name!r}; "
                               "ring mode batches the guidance branches of one latent")


