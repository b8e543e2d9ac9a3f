"""assert_equivalent's checks of stale mode beyond its fixed points: a generation whose
inputs change every step against stale semantics run on the eager model (what it catches,
where it cannot run and says so), a model split by graph breaks, and a model without a
timestep input (no guidance branches to check)."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch

from tests.compiler.test_testing import dit
from tests.fixtures.models import TinyDiT, dit_inputs, timestep_features
from tokpipe_compiler.stage_programs import pipelined
from tokpipe_compiler.testing import NotEquivalent, assert_equivalent


def _attend_before_writing(original):
    """A kv_attention kernel whose chunks attend to the cache before writing their own
    K/V: each chunk sees its own tokens' K/V one step late."""
    signature = inspect.signature(original)

    def kernel(*args, **kwargs):
        call = signature.bind(*args, **kwargs)
        q, k, v = (call.arguments[n] for n in ("q", "k", "v"))
        k_cache, v_cache = call.arguments["k_cache"], call.arguments["v_cache"]
        if q.shape[-2] == k_cache.shape[-2]:  # a whole-sequence call: as it should
            return original(*args, **kwargs)
        offset = int(call.arguments["chunk"][0]) * call.arguments["per_unit"]
        rows = slice(offset, offset + q.shape[-2])
        call.arguments["k"] = k_cache[..., rows, :].clone()
        call.arguments["v"] = v_cache[..., rows, :].clone()
        out = original(*call.args, **call.kwargs)
        k_cache[..., rows, :].copy_(k)
        v_cache[..., rows, :].copy_(v)
        return out

    return kernel


def test_catches_chunks_that_see_their_own_kv_a_step_late():
    """Stale K/V of the chunk's own tokens equal the fresh ones wherever an input repeats,
    so only a generation whose inputs change step by step, against stale semantics run
    eagerly, shows the chunks attending to their own K/V one step late."""
    from tokpipe_compiler.runtime import kv_attention

    library = torch.library.Library("tokpipe", "IMPL")
    library.impl("kv_attention", _attend_before_writing(kv_attention._kv_attention), "CPU")
    model, args = dit()
    try:
        with pytest.raises(NotEquivalent, match="differ from stale semantics run eagerly"
                           ) as info:
            assert_equivalent(model, args, stages=2, chunks=4, mode="stale")
    finally:
        library._destroy()
    assert info.value.check.chunks == 4
    assert assert_equivalent(model, args, stages=2, chunks=4, mode="stale").chunked


def test_catches_a_first_step_that_attends_to_keys_not_yet_written(monkeypatch):
    """warmup_steps=0: the first step's chunks must see only the chunks before them (and
    their own), not the zeros of the keys no call has written yet."""
    monkeypatch.setattr(pipelined.PipelinedProgram, "_visible",
                        lambda self, chunks: lambda chunk: self.plan.units)
    model, args = dit()
    with pytest.raises(NotEquivalent) as info:
        assert_equivalent(model, args, stages=2, chunks=4, mode="stale", warmup_steps=0)
    assert info.value.check.name == ("stale mode, step 0 of a generation against stale "
                                     "semantics run eagerly")


def test_says_where_stale_semantics_were_not_run_eagerly():
    """Attention written out (softmax of q @ k.mT) is not intercepted by the eager
    reference, and the report says so."""
    from tests.compiler.test_hand_written import TokenDiT

    torch.manual_seed(0)
    report = assert_equivalent(TokenDiT("k.mT").eval(), (torch.randn(2, 4, 16, 24),),
                               stages=2, chunks=4, mode="stale")
    assert any("attention written out" in u for u in report.unchecked), str(report)
    assert "not checked: stale steps against stale semantics run eagerly" in str(report)


@pytest.mark.parametrize("readout", ["", "class", "register"])
def test_joined_tokens_are_checked_against_stale_semantics(readout):
    """Joint attention's text (here with padded text keys masked) and a class or register
    token are computed by a step's first chunk; every chunk attends to their fresh K/V."""
    from tests.compiler.test_hand_written import TokenDiT
    from tests.compiler.test_masked_stale import JointModel, joint_args

    torch.manual_seed(0)
    model, args = ((JointModel(), joint_args()) if not readout else
                   (TokenDiT(readout=readout), (torch.randn(2, 4, 16, 24),)))
    report = assert_equivalent(model.eval(), args, stages=2, chunks=2, mode="stale",
                               warmup_steps=0)
    assert not any("stale semantics" in u for u in report.unchecked), str(report)
    assert any("against stale semantics" in c.name and c.chunks == 2
               for c in report.checks), str(report)


class HalvesDiT(TinyDiT):
    """TinyDiT with a graph break between the first half of its blocks and the second,
    outside the loops over them: two graphs with attention, two programs."""

    def forward(self, latents: torch.Tensor, timestep: torch.Tensor, labels: torch.Tensor):
        b, c, h, w = latents.shape
        x = self.embed(latents).flatten(2).transpose(1, 2) + self.pos
        cond = self.t_mlp(timestep_features(timestep, 16)) + self.label(labels)
        half = len(self.blocks) // 2
        for block in self.blocks[:half]:
            x = block(x, cond)
        torch._dynamo.graph_break()
        for block in self.blocks[half:]:
            x = block(x, cond)
        p = self.patch
        x = self.out(x).reshape(b, h // p, w // p, p, p, c)
        return torch.einsum("nhwpqc->nchpwq", x).reshape(b, c, h, w)


@pytest.mark.parametrize("warmup", [0, 1])
def test_a_model_split_by_graph_breaks_passes_stale(warmup):
    """The programs run one after another, so the given input's K/V replace another's one
    layer a call across all of them. The repetitions counted the layers of one program and
    failed a correct model (1.1e-2)."""
    torch.manual_seed(0)
    model = HalvesDiT(depth=4, width=32, heads=2, grid=8).eval()
    report = assert_equivalent(model, dit_inputs(model, 8), stages=2, chunks=4, mode="stale",
                               warmup_steps=warmup)
    assert report.chunked and not report.unchecked, str(report)


class _Untimed(torch.nn.Module):
    """A DiT called with its timestep and labels fixed: no timestep input."""

    def __init__(self, model: torch.nn.Module, timestep: torch.Tensor, labels: torch.Tensor):
        super().__init__()
        self.model, self.timestep, self.labels = model, timestep, labels

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        return self.model(latents, self.timestep, self.labels)


def test_says_the_guidance_branches_were_not_checked_without_a_timestep():
    """Without a timestep input every call is a step: the branch check cannot run, and the
    report said nothing of it."""
    model, (latents, timestep, labels) = dit()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = assert_equivalent(_Untimed(model, timestep, labels), (latents,), stages=2,
                                   chunks=4, mode="stale")
    assert any(u.startswith("guidance branches: the model reads no timestep tensor")
               for u in report.unchecked), str(report)
    assert not any("guidance branch" in c.name for c in report.checks)
