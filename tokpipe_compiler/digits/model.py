"""The shipped digit model: loading it, its step function and the serial sampler.

Pixel space, one channel; with patch size 1 a 32x32 image is 1,024 tokens. The 2D sin-cos
position embedding is laid out on the configured 32x32 grid, so the same weights also run
on 8x8 and 16x16 images (positions spread over the same range): training spends most of its
time at those sides, and the fidelity benchmark can afford 500 samples per setting there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from tokpipe_compiler.pipelines.schedulers import step_table, update

WEIGHTS = Path(__file__).parent / "weights"
SIDE = 32  # the side the model is configured for and fine-tuned at last

CONFIG = {  # DiTTransformer2DModel's arguments
    "num_attention_heads": 4, "attention_head_dim": 64, "num_layers": 6,
    "in_channels": 1, "out_channels": 1, "patch_size": 1, "sample_size": SIDE,
    "num_embeds_ada_norm": 10, "norm_type": "ada_norm_zero",
}
SCHEDULER = {"num_train_timesteps": 1000, "beta_schedule": "squaredcos_cap_v2",
             "clip_sample": False, "prediction_type": "epsilon"}

StepFn = Callable[..., tuple[torch.Tensor, Any]]


def new_model(seed: int = 0):
    """A freshly initialised model of the shipped configuration."""
    from diffusers import DiTTransformer2DModel

    torch.manual_seed(seed)
    return DiTTransformer2DModel(**CONFIG)


def load(path: Path | str = WEIGHTS) -> tuple[Any, Any]:
    """(model in eval mode, float32; DDIM scheduler) from a folder `save` wrote."""
    from diffusers import DDIMScheduler, DiTTransformer2DModel

    from tokpipe_compiler.pipelines.loading import from_pretrained

    model = from_pretrained(DiTTransformer2DModel, path, torch.float32,
                            low_cpu_mem_usage=False).eval()
    return model, DDIMScheduler.from_pretrained(path)


def save(model: Any, path: Path | str) -> None:
    """Weights in float16 safetensors (half the size; loaded back as float32) and the
    scheduler's config next to them."""
    import copy

    from diffusers import DDIMScheduler

    # a copy: casting in place would round the caller's (training) weights
    copy.deepcopy(model).to(torch.float16).save_pretrained(path, safe_serialization=True)
    DDIMScheduler(**SCHEDULER).save_pretrained(path)


def denoiser(model: Any) -> StepFn:
    """One DDIM step as a function of tensors (what Ring and the serial loop both call):
    x_next = c0 * x + c1 * eps, token-wise, so ring mode can run it inside the pipeline."""

    def denoise(latents, timestep, input_scale, coeffs, labels):
        eps = model(latents * input_scale, timestep=timestep[None], class_labels=labels).sample
        return update(latents, eps, None, coeffs)

    return denoise


def per_step(scheduler: Any, steps: int) -> dict[str, torch.Tensor]:
    """The per-step inputs of `denoiser`'s function for a `steps`-step generation."""
    table = step_table(scheduler, steps)
    return {"timestep": table.timesteps, "input_scale": table.input_scale,
            "coeffs": table.coeffs}


def noise(seeds: Sequence[int], side: int) -> torch.Tensor:
    """Starting noise, one generator per seed: sample i is the same in any batch."""
    return torch.cat([torch.randn(1, 1, side, side, generator=torch.Generator().manual_seed(s))
                      for s in seeds])


@torch.no_grad()
def sample(model: Any, scheduler: Any, labels: torch.Tensor, seeds: Sequence[int],
           steps: int = 20, side: int = SIDE) -> torch.Tensor:
    """The serial loop: [len(seeds), 1, side, side] images in model space [-1, 1]."""
    denoise, values = denoiser(model), per_step(scheduler, steps)
    x = noise(seeds, side)
    for k in range(steps):
        x, _ = denoise(x, values["timestep"][k], values["input_scale"][k],
                       values["coeffs"][k], labels)
    return x
