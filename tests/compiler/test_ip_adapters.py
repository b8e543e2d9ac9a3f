"""SD3 with an IP-Adapter (SD3IPAdapterJointAttnProcessor2_0, InstantX-style weights made
here at random): its processor views the transposed output of the attention to the image
features, `.transpose(1, 2).view(...)`, which the whole sequence's sdpa output allowed
and a chunk's did not (sdpa picks its kernel, and so its output's layout, by shape):
every call raised, as if the view had a literal size.

Tolerance: sync equals the serial pipeline within 1e-5 of the output's largest value
(float32 compute).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import tokpipe_compiler as tp
from tests.fixtures.pipelines import generate, sd3
from tests.fixtures.tracing import rel_error

pytest.importorskip("diffusers")


def _with_ip_adapter(built: tuple[Any, dict]) -> tuple[Any, dict]:
    """The pipeline with an IP-Adapter's processors and image projection, as
    `_load_ip_adapter_weights` would make them, every weight random."""
    from diffusers.models.attention_processor import SD3IPAdapterJointAttnProcessor2_0
    from diffusers.models.embeddings import IPAdapterTimeImageProjection

    pipe, kwargs = built
    transformer = pipe.transformer
    heads, head_dim = (transformer.config.num_attention_heads,
                       transformer.config.attention_head_dim)
    torch.manual_seed(5)
    transformer.set_attn_processor({name: SD3IPAdapterJointAttnProcessor2_0(
        hidden_size=heads * head_dim, ip_hidden_states_dim=heads * head_dim,
        head_dim=head_dim, timesteps_emb_dim=32, scale=0.5)
        for name in transformer.attn_processors})
    transformer.image_proj = IPAdapterTimeImageProjection(
        embed_dim=12, output_dim=heads * head_dim, hidden_dim=32, heads=2, num_queries=4,
        timestep_in_dim=320)
    with torch.no_grad():  # the zero-initialised layers too, so that every path counts
        for weight in transformer.parameters():
            if not weight.count_nonzero():
                weight.copy_(torch.randn(weight.shape) * 0.02)
    pipe.register_modules(image_encoder=None, feature_extractor=None)
    embeds = torch.randn(2, 1, 12, generator=torch.Generator().manual_seed(9))
    return pipe, {**kwargs, "ip_adapter_image_embeds": embeds}


def test_sd3_with_an_ip_adapter_equals_serial():
    serial, kwargs = _with_ip_adapter(sd3())
    expected = generate(serial, kwargs, steps=2)
    pipe, _ = _with_ip_adapter(sd3())
    tp.pipelines.parallelize(pipe, stages=2, chunks=2, mode="sync", compiler="eager")
    assert rel_error(generate(pipe, kwargs, steps=2), expected) <= 1e-5
    assert tp.programs(pipe)  # pipelined
