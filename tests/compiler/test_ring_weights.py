"""A Ring follows its step function's modules between runs: where a weight was assigned
anew, another module put in the place the step reads, or a module changed other than in
place, the next run warns and traces anew, and computes what the step computes eagerly
(sync mode, within 1e-5 relative, float32). Values written in place reach the ring without
a new trace; nothing changed: nothing is traced again."""

from __future__ import annotations

import functools
import gc
import warnings
import weakref

import pytest
import torch

import tokpipe_compiler as tp
from tests.fixtures.models import TinyDiT, dit_inputs

OPTIONS = {"stages": 2, "chunks": 2, "mode": "sync", "compiler": "eager"}
STEPS = 2
TRACED_ANEW = "weights changed since it was traced"


class Holder:
    """A user's object that holds the model (as a pipeline holds its transformer)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model


def _model(seed: int) -> TinyDiT:
    torch.manual_seed(seed)
    return TinyDiT(depth=2, width=32, heads=2, grid=8).eval()


def _step(model: torch.nn.Module, latents, timestep, labels):
    return (latents - 0.1 * model(latents, timestep[None], labels),)


class Stepper(torch.nn.Module):
    """A step as a module's method: the weights come from `self`."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def step(self, latents, timestep, labels):
        return _step(self.model, latents, timestep, labels)


def _forms() -> dict:
    """Step functions reaching the model through a global-like holder, a closure, a bound
    method and a partial's keyword; each returns (step, a function that gives the model)."""
    holder = Holder(_model(0))
    closed = _model(0)
    stepper = Stepper(_model(0))
    return {
        "holder": (lambda latents, timestep, labels:
                   _step(holder.model, latents, timestep, labels),
                   lambda: holder.model, lambda m: setattr(holder, "model", m)),
        "closure": (lambda latents, timestep, labels:
                    _step(closed, latents, timestep, labels), lambda: closed, None),
        "method": (stepper.step, lambda: stepper.model, lambda m: setattr(stepper, "model", m)),
        "partial": (functools.partial(_step_with, model=closed), lambda: closed, None),
    }


def _step_with(latents, timestep, labels, model):
    return _step(model, latents, timestep, labels)


def _inputs():
    latents, _, labels = dit_inputs(_model(0), 8)
    return {"latents": latents, "labels": labels}, {"timestep": torch.tensor([900, 500])}


def _eager(step, inputs: dict, per_step: dict) -> torch.Tensor:
    x = inputs["latents"]
    with torch.no_grad():
        for k in range(STEPS):
            (x,) = step(x, per_step["timestep"][k], inputs["labels"])
    return x


def _run(ring: tp.Ring, inputs: dict, per_step: dict) -> tuple[torch.Tensor, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        (out,) = ring.run(inputs, per_step=per_step)
    return out, [str(w.message) for w in caught if "tokpipe" in str(w.message)]


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _assign_weight(model: torch.nn.Module) -> None:
    layer = model.out
    layer.weight = torch.nn.Parameter(layer.weight.detach() * 3.0)


@pytest.mark.parametrize("form", ["holder", "closure", "method", "partial"])
def test_a_weight_assigned_anew_is_traced_again(form):
    step, model_of, _ = _forms()[form]
    inputs, per_step = _inputs()
    ring = tp.Ring(step, carry=["latents"], **OPTIONS)
    before, said = _run(ring, inputs, per_step)
    assert not said
    _assign_weight(model_of())
    after, said = _run(ring, inputs, per_step)
    assert len(said) == 1 and TRACED_ANEW in said[0] and "out" in said[0]
    expected = _eager(step, inputs, per_step)
    assert _relative(after, expected) <= 1e-5
    assert _relative(before, expected) > 1e-3  # the change matters


@pytest.mark.parametrize("form, named", [("holder", "holder.model is another object"),
                                         ("method", "self changed in model, model.embed")])
def test_another_module_in_the_place_the_step_reads_is_traced_again(form, named):
    step, _, put = _forms()[form]
    inputs, per_step = _inputs()
    ring = tp.Ring(step, carry=["latents"], **OPTIONS)
    _run(ring, inputs, per_step)
    put(_model(1))
    after, said = _run(ring, inputs, per_step)
    assert len(said) == 1 and named in said[0]
    assert _relative(after, _eager(step, inputs, per_step)) <= 1e-5


def test_values_written_in_place_reach_the_ring_without_a_new_trace():
    step, model_of, _ = _forms()["holder"]
    inputs, per_step = _inputs()
    ring = tp.Ring(step, carry=["latents"], **OPTIONS)
    _run(ring, inputs, per_step)
    program = ring.program
    with torch.no_grad():
        model_of().out.weight.mul_(2.0)
    after, said = _run(ring, inputs, per_step)
    assert not said and ring.program is program
    assert _relative(after, _eager(step, inputs, per_step)) <= 1e-5


def test_nothing_changed_nothing_traced_again():
    step, _, _ = _forms()["closure"]
    inputs, per_step = _inputs()
    ring = tp.Ring(step, carry=["latents"], **OPTIONS)
    first, _ = _run(ring, inputs, per_step)
    program = ring.program
    second, said = _run(ring, inputs, per_step)
    assert not said and ring.program is program and torch.equal(first, second)


def test_a_ring_told_not_to_follow_its_modules_keeps_its_trace():
    """`parallelize` follows the transformer itself and makes new rings on a change."""
    step, model_of, _ = _forms()["holder"]
    inputs, per_step = _inputs()
    ring = tp.Ring(step, carry=["latents"], follow_modules=False, **OPTIONS)
    _run(ring, inputs, per_step)
    program = ring.program
    _assign_weight(model_of())
    _, said = _run(ring, inputs, per_step)
    assert not said and ring.program is program


def test_a_step_that_raises_raises_its_own_error():
    """A model that fails on these inputs (diffusers' SD3 PAG with its default processors
    swapped in: a tuple unpacked into too many names) raised "Dynamo broke it: Observed
    exception", the model's error two links down the chain."""
    model = _model(0)

    def step(latents, timestep, labels):
        batch, _channels = model(latents, timestep[None], labels).shape[:3]  # three values
        return (latents * batch,)

    inputs, per_step = _inputs()
    ring = tp.Ring(step, carry=["latents"], **OPTIONS)
    with pytest.raises(ValueError, match=r"too many values to unpack \(expected 2"):
        ring.run(inputs, per_step=per_step)


def test_a_step_with_a_name_it_lacks_raises_pythons_name_error():
    """Dynamo reported "failed to find name in frame builtins", without the name."""
    model = _model(0)

    def step(latents, timestep, labels):
        return (undefined_helper(model(latents, timestep[None], labels)),)  # noqa: F821

    inputs, per_step = _inputs()
    ring = tp.Ring(step, carry=["latents"], **OPTIONS)
    with pytest.raises(NameError, match="undefined_helper"):
        ring.run(inputs, per_step=per_step)


def test_a_step_with_a_graph_break_says_what_and_where():
    model = _model(0)

    def step(latents, timestep, labels):
        torch._dynamo.graph_break()
        return (model(latents, timestep[None], labels),)

    inputs, per_step = _inputs()
    ring = tp.Ring(step, carry=["latents"], **OPTIONS)
    with pytest.raises(tp.TokpipeError, match=r"one graph; Dynamo broke it: .*test_ring_weights"):
        ring.run(inputs, per_step=per_step)


def test_a_ring_keeps_no_tensor_a_run_was_given():
    """Each trace kept its first run's inputs: a server's ring per size held the first
    request's prompt embeddings and latents for good."""
    model = _model(0)

    def step(latents, timestep, labels):
        return (latents - 0.1 * model(latents, timestep[None], labels),)

    ring = tp.Ring(step, carry=["latents"], **OPTIONS)
    inputs, per_step = _inputs()
    first = ring.run(inputs, per_step=per_step)[0]
    given = [weakref.ref(t) for t in (*inputs.values(), *per_step.values())]
    del inputs, per_step
    gc.collect()
    assert all(ref() is None for ref in given)
    inputs, per_step = _inputs()
    assert torch.equal(ring.run(inputs, per_step=per_step)[0], first)


def test_a_step_dynamo_cannot_trace_leaves_the_callers_inputs_as_they_were():
    """The step runs once eagerly to raise its own error: on copies, since it may write
    its inputs (here before a data-dependent branch, which Dynamo breaks at)."""
    model = _model(0)

    def step(latents, timestep, labels):
        latents.mul_(0.5)
        out = model(latents, timestep[None], labels)
        if out.sum() > 0:  # data-dependent: Dynamo breaks here
            out = -out
        return (latents - 0.1 * out,)

    inputs, per_step = _inputs()
    before = inputs["latents"].clone()
    with pytest.raises(tp.TokpipeError, match="Dynamo broke it"):
        tp.Ring(step, carry=["latents"], **OPTIONS).run(inputs, per_step=per_step)
    assert torch.equal(inputs["latents"], before)


def test_a_ring_keeps_the_programs_of_its_latest_input_signatures(monkeypatch):
    """A server drawing at many sizes kept every size's trace and programs (about 3 MB a
    block each at released widths): the ring keeps those of the signatures used last and
    traces an older one again when it returns, with the same numbers."""
    from tokpipe_compiler import ring as ring_module

    monkeypatch.setattr(ring_module, "KEPT_SIGNATURES", 2)
    step, _, _ = _forms()["closure"]
    inputs, per_step = _inputs()

    def batch(b: int) -> dict:
        return {name: value.repeat(b, *[1] * (value.dim() - 1))
                for name, value in inputs.items()}

    ring = tp.Ring(step, carry=["latents"], **OPTIONS)
    _run(ring, batch(1), per_step)
    first = weakref.ref(ring.program)
    for b in (2, 1, 3):  # batch 1 used again before batch 3: batch 2's is the oldest
        _run(ring, batch(b), per_step)
    gc.collect()
    assert len(ring.programs()) == 2 and first() is not None
    out, _ = _run(ring, batch(2), per_step)  # traced again, batch 1's dropped
    gc.collect()
    assert len(ring.programs()) == 2 and first() is None
    assert _relative(out, _eager(step, batch(2), per_step)) <= 1e-5


def test_a_dropped_signature_frees_its_fake_tensors(monkeypatch):
    """Each trace's fake tensors (Dynamo's FakeTensorMode and about 50 fake copies) outlived
    the ring's dropping it where a per-step input is a view (`timesteps[k]`): its fake copy
    holds a symbol of the trace from C++, out of the garbage collector's sight
    (`planning.capture`). Past the kept signatures, their number stays."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tokpipe_compiler import ring as ring_module

    monkeypatch.setattr(ring_module, "KEPT_SIGNATURES", 2)
    step, _, _ = _forms()["closure"]
    inputs, per_step = _inputs()

    def modes() -> int:
        gc.collect()
        return sum(isinstance(o, FakeTensorMode) for o in gc.get_objects())

    ring = tp.Ring(step, carry=["latents"], **OPTIONS)
    held = []
    for b in range(1, 7):
        _run(ring, {name: value.repeat(b, *[1] * (value.dim() - 1))
                    for name, value in inputs.items()}, per_step)
        held.append(modes())
    assert per_step["timestep"][0]._is_view()
    assert held[-1] == held[2], f"fake modes held after each new signature: {held}"


class _Settings:
    def __init__(self, guidance: float):
        self.guidance = guidance


def test_a_settings_object_changed_between_runs_is_traced_again():
    """A step reading `settings.guidance` of an object it is passed holds the value as a
    constant: changed between runs, the ring kept the first run's (0.27 relative off)."""
    model = _model(0)

    def step(latents, timestep, labels, settings):
        return (latents - settings.guidance * model(latents, timestep[None], labels),)

    inputs, per_step = _inputs()
    settings = _Settings(0.1)
    ring = tp.Ring(step, carry=["latents"], **OPTIONS)
    _run(ring, {**inputs, "settings": settings}, per_step)
    settings.guidance = 0.5
    out, _ = _run(ring, {**inputs, "settings": settings}, per_step)
    x = inputs["latents"]
    with torch.no_grad():
        for t in per_step["timestep"]:
            (x,) = step(x, t, inputs["labels"], settings)
    assert _relative(out, x) <= 1e-5
