"""Small configs and random inputs for diffusers transformers (tests and scripts/coverage.py).

Each entry builds a model with random weights at a size that traces and runs in seconds on
a CPU, and its keyword inputs for a seed (a new seed: new latents, text and timestep).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

Inputs = Callable[[int], dict[str, Any]]


@dataclass(frozen=True)
class Entry:
    config: dict[str, Any]
    inputs: Inputs
    chunks: int = 2  # chunks for the coverage run (at most the token grid's rows)
    notes: str = ""


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def image(channels: int, size: int = 8, frames: int | None = None, frames_first=False,
          **text: tuple[int, ...]) -> Inputs:
    """Latents [1, C, H, W] (or video [1, C, F, H, W] / [1, F, C, H, W]), a timestep, and
    random tensors of the given shapes by keyword."""

    def make(seed: int) -> dict[str, Any]:
        g = _gen(seed)
        if frames is None:
            shape = (1, channels, size, size)
        else:
            shape = (1, frames, channels, size, size) if frames_first else (
                1, channels, frames, size, size)
        out = {"hidden_states": torch.randn(*shape, generator=g),
               "timestep": torch.rand(1, generator=g) * 900 + 50}
        out.update({k: torch.randn(*s, generator=g) for k, s in text.items()})
        return out

    return make


def _flux_inputs(seed: int) -> dict[str, Any]:
    g, side = _gen(seed), 4
    rows, cols = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    img_ids = torch.stack([torch.zeros_like(rows), rows, cols], -1).reshape(-1, 3).float()
    return {"hidden_states": torch.randn(1, side * side, 8, generator=g),
            "encoder_hidden_states": torch.randn(1, 5, 12, generator=g),
            "pooled_projections": torch.randn(1, 10, generator=g),
            "timestep": torch.rand(1, generator=g), "img_ids": img_ids,
            "txt_ids": torch.zeros(5, 3)}


def _dit_inputs(seed: int) -> dict[str, Any]:
    g = _gen(seed)
    return {"hidden_states": torch.randn(1, 4, 8, 8, generator=g),
            "timestep": torch.randint(0, 1000, (1,), generator=g),
            "class_labels": torch.randint(0, 10, (1,), generator=g)}


def _hunyuan_inputs(seed: int) -> dict[str, Any]:
    from diffusers.models.embeddings import get_2d_rotary_pos_embed

    g = _gen(seed)
    return {"hidden_states": torch.randn(1, 4, 8, 8, generator=g),
            "timestep": torch.rand(1, generator=g) * 900 + 50,
            "encoder_hidden_states": torch.randn(1, 5, 12, generator=g),
            "text_embedding_mask": torch.ones(1, 5),
            "encoder_hidden_states_t5": torch.randn(1, 6, 16, generator=g),
            "text_embedding_mask_t5": torch.ones(1, 6),
            "image_rotary_emb": get_2d_rotary_pos_embed(8, ((0, 0), (4, 4)), (4, 4))}


def _ltx_inputs(seed: int) -> dict[str, Any]:
    g = _gen(seed)
    return {"hidden_states": torch.randn(1, 2 * 4 * 4, 8, generator=g),
            "encoder_hidden_states": torch.randn(1, 5, 12, generator=g),
            "timestep": torch.rand(1, generator=g) * 900 + 50,
            "encoder_attention_mask": torch.ones(1, 5), "num_frames": 2, "height": 4, "width": 4}


def _qwen_inputs(seed: int) -> dict[str, Any]:
    g = _gen(seed)
    return {"hidden_states": torch.randn(1, 16, 8, generator=g),
            "encoder_hidden_states": torch.randn(1, 5, 12, generator=g),
            "encoder_hidden_states_mask": torch.ones(1, 5), "timestep": torch.rand(1, generator=g),
            "img_shapes": [(1, 4, 4)]}


def _chroma_inputs(seed: int) -> dict[str, Any]:
    out = _flux_inputs(seed)
    del out["pooled_projections"]
    return out


def _cogview_inputs(seed: int) -> dict[str, Any]:
    out = image(4, encoder_hidden_states=(1, 5, 12))(seed)
    size = torch.tensor([[8.0, 8.0]])
    return {**out, "original_size": size, "target_size": size, "crop_coords": torch.zeros(1, 2)}


def _ids_inputs(axes: int, pooled: bool) -> Inputs:
    """Flux-style packed latents with position ids: text ids zero, image ids (0.., row, col)."""

    def make(seed: int) -> dict[str, Any]:
        out = _flux_inputs(seed)
        if not pooled:
            del out["pooled_projections"]
        pad = torch.zeros(16, axes - 3)
        out["img_ids"] = torch.cat([out["img_ids"], pad], -1)
        out["txt_ids"] = torch.zeros(5, axes)
        return out

    return make


def _with(inputs: Inputs, **fixed: Any) -> Inputs:
    return lambda seed: {**inputs(seed), **fixed}


HEADS = {"num_attention_heads": 2, "attention_head_dim": 8}
TEXT = {"encoder_hidden_states": (1, 5, 12)}
VIDEO = image(4, frames=2, **TEXT)

ZOO: dict[str, Entry] = {
    "DiTTransformer2DModel": Entry(
        {**HEADS, "in_channels": 4, "out_channels": 8, "num_layers": 2, "sample_size": 8,
         "patch_size": 2, "num_embeds_ada_norm": 10}, _dit_inputs),
    "PixArtTransformer2DModel": Entry(
        {**HEADS, "in_channels": 4, "out_channels": 8, "num_layers": 2, "sample_size": 8,
         "patch_size": 2, "cross_attention_dim": 16, "caption_channels": 12,
         "use_additional_conditions": False},
        image(4, encoder_hidden_states=(1, 5, 12))),
    "SD3Transformer2DModel": Entry(
        {**HEADS, "sample_size": 8, "patch_size": 2, "in_channels": 4, "num_layers": 2,
         "joint_attention_dim": 12, "caption_projection_dim": 16, "pooled_projection_dim": 10,
         "out_channels": 4, "pos_embed_max_size": 8},
        image(4, encoder_hidden_states=(1, 5, 12), pooled_projections=(1, 10))),
    "FluxTransformer2DModel": Entry(
        {**HEADS, "patch_size": 1, "in_channels": 8, "num_layers": 1, "num_single_layers": 1,
         "joint_attention_dim": 12, "pooled_projection_dim": 10, "axes_dims_rope": (2, 2, 4)},
        _flux_inputs, chunks=4),
    "HunyuanDiT2DModel": Entry(
        {**HEADS, "in_channels": 4, "patch_size": 2, "activation_fn": "gelu-approximate",
         "sample_size": 8, "hidden_size": 16, "num_layers": 6, "mlp_ratio": 2.0,
         "learn_sigma": True, "cross_attention_dim": 12, "norm_type": "layer_norm",
         "cross_attention_dim_t5": 16, "pooled_projection_dim": 10, "text_len": 5,
         "text_len_t5": 6, "use_style_cond_and_image_meta_size": False},
        _hunyuan_inputs, notes="long skips from block i to block depth-1-i"),
    "CogVideoXTransformer3DModel": Entry(
        {**HEADS, "in_channels": 4, "out_channels": 4, "time_embed_dim": 8,
         "text_embed_dim": 12, "num_layers": 2, "sample_width": 8, "sample_height": 8,
         "sample_frames": 13, "patch_size": 2, "temporal_compression_ratio": 4,
         "max_text_seq_length": 5},
        image(4, frames=4, frames_first=True, encoder_hidden_states=(1, 5, 12)), chunks=4),
    "Transformer2DModel": Entry(
        {**HEADS, "in_channels": 4, "num_layers": 1, "patch_size": 2, "sample_size": 8,
         "norm_type": "ada_norm_zero", "num_embeds_ada_norm": 10}, _dit_inputs),
    "AuraFlowTransformer2DModel": Entry(
        {**HEADS, "sample_size": 8, "patch_size": 2, "in_channels": 4, "num_mmdit_layers": 1,
         "num_single_dit_layers": 1, "joint_attention_dim": 12, "caption_projection_dim": 16,
         "out_channels": 4, "pos_embed_max_size": 16}, image(4, **TEXT)),
    "Lumina2Transformer2DModel": Entry(
        {"sample_size": 8, "patch_size": 2, "in_channels": 4, "hidden_size": 16,
         "num_layers": 1, "num_refiner_layers": 1, "num_attention_heads": 2, "num_kv_heads": 1,
         "multiple_of": 16, "axes_dim_rope": (2, 2, 4), "axes_lens": (32, 32, 32),
         "cap_feat_dim": 12},
        _with(image(4, **TEXT), encoder_attention_mask=torch.ones(1, 5, dtype=torch.bool))),
    "SanaTransformer2DModel": Entry(
        {**HEADS, "in_channels": 4, "out_channels": 4, "num_layers": 1,
         "num_cross_attention_heads": 2, "cross_attention_head_dim": 8,
         "cross_attention_dim": 16, "caption_channels": 12, "sample_size": 8, "patch_size": 1},
        image(4, **TEXT)),
    "WanTransformer3DModel": Entry(
        {**HEADS, "patch_size": (1, 2, 2), "in_channels": 4, "out_channels": 4, "text_dim": 12,
         "freq_dim": 16, "ffn_dim": 32, "num_layers": 1, "rope_max_seq_len": 32}, VIDEO),
    "SkyReelsV2Transformer3DModel": Entry(
        {**HEADS, "patch_size": (1, 2, 2), "in_channels": 4, "out_channels": 4, "text_dim": 12,
         "freq_dim": 16, "ffn_dim": 32, "num_layers": 1, "rope_max_seq_len": 32}, VIDEO),
    "LTXVideoTransformer3DModel": Entry(
        {**HEADS, "in_channels": 8, "out_channels": 8, "cross_attention_dim": 16,
         "num_layers": 1, "caption_channels": 12}, _ltx_inputs),
    "MochiTransformer3DModel": Entry(
        {**HEADS, "patch_size": 2, "num_layers": 1, "pooled_projection_dim": 16,
         "in_channels": 4, "text_embed_dim": 16, "time_embed_dim": 16,
         "max_sequence_length": 5},  # its text pooler has 8 heads: text width 16
        _with(image(4, frames=2, encoder_hidden_states=(1, 5, 16)),
              encoder_attention_mask=torch.ones(1, 5))),
    "HunyuanVideoTransformer3DModel": Entry(
        {**HEADS, "in_channels": 4, "out_channels": 4, "num_layers": 1, "num_single_layers": 1,
         "num_refiner_layers": 1, "patch_size": 2, "patch_size_t": 1, "guidance_embeds": False,
         "text_embed_dim": 12, "pooled_projection_dim": 10, "rope_axes_dim": (2, 2, 4)},
        _with(image(4, frames=2, pooled_projections=(1, 10), **TEXT),
              encoder_attention_mask=torch.ones(1, 5))),
    "LatteTransformer3DModel": Entry(
        {**HEADS, "in_channels": 4, "out_channels": 4, "num_layers": 1,
         "cross_attention_dim": 16, "sample_size": 8, "patch_size": 2,
         "norm_type": "ada_norm_single", "caption_channels": 12, "video_length": 2}, VIDEO),
    "AllegroTransformer3DModel": Entry(
        {**HEADS, "patch_size": 2, "patch_size_t": 1, "in_channels": 4, "out_channels": 4,
         "num_layers": 1, "cross_attention_dim": 16, "sample_height": 8, "sample_width": 8,
         "sample_frames": 2, "caption_channels": 12}, VIDEO),
    "CogView3PlusTransformer2DModel": Entry(
        {**HEADS, "patch_size": 2, "in_channels": 4, "num_layers": 1, "out_channels": 4,
         "text_embed_dim": 12, "time_embed_dim": 8, "condition_dim": 4,
         "pos_embed_max_size": 8, "sample_size": 8}, _cogview_inputs),
    "CogView4Transformer2DModel": Entry(
        {**HEADS, "patch_size": 2, "in_channels": 4, "num_layers": 1, "out_channels": 4,
         "text_embed_dim": 12, "time_embed_dim": 8, "condition_dim": 4,
         "pos_embed_max_size": 8, "sample_size": 8, "rope_axes_dim": (4, 4)}, _cogview_inputs),
    "ChromaTransformer2DModel": Entry(
        {**HEADS, "patch_size": 1, "in_channels": 8, "num_layers": 1, "num_single_layers": 1,
         "joint_attention_dim": 12, "axes_dims_rope": (2, 2, 4),
         "approximator_num_channels": 8, "approximator_hidden_dim": 16,
         "approximator_layers": 1}, _chroma_inputs, chunks=4),
    "QwenImageTransformer2DModel": Entry(
        {**HEADS, "patch_size": 2, "in_channels": 8, "out_channels": 2, "num_layers": 1,
         "joint_attention_dim": 12, "axes_dims_rope": (2, 2, 4)}, _qwen_inputs, chunks=4),
    "CosmosTransformer3DModel": Entry(
        {"num_attention_heads": 2, "attention_head_dim": 24, "in_channels": 4,
         "out_channels": 4, "num_layers": 1, "mlp_ratio": 2.0,
         "text_embed_dim": 12, "adaln_lora_dim": 4, "max_size": (4, 16, 16),
         "patch_size": (1, 2, 2), "concat_padding_mask": False}, VIDEO),
    "Flux2Transformer2DModel": Entry(
        {**HEADS, "patch_size": 1, "in_channels": 8, "num_layers": 1, "num_single_layers": 1,
         "joint_attention_dim": 12, "timestep_guidance_channels": 16,
         "axes_dims_rope": (2, 2, 2, 2), "guidance_embeds": False},
        _ids_inputs(4, pooled=False), chunks=4),
    "BriaTransformer2DModel": Entry(
        {**HEADS, "patch_size": 1, "in_channels": 8, "num_layers": 1, "num_single_layers": 1,
         "joint_attention_dim": 12, "pooled_projection_dim": 10, "axes_dims_rope": [2, 2, 4]},
        _ids_inputs(3, pooled=True), chunks=4),
    "LongCatImageTransformer2DModel": Entry(
        {**HEADS, "patch_size": 1, "in_channels": 8, "num_layers": 1, "num_single_layers": 1,
         "joint_attention_dim": 12, "pooled_projection_dim": 10, "axes_dims_rope": [2, 2, 4]},
        _ids_inputs(3, pooled=False), chunks=4),
    "OvisImageTransformer2DModel": Entry(
        {**HEADS, "patch_size": 1, "in_channels": 8, "out_channels": 8, "num_layers": 1,
         "num_single_layers": 1, "joint_attention_dim": 12, "axes_dims_rope": (2, 2, 4)},
        _ids_inputs(3, pooled=False), chunks=4),
    "ChronoEditTransformer3DModel": Entry(
        {**HEADS, "patch_size": (1, 2, 2), "in_channels": 4, "out_channels": 4, "text_dim": 12,
         "freq_dim": 16, "ffn_dim": 32, "num_layers": 1, "rope_max_seq_len": 32}, VIDEO),
    "SanaVideoTransformer3DModel": Entry(
        {**HEADS, "in_channels": 4, "out_channels": 4, "num_layers": 1,
         "num_cross_attention_heads": 2, "cross_attention_head_dim": 8,
         "cross_attention_dim": 16, "caption_channels": 12, "sample_size": 8,
         "rope_max_seq_len": 32}, VIDEO),
    "ConsisIDTransformer3DModel": Entry(
        {**HEADS, "in_channels": 4, "out_channels": 4, "time_embed_dim": 8,
         "text_embed_dim": 12, "num_layers": 1, "sample_width": 8, "sample_height": 8,
         "sample_frames": 5, "patch_size": 2, "max_text_seq_length": 5},
        image(4, frames=2, frames_first=True, **TEXT)),
    "HunyuanImageTransformer2DModel": Entry(
        {**HEADS, "in_channels": 4, "out_channels": 4, "num_layers": 1, "num_single_layers": 1,
         "num_refiner_layers": 1, "patch_size": (2, 2), "text_embed_dim": 12,
         "rope_axes_dim": (4, 4)},
        _with(image(4, **TEXT), encoder_attention_mask=torch.ones(1, 5))),
    "PRXTransformer2DModel": Entry(
        {"in_channels": 4, "patch_size": 2, "context_in_dim": 12, "hidden_size": 16,
         "mlp_ratio": 2.0, "num_heads": 2, "depth": 2, "axes_dim": [4, 4]}, image(4, **TEXT)),
    "StableAudioDiTModel": Entry(
        {"sample_size": 16, "in_channels": 4, "num_layers": 1, **HEADS,
         "num_key_value_attention_heads": 1, "out_channels": 4, "cross_attention_dim": 16,
         "time_proj_dim": 8, "global_states_input_dim": 12, "cross_attention_input_dim": 12},
        lambda seed: {"hidden_states": torch.randn(1, 4, 16, generator=_gen(seed)),
                      "timestep": torch.tensor([10.0 + seed]),
                      "encoder_hidden_states": torch.randn(1, 5, 12, generator=_gen(seed)),
                      "global_hidden_states": torch.randn(1, 1, 12, generator=_gen(seed + 1))}),
    "WanVACETransformer3DModel": Entry(
        {**HEADS, "patch_size": (1, 2, 2), "in_channels": 4, "out_channels": 4, "text_dim": 12,
         "freq_dim": 16, "ffn_dim": 32, "num_layers": 2, "rope_max_seq_len": 32,
         "vace_layers": [0], "vace_in_channels": 4},
        lambda seed: {**VIDEO(seed), "control_hidden_states": torch.randn(
            1, 4, 2, 8, 8, generator=_gen(seed + 7))}),
    "MotifVideoTransformer3DModel": Entry(
        {**HEADS, "in_channels": 4, "out_channels": 4, "num_layers": 1, "num_single_layers": 1,
         "patch_size": 2, "patch_size_t": 1, "text_embed_dim": 12, "rope_axes_dim": (2, 2, 4)},
        _with(VIDEO, encoder_attention_mask=torch.ones(1, 5))),
    "TransformerTemporalModel": Entry(
        {**HEADS, "in_channels": 4, "norm_num_groups": 2, "num_layers": 1},
        _with(image(4), num_frames=1)),
}


def build(name: str, seed: int = 0) -> torch.nn.Module:
    import diffusers

    torch.manual_seed(seed)
    model = getattr(diffusers, name)(**ZOO[name].config).eval()
    with torch.no_grad():
        for param in model.parameters():
            # Zero-initialised gates (adaLN-zero) make blocks the identity, and any pipeline
            # then matches eager trivially: give them random values too.
            if not param.any():
                param.normal_(0.0, 0.1)
    return model
