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
from tokpipe_compiler.pipelines.glue import same

EXACT = 1e-6  # relative: a blend replayed from the found mask gives the pipeline's latents


class BlendNotFound(TokpipeError):
    """The latents changed between two steps in a way ring mode cannot replay."""


@dataclass
class Blends:
    """The blends seen so far in a generation: the noised image recorded before each step,
    the mask (NaN where no step has told it yet), and the steps blended after."""

    noised: dict[int, torch.Tensor] = field(default_factory=dict)
    keep: torch.Tensor | None = None  # the mask: where the step's latents are kept
    after: set[int] = field(default_factory=set)  # the steps whose latents were blended

    def observe(self, step: int, before: torch.Tensor, after: torch.Tensor) -> None:
        """The latents were `before` after step `step - 1` and `after` at step `step`; raises
        BlendNotFound unless that is a blend with the image noised for `step`."""
        noised = self.noised.get(step)
        if noised is None or noised.shape != after.shape:
            raise BlendNotFound("the latents between two steps")
        before32, after32, noised32 = before.float(), after.float(), noised.float()
        # where the probes' latents equal the noised image (half precision) this step cannot
        # tell the mask, and any mask gives the noised image there
        apart = before32 != noised32
        found = (after32 - noised32) / torch.where(apart, before32 - noised32, 1.0)
        unknown = torch.full_like(found, float("nan"))
        keep = torch.where(apart, found, unknown) if self.keep is None else \
            torch.where(self.keep.isnan() & apart, found, self.keep)
        replayed = torch.where(apart, (1 - keep) * noised32 + keep * before32, noised32)
        if not same(replayed, after32, EXACT):
            raise BlendNotFound("the latents between two steps (not one blend with a noised "
                                "image under one mask)")
        self.keep = keep
        self.after.add(step - 1)

    def per_step(self, begin: int, steps: int, like: torch.Tensor) -> dict[str, torch.Tensor]:
        """The blends of steps begin..begin+steps-1 as the ring's per-step inputs (the
        latents kept as they are after a step without one); empty where there is none."""
        blended = [k for k in range(begin, begin + steps) if k in self.after]
        if not blended:
            return {}
        if self.keep.isnan().any():
            raise BlendNotFound("the latents between two steps (a blend whose mask the "
                                f"probes could not tell at {int(self.keep.isnan().sum())} "
                                "positions)")
        keep = self.keep.to(self.noised[blended[0] + 1].dtype)
        ones, zeros = torch.ones_like(like), torch.zeros_like(like)
        # in the pipeline's arithmetic: (1 - mask) * noised, in the noised image's dtype
        targets = {k: ((1 - keep) * self.noised[k + 1]).to(like.dtype) for k in blended}
        return {"blend_keep": torch.stack([keep.to(like.dtype) if k in targets else ones
                                           for k in range(begin, begin + steps)]),
                "blend_target": torch.stack([targets.get(k, zeros)
                                             for k in range(begin, begin + steps)])}
