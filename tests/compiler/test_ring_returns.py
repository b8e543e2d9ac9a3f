"""A Ring maps what its step returns onto `carry` value by value, inputs returned unchanged
included. Dynamo's graph outputs only the tensors the graph computes, once each: a step
returning its `history` unchanged was refused with a count that named the wrong fix, and
one returning an input where another name is carried could be fed the wrong value. Each
runs as the eager loop does (sync, float32, 1e-5), or is refused naming what it returns."""

from __future__ import annotations

import collections
import dataclasses
import inspect

import pytest
import torch

import tokpipe_compiler as tp
from tests.fixtures.models import TinyDiT, dit_inputs

OPTIONS = {"stages": 2, "chunks": 2, "mode": "sync", "compiler": "eager"}
TIMESTEPS = torch.tensor([900, 500, 300])


def _model() -> TinyDiT:
    torch.manual_seed(0)
    return TinyDiT(depth=2, width=32, heads=2, grid=8).eval()


MODEL = _model()


def _eps(latents, timestep, labels):
    return MODEL(latents, timestep[None], labels)


def history_passed_through(latents, history, timestep, labels):
    return latents - 0.1 * _eps(latents, timestep, labels) + 0.01 * history, history


def previous_as_a_copy(latents, prev, timestep, labels):
    return latents - 0.1 * _eps(latents, timestep, labels) + 0.01 * prev, latents.clone()


def one_value_twice(latents, prev, timestep, labels):
    x = latents - 0.1 * _eps(latents, timestep, labels) + 0.01 * prev
    return x, x


def diagnostics_beside(latents, timestep, labels):
    return latents - 0.1 * _eps(latents, timestep, labels), None, 3.0


Carried = collections.namedtuple("Carried", ["latents", "prev"])


def a_named_tuple(latents, prev, timestep, labels):
    """Dynamo does not say what a named tuple holds: read by the graph's outputs."""
    return Carried(latents - 0.1 * _eps(latents, timestep, labels) + 0.01 * prev, 0.5 * prev)


def history_through_other_kwargs(latents, timestep, **extra):
    """An input passed through a `**kwargs` of another name, unchanged."""
    x = latents - 0.1 * _eps(latents, timestep, extra["labels"]) + 0.01 * extra["history"]
    return x, extra["history"]


def a_dict_by_name(latents, prev, timestep, labels):
    x = latents - 0.1 * _eps(latents, timestep, labels) + 0.01 * prev
    return {"prev": latents.clone(), "latents": x, "note": "not a tensor"}


def _inputs(step) -> dict:
    latents, _, labels = dit_inputs(MODEL, 8)
    given = {"latents": latents, "labels": labels, "history": latents * 0.5,
             "prev": latents * 0.3}
    parameters = inspect.signature(step).parameters.values()
    if any(p.kind == p.VAR_KEYWORD for p in parameters):
        return given
    return {k: v for k, v in given.items() if k in {p.name for p in parameters}}


def _eager(step, inputs: dict, carry: list[str]) -> dict:
    values = dict(inputs)
    with torch.no_grad():
        for t in TIMESTEPS:
            returned = step(**values, timestep=t)
            if isinstance(returned, dict):
                returned = [returned[name] for name in carry]
            tensors = [r for r in returned if isinstance(r, torch.Tensor)]
            values.update(zip(carry, tensors, strict=True))
    return values


@pytest.mark.parametrize(("step", "carry"), [
    (history_passed_through, ["latents", "history"]),
    (previous_as_a_copy, ["latents", "prev"]),
    (one_value_twice, ["latents", "prev"]),
    (diagnostics_beside, ["latents"]),
    (a_dict_by_name, ["latents", "prev"]),
    (a_named_tuple, ["latents", "prev"]),
    (history_through_other_kwargs, ["latents", "history"]),
])
def test_each_carried_value_is_what_the_step_returns_in_its_place(step, carry):
    inputs = _inputs(step)
    ring = tp.Ring(step, carry=carry, **OPTIONS)
    returned = ring.run(inputs, per_step={"timestep": TIMESTEPS})
    expected = _eager(step, inputs, carry)
    assert len(returned) == len(carry)
    for name, value in zip(carry, returned, strict=True):
        error = ((value - expected[name]).norm() / expected[name].norm()).item()
        assert error <= 1e-5, (name, error)


def test_an_input_returned_unchanged_comes_back_as_it_went_in():
    inputs = _inputs(history_passed_through)
    _, history = tp.Ring(history_passed_through, carry=["latents", "history"],
                         **OPTIONS).run(inputs, per_step={"timestep": TIMESTEPS})
    assert torch.equal(history, inputs["history"])


def previous_unchanged(latents, prev, timestep, labels):
    return latents - 0.1 * _eps(latents, timestep, labels) + 0.01 * prev, latents


def an_input_beside(latents, timestep, labels):
    return latents - 0.1 * _eps(latents, timestep, labels), latents


def a_dict_without_a_carried_name(latents, timestep, labels):
    return {"x": latents - 0.1 * _eps(latents, timestep, labels)}


def a_nested_tuple(latents, timestep, labels):
    return (latents - 0.1 * _eps(latents, timestep, labels),), 1


def a_tensor_diagnostic(latents, timestep, labels):
    eps = _eps(latents, timestep, labels)
    return latents - 0.1 * eps, eps.norm()


@dataclasses.dataclass
class Out:
    latents: torch.Tensor
    prev: torch.Tensor


def an_object(latents, prev, timestep, labels):
    """Its tensors came out in the graph's order (prev first), silently."""
    p = 0.5 * prev
    return Out(latents - 0.1 * _eps(latents, timestep, labels) + p, p)


def upsampled_named(latents, prev, timestep, labels):
    x = latents - 0.1 * _eps(latents, timestep, labels)
    return Carried(torch.nn.functional.interpolate(x, scale_factor=2), prev * 0.5)


def upsampled(latents, timestep, labels):
    x = latents - 0.1 * _eps(latents, timestep, labels)
    return torch.nn.functional.interpolate(x, scale_factor=2)


def cropped(latents, timestep, labels):
    return (latents - 0.1 * _eps(latents, timestep, labels))[:, :, :4]


def the_token_input_unchanged(latents, prev, timestep, labels):
    return latents, prev + _eps(latents, timestep, labels)


@pytest.mark.parametrize(("step", "carry", "says"), [
    (previous_unchanged, ["latents", "prev"],
     r"returns its input 'latents' unchanged as the next 'prev'.*return latents\.clone\(\)"),
    (an_input_beside, ["latents"],
     r"returns 2 tensor\(s\) \(a tensor it computes, its input 'latents' unchanged\); "
     r"carry names 1: \['latents'\]"),
    (a_dict_without_a_carried_name, ["latents"],
     r"returns a dict of 'x': a tensor it computes; carry names \['latents'\]"),
    (a_nested_tuple, ["latents"], r"returns a tuple holding tensors, a int: a ring takes "
                                  r"tensors at the top of the return only"),
    (a_tensor_diagnostic, ["latents"],
     r"returns 2 tensor\(s\).*pass each_step= to run"),
    (upsampled, ["latents"], r"'latents' is passed in shape \(1, 4, 8, 8\) but the step "
                             r"returns it in shape \(1, 4, 16, 16\)"),
    (cropped, ["latents"], r"returns it in shape \(1, 4, 4, 8\)"),
    (an_object, ["latents", "prev"], r"returns 0 tensor\(s\) \(a Out\); carry names 2"),
    (upsampled_named, ["latents", "prev"], r"returns it in shape \(1, 4, 16, 16\)"),
    (the_token_input_unchanged, ["latents", "prev"],
     r"returns 'latents', the token input a ring chunks .*, unchanged"),
])
@pytest.mark.parametrize("mode", ["sync", "stale"])
def test_returns_that_do_not_match_carry_are_named(step, carry, says, mode):
    """In both modes alike, before planning (stale planning refused a diagnostic's norm
    as unchunkable and advised fallback=True, which a ring refuses)."""
    with pytest.raises(tp.TokpipeError, match=says):
        tp.Ring(step, carry=carry, **{**OPTIONS, "mode": mode}).run(
            _inputs(step), per_step={"timestep": TIMESTEPS})


def test_a_return_dynamo_does_not_describe_is_read_by_place_with_a_warning(monkeypatch):
    """Another torch may keep Dynamo's return value otherwise: the ring says it reads the
    graph's outputs by place instead, which a step that computes each carried value in
    carry order still runs right."""
    from tokpipe_compiler.planning import capture

    monkeypatch.setattr(capture, "returned_values", lambda gm: None)
    step, carry = previous_as_a_copy, ["latents", "prev"]
    inputs = _inputs(step)
    with pytest.warns(UserWarning, match="Dynamo did not say what the step function returns"):
        returned = tp.Ring(step, carry=carry, **OPTIONS).run(
            inputs, per_step={"timestep": TIMESTEPS})
    expected = _eager(step, inputs, carry)
    for name, value in zip(carry, returned, strict=True):
        assert ((value - expected[name]).norm() / expected[name].norm()).item() <= 1e-5
