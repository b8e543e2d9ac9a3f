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
from collections.abc import Iterator
from dataclasses import dataclass
from types import FrameType

import torch

import tokpipe_compiler
from tokpipe_compiler import passes, runtime

_EVAL_FRAME = os.path.join("_dynamo", "eval_frame.py")
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
# this package's (the backend's frames, between Dynamo's and the traced block's caller)
_PACKAGE_DIRS = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep
                      for m in (tokpipe_compiler, passes, runtime))


_REGIONAL = ("compiled on its own while the model runs eagerly (diffusers' "
             "compile_repeated_blocks, block.compile() or blocks[i] = torch.compile(blocks[i]) "
             "in a loop): each block would fill and drain a pipeline of its own and count its "
             "calls as denoising steps. Compile the model instead: torch.compile(transformer, "
             "backend='tokpipe', ...) or tp.pipelines.parallelize(pipe)")
_SKIPPED = ("traced on its own: the model was compiled whole, but Dynamo skipped its forward "
            "at a graph break inside its loop over the blocks (a print, a branch on .item(), "
            "a torch.compiler.disable'd call, in the loop or in a block; TORCH_LOGS="
            "graph_breaks names it) and traced each block it calls")


@dataclass(frozen=True)
class BlockAlone:
    """A block of a model traced on its own: `what` names it, `skipped` where Dynamo
    skipped the model's forward (else the block was compiled on its own)."""

    what: str
    skipped: bool

    def refusal(self) -> str:
        """Why the graph is not pipelined, and what to do."""
        if not self.skipped:
            return f"tokpipe pipelines a whole model, but this graph is {self.what}, {_REGIONAL}"
        return (f"tokpipe pipelines a whole model, but this graph is {self.what}, {_SKIPPED}. "
                "In stale mode each block's pipeline must tell steps and guidance branches "
                "apart, and no graph of the model read a timestep for it to follow: a step's "
                "second branch would attend to the first's K/V as the last step's. Move what "
                "breaks the graph out of the loop (mode='sync' runs each block as a pipeline "
                "of its own, exactly)")

    def warning(self) -> str:
        """What it costs where it runs (a skipped forward whose steps are told apart)."""
        return (f"tokpipe: this graph is {self.what}, {_SKIPPED}: each block runs as a "
                "pipeline of its own, filling and draining it at every call, which costs "
                "most of what pipelining saves; move what breaks the graph out of the loop")


def repeated_block(piece: bool) -> BlockAlone | None:
    """Called by the backend while Dynamo traces: the block, when the traced frame is a
    block of its caller, an eagerly running module: one of a stack of blocks (a ModuleList
    or Sequential of its class), or of a class the caller lists among its repeated blocks
    (diffusers' `_repeated_blocks`); None otherwise. The caller runs eagerly where the
    block was compiled on its own (regional compilation), or, for a `piece` (a graph
    Dynamo traced from a frame its caller's code called), where Dynamo skipped the
    caller's forward, compiled whole (a graph break in its loop over the blocks)."""
    block = _traced_module()
    if block is None or _is_model(block):
        return None  # a model compiled whole (one of an ensemble, say) is no block
    frames = _outer_frames()
    model = _skipped_model(block, frames) if piece else _calling_module(block, frames)
    if model is None:
        return None
    alike = sum(type(m) is type(block) for m in model.modules())
    declared = type(block).__name__ in (getattr(model, "_repeated_blocks", None) or ())
    if not declared and not _in_a_stack(block, model):
        return None  # a wrapper calling a model it holds (two experts, say): that is whole
    count = "the" if alike == 1 else f"one of the {alike}"
    return BlockAlone(f"{count} {type(block).__name__} block{'s' * (alike > 1)} of "
                      f"{type(model).__name__}", piece)


def _in_a_stack(block: torch.nn.Module, model: torch.nn.Module) -> bool:
    """Whether `block` is one of a stack of blocks of `model`."""
    return any(any(_unwrapped(m) is block for m in stack) for stack in _stacks(model))


def _unwrapped(module: torch.nn.Module) -> torch.nn.Module:
    """The module a `torch.compile` wrapper put in a stack (`blocks[i] = torch.compile(
    blocks[i])`) compiles: what Dynamo traces."""
    return getattr(module, "_orig_mod", module)


def _is_model(module: torch.nn.Module) -> bool:
    """A module that holds a stack of blocks, or names its repeated blocks: a model."""
    return bool(getattr(module, "_repeated_blocks", None)) or next(_stacks(module), None) \
        is not None


def _stacks(module: torch.nn.Module) -> Iterator[list[torch.nn.Module]]:
    """The ModuleLists and Sequentials in `module` holding two or more modules of one class
    with modules of their own (blocks, not a Linear and another): what a forward loops over."""
    for container in module.modules():
        if isinstance(container, (torch.nn.ModuleList, torch.nn.Sequential)):
            members = [m for m in container if next(m.children(), None) is not None]
            classes = [type(m) for m in members]
            if any(classes.count(c) >= 2 for c in classes):
                yield members


def _traced_module() -> torch.nn.Module | None:
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
        module = tx.f_locals.get(tx.f_code.co_varnames[0]) if tx.f_code.co_argcount else None
    except Exception:  # a Dynamo internal: without it, nothing is known
        return None
    return module if isinstance(module, torch.nn.Module) else None


def _calling_module(block: torch.nn.Module,
                    frames: list[FrameType]) -> torch.nn.Module | None:
    """The module whose forward called the compiled block: the first frame outside torch
    past the torch.compile wrapper (eval_frame.py), if it is a module's `forward` holding
    `block`. Only that frame's locals are read: on Python 3.11 reading a running frame's
    locals keeps a copy of them on the frame, and a caller's loop (a function that makes,
    compiles and drops models) would keep its first model alive."""
    entered = _entered(frames)
    if entered is None:
        return None
    for frame in frames[entered + 1:]:
        if os.path.abspath(frame.f_code.co_filename).startswith(_TORCH_DIR):
            continue  # the module call machinery (the block's own __call__)
        return _forward_holding(frame, block)
    return None


def _skipped_model(block: torch.nn.Module,
                   frames: list[FrameType]) -> torch.nn.Module | None:
    """The model whose forward, inside the torch.compile wrapper, runs eagerly and called
    the traced block: Dynamo skipped that frame (a graph break inside its loop over the
    blocks) and traces each frame it calls. The innermost frame outside torch and this
    package, between the wrapper and the trace; it ends with the call, so reading its
    locals keeps nothing alive."""
    entered = _entered(frames)
    for frame in frames[:entered]:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith((_TORCH_DIR, *_PACKAGE_DIRS)):
            return _forward_holding(frame, block)
    return None


def _entered(frames: list[FrameType]) -> int | None:
    """The index of the outermost torch.compile wrapper's frame (eval_frame.py)."""
    entered = [i for i, f in enumerate(frames) if f.f_code.co_filename.endswith(_EVAL_FRAME)]
    return entered[-1] if entered else None


def _forward_holding(frame: FrameType, block: torch.nn.Module) -> torch.nn.Module | None:
    """The module `frame` runs the forward of, if it holds `block` and is not it."""
    code = frame.f_code
    if code.co_name != "forward" or not code.co_argcount:
        return None
    caller = frame.f_locals.get(code.co_varnames[0])  # `self`, whatever its name
    if isinstance(caller, torch.nn.Module) and caller is not block and \
            any(m is block for m in caller.modules()):
        return caller
    return None


def _outer_frames() -> list[FrameType]:
    frames, frame = [], sys._getframe(2)
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    return frames
