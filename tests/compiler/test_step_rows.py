"""The step tables' row arithmetic (`update`, `update_state`): token-wise, so a chunk of
rows updates as the whole does; float32 inside, the input dtype out; traced to a graph the
compiler reads as token-wise."""

from __future__ import annotations

import pytest
import torch
from diffusers import DPMSolverMultistepScheduler, UniPCMultistepScheduler
from hypothesis import given
from hypothesis import strategies as st

from tokpipe_compiler.api import capture_graphs
from tokpipe_compiler.core.meta import META_KEY
from tokpipe_compiler.passes.annotate import annotate
from tokpipe_compiler.pipelines.schedulers import K, step_table, update, update_state

# diffusers' schedulers trip numpy 2's __array__ copy deprecation; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:diffusers")


@given(
    rows=st.integers(2, 24),
    cut=st.data(),
    coeffs=st.lists(st.floats(-3, 3, width=32), min_size=K, max_size=K),
    with_history=st.booleans(),
)
def test_update_is_token_wise(rows: int, cut: st.DataObject, coeffs: list[float],
                              with_history: bool) -> None:
    lo = cut.draw(st.integers(0, rows - 1))
    hi = cut.draw(st.integers(lo + 1, rows))
    gen = torch.Generator().manual_seed(rows)
    x, out, hist = (torch.randn(2, rows, 6, generator=gen) for _ in range(3))
    row = torch.tensor(coeffs)
    hist = hist if with_history else None
    whole = update(x, out, hist, row)
    part = update(x[:, lo:hi], out[:, lo:hi], None if hist is None else hist[:, lo:hi], row)
    assert torch.equal(part[0], whole[0][:, lo:hi])
    if with_history:
        assert torch.equal(part[1], whole[1][:, lo:hi])
    else:
        assert part[1] is None and whole[1] is None


@given(rows=st.integers(2, 24), cut=st.data(), m=st.integers(0, 4), seed=st.integers(0, 99))
def test_update_state_is_token_wise(rows: int, cut: st.DataObject, m: int, seed: int) -> None:
    lo = cut.draw(st.integers(0, rows - 1))
    hi = cut.draw(st.integers(lo + 1, rows))
    gen = torch.Generator().manual_seed(seed)
    x, out, *state = (torch.randn(2, rows, 6, generator=gen) for _ in range(2 + m))
    row = torch.randn((1 + m) * (2 + m), generator=gen)
    whole = update_state(x, out, state, row)
    part = update_state(x[:, lo:hi], out[:, lo:hi], [s[:, lo:hi] for s in state], row)
    assert torch.equal(part[0], whole[0][:, lo:hi])
    assert len(part[1]) == len(whole[1]) == m
    for p, w in zip(part[1], whole[1], strict=True):
        assert torch.equal(p, w[:, lo:hi])


def test_pattern_only_drops_zero_terms() -> None:
    table = step_table(UniPCMultistepScheduler(), 12)
    gen = torch.Generator().manual_seed(0)
    x, out, *state = (torch.randn(1, 16, 8, generator=gen) for _ in range(2 + table.state_size))
    for row in table.rows:
        sparse = update_state(x, out, state, row, table.pattern)
        dense = update_state(x, out, state, row)
        torch.testing.assert_close(sparse, dense, rtol=1e-6, atol=1e-6)


def test_update_keeps_dtype_and_computes_in_float32() -> None:
    """bfloat16 in, bfloat16 out, float32 inside: the only error is the final rounding."""
    gen = torch.Generator().manual_seed(0)
    x, out = (torch.randn(1, 8, 4, generator=gen).bfloat16() for _ in range(2))
    hist = torch.randn(1, 8, 4, generator=gen)
    row = step_table(DPMSolverMultistepScheduler(), 10).coeffs[3]
    want, want_hist = update(x.float(), out.float(), hist, row)  # the same inputs, float32
    got, got_hist = update(x, out, hist, row)
    assert got.dtype == torch.bfloat16 and got_hist.dtype == torch.float32
    assert ((got.float() - want).abs() <= want.abs() * 2**-8 + 1e-6).all()  # one rounding
    torch.testing.assert_close(got_hist, want_hist, rtol=1e-6, atol=1e-6)


def test_update_state_keeps_dtype_and_computes_in_float32() -> None:
    table = step_table(UniPCMultistepScheduler(), 10)
    gen = torch.Generator().manual_seed(0)
    x, out = (torch.randn(1, 8, 4, generator=gen).bfloat16() for _ in range(2))
    state = [torch.randn(1, 8, 4, generator=gen) for _ in range(table.state_size)]
    want, want_state = update_state(x.float(), out.float(), state, table.rows[3], table.pattern)
    got, got_state = update_state(x, out, state, table.rows[3], table.pattern)
    assert got.dtype == torch.bfloat16 and all(s.dtype == torch.float32 for s in got_state)
    assert ((got.float() - want).abs() <= want.abs() * 2**-8 + 1e-6).all()
    torch.testing.assert_close(got_state, want_state, rtol=1e-6, atol=1e-6)


def test_update_traces_to_token_wise_graph() -> None:
    """Dynamo traces `update` in one graph that the annotate pass finds token-wise."""
    table = step_table(DPMSolverMultistepScheduler(), 10)

    def last_stage_step(latents, model_output, history, coeffs):
        return update(latents, model_output, history, coeffs)

    x, out, hist = (torch.randn(1, 16, 8) for _ in range(3))
    (gm,) = capture_graphs(last_stage_step, (x, out, hist, table.coeffs[4]), None)
    annotation = annotate(gm, "latents")
    assert not annotation.unsupported
    outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    assert all(n.meta[META_KEY].carries_tokens for n in outputs)


def test_update_state_traces_to_token_wise_graph() -> None:
    """The same for `update_state` with UniPC's three state tensors."""
    table = step_table(UniPCMultistepScheduler(prediction_type="flow_prediction",
                                               use_flow_sigmas=True, flow_shift=3.0), 10)

    def last_stage_step(latents, model_output, s0, s1, s2, row):
        x, state = update_state(latents, model_output, (s0, s1, s2), row, table.pattern)
        return (x, *state)

    x, out, *state = (torch.randn(1, 16, 8) for _ in range(5))
    (gm,) = capture_graphs(last_stage_step, (x, out, *state, table.rows[4]), None)
    annotation = annotate(gm, "latents")
    assert not annotation.unsupported
    outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    assert len(outputs) == 4 and all(n.meta[META_KEY].carries_tokens for n in outputs)
