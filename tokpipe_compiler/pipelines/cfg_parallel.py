"""Classifier-free guidance in parallel: each guidance branch on its own ranks.

A guided pipeline runs its transformer on a batch of two halves (or in two calls), one per
branch, and combines them where the guidance formula needs both. With `cfg=2` and one
stage per branch (`run`), rank r runs the whole transformer on half r of every batched
input, the two ranks exchange their predictions (one all-gather of the model output per
step), and both apply guidance and the scheduler's token-wise update to the same latents.
Without a process group both halves run in the calling process, one after the other (the
same numbers, for tests and checks).

With `cfg=2` and S > 1 stages (hybrid, 2 x S ranks: `Branches`), each branch runs its own
ring over S ranks, and the two rings' last stages swap each chunk's prediction
(`runtime.branch_exchange`) before guidance and the update; see `ring_call`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from tokpipe_compiler.core.errors import TokpipeError
from tokpipe_compiler.pipelines.glue import (
    CONDITION,
    Glue,
    first_tensor,
    guide,
    model_input,
    model_timesteps,
)
from tokpipe_compiler.pipelines.schedulers import StepTable, update_state
from tokpipe_compiler.runtime.branch_exchange import gather_branches
from tokpipe_compiler.runtime.run_stops import share_stops


def check_world(cfg: int, stages: int) -> None:
    """The degrees against the ranks there are, at parallelize time."""
    if cfg not in (1, 2):
        raise TokpipeError(f"cfg={cfg}: guidance has two branches; use cfg=1 or cfg=2")
    if dist.is_available() and dist.is_initialized():
        world = dist.get_world_size()
        if world != cfg * stages:
            raise TokpipeError(f"cfg={cfg} x stages={stages} needs {cfg * stages} rank(s); the "
                               f"process group has {world}")


@dataclass(frozen=True)
class Branches:
    """Where this rank sits in cfg=2 x `stages` ranks: rank r runs stage r % stages of
    guidance branch r // stages."""

    branch: int
    stage_group: Any  # this branch's ranks, one per stage: its ring runs over them
    peer_group: Any  # this stage's rank in either branch: they swap predictions


def branch_groups(stages: int) -> Branches | None:
    """The process groups of a hybrid cfg=2 run (stages > 1), made on every rank in one
    order (torch.distributed requires it); None without a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    rank = dist.get_rank()
    stage_groups = [dist.new_group(list(range(b * stages, (b + 1) * stages))) for b in (0, 1)]
    peer_groups = [dist.new_group([s, stages + s]) for s in range(stages)]
    share_stops(stage_groups)  # a run one branch stops, the other stops too
    return Branches(rank // stages, stage_groups[rank // stages], peer_groups[rank % stages])


def half(inputs: dict[str, Any], branch: int, batch: int,
         whole: frozenset[int] = frozenset()) -> dict[str, Any]:
    """Half `branch` of every input batched over both guidance branches: of `batch` rows,
    but those in `whole` (ids of tensors both branches' calls pass as they are: Kandinsky
    5's rotary positions, `arange(frames)`, whose 2 rows are no batch)."""

    def take(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == batch \
                and id(value) not in whole:
            return value.chunk(2)[branch]
        return value

    return pytree.tree_map(take, inputs)


def run(forward: Callable[..., Any], glue: Glue, table: StepTable, sample: torch.Tensor,
        fixed: dict[str, Any], timesteps: torch.Tensor, timeout: float,
        state: Sequence[torch.Tensor] = (), blends: dict[str, torch.Tensor] | None = None,
        each_step: Callable[[int, torch.Tensor], None] | None = None,
        whole: frozenset[int] = frozenset()) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """Every step of `table` from `sample` (and the scheduler's `state`, zeros where none is
    given), the branches split over two ranks (or run in turn in this process); returns the
    last latents and state, on every rank. blends: the per-step blends after the update
    (`blends.Blends.per_step`), if any; each_step(k, latents): sees the latents after step
    k."""
    batch = sample.shape[0] * glue.copies
    per_step = model_timesteps(glue, timesteps, batch).to(sample.device)
    distributed = dist.is_available() and dist.is_initialized()
    state_dtype = torch.promote_types(sample.dtype, torch.float32)
    state = list(state) or [torch.zeros_like(sample, dtype=state_dtype)
                            for _ in range(table.state_size)]
    fixed = dict(fixed)
    condition = fixed.pop(CONDITION, None)
    if distributed:
        check_same_generation(sample, timesteps, glue.guidance, timeout)
    for k in range(len(timesteps)):
        latent = model_input(glue, sample, table.input_scale[k], condition)
        inputs = {**fixed, glue.latent_arg: latent, glue.timestep_arg: per_step[k]}
        if distributed:
            mine = first_tensor(forward(**half(inputs, dist.get_rank(), batch, whole)))
            out = gather_branches(mine, None, timeout, f"step {k}")
        else:
            out = torch.cat([first_tensor(forward(**half(inputs, r, batch, whole)))
                             for r in (0, 1)])
        noise = guide(glue, out, glue.guidance)
        sample, state = update_state(sample, noise, state, table.rows[k], table.pattern)
        state = list(state)
        if blends:
            sample = blends["blend_target"][k] + blends["blend_keep"][k] * sample
        if each_step is not None:
            each_step(k, sample)
    return sample, tuple(state)


def check_same_generation(sample: torch.Tensor, timesteps: torch.Tensor, guidance: float,
                          timeout: float, group: Any = None) -> None:
    """Raises on both ranks of `group` (two ranks, one per guidance branch; default: the
    world) where their calls start different generations (another seed, step count or
    guidance scale, or a call one rank made and the other did not): each would swap
    predictions with a generation not its own and return a wrong image."""
    x = sample.detach().to(torch.float64)
    weights = torch.arange(1, x.numel() + 1, device=x.device, dtype=torch.float64)
    mine = torch.stack([x.sum(), (x.flatten() * weights).sum(),
                        timesteps.detach().to(x.device, torch.float64).sum(),
                        torch.tensor(float(len(timesteps)), device=x.device, dtype=x.dtype),
                        torch.tensor(float(guidance), device=x.device, dtype=x.dtype)])
    both = gather_branches(mine[None], group, timeout, "the generation's start").cpu()
    if torch.equal(both[0], both[1]):
        return
    ranks = dist.get_process_group_ranks(group) if group is not None else [0, 1]
    said = [f"rank {ranks[r]}: latents checksum {both[r, 0]:.6g}, timesteps sum {both[r, 2]:.6g}, "
            f"{int(both[r, 3])} steps, guidance {both[r, 4]:g}" for r in (0, 1)]
    raise TokpipeError("cfg=2: the ranks' calls start different generations (" +
                       "; ".join(said) + "): each rank must make the same pipeline calls, "
                       "with the same generator seed, steps and guidance scale")
