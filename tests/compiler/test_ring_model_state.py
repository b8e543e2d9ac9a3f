"""parallelize(pipe) with transformers that keep state of their own or read a tensor's
value: the ring's fake-tensor run leaves their lazily filled tables and caches as they were,
and a transformer that reads a Python number off a tensor runs per call.

Tolerance (float32): sync equals the serial pipeline within 1e-5 of its largest value.
"""

from __future__ import annotations

import pytest
import torch

from tests.fixtures import pipelines
from tests.fixtures.pipelines import generate, parallelized, pixart_alpha
from tests.fixtures.tracing import rel_error

pytest.importorskip("diffusers")


def test_a_call_started_again_per_call_computes_with_the_models_own_caches(monkeypatch):
    """A ring's first step learns the transformer's outputs from a run on fake tensors.
    Z-Image fills its rotary table on its first call, as an attribute of a plain object
    (`rope_embedder.freqs_cis`): that run left fake tensors there, and the call, started
    again per call where the ring cannot replay Z-Image's step (here in the table to get
    that far), computed with them (0.34 relative from serial). The fake run's attributes
    are put back. (Its guidance normalised over the whole image is the step the ring
    cannot replay here.)"""
    from tokpipe_compiler.pipelines import table

    monkeypatch.setitem(table.RING_PIPELINES, "ZImagePipeline", {})
    serial_pipe, kwargs = pipelines.zimage()
    kwargs["cfg_normalization"] = 1.0
    serial = generate(serial_pipe, kwargs, steps=4)
    pipe, _ = parallelized(pipelines.zimage, mode="sync")
    with pytest.warns(UserWarning, match="the call started again per call"):
        out = generate(pipe, kwargs, steps=4)
    assert rel_error(out, serial) <= 1e-5
    assert all(type(t) is torch.Tensor for t in pipe.transformer.rope_embedder.freqs_cis)


def test_the_fake_run_leaves_no_fake_tensor_in_the_models_caches():
    """QwenImage's rotary tables are `functools.lru_cache`d methods: the ring's fake run
    filled them with fake tensors, which the ring's own trace skips but an eager call of
    the transformer afterwards was served (a FakeTensor result). The caches a fake run
    fills are emptied."""
    from torch._subclasses.fake_tensor import is_fake

    pipe, kwargs = parallelized(pipelines.qwenimage, mode="sync")
    generate(pipe, kwargs, steps=2)
    frames = pipe.transformer.pos_embed([(1, 4, 4)], torch.device("cpu"), max_txt_seq_len=5)
    assert not any(is_fake(t) for t in frames)


def test_a_transformer_that_reads_a_number_off_a_tensor_runs_per_call():
    """A transformer whose forward reads a Python number off a tensor (`.item()`, as
    HiDream's unpatchify does) cannot be a ring's graph: the parallelized pipeline runs
    the generation per call, saying why, where it raised."""
    def make():
        pipe, kwargs = pixart_alpha()
        embed = pipe.transformer.pos_embed
        plain = embed.forward
        embed.forward = lambda latent: plain(latent) * (latent.abs().max().item() >= 0)
        return pipe, kwargs

    serial = generate(*make(), steps=3)
    pipe, kwargs = parallelized(make, mode="sync")
    with pytest.warns(UserWarning, match=r"runs per call.*reads a Python number off a tensor "
                                         r"\(\.item\(\)\)"):
        out = generate(pipe, kwargs, steps=3)
    assert rel_error(out, serial) <= 1e-5
