"""Latents blended with a fixed image between steps (inpainting).

Inpainting pipelines keep the unmasked part of their image: after each scheduler step but
the last they blend the latents with the image's latents noised to the next step's level,

    latents = (1 - mask) * scheduler.scale_noise(image_latents, t_next, noise) + mask * latents

(`add_noise` for the other schedulers), and after the last one with the image itself. With
the scheduler's noising methods routed, ring mode sees the noised image, and the latents
before and after each blend (the probes' step output, and the sample of the next step).
The mask follows from them; every step's blend is then checked to be that one form. The
ring applies the blends after its update (`make_step(blended=True)`), as per-step inputs;
the pipeline's own code blends the last step's latents, which the ring hands back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tokpipe_compiler.core.errors import TokpipeError

EXACT = 1e-6  # relative: a blend replayed from the found mask gives the pipeline's latents


class BlendNotFound(TokpipeError):
    """The latents changed between two steps in a way ring mode cannot replay."""


@dataclass
class Blends:
    """The blends seen so far in a generation: the noised image recorded before each step,
    the mask, and per step k the blend applied after it ((1 - mask) * noised image)."""

    noised: dict[int, torch.Tensor] = field(default_factory=dict)
    keep: torch.Tensor | None = None  # the mask: where the step's latents are kept
    targets: dict[int, torch.Tensor] = field(default_factory=dict)

    def observe(self, step: int, before: torch.Tensor, after: torch.Tensor) -> None:
        """The latents were `before` after step `step - 1` and `after` at step `step`; raises
        BlendNotFound unless that is a blend with the image noised for `step`."""
        noised = self.noised.get(step)
        if noised is None or noised.shape != after.shape:
            raise BlendNotFound("the latents between two steps")
        before, noised32 = before.float(), noised.float()
        if self.keep is None:
            self.keep = _mask(before, after.float(), noised32)
        keep = self.keep.to(noised.dtype)
        target = (1 - keep) * noised
        replayed = target + keep * before.to(noised.dtype)
        if not _close(replayed.float(), after.float()):
            raise BlendNotFound("the latents between two steps (not one blend with a noised "
                                "image under one mask)")
        self.targets[step - 1] = target

    def per_step(self, begin: int, steps: int, like: torch.Tensor) -> dict[str, torch.Tensor]:
        """The blends of steps begin..begin+steps-1 as the ring's per-step inputs (the
        latents kept as they are after a step without one); empty where there is none."""
        if not any(begin <= k < begin + steps for k in self.targets):
            return {}
        ones, zeros = torch.ones_like(like), torch.zeros_like(like)
        keep = self.keep.to(like.dtype)
        return {"blend_keep": torch.stack([keep if k in self.targets else ones
                                           for k in range(begin, begin + steps)]),
                "blend_target": torch.stack([self.targets.get(k, zeros).to(like.dtype)
                                             for k in range(begin, begin + steps)])}


def _mask(before: torch.Tensor, after: torch.Tensor, noised: torch.Tensor) -> torch.Tensor:
    """mask from after = (1 - mask) * noised + mask * before, where before differs from the
    noised image (the probes make it differ: elsewhere the mask cannot be told)."""
    apart = before != noised
    if not bool(apart.all()):
        raise BlendNotFound("the latents between two steps (a blend whose mask the first "
                            "step cannot tell)")
    return (after - noised) / (before - noised)


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    scale = max(b.abs().max().item(), 1e-30)
    return (a - b).abs().max().item() <= EXACT * scale
