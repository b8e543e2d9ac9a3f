"""Ranks whose model holds other parameter values (initialised at random without one seed
per process, another checkpoint, a weight changed on one rank only) each ran their stages
with their own and returned one mixed model's output, silently; now every rank raises at the
generation's first call, naming the first parameter that differs
(`stage_programs/weight_values.py`)."""

from __future__ import annotations

import pytest
import torch

import tokpipe_compiler as tp
from tests.fixtures.models import TinyDiT, dit_inputs
from tokpipe_compiler.runtime.launch import launch

pytestmark = [pytest.mark.slow, pytest.mark.ranks]

OPTIONS = {"chunks": 2, "mode": "sync", "compiler": "eager", "timeout": 20.0}


def generations(rank: int, world: int, how: str) -> list[str]:
    """Two generations of a TinyDiT compiled directly; rank 1's weights differ from the
    start ("init"), from the second generation (written in place: "later"; through
    `.data`; "reordered", the same values in other rows), or never ("alike"). Each
    generation's outcome on this rank."""
    torch.set_num_threads(1)
    torch.manual_seed(rank if how == "init" else 0)
    model = TinyDiT(depth=world, width=32, heads=2, grid=8).eval()
    latents, t, labels = dit_inputs(model, 8)
    compiled = torch.compile(model, backend="tokpipe", dynamic=False,
                             options={**OPTIONS, "stages": world})
    outcomes = []
    for generation in range(2):
        if generation == 1 and rank == 1:
            weight = model.blocks[1].mlp[0].weight
            if how == "later":
                with torch.no_grad():
                    weight.mul_(1.001)
            elif how == "through .data":  # as peft fuses a LoRA: no version counter moves
                weight.data.add_(1e-3)
            elif how == "reordered":
                weight.data.copy_(weight.data.flip(0))
        try:
            with torch.no_grad():
                out, eager = compiled(latents, t, labels), model(latents, t, labels)
            close = (out - eager).abs().max() <= 1e-5 * eager.abs().max()
            outcomes.append("same as eager" if close else "differs from eager")
        except tp.TokpipeError as err:
            outcomes.append(str(err))
        tp.reset(compiled)
    return outcomes


@pytest.mark.parametrize(("how", "generation", "named"), [
    ("init", 0, "embed.weight"), ("later", 1, "blocks.1.mlp.0.weight"),
    ("through .data", 1, "blocks.1.mlp.0.weight"), ("reordered", 1, "blocks.1.mlp.0.weight")])
def test_ranks_with_other_weights_raise_naming_the_first_that_differs(how, generation, named):
    for outcomes in launch(generations, 2, timeout=120, args=(how,)):
        assert outcomes[:generation] == ["same as eager"] * generation, outcomes
        assert outcomes[generation].startswith(
            f"the ranks hold other values in the model's parameters, {named!r} the first "
            "of them"), outcomes


def test_ranks_with_the_same_weights_run_on():
    for outcomes in launch(generations, 2, timeout=120, args=("alike",)):
        assert outcomes == ["same as eager"] * 2, outcomes


def models_called_in_another_order(rank: int, world: int) -> str:
    """Two models of one architecture, seeded alike on every rank (0 and 1), compiled; rank
    1 calls the second first: the error of the first call."""
    torch.set_num_threads(1)
    models = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        models.append(TinyDiT(depth=world, width=32, heads=2, grid=8).eval())
    compiled = [torch.compile(m, backend="tokpipe", dynamic=False,
                              options={**OPTIONS, "stages": world}) for m in models]
    first = compiled[rank]
    try:
        with torch.no_grad():
            first(*dit_inputs(models[0], 8))
    except tp.TokpipeError as err:
        return str(err)
    return "no error"


def test_ranks_calling_other_models_are_told_so():
    """Their weights are alike on every rank: the error sent users to their checkpoints and
    seeds only."""
    for error in launch(models_called_in_another_order, 2, timeout=120):
        assert error.startswith("the ranks hold other values in the model's parameters"), error
        assert error.endswith("the ranks called different models of one architecture: call "
                              "the pipelined models (or pipelines) in the same order on every "
                              "rank."), error


def test_a_digest_of_many_parameters_names_none():
    """Past NAMED_UP_TO parameters the ranks compare one digest of them all: it names no
    parameter (it named the first one, whichever differed)."""
    from tokpipe_compiler.stage_programs.weight_values import (
        NAMED_UP_TO,
        WeightValues,
        first_differing,
    )

    many = NAMED_UP_TO + 1
    weights = {f"p{i}": torch.nn.Parameter(torch.full((2,), float(i))) for i in range(many)}
    mine = WeightValues().digest(weights)
    weights[f"p{many - 1}"].data.add_(1.0)
    theirs = WeightValues().digest(weights)
    assert mine != theirs and first_differing([mine, theirs], many) is None
    few = dict(list(weights.items())[:3])
    alike, other = WeightValues().digest(few), None
    few["p1"].data.mul_(2.0)
    other = WeightValues().digest(few)
    assert first_differing([alike, other], 3) == 1
