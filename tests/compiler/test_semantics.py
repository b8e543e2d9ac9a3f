"""Properties of every mode against eager PyTorch, over random models, stages and chunks.

Tolerance: float32, max |pipelined - eager| <= 1e-5 * max |eager|.
"""

from __future__ import annotations

import functools
import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.fixtures.models import TinyCausalLM, TinyDiT, dit_inputs
from tests.fixtures.tracing import assert_rel_close, rel_error, trace
from tokpipe_compiler import TokpipeError


@functools.cache
def traced_dit(depth: int, width: int, heads: int, grid: int):
    torch.manual_seed(depth * 100 + width + heads + grid)
    model = TinyDiT(depth=depth, width=width, heads=heads, grid=grid).eval()
    latents, t, labels = dit_inputs(model, grid)
    return model, trace(model, latents, t, labels)


@functools.cache
def traced_causal(depth: int, width: int, heads: int, length: int):
    torch.manual_seed(depth + width + length)
    model = TinyCausalLM(depth=depth, width=width, heads=heads).eval()
    x = torch.randn(1, length, width)
    return model, trace(model, x)


dit_configs = st.tuples(
    st.integers(1, 4),  # depth
    st.sampled_from([16, 32]),  # width
    st.sampled_from([1, 2, 4]),  # heads
    st.sampled_from([8, 12, 16]),  # latent grid (patch 2: 4..8 token rows)
)


def eager(model, latents, t, labels):
    with torch.no_grad():
        return model(latents, t, labels)


def pipeline_options(draw, depth: int, rows: int) -> dict:
    stages = draw(st.integers(1, min(4, 2 * depth)))
    chunks = draw(st.integers(1, min(8, rows)))
    return {"stages": stages, "chunks": chunks}


@settings(max_examples=25)
@given(config=dit_configs, data=st.data(), mode=st.sampled_from(["sync", "stale"]))
def test_exact_modes_equal_eager(config, data, mode):
    """sync, and stale with warmup covering every call, equal eager on changing inputs."""
    model, traced = traced_dit(*config)
    options = pipeline_options(data.draw, config[0], config[3] // 2)
    program = traced.program(mode=mode, warmup_steps=3, **options)
    for seed in range(3):
        latents, t, labels = dit_inputs(model, config[3], seed=seed)
        (out,) = program(*traced.args(latents=latents, timestep=t, labels=labels))
        assert_rel_close(out, eager(model, latents, t, labels))


@settings(max_examples=25)
@given(config=dit_configs, data=st.data())
def test_stale_on_repeated_input_equals_eager(config, data):
    """Stale K/V of the same input are the fresh ones: the second call is exact too."""
    model, traced = traced_dit(*config)
    program = traced.program(mode="stale", warmup_steps=1,
                             **pipeline_options(data.draw, config[0], config[3] // 2))
    latents, t, labels = dit_inputs(model, config[3], seed=7)
    args = traced.args(latents=latents, timestep=t, labels=labels)
    program(*args)
    (second,) = program(*args)
    assert_rel_close(second, eager(model, latents, t, labels))


@settings(max_examples=15)
@given(config=dit_configs, data=st.data())
def test_stale_on_changing_input_is_stale(config, data):
    """After warmup, later chunks see the previous call's K/V: not the eager answer."""
    model, traced = traced_dit(*config)
    rows = config[3] // 2
    stages = data.draw(st.integers(1, min(4, 2 * config[0])))
    chunks = data.draw(st.integers(2, min(8, rows)))
    program = traced.program(mode="stale", warmup_steps=1, stages=stages, chunks=chunks)
    first = dit_inputs(model, config[3], seed=1)
    second = dit_inputs(model, config[3], seed=2)
    second = (second[0], first[1] - 1, second[2])  # the next step: a lower timestep
    program(*traced.args(latents=first[0], timestep=first[1], labels=first[2]))
    (out,) = program(*traced.args(latents=second[0], timestep=second[1], labels=second[2]))
    assert rel_error(out, eager(model, *second)) > 1e-4


@settings(max_examples=25)
@given(
    config=st.tuples(st.integers(1, 3), st.sampled_from([16, 32]), st.sampled_from([1, 2]),
                     st.sampled_from([8, 13, 24])),
    data=st.data(),
)
def test_causal_equals_eager(config, data):
    """TeraPipe: a causal model chunked over its sequence is exact, uneven chunks included."""
    model, traced = traced_causal(*config)
    stages = data.draw(st.integers(1, min(4, 2 * config[0])))
    chunks = data.draw(st.integers(1, min(8, config[3])))
    program = traced.program(mode="causal", stages=stages, chunks=chunks)
    for seed in range(2):
        x = torch.randn(1, config[3], config[1], generator=torch.Generator().manual_seed(seed))
        (out,) = program(*traced.args(x=x))
        with torch.no_grad():
            assert_rel_close(out, model(x))


@settings(max_examples=15)
@given(config=st.tuples(st.integers(1, 2), st.sampled_from([16, 32]), st.sampled_from([9, 16])),
       data=st.data())
def test_causal_with_explicit_lengths_equals_eager(config, data):
    """Any lengths the user pins (TeraPipe's uneven slicing among them) stay exact."""
    depth, width, length = config
    model, traced = traced_causal(depth, width, 2, length)
    cuts = data.draw(st.sets(st.integers(1, length - 1), max_size=5))
    bounds = [0, *sorted(cuts), length]
    lengths = [b - a for a, b in itertools.pairwise(bounds)]
    program = traced.program(mode="causal", stages=data.draw(st.integers(1, 2)), chunks=lengths)
    assert [c.units for c in program.plan.chunks] == lengths  # one token a row here
    x = torch.randn(1, length, width, generator=torch.Generator().manual_seed(length))
    (out,) = program(*traced.args(x=x))
    with torch.no_grad():
        assert_rel_close(out, model(x))


def test_stale_with_explicit_lengths_repeats_eager():
    model, traced = traced_dit(2, 16, 2, 16)  # 8 rows of 8 tokens
    program = traced.program(mode="stale", stages=2, chunks=[24, 8, 32])
    assert [c.units for c in program.plan.chunks] == [3, 1, 4]
    latents, t, labels = dit_inputs(model, 16)
    for _ in range(2):  # warmup, then a pipelined call on the same input
        (out,) = program(*traced.args(latents=latents, timestep=t, labels=labels))
    assert_rel_close(out, eager(model, latents, t, labels))


@pytest.mark.parametrize(("lengths", "words"), [
    ([32, 16], "covers 48 tokens but the token input has 64"),
    ([20, 44], r"chunk lengths \[20, 44\] are not whole units .*8 tokens a unit, 8 units; "
               r"a unit is an image.s row of patches.*multiples of 8"),
])
@pytest.mark.parametrize("mode", ["stale", "sync"])
def test_explicit_lengths_that_do_not_tile_the_grid_are_errors(lengths, words, mode):
    """In sync too, which runs one chunk: the same options would fail when run stale."""
    _, traced = traced_dit(2, 16, 2, 16)
    with pytest.raises(TokpipeError, match=words):
        traced.program(mode=mode, stages=2, chunks=lengths)


def test_reset_restarts_warmup():
    model, traced = traced_dit(2, 32, 2, 8)
    program = traced.program(mode="stale", warmup_steps=1, stages=2, chunks=4)
    a, b = dit_inputs(model, 8, seed=1), dit_inputs(model, 8, seed=2)
    program(*traced.args(latents=a[0], timestep=a[1], labels=a[2]))
    program.reset()
    (out,) = program(*traced.args(latents=b[0], timestep=b[1], labels=b[2]))
    assert_rel_close(out, eager(model, *b))  # the first call after reset is warmup: exact


@pytest.mark.parametrize("chunks", [3, 4])
def test_uneven_chunks_tile_the_grid(chunks):
    model, traced = traced_dit(2, 16, 2, 16)  # 8 token rows
    program = traced.program(mode="sync", stages=2, chunks=chunks)
    plan = traced.program(mode="stale", stages=2, chunks=chunks).plan
    covered = [u for c in plan.chunks for u in range(c.start, c.stop)]
    assert covered == list(range(plan.units))
    latents, t, labels = dit_inputs(model, 16)
    (out,) = program(*traced.args(latents=latents, timestep=t, labels=labels))
    assert_rel_close(out, eager(model, latents, t, labels))
