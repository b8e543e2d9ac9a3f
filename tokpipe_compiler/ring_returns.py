"""A Ring step's return matched to its carried names: which graph output feeds each carried
input at the next step, or that the step returns the input unchanged; a return that
cannot feed `carry` raises, naming what the step returns (`planning.returned_values`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from tokpipe_compiler.core.errors import TokpipeError
from tokpipe_compiler.core.fx import example_value
from tokpipe_compiler.core.warn import warn
from tokpipe_compiler.planning.argument_reads import call_frame, evaluate_source
from tokpipe_compiler.planning.capture import Captured
from tokpipe_compiler.planning.returned_values import Kind, Returned, readable

ONE_PER_CARRY = ("A ring feeds each returned tensor back as the carried input of its place "
                 "and returns those: return a tuple of tensors, one per name in carry, in "
                 "carry order (a multistep solver's history too), or a dict of them by name; "
                 "to look at the latents after each step, pass each_step= to run")

Feeds = list[int | None]  # per carried name: the graph output feeding it, None: unchanged


def check_returns(traced: Captured, carry: Sequence[str], step_fn: Callable[..., Any],
                  values: dict[str, Any]) -> Feeds | None:
    """The feeds of `carry` from the traced step's return (None where Dynamo did not say
    what it returns); raises where the return cannot feed `carry`: by place (or key), each
    carried value in the shape it came in (the stages are planned for that shape)."""
    if traced.returned is None:
        warn("tokpipe: Dynamo did not say what the step function returns (this torch "
             f"{torch.__version__} keeps it otherwise than tokpipe reads it), so each "
             "tensor the step computes feeds the carried name of its place in the traced "
             "graph's outputs: return one computed tensor per name in carry, in carry "
             "order, or check the ring against the eager loop")
        return None
    frame = call_frame(step_fn, values)

    def is_input(value: Returned, name: str) -> bool:  # the very object passed as `name`
        try:
            return evaluate_source(value.source, frame) is values.get(name)
        except Exception:  # a source this cannot evaluate: not shown to be that input
            return False

    feeds = feeds_of(traced.returned, carry, is_input)
    outputs = next(n for n in traced.gm.graph.nodes if n.op == "output").args[0]
    for name, feed in zip(carry, feeds, strict=True):
        given, made = values.get(name), None if feed is None else example_value(outputs[feed])
        if isinstance(given, torch.Tensor) and isinstance(made, torch.Tensor) and \
                tuple(given.shape) != tuple(made.shape):
            raise TokpipeError(f"carried input {name!r} is passed in shape "
                               f"{tuple(given.shape)} but the step returns it in shape "
                               f"{tuple(made.shape)}: a ring feeds each step's value to the "
                               "next in place, chunk by chunk, so a carried value keeps its "
                               "shape (change resolution between rings, not inside one)")
    return feeds


def feeds_of(returned: tuple[Returned, ...], carry: Sequence[str],
             is_input: Callable[[Returned, str], bool]) -> Feeds:
    """For each carried name, the graph output its next value is, or None where the step
    returns that very input unchanged (`is_input`); raises where the return does not match
    `carry`. A dict returned is matched by key, anything else by place."""
    feeds: Feeds = []
    for name, value in zip(carry, _carried_returns(returned, carry), strict=True):
        if value.kind == Kind.INPUT and not is_input(value, name):
            shown = readable(value.source)
            raise TokpipeError(f"the step function returns its input {shown!r} unchanged "
                               f"as the next {name!r}: a ring carries each value chunk by "
                               f"chunk from the step that computes it; return "
                               f"{shown}.clone() there")
        feeds.append(None if value.kind == Kind.INPUT else value.output)
    if feeds[0] is None:
        raise TokpipeError(f"the step function returns {carry[0]!r}, the token input a ring "
                           "chunks (carry's first name), unchanged: a ring needs a step that "
                           "computes its next value")
    return feeds


def _carried_returns(returned: tuple[Returned, ...], carry: Sequence[str]) -> list[Returned]:
    """The returned tensor of each carried name, in carry order."""
    said = ", ".join(r.describe() for r in returned)
    tensors = [r for r in returned if r.is_tensor]
    if any(r.kind == Kind.CONTAINER for r in returned):
        raise TokpipeError(f"the step function returns {said}: a ring takes tensors at the "
                           f"top of the return only. {ONE_PER_CARRY}")
    if returned and returned[0].key is not None:  # a dict
        if {r.key for r in tensors} != set(carry):
            raise TokpipeError(f"the step function returns a dict of {said}; carry names "
                               f"{list(carry)}: return a tensor under each carried name and "
                               f"no other tensors (the ring returns the carried ones)")
        return [next(r for r in tensors if r.key == name) for name in carry]
    if len(tensors) != len(carry):
        raise TokpipeError(f"the step function returns {len(tensors)} tensor(s) ({said}); "
                           f"carry names {len(carry)}: {list(carry)}. {ONE_PER_CARRY}")
    return tensors
