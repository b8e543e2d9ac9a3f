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


def generate(pipe, seed: int = 0, steps: int = 4) -> torch.Tensor:
    """Guided (batch 2 inside the pipeline), `steps` steps, the latents before the VAE."""
    out = pipe(class_labels=[1], num_inference_steps=steps, guidance_scale=4.0,
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


@pytest.mark.parametrize(("family", "branches"), [("lumina2", [0, 1]), ("zimage", [0])])
def test_a_pipeline_whose_timestep_rises_runs_its_steps_stale(family, branches):
    """Lumina2 and Z-Image pass 1 - t / 1000, rising from step to step (Lumina2 calls the
    transformer twice per step). Each rise is the next step, not a new image (which would
    rerun the warmup on every call): after the warmup step the blocks run chunked with
    stale K/V, each guidance branch with its own caches, and a second image repeats the
    first."""
    from tests.fixtures import pipelines

    make = getattr(pipelines, family)
    serial = pipelines.generate(*make(), steps=4)
    pipe, kwargs = make()
    pipe.transformer.compile(backend="tokpipe", dynamic=False, options={
        "stages": 2, "chunks": 2, "mode": "stale", "warmup_steps": 1, "compiler": "eager"})
    with pytest.warns(UserWarning, match="running this graph unpipelined"):
        first = pipelines.generate(pipe, kwargs, steps=4)
    assert torch.equal(pipelines.generate(pipe, kwargs, steps=4), first)
    (program,) = tp.programs(pipe.transformer)
    assert program.clock.step == 3 and sorted(program.branches) == branches
    error = (first - serial).abs().max().item() / serial.abs().max().item()
    assert 0 < error < 0.1  # stale K/V on steps 2-4: close to serial, not equal


def test_the_classic_attention_processor_runs_as_the_default_one():
    """set_default_attn_processor() installs diffusers' AttnProcessor, attention written as
    baddbmm, softmax and bmm, whose scores matrix no token rule can chunk. It is folded into
    scaled_dot_product_attention, so in stale mode the blocks' self-attention runs with K/V
    caches as the default processor's does, and both give one image (within 1e-5: only
    the softmax's rounding differs). The text mask is ragged: half the prompt is padding."""
    from tests.fixtures import pipelines

    images = {}
    for classic in (False, True):
        pipe, kwargs = pipelines.pixart_alpha(classic_attention=classic)
        for mask in ("prompt_attention_mask", "negative_prompt_attention_mask"):
            kwargs[mask][:, pipelines.TEXT // 2:] = 0
        serial = pipelines.generate(pipe, kwargs, steps=4)
        pipe.transformer.compile(backend="tokpipe", dynamic=False, options={
            "stages": 2, "chunks": 2, "mode": "stale", "warmup_steps": 1, "compiler": "eager"})
        images[classic] = pipelines.generate(pipe, kwargs, steps=4)
        (program,) = tp.programs(pipe.transformer)
        assert len(program.plan.caches) == 2  # one K/V cache per block's self-attention
        assert (images[classic] - serial).abs().max().item() > 0  # stale K/V: not serial
    scale = images[False].abs().max().item()
    assert (images[True] - images[False]).abs().max().item() <= 1e-5 * scale


def test_parallelize_ends_each_generation_with_the_pipeline_call():
    """parallelize compiles the transformer in place, and the pipeline's end-of-call reset
    ends the generation. One-step generations (distilled models) never raise the timestep:
    without that reset each new seed would count as one more guidance branch of the same
    step, and every branch's K/V caches would be kept."""
    pipe = tp.pipelines.parallelize(dit_pipeline(), stages=2, chunks=2, mode="stale",
                                    warmup_steps=1, compiler="eager")
    reference = dit_pipeline()
    for seed in range(3):
        image = generate(pipe, seed, steps=1)
        (program,) = tp.programs(pipe.transformer)
        assert not program.branches  # dropped when the call ended
        serial = generate(reference, seed, steps=1)  # one step is the warmup step: exact
        assert (image - serial).abs().max().item() <= 1e-5 * serial.abs().max().item()


def test_parallelize_errors_name_the_problem():
    with pytest.raises(tp.TokpipeError, match="cfg=3: guidance has two branches"):
        tp.pipelines.parallelize(dit_pipeline(), cfg=3)
    with pytest.raises(ValueError, match="chunks"):
        tp.pipelines.parallelize(dit_pipeline(), chunks=0)
    with pytest.raises(ValueError, match="option 'ring' must be True or False, got 'no'"):
        tp.pipelines.parallelize(dit_pipeline(), ring="no")  # truthy: it ran a ring
    unet_like = diffusers.DDIMPipeline(unet=torch.nn.Identity(),
                                       scheduler=diffusers.DDIMScheduler())
    with pytest.raises(tp.TokpipeError, match="no denoising transformer"):
        tp.pipelines.parallelize(unet_like)
    wrapped = dit_pipeline()
    wrapped.transformer = torch.compile(wrapped.transformer, backend="tokpipe")
    with pytest.raises(tp.TokpipeError, match=r"torch.compile wrapper.*_orig_mod"):
        tp.pipelines.parallelize(wrapped)
