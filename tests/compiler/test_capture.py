"""The one graph recorder (planning/capture.py) and argument_of on real Dynamo graphs."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from tokpipe_compiler.core.fx import argument_of, input_label, is_user_input
from tokpipe_compiler.planning.capture import capture


class Named(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, latents, timestep, extra=None):
        return self.proj(latents) * timestep + extra["scale"]


class Gathering(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, *args, **kwargs):
        return self.proj(args[0]) + args[1] * kwargs["hidden_states"]


def user_arguments(model, args=(), kwargs=None) -> dict:
    """argument_of -> placeholder name, for the call's user inputs."""
    (captured,) = capture(model, args, kwargs, fresh=True)
    placeholders = [n for n in captured.gm.graph.nodes if n.op == "placeholder"]
    assert [argument_of(n) for n in placeholders] == captured.arguments
    return {argument_of(n): n.name for n in placeholders if is_user_input(n)}


def x(*shape):
    return torch.randn(*shape)


def test_arguments_passed_by_name_or_position_are_named_by_the_parameter():
    extra = {"scale": x(4)}
    by_name = user_arguments(Named(), kwargs={"latents": x(2, 4), "timestep": x(1),
                                              "extra": extra})
    by_position = user_arguments(Named(), (x(2, 4), x(1), extra))
    assert set(by_name) == set(by_position) == {"latents", "timestep", "scale"}


def test_star_args_are_positions_and_star_kwargs_are_keywords():
    found = user_arguments(Gathering(), (x(2, 4), x(4)), {"hidden_states": x(4)})
    assert found == {0: "l_args_0_", 1: "l_args_1_", "hidden_states": "l_kwargs_hidden_states_"}


class Listing(torch.nn.Module):
    """A list parameter and a list gathered by **kwargs, as HunyuanDiT's rotary table and
    SD3's ControlNet residuals come."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, latents, rotary, cond, uncond, **kwargs):
        return (self.proj(latents) * rotary[0] + rotary[1] + sum(kwargs["residuals"])
                + cond["scale"] * uncond["scale"] + kwargs["extra"].emb
                + kwargs["adapter"](latents))


class Extra:
    """An object the call passes, holding a tensor (read as `L['kwargs']['extra'].emb`)."""

    def __init__(self, emb: torch.Tensor):
        self.emb = emb


def test_every_input_the_call_passes_has_a_label_of_its_own():
    """argument_of names a list entry by its index alone (rotary[0] and residuals[0] both
    0), a dict entry by its key alone (both 'scale'), and an entry nested deeper or an
    object's attribute not at all (a weight, to the ranks' checks). A module passed as an
    argument holds weights."""
    adapter = torch.nn.Linear(4, 4)
    (captured,) = capture(Listing(), (x(2, 4), [x(4), x(4)], {"scale": x(4)}, {"scale": x(4)}),
                          {"residuals": [x(4), x(4)], "extra": Extra(x(4)),
                           "adapter": adapter}, fresh=True)
    placeholders = [n for n in captured.gm.graph.nodes if n.op == "placeholder"]
    labels = [input_label(n) for n in placeholders]
    assert sorted(label for label in labels if label) == [
        "cond['scale']", "extra.emb", "latents", "residuals[0]", "residuals[1]", "rotary[0]",
        "rotary[1]", "uncond['scale']"]
    weights = [n for n, label in zip(placeholders, labels, strict=True) if label is None]
    assert len(weights) == 4  # proj's and the adapter's weight and bias
    assert weights == [n for n in placeholders if not is_user_input(n)]
    assert {argument_of(n) for n in placeholders if "rotary" in (input_label(n) or "")} == {0, 1}


def test_module_parameters_have_no_argument():
    (captured,) = capture(Named(), (x(2, 4), x(1), {"scale": x(4)}), fresh=True)
    params = [n for n in captured.gm.graph.nodes if n.op == "placeholder" and "proj" in n.name]
    assert len(params) == 2 and all(argument_of(n) is None for n in params)
    assert captured.arguments.count(None) == 2


def test_with_arguments_replaces_by_argument_name():
    (captured,) = capture(Gathering(), (x(2, 4), x(4)), {"hidden_states": x(4)}, fresh=True)
    new = x(4)
    args = captured.with_arguments({"hidden_states": new, 1: new})
    assert args[captured.names.index("l_kwargs_hidden_states_")] is new
    assert args[captured.names.index("l_args_1_")] is new
    assert captured.placeholder(0) == "l_args_0_" and captured.placeholder("nope") is None
    with pytest.raises(KeyError, match="nope"):
        captured.with_arguments({"nope": new})
    assert len(captured.with_arguments({"nope": new}, strict=False)) == len(captured.inputs)


def test_capture_past_dynamos_recompile_limit():
    """Dynamo stops tracing a function after its recompile limit; capture starts afresh."""
    def f(a):
        return a.sin() + 1

    limit = torch._dynamo.config.recompile_limit
    for _ in range(limit + 2):
        (captured,) = capture(f, (x(3),))
        assert captured.arguments == ["a"]


def test_capture_runs_without_grad():
    seen = []

    def f(a):
        seen.append(torch.is_grad_enabled())
        return a * 2

    capture(f, (x(3),), fresh=True)
    assert seen == [False]


def test_capture_keeps_nothing_of_what_it_traced():
    """Dynamo keeps a cache entry per traced frame for as long as the code object lives (a
    model class's forward: the process); a capture's entry must not hold its graphs, whose
    example inputs are the model's weights."""
    weights = []
    for _ in range(3):
        model = Named()
        capture(model, (x(2, 4), x(1), {"scale": x(4)}))
        weights.append(weakref.ref(model.proj.weight))
        del model
    gc.collect()
    assert all(ref() is None for ref in weights)


def test_many_captures_of_one_function_leave_the_users_compiled_code_alone():
    """A step function defined once and closing over a new model each time (a pipeline's
    ring step) is captured past Dynamo's recompile limit without resetting Dynamo: the
    user's own compiled function is not compiled again, and no captured model stays."""
    compiles = []

    def counting(gm, example_inputs):
        compiles.append(gm)
        return gm.forward

    def user(a):
        return a.cos() * 2

    compiled_user = torch.compile(user, backend=counting, dynamic=False)
    compiled_user(x(3))

    def step_over(model):
        def step(a):
            return model(a) + 1
        return step

    weights = []
    for _ in range(torch._dynamo.config.recompile_limit + 2):
        model = torch.nn.Linear(3, 3)
        (captured,) = capture(step_over(model), (x(3),))
        assert captured.arguments.count(None) == 2  # the weight and bias
        weights.append(weakref.ref(model.weight))
        del model, captured
    compiled_user(x(3))
    assert len(compiles) == 1
    gc.collect()
    assert all(ref() is None for ref in weights)


def test_captures_leave_no_finalizers_behind():
    """Dynamo puts a finalizer on each object its guards match by identity, to drop the
    cache entry when the object dies; on objects that live on (classes, functions) they
    never run, and each kept the dropped entry's guards: about 2 MiB a parallelized
    pipeline, every time a service built one."""
    def finalizers() -> int:
        gc.collect()
        return len(weakref.finalize._registry)

    capture(Named(), (x(2, 4), x(1), {"scale": x(4)}))  # Dynamo's one-time state
    before = finalizers()
    for _ in range(4):
        capture(Named(), (x(2, 4), x(1), {"scale": x(4)}))
    assert finalizers() == before


class _ViewBuffer(torch.nn.Module):
    """A table registered as a view (SD3's position table: `from_numpy(...).unsqueeze(0)`)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("table", torch.randn(8, 4).unsqueeze(0), persistent=False)

    def forward(self, a, t):
        return a * self.table[:, : a.shape[1]] + t


def test_captures_of_views_free_their_fake_tensors():
    """A fake copy of a view (a view buffer, a step's `timesteps[k]`) holds its fake base,
    or a symbol of the trace, from C++, out of the garbage collector's sight: with the
    shape environment's list of fakes, each trace's fake tensors and mode outlived it, 5
    MB a new input size at SD3's widths. Captures at new sizes must leave none behind."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    def modes() -> int:
        gc.collect()
        return sum(isinstance(o, FakeTensorMode) for o in gc.get_objects())

    model, steps = _ViewBuffer(), torch.tensor([0.5, 0.25])
    assert model.table._is_view() and steps[0]._is_view()
    held = []
    for n in range(2, 7):
        for run in (True, False):
            captured = capture(model, (x(1, n, 4), steps[0]), fullgraph=True, run=run)
            del captured
        held.append(modes())
    assert held[-1] <= held[0], f"fake modes held after each new size: {held}"
