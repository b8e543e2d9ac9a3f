"""The noise a scheduler's step draws, recorded or replaced.

diffusers' stochastic steps (DDPM, Euler ancestral, LCM, SCM) add noise drawn with
`randn_tensor`, which each scheduler's module imports by name:

    x_next = M_k @ [x, out, state] + noise_k * randn_tensor(out.shape, generator=...)

The probes replace the draw with a basis column (so `noise_k` is read off like the
table's other columns); a ring's probe steps, which run the scheduler's own step as the
pipeline calls it, record what each step draws, from the pipeline's generator in the
pipeline's order; the ring then adds `noise_k` times it after its update.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import torch

Draw = Callable[[tuple, dict], torch.Tensor]


@contextlib.contextmanager
def drawn_noise(scheduler: Any, replace: Draw | None = None) -> Iterator[list[torch.Tensor]]:
    """Within: every `randn_tensor` call of the scheduler's step, drawn as it would be (or
    `replace(shape, kwargs)`), is recorded in the list yielded."""
    drawn: list[torch.Tensor] = []
    modules = {sys.modules.get(cls.__module__) for cls in type(scheduler).__mro__}
    modules = [m for m in modules if callable(getattr(m, "randn_tensor", None))]
    with contextlib.ExitStack() as patches:
        for module in modules:
            original = module.randn_tensor

            def draw(shape, *args, _original=original, **kwargs):
                value = _original(shape, *args, **kwargs) if replace is None else \
                    replace(tuple(shape), kwargs)
                drawn.append(value)
                return value

            patches.enter_context(mock.patch.object(module, "randn_tensor", draw))
        yield drawn


def with_noise(blends: dict[str, torch.Tensor], noises: dict[int, torch.Tensor], begin: int,
               steps: int, like: torch.Tensor) -> dict[str, torch.Tensor]:
    """The ring's per-step blends (`blends.per_step`: `x = target + keep * x` after each
    update) with each step's scaled noise (`noises`, by step) added before the blend:
    target + keep * noise."""
    noisy = [k for k in range(begin, begin + steps) if k in noises]
    if not noisy:
        return blends
    zeros = torch.zeros_like(like)
    keep = blends["blend_keep"] if blends else torch.ones_like(like).expand(steps, *like.shape)
    target = blends["blend_target"] if blends else zeros.expand(steps, *like.shape)
    added = torch.stack([noises[k].to(like.dtype) if k in noises else zeros
                         for k in range(begin, begin + steps)])
    return {"blend_keep": keep, "blend_target": target + keep * added}
