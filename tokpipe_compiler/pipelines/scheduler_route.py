"""A pipeline's scheduler routed through ring mode, and the step's arguments and result.

`route` sends one scheduler instance's `set_timesteps`, `step` and noising methods through
the ring's hooks; `step_arguments` reads what the pipeline passed to `step`, and
`with_sample` hands the ring's latents back in the scheduler's own output.
"""

from __future__ import annotations

import copy
import functools
import inspect
import threading
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch

Hook = Callable[..., Any]  # hook(original bound method, *args, **kwargs)


class _Route:
    """Where one scheduler instance's routed methods go, held on that instance: a copy
    (step tables probe copies, `copy.deepcopy`, a pickle) gets no route, and a shallow copy
    shares this one, which answers only the instance it was made for."""

    def __init__(self, instance: Any, owner: Any, hooks: dict[str, Hook]):
        self.instance = weakref.ref(instance)
        self.owner = owner
        self.hooks = hooks
        self._local = threading.local()  # the hooks running on this thread

    def running(self) -> set[str]:
        if not hasattr(self._local, "names"):
            self._local.names = set()
        return self._local.names

    def __deepcopy__(self, memo: dict) -> None:
        return None

    def __reduce__(self) -> tuple:
        return _no_route, ()


def _no_route() -> None:
    return None


_ROUTE = "_tokpipe_route"
_DISPATCHER = "_tokpipe_dispatcher"


def route(scheduler: Any, owner: Any, hooks: dict[str, Hook]) -> None:
    """Route `scheduler`'s methods named in `hooks` (those it has as plain methods) through
    the hooks of `owner`, replacing an earlier owner's. Its class keeps its identity
    (pipelines test `type(scheduler) != FlowMatchEulerDiscreteScheduler`, as Bria's does):
    the class's methods dispatch by instance, every other instance (a copy, one
    `from_config` made) running its own method, and keep their signatures, which pipelines
    inspect."""
    names = {name: hook for name, hook in hooks.items()
             if _dispatch_from(type(scheduler), name)}
    vars(scheduler)[_ROUTE] = _Route(scheduler, owner, names)


def _route_of(sched: Any) -> _Route | None:
    """The route made for `sched` itself (not one a shallow copy shares)."""
    entry = vars(sched).get(_ROUTE) if hasattr(sched, "__dict__") else None
    return entry if isinstance(entry, _Route) and entry.instance() is sched else None


def _dispatch_from(cls: type, name: str) -> bool:
    """Makes `cls.name` call the hook of the instance's route, where it has one (once per
    class; a method it inherits dispatches already where the base's does). False where
    `name` is no plain method of `cls` (a static or class method is left as it is)."""
    if not isinstance(inspect.getattr_static(cls, name, None), types.FunctionType):
        return False
    method = getattr(cls, name)
    if getattr(method, _DISPATCHER, False):
        return True

    @functools.wraps(method)
    def call(sched: Any, *args: Any, **kwargs: Any) -> Any:
        original = method.__get__(sched)
        entry = _route_of(sched)
        hook = None if entry is None or name in entry.running() else entry.hooks.get(name)
        if hook is None:  # not routed, or within its own hook (a subclass's super().step)
            return original(*args, **kwargs)
        entry.running().add(name)
        try:
            return hook(original, *args, **kwargs)
        finally:
            entry.running().discard(name)

    setattr(call, _DISPATCHER, True)
    setattr(cls, name, call)
    return True


def step_arguments(original: Callable[..., Any], args: tuple, kwargs: dict) -> tuple:
    """(model_output, timestep, sample) as the pipeline passed them to `step`."""
    bound = step_signature(original).bind(*args, **kwargs).arguments
    return bound["model_output"], bound["timestep"], bound["sample"]


def step_signature(original: Callable[..., Any]) -> inspect.Signature:
    """The signature of a bound `step` that names its arguments: its own, or, where it
    takes `*args, **kwargs` (a subclass's step passing them on to `super().step`), the
    first of its class's bases' that names `model_output`."""
    signature = inspect.signature(original)
    owner = getattr(original, "__self__", None)
    if "model_output" in signature.parameters or owner is None:
        return signature
    for cls in type(owner).__mro__:
        step = vars(cls).get("step")
        if isinstance(step, types.FunctionType):
            named = inspect.signature(step)
            if "model_output" in named.parameters:
                return named.replace(parameters=list(named.parameters.values())[1:])
    return signature


# What a pipeline hands `step` besides the step's values: none changes the update.
_PASSED_THROUGH = ("model_output", "timestep", "sample", "return_dict", "generator")


def step_option_reasons(original: Callable[..., Any], args: tuple, kwargs: dict) -> list[str]:
    """Why the ring cannot replay these `step` calls: an option set to other than its
    default (DDIM's eta=0.5, which draws noise; Euler's s_churn), where the ring's step
    table was read off the scheduler's step with its defaults."""
    signature = step_signature(original)
    defaults = {name: p.default for name, p in signature.parameters.items()
                if p.default is not inspect.Parameter.empty and name not in _PASSED_THROUGH}
    changed = [f"{name}={_shown(value)}"
               for name, value in signature.bind(*args, **kwargs).arguments.items()
               if name in defaults and not _same_value(value, defaults[name])]
    if not changed:
        return []
    owner = getattr(original, "__self__", None)
    name = type(owner).__name__ if owner is not None else "the scheduler"
    return [f"{name}.step is called with {', '.join(changed)} (not its default), and ring "
            "mode replays the step with its defaults"]


def _same_value(value: Any, default: Any) -> bool:
    if isinstance(value, torch.Tensor) or isinstance(default, torch.Tensor):
        return value is default
    try:
        return bool(value == default)
    except Exception:  # a value that does not compare: take it for changed
        return False


def _shown(value: Any) -> str:
    return f"a {tuple(value.shape)} tensor" if isinstance(value, torch.Tensor) else repr(value)


def with_sample(output: Any, sample: torch.Tensor) -> Any:
    """The scheduler's step output with `sample` as its previous sample, in the dtype the
    scheduler's own step returns (flow-matching steps cast to the prediction's: CogView4
    and HunyuanVideo keep float32 latents and get bfloat16 ones back; the ring's carried
    float32 latents are rounded once, at the end)."""
    sample = sample.to(prev_sample(output).dtype)
    if isinstance(output, tuple):
        return (sample, *output[1:])
    output = copy.copy(output)
    output.prev_sample = sample
    return output


def prev_sample(output: Any) -> torch.Tensor:
    """The latents a scheduler's step output holds (a tuple's first, or `prev_sample`)."""
    return output[0] if isinstance(output, tuple) else output.prev_sample
