"""The equivalence toolkit: passes on correct pipelines, names the stage and chunk of a
broken one. The hypothesis test is the pattern the README shows for users' own models."""

from __future__ import annotations

import dataclasses
import functools
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tokpipe_compiler as tp
from tests.fixtures.models import TinyCausalLM, TinyDiT, dit_inputs
from tokpipe_compiler.passes.partition import ImbalanceWarning
from tokpipe_compiler.runtime import executor, stage_feeds
from tokpipe_compiler.runtime.chunking import Chunk
from tokpipe_compiler.stage_programs import compile as compile_module
from tokpipe_compiler.stage_programs import pipelined
from tokpipe_compiler.testing import (
    NotEquivalent,
    assert_equivalent,
    latents_like,
    options,
)
from tokpipe_compiler.testing.inputs import other_input


@functools.cache
def dit(depth: int = 2):
    torch.manual_seed(depth)
    model = TinyDiT(depth=depth, width=32, heads=2, grid=8).eval()
    return model, dit_inputs(model, 8)


@pytest.mark.parametrize("opts", [
    {"stages": 2, "chunks": 4, "mode": "stale"},
    {"stages": 2, "chunks": 3, "mode": "stale", "warmup_steps": 0},
    {"stages": 3, "chunks": 4, "mode": "sync"},
])
def test_passes_on_correct_pipelines(opts):
    model, args = dit()
    report = assert_equivalent(model, args, **opts)
    assert report.checks and report.max_relative_error <= 1e-5
    names = [c.name for c in report.checks]
    if opts["mode"] == "sync":
        assert names == ["exact mode", "exact mode, caches reused", "exact mode, another input",
                         "exact mode, the given input after another"]
        assert {c.chunks for c in report.checks} == {1}  # sync runs the whole sequence
    else:
        assert "stale mode, repeated input" in names
        assert "stale mode, given input after another's K/V" in names
        branches = [c for c in report.checks if "guidance branch" in c.name]
        steps = opts.get("warmup_steps", 1) + 2
        assert len(branches) == 2 * steps and branches[-1].chunks == opts["chunks"]
        assert report.chunked


def test_catches_caches_that_stop_following_the_calls(monkeypatch):
    """After warmup, stage programs get copies of the K/V caches: every later call attends
    to the warmup's K/V. Repeating the warmup's input cannot tell; the generation warmed
    up on another input can."""
    original = pipelined.PipelinedProgram._call_env

    def frozen(self, args):
        env = original(self, args)
        if self.caches.filled:
            env.update({k: v.clone() for k, v in env.items() if k.startswith("kv_cache")})
        return env

    monkeypatch.setattr(pipelined.PipelinedProgram, "_call_env", frozen)
    model, args = dit()
    with pytest.raises(NotEquivalent) as info:
        assert_equivalent(model, args, stages=2, chunks=4, mode="stale")
    assert info.value.check.name == "stale mode, given input after another's K/V"


@dataclasses.dataclass
class Prediction:  # a plain dataclass, which torch's pytree does not flatten
    sample: torch.Tensor
    note: str = "x"


class DataclassOutput(torch.nn.Module):
    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *args):
        return Prediction(self.model(*args))


def test_compares_a_plain_dataclass_output():
    model, args = dit()
    report = assert_equivalent(DataclassOutput(model), args, stages=2, chunks=2, mode="sync")
    assert report.checks and report.max_relative_error <= 1e-5
    with torch.no_grad():  # the sample inside it is what was compared
        assert report.checks[0].scale == model(*args).abs().max().item()


def test_passes_on_causal():
    torch.manual_seed(0)
    model = TinyCausalLM(depth=2, width=32, heads=2).eval()
    report = assert_equivalent(model, (torch.randn(1, 12, 32),), stages=2, chunks=5,
                               mode="causal")
    assert [c.call for c in report.checks] == [1, 2, 3, 4]
    assert {c.chunks for c in report.checks} == {5}  # causal chunks every call


def test_catches_a_program_that_keeps_its_first_calls_inputs(monkeypatch):
    """Exact modes: a program that reads the first call's inputs at every call (a static
    input buffer never refreshed, say) equals eager on that input repeated; the second
    input shows it."""
    original = pipelined.PipelinedProgram._call_env
    first: dict = {}

    def stuck(self, args):
        return first.setdefault(id(self), original(self, args))

    monkeypatch.setattr(pipelined.PipelinedProgram, "_call_env", stuck)
    torch.manual_seed(0)
    model = TinyCausalLM(depth=2, width=32, heads=2).eval()
    with pytest.raises(NotEquivalent) as info:
        assert_equivalent(model, (torch.randn(1, 12, 32),), stages=2, chunks=4, mode="causal")
    assert info.value.check.name == "exact mode, another input"


def test_catches_guidance_branches_that_share_caches(monkeypatch):
    """Stale mode: two calls of a step at one timestep with other inputs are two guidance
    branches, each with caches of its own. Taken for one branch, each reads the other's
    K/V; every single-branch check still passes."""
    from tokpipe_compiler.stage_programs import generations

    original = generations.StepClock.tick
    monkeypatch.setattr(generations.StepClock, "tick", lambda self, args: dataclasses.replace(
        original(self, args), branch=0))
    model, args = dit()
    with pytest.raises(NotEquivalent, match="guidance branches differ from each branch run "
                                            "alone") as info:
        assert_equivalent(model, args, stages=2, chunks=4, mode="stale")
    assert "guidance branch" in info.value.check.name


def test_names_the_stage_and_chunk_of_an_offset_bug(monkeypatch):
    """The chunk descriptor of chunk 1 starts one row late (every stage)."""
    original = stage_feeds.chunk_descriptor

    def off_by_one(chunk: Chunk, visible: int) -> torch.Tensor:
        return original(Chunk(chunk.index, chunk.start + 1, chunk.stop + 1)
                        if chunk.index == 1 else chunk, visible)

    monkeypatch.setattr(stage_feeds, "chunk_descriptor", off_by_one)
    model, args = dit()
    with pytest.raises(NotEquivalent) as info:
        assert_equivalent(model, args, stages=2, chunks=4, mode="stale")
    where = info.value.where
    assert (where.stage, where.chunk, where.start, where.stop) == (0, 1, 1, 2)
    assert "stage 0, chunk 1" in str(info.value)
    assert info.value.check.name == "stale mode, repeated input"


def test_a_difference_in_a_model_with_joined_tokens_is_reported(monkeypatch):
    """A register token joined to the image's: locating the difference compared stage
    outputs that hold it with the unchunked run's and crashed (68 against 64 tokens)."""
    from tests.compiler.test_hand_written import TokenDiT

    original = stage_feeds.chunk_descriptor

    def off_by_one(chunk: Chunk, visible: int) -> torch.Tensor:
        return original(Chunk(chunk.index, chunk.start + 1, chunk.stop + 1, chunk.segments)
                        if chunk.index == 1 else chunk, visible)

    monkeypatch.setattr(stage_feeds, "chunk_descriptor", off_by_one)
    torch.manual_seed(0)
    with pytest.raises(NotEquivalent):
        assert_equivalent(TokenDiT(readout="register").eval(), (torch.randn(2, 4, 16, 24),),
                          stages=2, chunks=4, mode="stale")


def test_names_a_later_stage(monkeypatch):
    """Only stage 1 runs chunk 2 one row late: stage 0 is right, stage 1 is not."""
    original = executor.Executor._compute

    def compute(self, action, chunk, *rest):
        if action.stage == 1 and chunk.index == 2:
            chunk = Chunk(chunk.index, chunk.start + 1, chunk.stop + 1)
        return original(self, action, chunk, *rest)

    monkeypatch.setattr(executor.Executor, "_compute", compute)
    model, args = dit()
    with pytest.raises(NotEquivalent) as info:
        assert_equivalent(model, args, stages=2, chunks=4, mode="stale")
    where = info.value.where
    assert (where.stage, where.chunk, where.start, where.stop) == (1, 2, 2, 3)


@settings(max_examples=6, deadline=None)
@given(data=st.data())
def test_any_options_any_latents(data):
    model, (latents, t, labels) = dit()
    opts = data.draw(options(model, (latents, t, labels), max_stages=3))
    noise = data.draw(latents_like(latents))
    assert noise.shape == latents.shape and noise.dtype == latents.dtype
    assert_equivalent(model, (noise, t, labels), **opts)


CAUSAL = TinyCausalLM(depth=1, width=16, heads=1).eval()


@settings(max_examples=10, deadline=None)
@given(opts=options(CAUSAL, (torch.zeros(1, 3, 16),), max_chunks=8))
def test_options_respect_the_model(opts):
    """And pipeline: two chunks at least (the model has three rows) and two stages."""
    assert 2 <= opts["chunks"] <= 3 and opts["mode"] in ("stale", "causal", "sync")
    assert opts["stages"] >= 2


def test_options_shrink_to_a_chunked_mode():
    from hypothesis import find

    model, args = dit()
    smallest = find(options(model, args), lambda opts: True)
    assert smallest["mode"] != "sync" and smallest["chunks"] == 2 and smallest["stages"] == 2


@pytest.mark.filterwarnings("ignore:tokpipe.*cannot be balanced")
def test_options_draw_no_more_stages_than_have_work():
    """The most stages drawn is the most every stage of which has a FLOP to compute (the
    cut points alone allow dozens more on two blocks); one more warns of the idle stage."""
    from tokpipe_compiler.testing.strategies import model_facts

    model = TinyDiT(depth=2, width=16, heads=2, grid=8).eval()
    args = dit_inputs(model, 8)
    most = model_facts(model, args).max_stages(100)
    assert 2 < most < 20
    with warnings.catch_warnings():
        warnings.simplefilter("error", ImbalanceWarning)  # not even that one
        warnings.filterwarnings("ignore", "tokpipe.*cannot be balanced")
        tp.explain(model, args, stages=most, chunks=1, compiler="eager")
    with pytest.warns(ImbalanceWarning, match="nothing to compute.*use fewer stages"):
        tp.explain(model, args, stages=most + 1, chunks=1, compiler="eager")


def test_options_refuse_modes_the_model_lacks():
    model, args = dit()
    with pytest.raises(ValueError, match="none of modes"):
        options(model, args, modes=["causal"])


def test_names_the_compiler_when_no_stage_differs(monkeypatch):
    """Compiled stages and prelude round differently from eager: no stage differs from the
    unchunked run (compiled alike), so the diagnosis measures the compiled run against the
    same calls run with compiler="eager" and names the compiler, not the assembling."""
    def rounding(gm, example_inputs, compiler):  # stands in for Inductor's code
        def run(*args):
            return [x * (1 + 1e-6) if x.is_floating_point() else x for x in gm(*args)]

        return run

    monkeypatch.setattr(compile_module, "compile_stage", rounding)
    model, args = dit()
    with pytest.raises(NotEquivalent) as info:
        assert_equivalent(model, args, rtol=1e-7, stages=2, chunks=4, mode="stale",
                          compiler="inductor")
    message = str(info.value)
    assert info.value.where is None and info.value.check.name == "stale mode, warmup call"
    assert "compiled with inductor, whose code rounds differently from eager" in message
    assert "replayed with compiler='eager' differ from the inductor-compiled run" in message
    assert "outside the stages" not in message


@pytest.mark.parametrize("sizes, says", [
    ({"height": [16]}, "key 'height' is not an axis"),
    ({4: [16]}, "key 4 is not an axis"),
    ({2: []}, "axis 2 needs a non-empty list"),
    ({-1: [0]}, "axis -1 needs a non-empty list"),
])
def test_latents_like_names_a_bad_size_key(sizes, says):
    with pytest.raises(ValueError, match=says):
        latents_like(torch.zeros(1, 4, 8, 8), sizes=sizes)


@settings(max_examples=5, deadline=None)
@given(data=st.data())
def test_latents_like_draws_the_given_sizes(data):
    noise = data.draw(latents_like(torch.zeros(1, 4, 8, 8), sizes={2: [8, 12], -1: [16]}))
    assert noise.shape[:2] == (1, 4) and noise.shape[2] in (8, 12) and noise.shape[3] == 16


@settings(max_examples=5, deadline=None)
@given(data=st.data())
def test_latents_like_draws_one_size_for_a_tuple_of_axes(data):
    noise = data.draw(latents_like(torch.zeros(1, 4, 8, 8), sizes={(2, -1): [8, 12, 16]}))
    assert noise.shape[2] == noise.shape[3] in (8, 12, 16)


def test_options_for_inputs_the_model_does_not_take_say_so():
    """A DiT takes square grids only: a non-square draw fails in the model, not in tokpipe."""
    model = TinyDiT(depth=1, width=16, heads=2, grid=8).eval()
    latents, t, labels = dit_inputs(model, 8)
    with pytest.raises(tp.TokpipeError, match="the model itself raises at these inputs"):
        options(model, (latents[..., :4], t, labels))


class TimestepForms(TinyDiT):
    """A timestep as an index into a learned table (`table`), as a sigma taken the log of
    (`log`), or beside an additive mask of 0 and -inf (`mask`)."""

    def __init__(self, form: str):
        super().__init__(depth=1, width=32, heads=2, grid=8)
        self.form = form
        self.table = torch.nn.Embedding(1000, 16)

    def forward(self, latents, timestep, labels, mask=None):
        if self.form == "table":
            return super().forward(latents, self.table(timestep).sum(-1), labels)
        if self.form == "log":
            return super().forward(latents, timestep.log() * 100, labels)
        out = super().forward(latents, timestep, labels)
        return out + mask.clamp(min=-1.0).mean() if mask is not None else out


@pytest.mark.parametrize(("form", "t", "mode"), [
    ("table", 1, "stale"), ("table", 999, "sync"), ("table", 999, "stale"),
    ("log", 0.5, "stale"), ("mask", 500.0, "sync")])
def test_made_inputs_stay_in_the_models_domain(form, t, mode):
    """The inputs assert_equivalent makes from the given one: a table's index stays in the
    table, a sigma stays positive, a mask stays a mask; the stale steps the branch check
    means to run chunked run chunked (a timestep that turned back started a generation)."""
    torch.manual_seed(0)
    model = TimestepForms(form).eval()
    latents, _, labels = dit_inputs(model, 8)
    timestep = torch.tensor([t])
    args = (latents, timestep, labels)
    if form == "mask":
        args += (torch.zeros(1, 1, 16, 16).masked_fill(torch.ones(16, 16).triu(1).bool(),
                                                       float("-inf")),)
    report = assert_equivalent(model, args, stages=2, chunks=2, mode=mode)
    branches = [c for c in report.checks if "guidance branch" in c.name]
    assert all(c.chunks == 2 for c in branches if "step 0" not in c.name)
    assert len(branches) == (6 if mode == "stale" else 0)


def test_a_timestep_in_a_conditioning_dict_is_moved():
    from tests.compiler.test_timestep_inputs import DictDiT

    torch.manual_seed(0)
    model = DictDiT(depth=1, width=16, heads=2, grid=8).eval()
    latents, t, labels = dit_inputs(model, 8)
    report = assert_equivalent(model, (latents, {"t": t.float(), "y": labels}), stages=2,
                               chunks=2, mode="stale")
    assert report.chunked


@pytest.mark.parametrize("by_keyword", [("latents", "timestep", "labels"), ("labels",)])
def test_the_inputs_it_makes_are_passed_as_the_given_one(by_keyword):
    """Arguments given by keyword stay keywords: a call by position would be traced again
    by Dynamo (its guards check how a call passes them), with a warning to the user."""
    model, args = dit()
    names = ("latents", "timestep", "labels")
    positional = tuple(a for n, a in zip(names, args, strict=True) if n not in by_keyword)
    keywords = {n: a for n, a in zip(names, args, strict=True) if n in by_keyword}
    moved_args, moved_kwargs = other_input(model, positional, keywords)
    assert len(moved_args) == len(positional) and sorted(moved_kwargs) == sorted(keywords)
    assert not torch.equal(moved_kwargs.get("timestep", moved_args[-1] if moved_args else 0),
                           args[1])
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="tokpipe: Dynamo traced")
        assert_equivalent(model, positional, keywords, stages=2, chunks=2, mode="sync")
