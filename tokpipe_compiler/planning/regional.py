"""A graph of one block of a model, compiled on its own while the model runs eagerly.

diffusers' regional compilation (`transformer.compile_repeated_blocks(backend=...)`) and a
hand-written `block.compile()` in a loop over `transformer.blocks` both do this. A pipeline
is then made per block: every block's call fills and drains its own pipeline over the
ranks, and a block reads no timestep, so its program counts each of its calls as a step
(the two guidance branches of a step become two steps, each attending to the other's
stale K/V). The model, compiled whole, is what the backend pipelines.
"""

from __future__ import annotations

import os
import sys
from types import FrameType

import torch

_EVAL_FRAME = os.path.join("_dynamo", "eval_frame.py")


def repeated_block() -> str | None:
    """Called by the backend while Dynamo traces: a description of the model and block
    when the traced frame is a block of its caller, an eagerly running module: one of a
    stack of blocks (a ModuleList or Sequential of its class), or of a class the caller
    lists among its repeated blocks (diffusers' `_repeated_blocks`); None otherwise."""
    block = _traced_module()
    if block is None:
        return None
    model = _calling_module(block)
    if model is None:
        return None
    alike = sum(type(m) is type(block) for m in model.modules())
    declared = type(block).__name__ in (getattr(model, "_repeated_blocks", None) or ())
    if not declared and not _in_a_stack(block, model):
        return None  # a wrapper calling a model it holds (two experts, say): that is whole
    count = "the" if alike == 1 else f"one of the {alike}"
    return (f"{count} {type(block).__name__} block{'s' * (alike > 1)} of "
            f"{type(model).__name__}, compiled on its own while the model runs eagerly")


def _in_a_stack(block: torch.nn.Module, model: torch.nn.Module) -> bool:
    """Whether `block` is one of several of its class in a ModuleList or Sequential of
    `model`: a stack of blocks the model's forward loops over."""
    for container in model.modules():
        if isinstance(container, (torch.nn.ModuleList, torch.nn.Sequential)):
            members = list(container)
            if any(m is block for m in members) and \
                    sum(type(m) is type(block) for m in members) >= 2:
                return True
    return False


def _traced_module() -> torch.nn.Module | None:
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        module = InstructionTranslator.current_tx().f_locals.get("self")
    except Exception:  # a Dynamo internal: without it, nothing is known
        return None
    return module if isinstance(module, torch.nn.Module) else None


def _calling_module(block: torch.nn.Module) -> torch.nn.Module | None:
    """The module whose code called the compiled block: the first frame past the
    torch.compile wrapper (eval_frame.py) whose `self` is a module holding `block`."""
    frames = _outer_frames()
    entered = [i for i, f in enumerate(frames) if f.f_code.co_filename.endswith(_EVAL_FRAME)]
    if not entered:
        return None
    for frame in frames[entered[-1] + 1:]:
        caller = frame.f_locals.get("self")
        if isinstance(caller, torch.nn.Module) and caller is not block:
            return caller if any(m is block for m in caller.modules()) else None
    return None


def _outer_frames() -> list[FrameType]:
    frames, frame = [], sys._getframe(2)
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    return frames
