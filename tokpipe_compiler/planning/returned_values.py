"""What a function returns, from a call on fake tensors: how many values, and which of
them are its inputs returned unchanged.

Dynamo leaves out of a graph's outputs those that are its inputs, returned unchanged
(`return x_next, latents`): the graph returns fewer values than the function does, and
its outputs no longer line up with the function's. A call under FakeTensorMode runs the
function's Python and shapes without computing anything.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from tokpipe_compiler.core.errors import TokpipeError


def returned_inputs(fn: Callable[..., Any], kwargs: dict[str, Any]) -> list[str | None] | None:
    """Per value `fn(**kwargs)` returns (a tuple's or list's, else the one), the name of
    the input it is, unchanged, or None where it is computed; None where `fn` cannot run on
    fake tensors (a Python number read off a tensor, say). A dict returned raises."""
    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode, torch.no_grad():
            fakes = {name: mode.from_tensor(value) if isinstance(value, torch.Tensor) else value
                     for name, value in kwargs.items()}
            returned = fn(**fakes)
    except Exception:
        return None
    if isinstance(returned, dict):  # its values would be taken in no order carry names
        raise TokpipeError(f"the step function returns a dict (keys {list(returned)}); "
                           "return a tuple of the values, in carry order")
    values = list(returned) if isinstance(returned, tuple | list) else [returned]
    names = {id(value): name for name, value in fakes.items() if isinstance(value, torch.Tensor)}
    return [names.get(id(value)) if isinstance(value, torch.Tensor) else None
            for value in values]
