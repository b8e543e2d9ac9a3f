"""Generations, guidance branches and models never share stale state.

A pipeline run twice gives the same image twice; two calls per step (the branches of
guidance) keep their own K/V; two models of one class compiled alike keep their own
programs, freed with the model.
"""

from __future__ import annotations

import functools
import gc
import warnings
import weakref

import pytest
import torch

import tokpipe_compiler as tp
from tests.fixtures.models import TinyDiT, dit_inputs
from tests.fixtures.tracing import assert_rel_close

OPTIONS = {"stages": 2, "chunks": 4, "mode": "stale", "warmup_steps": 1, "compiler": "eager"}


def denoise(step, latents: torch.Tensor, labels: torch.Tensor, steps: int = 4) -> torch.Tensor:
    """A toy sampler: a falling timestep per step, as every diffusers pipeline calls it."""
    for t in torch.linspace(900, 100, steps):
        latents = latents - 0.1 * step(latents, t.round().long()[None], labels)[:, :4]
    return latents


def compiled_dit(seed: int = 0, **options) -> tuple[TinyDiT, torch.nn.Module]:
    torch.manual_seed(seed)
    model = TinyDiT(depth=2, width=32, heads=2, grid=8).eval()
    return model, torch.compile(model, backend="tokpipe", options={**OPTIONS, **options},
                                dynamic=False)


def test_two_generations_in_a_row_give_the_same_result():
    _, compiled = compiled_dit()
    latents, _, labels = dit_inputs(TinyDiT(grid=8), 8)
    with torch.no_grad():
        first = denoise(compiled, latents, labels)
        second = denoise(compiled, latents, labels)  # no tp.reset: the timestep went back up
    assert torch.equal(first, second)


def test_warmup_counts_steps_not_calls():
    """With two calls per step, warmup_steps=1 still makes only the first step exact."""
    model, compiled = compiled_dit()
    latents, t, labels = dit_inputs(model, 8)
    with torch.no_grad():
        for branch in (labels, labels + 1):  # step 0: both branches exact
            assert_rel_close(compiled(latents, t, branch), model(latents, t, branch))
        program = tp.programs(compiled)[0]
        compiled(latents + 0.1, t - 1, labels)  # step 1 runs chunked
        assert program.clock.step == 1 and set(program.branches) == {0, 1}


def test_each_guidance_branch_has_its_own_caches():
    """cond and uncond as two calls per step equal two programs, one per branch."""
    model, both = compiled_dit()
    _, cond_only = compiled_dit()
    _, uncond_only = compiled_dit()
    latents, _, labels = dit_inputs(model, 8)
    null = torch.full_like(labels, 9)
    with torch.no_grad():
        for k, t in enumerate(torch.linspace(900, 100, 4).round().long()):
            x = latents + 0.05 * k
            cond, uncond = both(x, t[None], labels), both(x, t[None], null)
            assert torch.equal(cond, cond_only(x, t[None], labels))
            assert torch.equal(uncond, uncond_only(x, t[None], null))


def _takes_args(forward):
    """A forward seen through (*args, **kwargs), as diffusers wraps SD3's and Flux's."""
    @functools.wraps(forward)
    def wrapper(self, *args, **kwargs):
        return forward(self, *args, **kwargs)

    return wrapper


class ArgsDiT(TinyDiT):
    forward = _takes_args(TinyDiT.forward)


class LevelArgsDiT(TinyDiT):
    """Its timestep parameter has a name tokpipe does not look for."""

    @_takes_args
    def forward(self, latents, level, labels):
        return TinyDiT.forward(self, latents, level, labels)


@pytest.mark.parametrize(("model_class", "option"), [
    (ArgsDiT, None), (LevelArgsDiT, None), (LevelArgsDiT, 1)])
def test_a_timestep_passed_by_position_to_a_forward_of_args(model_class, option):
    """Dynamo names the arguments of `wrapper(self, *args, **kwargs)` by position, and the
    two branches of a step read each other's K/V (SD3 5.4e-3 from eager where keywords gave
    5.7e-4). They are named by the forward's own parameters now: the timestep is found by
    its name, and a position (timestep_input=1) names the argument there, where its name
    is none tokpipe looks for (without it, a warning says so)."""
    torch.manual_seed(0)
    model = model_class(depth=2, width=32, heads=2, grid=8).eval()
    latents, _, labels = dit_inputs(model, 8)
    null = torch.full_like(labels, 9)
    step = "timestep" if model_class is ArgsDiT else "level"
    keywords = torch.compile(model, backend="tokpipe", dynamic=False,
                             options={**OPTIONS, "timestep_input": step})
    given = {} if option is None else {"timestep_input": option}
    positions = torch.compile(model, backend="tokpipe", options={**OPTIONS, **given},
                              dynamic=False)
    with torch.no_grad():
        expected = denoise(lambda x, t, y: keywords(latents=x, **{step: t}, labels=y) +
                           keywords(latents=x, **{step: t}, labels=null), latents, labels)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            got = denoise(lambda x, t, y: positions(x, t, y) + positions(x, t, null), latents,
                          labels)
    missing = [str(w.message) for w in said if "found no timestep" in str(w.message)]
    if model_class is LevelArgsDiT and option is None:
        assert "inputs ['latents', 'level', 'labels']" in missing[0], missing
        assert not torch.equal(got, expected)  # the branches shared their K/V
    else:
        assert missing == []
        assert torch.equal(got, expected)


def test_two_models_of_one_class_stay_independent():
    a, compiled_a = compiled_dit(seed=0)
    b, compiled_b = compiled_dit(seed=1)
    inputs = dit_inputs(a, 8)
    with torch.no_grad():
        for _ in range(3):  # warmup, then stale on a repeated input: both exact
            assert_rel_close(compiled_a(*inputs), a(*inputs))
            assert_rel_close(compiled_b(*inputs), b(*inputs))
    assert tp.programs(compiled_a)[0] is not tp.programs(compiled_b)[0]


def test_one_model_compiled_twice_lists_and_resets_each_compiles_own_programs():
    """One model compiled with two option sets (a comparison of chunk counts, say): each
    compiled model lists its own program, first made first, and resetting one leaves the
    other's generation alone. Dynamo serves a compile with options equal to an earlier
    compile's from that compile's graph (here those of the tests before): the programs are
    found all the same."""
    model, two = compiled_dit(chunks=2)
    four = torch.compile(model, backend="tokpipe", options={**OPTIONS, "chunks": 4},
                         dynamic=False)
    inputs = dit_inputs(model, 8)
    with torch.no_grad():
        for compiled in (two, four):
            compiled(*inputs)
    (of_two,), (of_four,) = tp.programs(two), tp.programs(four)
    assert (len(of_two.plan.chunks), len(of_four.plan.chunks)) == (2, 4)
    tp.reset(four)
    assert of_four.clock.step == -1 and of_two.clock.step == 0
    assert tp.programs(model) == [of_two, of_four]


def test_a_compile_without_options_lists_and_resets_only_its_own_programs():
    """torch.compile without options (or with mode "default") hands the backend nothing
    that tells it apart: its programs are still its own, none before its first call."""
    model, two = compiled_dit(chunks=2)
    inputs = dit_inputs(model, 8)
    with torch.no_grad():
        two(*inputs)
    (of_two,) = tp.programs(two)
    for plain in (torch.compile(model, backend="tokpipe", dynamic=False),
                  torch.compile(model, backend="tokpipe", mode="default", dynamic=False)):
        assert tp.programs(plain) == []
        tp.reset(plain)
        assert of_two.clock.step == 0
    # a model not yet called, compiled as another was (a session shared, or found by
    # equal options): none of the other model's programs
    fresh = TinyDiT(depth=2, width=32, heads=2, grid=8).eval()
    assert tp.programs(torch.compile(fresh, backend="tokpipe", dynamic=False,
                                     options={**OPTIONS, "chunks": 2})) == []


def test_a_function_compiled_again_with_equal_options_finds_its_programs():
    """Dynamo runs the second compile on the first one's graph (equal options): the second
    compiled function still lists the program it ran."""
    model = TinyDiT(depth=2, width=32, heads=2, grid=8).eval()
    inputs = dit_inputs(model, 8)
    found = []
    for _ in range(2):
        step = torch.compile(lambda *a: model(*a), backend="tokpipe", options=dict(OPTIONS),
                             dynamic=False)
        with torch.no_grad():
            step(*inputs)
        found.append(tp.programs(step))
    assert found[0] and found[0] == found[1]


def test_programs_are_freed_with_their_model():
    refs = []
    for seed in range(3):
        model, compiled = compiled_dit(seed=seed)
        with torch.no_grad():
            compiled(*dit_inputs(model, 8))
        refs.append(weakref.ref(tp.programs(compiled)[0]))
        del model, compiled
    gc.collect()
    assert all(ref() is None for ref in refs)


def test_a_module_compiled_in_place_can_be_reset_and_listed():
    torch.manual_seed(0)
    model = TinyDiT(depth=2, width=32, heads=2, grid=8).eval()
    model.compile(backend="tokpipe", options=OPTIONS, dynamic=False)
    inputs = dit_inputs(model, 8)
    with torch.no_grad():
        model(*inputs)
        (program,) = tp.programs(model)
        assert program.clock.step == 0
        model(*inputs)
        tp.reset(model)
        assert program.clock.step == -1 and not program.branches


def test_a_branch_first_seen_after_warmup_warms_up_its_own_caches():
    """A second branch that appears at step 2 runs its first call whole (exact), not
    chunked against caches it never filled."""
    model, compiled = compiled_dit()
    latents, t, labels = dit_inputs(model, 8)
    with torch.no_grad():
        compiled(latents, t, labels)
        compiled(latents, t - 1, labels)  # step 1, chunked
        late = compiled(latents, t - 1, labels + 1)  # step 1, a new branch
        assert_rel_close(late, model(latents, t - 1, labels + 1))


def test_a_schedules_timesteps_are_copied_to_the_host_once():
    """Timesteps passed as pipelines pass them (t.expand(batch) of the scheduler's
    timesteps) are read from one host copy for the whole generation, and run the same
    steps as fresh timestep tensors do."""
    _, viewed = compiled_dit()
    _, fresh = compiled_dit()
    latents, _, labels = dit_inputs(TinyDiT(grid=8), 8)
    schedule = torch.linspace(900, 100, 4).round().long()
    with torch.no_grad():
        for t in schedule:
            batch = t.expand(latents.shape[0])
            out = viewed(latents, batch, labels)
            assert torch.equal(out, fresh(latents, batch.clone(), labels))
    clocks = [tp.programs(compiled)[0].clock for compiled in (viewed, fresh)]
    assert [c.step for c in clocks] == [3, 3]
    assert [c.timesteps.copies for c in clocks] == [1, 0]


class Flagged(torch.nn.Module):
    """A model whose call Dynamo traces as two graphs of the same input shapes (it guards
    on the Python flag), as a step cache's hooks trace each guidance branch apart."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x, t, y, doubled: bool):
        out = self.model(x, t, y)
        return out * 2 if doubled else out


def _branch_steps(compiled, latents, labels, flags) -> dict[bool, list[torch.Tensor]]:
    outputs: dict[bool, list[torch.Tensor]] = {flag: [] for flag in flags}
    with torch.no_grad():
        for t in torch.linspace(900, 100, 4):
            for flag in flags:
                outputs[flag].append(compiled(latents, t.round().long()[None], labels, flag))
    return outputs


def test_graphs_of_the_same_shapes_alternating_each_keep_their_generation():
    """Each graph's program keeps its caches and steps while the other runs (they reset
    each other at every call: every step ran whole, as warmup, and nothing was pipelined);
    each computes what it computes alone."""
    torch.manual_seed(0)
    model = Flagged(TinyDiT(depth=2, width=32, heads=2, grid=8).eval())
    latents, _, labels = dit_inputs(model.model, 8)

    def compiled():
        return torch.compile(model, backend="tokpipe", options=OPTIONS, dynamic=False)

    both = _branch_steps(compiled(), latents, labels, (True, False))
    for flag in (True, False):
        alone = _branch_steps(compiled(), latents, labels, (flag,))[flag]
        eager = [model(latents, t, labels, flag) for t in
                 torch.linspace(900, 100, 4).round().long()[:, None]]
        for step, (got, expected) in enumerate(zip(both[flag], alone, strict=True)):
            assert torch.equal(got, expected)
            if step >= 1:  # past warmup: chunked, stale, not the eager answer
                assert not torch.allclose(got, eager[step], rtol=1e-6, atol=0)


class OptionalText(torch.nn.Module):
    """Guidance as two calls a step whose unconditional call passes an optional input as
    None (or a shorter text): two graphs with other inputs, the same token input."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x, t, y, text=None):
        out = self.model(x, t, y)
        return out if text is None else out + text.mean(1, keepdim=True)[..., None]


def test_calls_of_a_step_with_other_inputs_each_keep_their_generation():
    """The unconditional call's graph (no text, or a shorter one) took the role over from
    the conditional one's at every call, each reset the other: every call ran whole, as a
    first step, and nothing was pipelined, silently. Programs of one token input shape now
    keep their generations side by side, and each computes what it computes alone."""
    torch.manual_seed(0)
    model = OptionalText(TinyDiT(depth=2, width=32, heads=2, grid=8).eval())
    latents, _, labels = dit_inputs(model.model, 8)
    texts = (torch.randn(1, 4, 1), None, torch.randn(1, 2, 1))

    def compiled():
        return torch.compile(model, backend="tokpipe", options=OPTIONS, dynamic=False)

    together = compiled()
    both = _branch_steps(together, latents, labels, texts)
    assert [p.last_chunk_count for p in tp.programs(together)] == [4, 4, 4]
    for text in texts:
        alone = _branch_steps(compiled(), latents, labels, (text,))[text]
        for got, expected in zip(both[text], alone, strict=True):
            assert torch.equal(got, expected)


def test_a_graph_of_the_same_shapes_left_behind_lets_its_caches_go():
    """A graph Dynamo made again for a new Python value (here the flag; a guidance scale
    passed as a float is another) of the same shapes: the old one's program, no longer
    called, frees its K/V within a few calls, as one of other shapes does at once."""
    torch.manual_seed(0)
    model = Flagged(TinyDiT(depth=2, width=32, heads=2, grid=8).eval())
    latents, _, labels = dit_inputs(model.model, 8)
    compiled = torch.compile(model, backend="tokpipe", options=OPTIONS, dynamic=False)
    _branch_steps(compiled, latents, labels, (True,))
    (first,) = tp.programs(compiled)
    assert first.branches
    with torch.no_grad():
        for t in torch.linspace(900, 100, 6):
            compiled(latents, t.round().long()[None], labels, False)
    assert not first.branches


def test_a_program_shows_its_plans_first_line():
    """tp.programs() listed `<PipelinedProgram object at 0x...>`, hiding the chunks that
    chunks="auto" chose for each input shape."""
    model, compiled = compiled_dit(chunks="auto")
    with torch.no_grad():
        compiled(*dit_inputs(model, 8))
    shown = repr(tp.programs(compiled)[0])
    assert shown.startswith("<PipelinedProgram: tokpipe plan: 2 stage(s) x ") and \
        "chunk(s), mode=stale" in shown
