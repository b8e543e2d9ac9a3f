"""A pipeline's scheduler routed through ring mode, and the step's arguments and result.

`route` gives one scheduler instance a subclass whose `set_timesteps`, `step` and noising
methods call the ring's hooks; `step_arguments` reads what the pipeline passed to `step`,
and `with_sample` hands the ring's latents back in the scheduler's own output.
"""

from __future__ import annotations

import copy
import functools
import inspect
import weakref
from collections.abc import Callable
from typing import Any

import torch

Hook = Callable[..., Any]  # hook(original bound method, *args, **kwargs)


def route(scheduler: Any, owner: Any, hooks: dict[str, Hook]) -> None:
    """Route `scheduler`'s methods named in `hooks` (those it has) through the hooks of
    `owner` (once; one routed to another owner before is routed anew). A subclass, not
    instance attributes: copies of the scheduler (step tables probe copies) must run their
    own methods, and pipelines inspect the methods' signatures."""
    routed_for = getattr(type(scheduler), "_tokpipe_instance", lambda: None)()
    if getattr(type(scheduler), "_tokpipe_calls", None) is owner and routed_for is scheduler:
        return
    # Otherwise route anew, also a scheduler made from a routed one's class (diffusers'
    # `pipe.scheduler.__class__.from_config(...)`, a deepcopy): its class is the routed
    # subclass, whose hooks answer only the instance they were made for.
    # A scheduler shared by two parallelized pipelines (diffusers' from_pipe) is routed to
    # each in turn: always from its own class, so that no earlier owner's hooks stay.
    base = getattr(type(scheduler), "_tokpipe_base", type(scheduler))
    instance = weakref.ref(scheduler)

    def routed(name: str, hook: Hook) -> Callable[..., Any]:
        method = getattr(base, name)

        @functools.wraps(method)
        def call(sched: Any, *args: Any, **kwargs: Any) -> Any:
            original = method.__get__(sched)
            return hook(original, *args, **kwargs) if sched is instance() else original(
                *args, **kwargs)

        return call

    methods = {name: routed(name, hook) for name, hook in hooks.items()
               if callable(getattr(base, name, None))}
    scheduler.__class__ = type(base.__name__, (base,), {
        **methods, "_tokpipe_calls": owner, "_tokpipe_base": base, "_tokpipe_instance": instance,
        "__module__": base.__module__, "__doc__": base.__doc__})


def step_arguments(original: Callable[..., Any], args: tuple, kwargs: dict) -> tuple:
    """(model_output, timestep, sample) as the pipeline passed them to `step`."""
    bound = inspect.signature(original).bind(*args, **kwargs).arguments
    return bound["model_output"], bound["timestep"], bound["sample"]


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
