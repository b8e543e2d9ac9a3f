"""The tensors a traced function read from its arguments, found again in a later call's.

Dynamo makes each tensor a call reads a placeholder of its own, named by where it came
from: `L['latents']`, and from inside an argument `L['conds']['labels']`,
`L['settings'].scale`, `L['embeds'][1]`, `L['kwargs']['cond']['w']`. A trace kept for
later calls (a ring's step) must read each of them from that call's arguments: matched by
name alone, a tensor inside a dict would keep the first call's value (or take a top-level
input's of the same key), silently.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from typing import Any

import torch

from tokpipe_compiler.core.errors import TokpipeError
from tokpipe_compiler.core.fx import is_user_input, source_name
from tokpipe_compiler.planning.returned_values import readable

_ROOT = re.compile(r"L\['(\w+)'\]")


def argument_reads(fn: Callable[..., Any], gm: torch.fx.GraphModule,
                   values: dict[str, Any]) -> tuple[tuple[int, str], ...]:
    """(placeholder index, source) of each graph input read from the arguments of the call
    `fn(**values)`: the call's own arguments and what they hold. Raises where one cannot
    be found again from its source (a dict's key that is no str or number)."""
    frame = call_frame(fn, values)
    reads = []
    for index, node in enumerate(n for n in gm.graph.nodes if n.op == "placeholder"):
        source = source_name(node)
        root = _ROOT.match(source)
        if root is not None and root[1] in frame and is_user_input(node):
            reads.append((index, source))
    for _, source in reads:
        try:
            evaluate_source(source, frame)
        except Exception as err:
            raise TokpipeError(f"the step reads {readable(source)} from inside its inputs, "
                               "where a later run could not find it again: pass that tensor as an "
                               "input of its own") from err
    return tuple(reads)


def read_arguments(reads: tuple[tuple[int, str], ...], fn: Callable[..., Any],
                   values: dict[str, Any]) -> list[tuple[int, Any]]:
    """(placeholder index, value) of each read in the call `fn(**values)`."""
    frame = call_frame(fn, values)
    found = []
    for index, source in reads:
        try:
            found.append((index, evaluate_source(source, frame)))
        except Exception as err:
            raise TokpipeError(f"the step read {readable(source)} from its inputs when it "
                               f"was traced, and this call's inputs lack it ({err!r}); pass "
                               "inputs of the same structure each call") from err
    return found


def call_frame(fn: Callable[..., Any], values: dict[str, Any]) -> dict[str, Any]:
    """The arguments of the frame `fn(**values)` runs, by parameter name, as Dynamo's
    `L[...]` names them: the keywords a `**kwargs` gathers as one dict under its name,
    defaults included; a decorated function's own frame (a `functools.wraps` wrapper's
    `*args, **kwargs`, which Dynamo traces), not the signature it shows."""
    try:
        bound = inspect.signature(fn, follow_wrapped=False).bind_partial(**values)
    except (TypeError, ValueError):  # no signature, or one the values do not fit: by name
        return dict(values)
    bound.apply_defaults()
    return dict(bound.arguments)


def evaluate_source(source: str, frame: dict[str, Any]) -> Any:
    """The value a Dynamo source names in the frame `call_frame` gives."""
    # Dynamo names a dict's entry under a key it cannot write by the key's place:
    # L['conds'][list(dict.keys(L['conds']))[1]] (the signature keeps the keys' order)
    return eval(source, {"__builtins__": _BUILTINS}, {"L": frame})


_BUILTINS = {"list": list, "dict": dict, "tuple": tuple}
