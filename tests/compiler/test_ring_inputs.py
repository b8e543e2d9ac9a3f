"""A Ring reads each run's tensors from inside its inputs: a dict's, a list's, an object's
attributes, keywords a `**kwargs` gathers. Its kept trace read them as constants, so a
second run with other values of the same shapes computed with the first run's, silently
(0.18 relative from eager). Each run equals the eager loop (sync, float32, 1e-5)."""

from __future__ import annotations

import enum
import functools

import pytest
import torch

import tokpipe_compiler as tp
from tests.fixtures.models import TinyDiT, dit_inputs

OPTIONS = {"stages": 2, "chunks": 2, "mode": "sync", "compiler": "eager"}
TIMESTEPS = torch.tensor([900, 500])


class Settings:
    def __init__(self, weight: torch.Tensor):
        self.weight = weight


def _model() -> TinyDiT:
    torch.manual_seed(0)
    return TinyDiT(depth=2, width=32, heads=2, grid=8).eval()


def _forms(model: torch.nn.Module) -> dict:
    """name -> (step, the inputs of a run with label set `y` and weight `w`)."""
    def update(latents, timestep, labels, weight):
        return (latents - 0.1 * weight * model(latents, timestep[None], labels),)

    def in_dict(latents, timestep, conds):
        return update(latents, timestep, conds["labels"], conds["weight"])

    def in_list(latents, timestep, conds):
        return update(latents, timestep, conds[0], conds[1])

    def in_object(latents, timestep, labels, settings):
        return update(latents, timestep, labels, settings.weight)

    def in_kwargs(latents, timestep, **kwargs):
        return update(latents, timestep, kwargs["conds"]["labels"], kwargs["weight"])

    @functools.wraps(in_dict)
    def decorated(*args, **kwargs):  # Dynamo traces this frame, not in_dict's
        return in_dict(*args, **kwargs)

    defaults = {"labels": None, "weight": None}

    def by_default(latents, timestep, labels, conds=defaults):
        return update(latents, timestep, conds["labels"], conds["weight"])

    def by_place(latents, timestep, conds):
        return update(latents, timestep, conds[Key.LABELS], conds[Key.WEIGHT])

    def given_defaults(y, w):  # the default dict's entries, and a top-level input beside
        defaults.update(labels=y, weight=w)
        return {"labels": 1 - y}

    return {
        "dict": (in_dict, lambda y, w: {"conds": {"labels": y, "weight": w}}),
        # a top-level input named like the dict's key must not stand in for it
        "dict beside a same-named input": (
            lambda latents, timestep, conds, labels: in_dict(latents, timestep, conds),
            lambda y, w: {"conds": {"labels": y, "weight": w}, "labels": 1 - y}),
        "list": (in_list, lambda y, w: {"conds": [y, w]}),
        "object": (in_object, lambda y, w: {"labels": y, "settings": Settings(w)}),
        "kwargs": (in_kwargs, lambda y, w: {"conds": {"labels": y}, "weight": w}),
        "decorated": (decorated, lambda y, w: {"conds": {"labels": y, "weight": w}}),
        "a default's": (by_default, given_defaults),
        # keys Dynamo names by their place in the dict
        "enum keys": (by_place, lambda y, w: {"conds": {Key.WEIGHT: w, Key.LABELS: y}}),
    }


class Key(enum.Enum):
    LABELS = 1
    WEIGHT = 2


def _eager(step, inputs: dict) -> torch.Tensor:
    values = dict(inputs)
    with torch.no_grad():
        for t in TIMESTEPS:
            (values["latents"],) = step(**values, timestep=t)
    return values["latents"]


@pytest.mark.parametrize("form", list(_forms(torch.nn.Identity())))
def test_tensors_inside_inputs_are_read_anew_each_run(form):
    """A decorated step read nothing anew (its wrapper's frame is traced), a default
    dict's entry took a top-level input of its key's name, and keys Dynamo names by
    place failed every run."""
    model = _model()
    step, inputs_of = _forms(model)[form]
    latents, _, labels = dit_inputs(model, 8)
    ring = tp.Ring(step, carry=["latents"], **OPTIONS)
    for y, w in ((labels, 1.0), ((labels + 1) % 10, 3.0)):  # same shapes, other values
        inputs = {"latents": latents, **inputs_of(y, torch.tensor(w))}
        (out,) = ring.run(inputs, per_step={"timestep": TIMESTEPS})
        expected = _eager(step, inputs)
        assert ((out - expected).norm() / expected.norm()).item() <= 1e-5, form
    assert len(ring.programs()) == 1  # read anew, not traced anew


def test_a_trace_keeps_no_tensor_of_its_first_inputs():
    """The tensors read from inside inputs are kept as meta stand-ins, like the inputs."""
    model = _model()
    step, inputs_of = _forms(model)["dict"]
    latents, _, labels = dit_inputs(model, 8)
    ring = tp.Ring(step, carry=["latents"], **OPTIONS)
    ring.run({"latents": latents, **inputs_of(labels, torch.tensor(2.0))},
             per_step={"timestep": TIMESTEPS})
    traced = next(iter(ring._traces.values()))
    read = {index for index, _ in traced.reads}
    assert len(read) == 4  # latents, timestep, conds['labels'], conds['weight']
    assert all(traced.inputs[i].device.type == "meta" for i in read)


def test_one_tensor_passed_under_two_names_is_traced_apart_from_two():
    """Dynamo reads a tensor passed twice as one input: a later run passing two tensors
    would have used the first for both."""
    model = _model()
    latents, _, labels = dit_inputs(model, 8)

    def step(latents, timestep, labels, a, b):
        return (latents - 0.1 * model(latents * a + b, timestep[None], labels),)

    ring = tp.Ring(step, carry=["latents"], **OPTIONS)
    scale = torch.rand_like(latents)
    for a, b in ((scale, scale), (scale, 0.5 * scale)):
        inputs = {"latents": latents, "labels": labels, "a": a, "b": b}
        (out,) = ring.run(inputs, per_step={"timestep": TIMESTEPS})
        expected = _eager(step, inputs)
        assert ((out - expected).norm() / expected.norm()).item() <= 1e-5
    assert len(ring.programs()) == 2


@pytest.mark.parametrize(("carry", "says"), [
    (["latents", "prev"], "carried inputs 'latents' and 'prev' are one tensor"),
    (["latents"], "the carried input and input 'latents' and 'prev' are one tensor"),
])
def test_a_carried_input_passed_as_another_input_too_is_refused(carry, says):
    """Traced as one input, the other would have followed the carried one step by step."""
    model = _model()
    latents, _, labels = dit_inputs(model, 8)

    def step(latents, prev, timestep, labels):
        x = latents - 0.1 * model(latents, timestep[None], labels) + 0.01 * prev
        return (x, latents.clone())[: len(carry)]

    with pytest.raises(tp.TokpipeError, match=f"{says}; pass a copy as 'prev'"):
        tp.Ring(step, carry=carry, **OPTIONS).run(
            {"latents": latents, "prev": latents, "labels": labels},
            per_step={"timestep": TIMESTEPS})
