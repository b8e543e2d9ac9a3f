"""A pipeline call's random state: taken before the call, and put back where the call
starts again per call (its ring unavailable after only probes ran), so it draws the same
noise."""

from __future__ import annotations

import inspect
from typing import Any

import torch


def call_generators(call: Any, pipe: Any, args: tuple, kwargs: dict) -> list[torch.Generator]:
    """The torch generators a pipeline call draws from: its `generator` argument's, named
    or gathered by `**kwargs` (a modular pipeline's `__call__(state, output, **kwargs)`)."""
    try:
        signature = inspect.signature(call)
        arguments = signature.bind(pipe, *args, **kwargs).arguments
    except TypeError:  # the pipeline's own call will say what is wrong
        return []
    given = arguments.get("generator")
    for name, parameter in signature.parameters.items():
        if given is None and parameter.kind is inspect.Parameter.VAR_KEYWORD:
            given = arguments.get(name, {}).get("generator")
    found = given if isinstance(given, (list, tuple)) else [given]
    return [g for g in found if isinstance(g, torch.Generator)]


def random_states(generators: list[torch.Generator]) -> tuple:
    """The random state a call starts from: its generators' and the global ones."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    return [g.get_state() for g in generators], torch.get_rng_state(), cuda


def restore_random_states(generators: list[torch.Generator], states: tuple) -> None:
    """Puts back the random state `random_states` took (a call started again draws the
    same noise)."""
    own, cpu, cuda = states
    for generator, state in zip(generators, own, strict=True):
        generator.set_state(state)
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
