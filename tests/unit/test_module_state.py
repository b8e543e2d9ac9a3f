"""module_state: equal while nothing a trace reads changed; different after a change that
does not write a tensor in place."""

from __future__ import annotations

import torch

from tokpipe_compiler.planning.module_state import changed_parts, module_state


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.scaling = {"style": 1.0}
        self.processor = object()
        self.settable = Processor()
        self.eps = float("nan")  # equal to itself in the state
        self.register_buffer("table", torch.zeros(3))


def _model() -> torch.nn.Sequential:
    return torch.nn.Sequential(Block(), Block())


def test_nothing_changed_or_written_in_place_is_the_same_state():
    model = _model()
    state = module_state(model)
    assert module_state(model) == state
    with torch.no_grad():
        model[0].proj.weight.mul_(2)
        model[1].table.add_(1)
    model[0].load_state_dict(model[1].state_dict())  # copies into the same tensors
    assert module_state(model) == state


def _assign(model):
    model[1].proj.weight = torch.nn.Parameter(torch.ones(4, 4))


def _buffer(model):
    model[0].table = torch.ones(3)


def _scale(model):
    model[0].scaling["style"] = 0.3


def _processor(model):
    model[1].processor = object()


class Processor:
    """An attention processor with a setting of its own (as IP-Adapter's `scale`)."""

    def __init__(self):
        self.scale = 1.0


def _processor_setting(model):
    model[0].settable.scale = 0.3


def _module(model):
    model[0].proj = torch.nn.Linear(4, 4)


def _convert(model):
    model[1].to(torch.float64)  # the same tensors, converted in place


def _hook(model):
    model[0].proj.register_forward_hook(lambda module, args, out: out * 2)


def _train(model):
    model.train(not model.training)


def test_each_change_changes_the_state_and_is_named():
    for change, where in [(_assign, "1.proj"), (_buffer, "0"), (_scale, "0"),
                          (_processor, "1"), (_processor_setting, "0"), (_module, "0.proj"),
                          (_convert, "1"),
                          (_hook, "0.proj"), (_train, "the root module")]:
        model = _model()
        before = module_state(model)
        change(model)
        after = module_state(model)
        assert after != before, change.__name__
        assert changed_parts(before, after).startswith(where), change.__name__


def test_a_replaced_object_is_not_taken_for_its_predecessor():
    """The state holds what it names by identity: a new object cannot reuse the address."""
    model = _model()
    before = module_state(model)
    for _ in range(100):
        model[0].processor = object()
        assert module_state(model) != before


def test_many_changes_are_counted():
    model = torch.nn.Sequential(*[Block() for _ in range(6)])
    before = module_state(model)
    for block in model:
        block.scaling["style"] = 0.5
    assert changed_parts(before, module_state(model)) == "0, 1, 2 and 3 other module(s)"


def test_diffusers_hooks_count_by_name():
    """A pipeline's first call creates the transformer's hook registry empty: the same
    state as none. A hook registered is a change."""
    from diffusers.hooks import HookRegistry, ModelHook

    model = _model()
    before = module_state(model)
    registry = HookRegistry.check_if_exists_or_initialize(model)
    assert module_state(model) == before
    registry.register_hook(ModelHook(), "noop")
    assert module_state(model) != before
