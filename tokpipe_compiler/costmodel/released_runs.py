"""How the released diffusion transformers are run, and the work outside the transformer.

Per model (the names of the released configs): the diffusers pipeline's default step count,
whether it runs classifier-free guidance (the conditional and unconditional rows as a
batch of 2), and what runs once per image outside the transformer: the text encoders on
the prompt (and the negative prompt under guidance) and the VAE decode. `outside_seconds`
turns that into seconds at a device's rates, as published.outside_seconds does for
PixArt-alpha.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokpipe_compiler.costmodel.calibrate import DeviceRates
from tokpipe_compiler.costmodel.published import (
    T5_XXL_PARAMS,
    VAE_DECODE_FLOPS,
    VAE_DECODE_OUTPUT_BYTES,
)

BF16 = 2
# Text encoders: parameters of the encoder alone (bf16). T5-XXL as in published.py; CLIP
# ViT-L/14 text 123M and OpenCLIP bigG text 695M (their model cards); UMT5-XXL encoder about
# 5.7B (T5-XXL with a 256k vocabulary); mT5-XL encoder about 1.7B and HunyuanDiT's
# bilingual CLIP text tower about 0.35B; Pile-T5-XL encoder about 1.4B; Gemma-2 2B 2.6B.
CLIP_L, CLIP_G, UMT5_XXL, MT5_XL, HY_CLIP, PILE_T5_XL, GEMMA2_2B = (
    123e6, 695e6, 5.7e9, 1.7e9, 0.35e9, 1.4e9, 2.6e9)

# The SD VAE decoder's cost per output pixel (published.py counted 1024 x 1024): SD, SDXL,
# SD3 and Flux VAEs share its decoder (the 16-channel ones differ only in the first conv),
# and Latte decodes frame by frame with it. Video VAEs were counted on the meta device
# (`count_decoder`, diffusers 0.42.1 class defaults, which are the released 2B / 1.3B /
# 0.9 configs): (FLOPs, bytes of op outputs) of one decode at the released size.
SD_VAE_PER_PIXEL = (VAE_DECODE_FLOPS / 1024**2, VAE_DECODE_OUTPUT_BYTES / 1024**2)
VIDEO_VAE = {
    "cogvideox": (3.150e14, 7.335e11),  # AutoencoderKLCogVideoX, 13x60x90 -> 49x480x720
    "wan": (2.754e14, 1.273e12),  # AutoencoderKLWan, 21x60x104 -> 81x480x832
    "ltx": (5.052e13, 1.464e11),  # AutoencoderKLLTXVideo, 21x16x22 -> 161x512x704
}


@dataclass(frozen=True)
class Run:
    """steps: the pipeline's default step count; guidance: batch 2 (classifier-free
    guidance); encoders: (parameters, tokens) of each text encoder; vae: (FLOPs, bytes) of
    the decode."""

    steps: int
    guidance: bool
    encoders: tuple[tuple[float, int], ...]
    vae: tuple[float, float]

    @property
    def batch(self) -> int:
        return 2 if self.guidance else 1


def _sd_vae(pixels: int) -> tuple[float, float]:
    return SD_VAE_PER_PIXEL[0] * pixels, SD_VAE_PER_PIXEL[1] * pixels


MP = 1024 * 1024
RUNS: dict[str, Run] = {
    "pixart-alpha-xl-2-1024-ms": Run(20, True, ((T5_XXL_PARAMS, 120),), _sd_vae(MP)),
    "pixart-sigma-xl-2-1024-ms": Run(20, True, ((T5_XXL_PARAMS, 300),), _sd_vae(MP)),
    "dit-xl-2-256": Run(50, True, (), _sd_vae(256 * 256)),  # class labels, no text
    "dit-xl-2-512": Run(50, True, (), _sd_vae(512 * 512)),
    "sd3-medium": Run(28, True, ((CLIP_L, 77), (CLIP_G, 77), (T5_XXL_PARAMS, 256)),
                      _sd_vae(MP)),
    "sd35-large": Run(28, True, ((CLIP_L, 77), (CLIP_G, 77), (T5_XXL_PARAMS, 256)),
                      _sd_vae(MP)),
    # Flux is guidance-distilled (one row per step); schnell's model card runs 4 steps.
    "flux1-dev": Run(28, False, ((CLIP_L, 77), (T5_XXL_PARAMS, 512)), _sd_vae(MP)),
    "flux1-schnell": Run(4, False, ((CLIP_L, 77), (T5_XXL_PARAMS, 256)), _sd_vae(MP)),
    "hunyuandit-v1.2": Run(50, True, ((HY_CLIP, 77), (MT5_XL, 256)), _sd_vae(MP)),
    "cogvideox-2b": Run(50, True, ((T5_XXL_PARAMS, 226),), VIDEO_VAE["cogvideox"]),
    "cogvideox-5b": Run(50, True, ((T5_XXL_PARAMS, 226),), VIDEO_VAE["cogvideox"]),
    "latte-1": Run(50, True, ((T5_XXL_PARAMS, 120),), _sd_vae(16 * 512 * 512)),
    "wan2.1-t2v-1.3b": Run(50, True, ((UMT5_XXL, 512),), VIDEO_VAE["wan"]),
    "wan2.1-t2v-14b": Run(50, True, ((UMT5_XXL, 512),), VIDEO_VAE["wan"]),
    "ltx-video": Run(50, True, ((T5_XXL_PARAMS, 128),), VIDEO_VAE["ltx"]),
    "auraflow": Run(50, True, ((PILE_T5_XL, 256),), _sd_vae(MP)),
    # Sana's DC-AE decoder is not counted: Sana's linear attention does not plan yet.
    "sana-1600m-1024px": Run(20, True, ((GEMMA2_2B, 300),), _sd_vae(MP)),
}


def outside_seconds(run: Run, rates: DeviceRates) -> float:
    """Text encoding (every prompt row: 2 under guidance) and the VAE decode of one
    image or video: FLOPs at the matmul rate plus bytes at the memory bandwidth (weights
    read once, op outputs written and read once)."""
    flops = sum(2 * params * tokens * run.batch for params, tokens in run.encoders)
    nbytes = sum(BF16 * params for params, _ in run.encoders)
    flops, nbytes = flops + run.vae[0], nbytes + 2 * run.vae[1]
    return flops / rates.matmul_flops + nbytes / rates.mem_bandwidth


def encoder_bytes(run: Run, itemsize: int) -> float:
    """The text encoders' weights at `itemsize` bytes a parameter: every rank of a
    parallelized pipeline runs its prompt encoding, so each GPU holds them."""
    return sum(params for params, _ in run.encoders) * itemsize


def count_decoder(cls_name: str, latent: tuple[int, ...]) -> tuple[float, float]:
    """(FLOPs, bytes of op outputs) of a diffusers VAE class's decode (its default config)
    of a bf16 `latent`, on the meta device: where VIDEO_VAE comes from."""
    import diffusers
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from tokpipe_compiler.costmodel.published import OutputBytes

    with torch.device("meta"):
        vae = getattr(diffusers, cls_name)().to(torch.bfloat16).eval()
        z = torch.empty(latent, dtype=torch.bfloat16)
    counted = OutputBytes()
    with FlopCounterMode(display=False) as flops, counted, torch.no_grad():
        vae.decode(z)
    return float(flops.get_total_flops()), float(counted.total)
