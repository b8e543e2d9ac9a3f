"""Generations, guidance branches and models never share stale state.

A pipeline run twice gives the same image twice; two calls per step (the branches of
guidance) keep their own K/V; two models of one class compiled alike keep their own
programs, freed with the model.
"""

from __future__ import annotations

import gc
import weakref

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


def test_two_models_of_one_class_stay_independent():
    a, compiled_a = compiled_dit(seed=0)
    b, compiled_b = compiled_dit(seed=1)
    inputs = dit_inputs(a, 8)
    with torch.no_grad():
        for _ in range(3):  # warmup, then stale on a repeated input: both exact
            assert_rel_close(compiled_a(*inputs), a(*inputs))
            assert_rel_close(compiled_b(*inputs), b(*inputs))
    assert tp.programs(compiled_a)[0] is not tp.programs(compiled_b)[0]


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
