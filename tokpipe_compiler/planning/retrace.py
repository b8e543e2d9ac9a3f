"""Graphs Dynamo traces again for one function, model and input shapes: a guard on a value
that changed since (a Python number or an int attribute the forward reads, grad mode, a
global). Each such graph is planned and compiled anew and starts its K/V caches afresh, and
past Dynamo's recompile limit the function runs eagerly, unpipelined; the backend says so,
once per function and kind of guard, with Dynamo's reason where it gives one.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

# Per session: (function, input shapes, model) -> the graphs Dynamo traced for it.
_SEEN: weakref.WeakKeyDictionary[Any, dict[tuple, int]] = weakref.WeakKeyDictionary()


def traced_again(session: Any, frame: tuple[Any, int | None] | None, example_inputs: list,
                 owner: int | None) -> tuple[str, str] | None:
    """Counts the graph Dynamo traces now; where Dynamo takes it for a recompilation and
    it is not the first of its function and module (`frame`: the code and the id of its
    `self`, None where unknown), model (the weight at `owner`) and input shapes in
    `session`: the warning's once-per-function key and its text."""
    if frame is None or any(part in frame[0].co_filename for part in _EXPECTED):
        return None
    code = frame[0]
    seen = _SEEN.setdefault(session, {})
    _forget_if_reset(seen, code)
    owner_id = None if owner is None else id(example_inputs[owner])
    key = (code, frame[1], _shapes(example_inputs), owner_id)
    count = seen[key] = seen.get(key, 0) + 1
    reason = recompile_reason()  # None after torch._dynamo.reset(): no cached graph to miss
    if count < 2 or reason is None:
        return None
    where = f"{code.co_name} ({code.co_filename}:{code.co_firstlineno})"
    # once per function and cause: another cause later (inference tensors after a grad
    # mode switch) says its own advice
    return f"traced again: {where}: {_cause(reason)}", (
        f"tokpipe: Dynamo traced {where} again for the same model and input shapes (graph "
        f"{count} of it; the guard that failed: {reason}): tokpipe plans and compiles each "
        "such graph anew and starts its K/V caches afresh, and past "
        "torch._dynamo.config.recompile_limit graphs Dynamo runs the function eagerly, "
        f"unpipelined. {_advice(reason)} TORCH_LOGS=recompiles gives every reason")


def _forget_if_reset(seen: dict[tuple, int], code: Any) -> None:
    """Forget `code`'s graphs where Dynamo holds fewer than were counted: its caches were
    reset since (`torch.compiler.reset()`), and the graphs it traces now are first ones."""
    try:
        cached = len(torch._C._dynamo.eval_frame._debug_get_cache_entry_list(code))
    except Exception:  # a Dynamo internal: without it, a reset may read as a retrace
        return
    counted = [key for key in seen if key[0] is code]
    if cached < sum(seen[key] for key in counted):
        for key in counted:
            del seen[key]


# Functions whose graphs per state are documented: diffusers' step caches and hooks (a
# graph per guidance branch and cache state, README "Several graphs of the same shapes").
_EXPECTED = ("/diffusers/hooks/",)


_ADVICE = {
    "dispatch keys": (
        "An input made outside torch.inference_mode() (the first latents, drawn before the "
        "loop) and the same input made inside it (the next step's) differ to Dynamo: make "
        "the inputs under the mode the model runs in (draw the latents inside "
        "torch.inference_mode()), or run the loop under torch.no_grad(), and call the "
        "model under one grad mode."),
    "grad mode": ("Call the model under one grad mode (torch.no_grad() or "
                  "torch.inference_mode(), not one and then the other)."),
    "training": "Keep the model in one mode (.eval()) between calls.",
    "a value": ("Where the guard is on a value of the model's own that changes between "
                "calls (a Python number, an int attribute of a module), pass it as a tensor."),
}


def _cause(reason: str) -> str:
    """The kind of guard that failed (a key of _ADVICE)."""
    if "dispatch key" in reason:
        return "dispatch keys"
    if "grad_mode" in reason or "GLOBAL_STATE" in reason:
        return "grad mode"
    return "training" if "training" in reason else "a value"


def _advice(reason: str) -> str:
    """What to do about the guard that failed."""
    return _ADVICE[_cause(reason)]


def recompile_reason() -> str | None:
    """The guard that failed, as Dynamo recorded it for the graph it traces now (an
    internal: None where this torch lacks it)."""
    try:
        from torch._dynamo.utils import get_metrics_context

        reason = get_metrics_context()._metrics.get("recompile_reason")
    except Exception:  # a Dynamo internal: without it, TORCH_LOGS tells
        return None
    if not isinstance(reason, str) or reason.startswith("Unable"):
        return None
    return reason.split(": ", 1)[-1].split("#")[0].strip() or None


def _shapes(example_inputs: list) -> tuple:
    return tuple((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else type(x)
                 for x in example_inputs)
