"""A released model inside its diffusers pipeline, with no weights to download:
`pipeline(name)` puts the transformer `released.build` makes (released widths, random
weights, few blocks, a small latent grid) into its family's pipeline with the family's
scheduler, and returns the keyword arguments of a guided call. There is no text encoder:
the call passes seeded random prompt (and negative prompt) embeddings at the released text
length and width. There is no VAE either (DiT's pipeline always decodes: it gets a tiny
random one), so the call asks for latents.

What each pipeline needs (diffusers 0.42, `pipelines/*/pipeline_*.py`): the embeddings it
takes instead of prompts, the pixel size of the grid (the VAE's scale), the frame count of
a video grid (the VAE's temporal scale) and, where the pipeline reads them from its VAE,
those scales set on the pipeline.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tokpipe_compiler.released import build, cast, check_grid, family, load
from tokpipe_compiler.released.families import Grid

Built = tuple[Any, dict[str, Any]]  # the pipeline, the keyword arguments of a guided call

# The latent grid a pipeline runs at unless told: a few hundred tokens a frame.
SMALL_GRIDS: dict[str, Grid] = {"image": (16, 16), "packed": (16, 16), "video": (2, 16, 16),
                                "frames_first": (2, 16, 16), "tokens": (2, 16, 16)}


def small_grid(name: str) -> Grid:
    """The latent grid `pipeline` uses by default for `name`'s family."""
    return SMALL_GRIDS[family(name).layout]


@dataclass
class Parts:
    """What a family's builder makes its pipeline and call from."""

    name: str
    spec: dict[str, Any]
    transformer: torch.nn.Module
    grid: Grid
    dtype: torch.dtype
    seed: int

    def embeds(self, index: int, *shape: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 101 + index)
        return torch.randn(shape, generator=gen).to(self.dtype)

    def prompts(self, masks: bool = False, mask_dtype: torch.dtype = torch.int64,
                pooled: bool = False) -> dict[str, Any]:
        """Prompt and negative prompt embeddings at the released text length and width
        (with all-ones attention masks, pooled embeddings)."""
        inputs = self.spec["inputs"]
        length, width = inputs["text_tokens"], inputs["text_width"]
        out: dict[str, Any] = {"prompt_embeds": self.embeds(1, 1, length, width),
                               "negative_prompt_embeds": self.embeds(2, 1, length, width)}
        if masks:
            mask = torch.ones(1, length, dtype=mask_dtype)
            out.update(prompt_attention_mask=mask, negative_prompt_attention_mask=mask)
        if pooled:
            width = inputs["pooled_width"]
            out.update(pooled_prompt_embeds=self.embeds(3, 1, width),
                       negative_pooled_prompt_embeds=self.embeds(4, 1, width))
        return out

    def size(self) -> dict[str, int]:
        """The pixel height and width of the grid."""
        scale = self.spec["inputs"]["vae_scale"]
        return {"height": self.grid[-2] * scale, "width": self.grid[-1] * scale}

    def frames(self) -> int:
        """The pixel frames of a video grid: the VAE keeps the first frame and compresses
        the rest by its temporal scale."""
        return (self.grid[0] - 1) * self.spec["inputs"].get("vae_temporal", 1) + 1


def _diffusers() -> Any:
    import diffusers

    return diffusers


def _none(*names: str) -> dict[str, None]:
    return dict.fromkeys(names)


def _dit(parts: Parts) -> Built:
    d = _diffusers()
    torch.manual_seed(parts.seed)
    vae = d.AutoencoderKL(  # DiT's pipeline decodes whatever output_type asks for
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(8, 8), latent_channels=parts.spec["inputs"]["latent_channels"],
        norm_num_groups=4).eval()
    vae = cast(vae, parts.dtype)
    pipe = d.DiTPipeline(transformer=parts.transformer, vae=vae,
                         scheduler=d.DDIMScheduler(clip_sample=False))
    return pipe, {"class_labels": [207], "guidance_scale": 4.0}


def _pixart(parts: Parts) -> Built:
    d = _diffusers()
    sigma = "sigma" in parts.name
    # The pipeline passes the resolution conditions when the transformer's sample_size is
    # 128 (1024 px); `build` sized it to the grid: the released value back.
    parts.transformer.register_to_config(sample_size=parts.spec["config"]["sample_size"])
    cls = d.PixArtSigmaPipeline if sigma else d.PixArtAlphaPipeline
    pipe = cls(transformer=parts.transformer, scheduler=d.DPMSolverMultistepScheduler(),
               **_none("tokenizer", "text_encoder", "vae"))
    return pipe, {"negative_prompt": None, **parts.prompts(masks=True), **parts.size(),
                  "guidance_scale": 4.5, "use_resolution_binning": False}


def _sd3(parts: Parts) -> Built:
    d = _diffusers()
    pipe = d.StableDiffusion3Pipeline(
        transformer=parts.transformer, scheduler=d.FlowMatchEulerDiscreteScheduler(shift=3.0),
        **_none("vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2",
                "text_encoder_3", "tokenizer_3"))
    return pipe, {**parts.prompts(pooled=True), **parts.size(), "guidance_scale": 5.0}


def _flux(parts: Parts) -> Built:
    """True guidance: with a negative prompt the pipeline calls the transformer twice a
    step; FLUX.1-dev also embeds its distilled guidance scale."""
    d = _diffusers()
    pipe = d.FluxPipeline(
        transformer=parts.transformer,
        scheduler=d.FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True),
        **_none("vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2"))
    return pipe, {**parts.prompts(pooled=True), **parts.size(), "guidance_scale": 3.5,
                  "true_cfg_scale": 4.0}


def _hunyuan(parts: Parts) -> Built:
    """With the released scheduler: DDPM without clipping, its steps drawing noise."""
    d = _diffusers()
    scheduler = d.DDPMScheduler(clip_sample=False, prediction_type="v_prediction",
                                beta_schedule="scaled_linear", beta_start=0.00085,
                                beta_end=0.03, steps_offset=1)
    pipe = d.HunyuanDiTPipeline(
        transformer=parts.transformer, scheduler=scheduler,
        **_none("vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2",
                "safety_checker", "feature_extractor"), requires_safety_checker=False)
    inputs = parts.spec["inputs"]
    length, width = inputs["text2_tokens"], inputs["text2_width"]
    mask = torch.ones(1, length, dtype=torch.int64)
    t5 = {"prompt_embeds_2": parts.embeds(5, 1, length, width),
          "negative_prompt_embeds_2": parts.embeds(6, 1, length, width),
          "prompt_attention_mask_2": mask, "negative_prompt_attention_mask_2": mask}
    return pipe, {**parts.prompts(masks=True), **t5, **parts.size(), "guidance_scale": 5.0,
                  "use_resolution_binning": False}


def _cogvideox(parts: Parts) -> Built:
    d = _diffusers()
    pipe = d.CogVideoXPipeline(transformer=parts.transformer,
                               scheduler=d.CogVideoXDDIMScheduler(clip_sample=False),
                               **_none("vae", "text_encoder", "tokenizer"))
    return pipe, {**parts.prompts(), **parts.size(), "num_frames": parts.frames(),
                  "guidance_scale": 6.0}


def _latte(parts: Parts) -> Built:
    d = _diffusers()
    pipe = d.LattePipeline(transformer=parts.transformer,
                           scheduler=d.DDIMScheduler(clip_sample=False),
                           **_none("vae", "text_encoder", "tokenizer"))
    return pipe, {"negative_prompt": None, **parts.prompts(), **parts.size(),
                  "video_length": parts.frames(), "guidance_scale": 7.5}


def _wan(parts: Parts) -> Built:
    """Two transformer calls a step, one per guidance branch."""
    d = _diffusers()
    scheduler = d.UniPCMultistepScheduler(prediction_type="flow_prediction",
                                          use_flow_sigmas=True, flow_shift=3.0)
    pipe = d.WanPipeline(transformer=parts.transformer, scheduler=scheduler,
                         **_none("vae", "text_encoder", "tokenizer"))
    inputs = parts.spec["inputs"]  # the pipeline reads both scales from its VAE
    pipe.vae_scale_factor_temporal = inputs["vae_temporal"]
    pipe.vae_scale_factor_spatial = inputs["vae_scale"]
    return pipe, {"negative_prompt": None, **parts.prompts(), **parts.size(),
                  "num_frames": parts.frames(), "guidance_scale": 5.0}


def _ltx(parts: Parts) -> Built:
    d = _diffusers()
    pipe = d.LTXPipeline(transformer=parts.transformer,
                         scheduler=d.FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True),
                         **_none("vae", "text_encoder", "tokenizer"))
    inputs = parts.spec["inputs"]  # the pipeline reads both ratios from its VAE
    pipe.vae_spatial_compression_ratio = inputs["vae_scale"]
    pipe.vae_temporal_compression_ratio = inputs["vae_temporal"]
    return pipe, {**parts.prompts(masks=True, mask_dtype=torch.bool), **parts.size(),
                  "num_frames": parts.frames(),
                  "guidance_scale": 3.0}


def _auraflow(parts: Parts) -> Built:
    d = _diffusers()
    pipe = d.AuraFlowPipeline(transformer=parts.transformer,
                              scheduler=d.FlowMatchEulerDiscreteScheduler(),
                              **_none("vae", "text_encoder", "tokenizer"))
    return pipe, {**parts.prompts(masks=True), **parts.size(), "guidance_scale": 3.5}


def _sana(parts: Parts) -> Built:
    d = _diffusers()
    scheduler = d.DPMSolverMultistepScheduler(prediction_type="flow_prediction",
                                              use_flow_sigmas=True, flow_shift=3.0)
    pipe = d.SanaPipeline(transformer=parts.transformer, scheduler=scheduler,
                          **_none("vae", "text_encoder", "tokenizer"))
    return pipe, {"negative_prompt": None, **parts.prompts(masks=True), **parts.size(),
                  "guidance_scale": 4.5, "use_resolution_binning": False}


BUILDERS: dict[str, Callable[[Parts], Built]] = {
    "DiTTransformer2DModel": _dit, "PixArtTransformer2DModel": _pixart,
    "SD3Transformer2DModel": _sd3, "FluxTransformer2DModel": _flux,
    "HunyuanDiT2DModel": _hunyuan, "CogVideoXTransformer3DModel": _cogvideox,
    "LatteTransformer3DModel": _latte, "WanTransformer3DModel": _wan,
    "LTXVideoTransformer3DModel": _ltx, "AuraFlowTransformer2DModel": _auraflow,
    "SanaTransformer2DModel": _sana,
}


def pipeline(name: str, layers: int | None = 1, grid: Grid | None = None, seed: int = 0,
             dtype: torch.dtype = torch.float32) -> Built:
    """(pipeline, call keyword arguments) of the released model `name` in its diffusers
    pipeline: `layers` blocks per depth field (None: all), latent `grid` (default
    `small_grid(name)`), random weights and embeddings from `seed`, guided, returning
    latents. Add `num_inference_steps` and a `generator` to call it. A video's first grid
    axis is its latent frames: Latte's transformer is built for that count (its temporal
    positions), so ask for another by `grid=(F, H, W)`, not by the call's `video_length`."""
    spec = load(name)
    grid = small_grid(name) if grid is None else check_grid(name, grid)
    transformer = build(name, layers, grid=grid, seed=seed)
    transformer = cast(transformer, dtype)
    pipe, kwargs = BUILDERS[spec["class"]](Parts(name, spec, transformer, grid, dtype, seed))
    return pipe, {**kwargs, "output_type": "latent"}
