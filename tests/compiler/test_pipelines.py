"""Inside a real diffusers pipeline, its transformer compiled in place: sync equals the
serial pipeline, and two calls with one seed give one image twice (no tp.reset between)."""

from __future__ import annotations

import pytest
import torch

import tokpipe_compiler as tp
from tests.fixtures.zoo import ZOO

diffusers = pytest.importorskip("diffusers")


def dit_pipeline() -> diffusers.DiTPipeline:
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 8), latent_channels=4,
        norm_num_groups=4, sample_size=16).eval()
    # The pipeline's unconditional label is 1000: the released embedding table's size.
    config = {**ZOO["DiTTransformer2DModel"].config, "num_embeds_ada_norm": 1000}
    transformer = diffusers.DiTTransformer2DModel(**config).eval()
    return diffusers.DiTPipeline(transformer=transformer, vae=vae,
                                 scheduler=diffusers.DDIMScheduler(), id2label={0: "a", 1: "b"})


def generate(pipe, seed: int = 0) -> torch.Tensor:
    """Guided (batch 2 inside the pipeline), 4 steps, the latents before the VAE."""
    out = pipe(class_labels=[1], num_inference_steps=4, guidance_scale=4.0,
               generator=torch.Generator().manual_seed(seed), output_type="latent")
    return torch.as_tensor(out.images)


@pytest.mark.parametrize("mode", ["sync", "stale"])
def test_dit_pipeline_twice_with_one_seed(mode):
    pipe = dit_pipeline()
    serial = generate(pipe)
    pipe.transformer.compile(backend="tokpipe", dynamic=False, options={
        "stages": 2, "chunks": 2, "mode": mode, "warmup_steps": 1, "compiler": "eager"})
    first, second = generate(pipe), generate(pipe)
    assert torch.equal(first, second)  # the second image is a new generation by itself
    if mode == "sync":
        scale = serial.abs().max().item()
        assert (first - serial).abs().max().item() <= 1e-5 * scale
    else:  # stale K/V after the warmup step: close to serial, not equal
        assert (first - serial).abs().max().item() > 0
    (program,) = tp.programs(pipe.transformer)
    assert program.clock.step == 3  # four steps of the second generation, counted
