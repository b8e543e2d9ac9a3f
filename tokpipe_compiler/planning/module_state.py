"""What a ring's trace of a transformer depends on besides its inputs: which tensors are its
weights, its module tree, and its modules' plain attributes.

A ring traces the transformer once and keeps the graph: its weights are the very tensors
the module held then, specialized to their dtypes and shapes. Values written in place
(`load_state_dict`) reach the graph; other changes do not: a conversion (`.to(dtype)`
keeps the tensors, in another dtype), a parameter assigned anew, a LoRA adapter added,
removed or fused, an attention processor swapped or its settings changed, an adapter's
scale set. Dynamo
guards on these for a compiled call; the ring compares the transformer's `ModuleState`
before each generation and traces anew when it changed.
"""

from __future__ import annotations

import enum
import types
from dataclasses import dataclass, field
from typing import Any

import torch

# nn.Module's own bookkeeping that a forward call does not read (parameters, buffers and
# submodules are compared by name and identity instead; forward hooks are read as any
# attribute), and what parallelizing routes (the compiled call, the generation's end).
_INTERNALS = frozenset({
    "_parameters", "_buffers", "_modules", "_non_persistent_buffers_set",
    "_backward_pre_hooks", "_backward_hooks", "_is_full_backward_hook",
    "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks", "_compiled_call_impl", "_reset_stateful_cache",
})
_HOOKS = "_diffusers_hook"
_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device,
          enum.Enum)
_DEPTH, _WIDTH = 3, 64  # how far containers are read by value; deeper or larger: by identity
# Objects read by identity only (a module's own state is walked as a module).
_OPAQUE = (torch.Tensor, torch.nn.Module, type, types.FunctionType, types.MethodType,
           types.BuiltinFunctionType, types.ModuleType)


@dataclass(eq=False)
class ModuleState:
    """`key` changes when anything a trace of the module reads may have changed, other
    than tensor values changed in place; `held` keeps the objects `key` names by address
    alive, so that no other object takes an address while the state is kept."""

    key: tuple
    held: list = field(repr=False)
    weights: int = 0  # the part of `key` that names the tensors: equal when only other
    # state changed (an attention processor swapped, a setting)
    processors: dict[str, str] = field(default_factory=dict, repr=False)  # their classes,
    # by attention module, for a message

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ModuleState) and other.key == self.key

    __hash__ = None  # type: ignore[assignment]


def module_state(module: torch.nn.Module) -> ModuleState:
    """The state of `module` and its submodules: two calls with nothing changed in between
    are equal."""
    held: list = []
    # Each module's part as a hash: a few hundred small tuples kept instead of tens of
    # thousands (the collector walks what is kept). The hashed values are ints, strings,
    # types and dtypes: equal parts hash equal; a collision of unequal ones is 2**-64.
    parts = [(name, m, _tensors(m, held))
             for name, m in module.named_modules(remove_duplicate=False)]
    key = tuple((name, hash((type(m), tensors, _attributes(m, held))))
                for name, m, tensors in parts)
    weights = hash(tuple((name, tensors) for name, _, tensors in parts))
    processors = {name: type(p).__name__ for name, m, _ in parts
                  if (p := m.__dict__.get("processor", m._modules.get("processor"))) is not None}
    return ModuleState(key, held, weights, processors)


def changed_parts(before: ModuleState, after: ModuleState, most: int = 3) -> str:
    """The modules whose state differs, for a message: up to `most` names, and a count of
    the others."""
    names_before = {entry[0]: entry for entry in before.key}
    names_after = {entry[0]: entry for entry in after.key}
    differ = [name or "the root module" for name in dict.fromkeys([*names_before, *names_after])
              if names_before.get(name) != names_after.get(name)]
    others = len(differ) - most
    return ", ".join(differ[:most]) + (f" and {others} other module(s)" if others > 0 else "")


def _tensors(module: torch.nn.Module, held: list) -> tuple:
    """Its own parameters and buffers by name and identity, with what a trace specializes
    on (`.to()` converts a module's tensors in place: the same objects in another dtype)."""
    own = [(name, t) for name, t in [*module._parameters.items(), *module._buffers.items()]
           if t is not None]
    held.extend(t for _, t in own)
    return tuple((name, id(t), t.dtype, t.device, t.shape) for name, t in own)


def _attributes(module: torch.nn.Module, held: list) -> tuple:
    plain = tuple((key, _token(value, 0, held)) for key, value in sorted(vars(module).items())
                  if key not in _INTERNALS and key != _HOOKS)
    return (*plain, _hooks(module))


def _hooks(module: torch.nn.Module) -> tuple:
    """diffusers' hook registry by the names of its hooks, none where it has none: a
    pipeline's first call creates it empty (a hook added also wraps the module's forward,
    which is read by identity)."""
    return (_HOOKS, tuple(getattr(getattr(module, _HOOKS, None), "_hook_order", ())))


def _token(value: Any, depth: int, held: list) -> Any:
    """The value itself where it is plain; containers item by item and other objects'
    attributes (an attention processor's) by value, to a depth; anything else (a tensor
    attribute, a function) by identity."""
    if isinstance(value, (float, complex)):
        return (type(value), repr(value))  # nan equals itself
    if isinstance(value, _PLAIN):
        return (type(value), value)
    if depth < _DEPTH and isinstance(value, (tuple, list, set, frozenset)) \
            and len(value) <= _WIDTH:
        items = sorted(value, key=repr) if isinstance(value, (set, frozenset)) else value
        return (type(value), tuple(_token(v, depth + 1, held) for v in items))
    if depth < _DEPTH and isinstance(value, dict) and len(value) <= _WIDTH:
        return (dict, tuple((_token(k, depth + 1, held), _token(v, depth + 1, held))
                            for k, v in value.items()))
    held.append(value)
    if depth < _DEPTH and _has_plain_state(value):  # an attention processor's own settings
        # by value where its attributes are all its state: a processor made anew with the
        # settings of the one traced (a swap undone with a fresh default) is the same
        same = () if _state_is_its_attributes(value) else (id(value),)
        return (type(value), *same, _token(vars(value), depth + 1, held))
    return (type(value), id(value))


def _state_is_its_attributes(value: Any) -> bool:
    """Whether an object is a processor-like callable whose `__dict__` is all its state: a
    `__call__` written in Python, no `__slots__` (`functools.partial`, say, keeps its
    function and arguments in C, out of its `__dict__`)."""
    cls = type(value)
    call = next((vars(c)["__call__"] for c in cls.__mro__ if "__call__" in vars(c)), None)
    return isinstance(call, types.FunctionType) and \
        not any("__slots__" in vars(c) for c in cls.__mro__[:-1])


def _has_plain_state(value: Any) -> bool:
    """Whether `value` is an object whose attributes a call may read and which is changed
    in place (`processor.scale = ...`, as diffusers' `set_ip_adapter_scale` does): an
    instance with a `__dict__`, not a module (walked as one), tensor, function or class."""
    return (not isinstance(value, _OPAQUE) and isinstance(getattr(value, "__dict__", None), dict)
            and len(vars(value)) <= _WIDTH)
