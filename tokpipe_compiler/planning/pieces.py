"""Graphs of a model that Dynamo split at graph breaks ("pieces").

A model Dynamo traces whole is one graph, planned and pipelined as a whole. At a graph
break (`.tolist()`, `nonzero`, a branch on a tensor's value) Dynamo hands the backend
pieces instead, each called in turn by the model's Python code:

    Lumina2:  embeddings | mask.sum(1) | .tolist() | rope tables, patchify | blocks, output
              graph 0    | graph 1     | (Python)  | graph 2               | graph 3

A piece is pipelined only when it holds attention over its token input: the graph with
the transformer blocks. Its token input is found with conditioning streams last (text by
the names diffusers gives it): a piece whose only token-like inputs are text (Mochi's
caption pooling, a text refiner) runs as traced; chunking text gains nothing. The others
(embeddings, rope tables, an output norm, pieces of a block whose attention runs outside
any graph) run as traced, each with a warning: pipelining them would fill and drain the
pipeline for a few token-wise ops.

Which graphs are pieces is told while Dynamo traces (`origin`): a graph that ends at a
break, a resume function after a break, a function called from code that Dynamo ran
outside its graphs (a submodule's forward when the model's own could not be traced), and
a forward hook or pre-hook of the compiled module (torch runs them around the forward).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import types
from dataclasses import dataclass

import torch
import torch.fx

from tokpipe_compiler.config import Config
from tokpipe_compiler.core.errors import NothingToPipeline, NoTokenInput, TokpipeError
from tokpipe_compiler.core.fx import argument_of
from tokpipe_compiler.passes.annotate import annotate
from tokpipe_compiler.passes.token_input import (
    ATTENTION_OPS,
    UnknownTokenInput,
    is_conditioning,
    piece_token_input,
)
from tokpipe_compiler.planning.driver import build_plan, copy_graph_module
from tokpipe_compiler.planning.plan import Plan
from tokpipe_compiler.planning.traced_frame import RESUME

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_MODULE_CALL = ("_call_impl", "inner")  # torch's module call, and its closure with hooks


@dataclass(frozen=True)
class Origin:
    """Where Dynamo traced a graph. `piece`: the model has graph breaks and this graph is
    one of its pieces; `where`: its frame, `broke`: why it ends, when at a graph break."""

    piece: bool = False
    where: str = ""
    broke: str = ""

    def describe(self) -> str:
        text = f"traced from {self.where}" if self.where else "traced"
        return f"{text}, ends at a graph break ({self.broke})" if self.broke else text


def origin(gm: torch.fx.GraphModule) -> Origin:
    """Called by the backend while Dynamo traces `gm`: whether it is a piece, and where from.
    Outside a Dynamo trace (a graph handed over directly) it is no piece."""
    reason = getattr(gm, "compile_subgraph_reason", None)
    broke = _first_line(reason.reason) if reason is not None and reason.graph_break else ""
    code = _traced_code()
    if code is None:
        return Origin(bool(broke), "", broke)
    where = f"{code.co_name} ({os.path.basename(code.co_filename)}:{code.co_firstlineno})"
    piece = bool(broke) or code.co_name.startswith(RESUME) or _called_from_user_code(code)
    return Origin(piece, where, broke)


def plan_piece(gm: torch.fx.GraphModule, config: Config, where: Origin) -> Plan:
    """The plan of a piece that holds attention over its tokens; NothingToPipeline for one
    without (it runs as traced, even where it could not be chunked)."""
    piece = (f"this graph, one of several Dynamo made of the model at graph breaks "
             f"({where.describe()}),")
    try:
        config = _with_piece_token_input(gm, config, piece)
        seed = token_input_without_attention(gm, config)
    except NoTokenInput:
        raise NothingToPipeline(f"{piece} has no input that looks like a token sequence (a "
                                "float tensor of rank >= 3)") from None
    if seed is not None:
        raise NothingToPipeline(f"{piece} holds no attention over its token input '{seed}' "
                                "to pipeline")
    return build_plan(gm, config)


def _with_piece_token_input(gm: torch.fx.GraphModule, config: Config, piece: str) -> Config:
    """`config` naming the piece's token input (the user's choice, when made)."""
    if config.token_input is not None:
        return config
    seed = piece_token_input(gm)
    if is_conditioning(seed):
        raise NothingToPipeline(f"{piece} reads no image or video tokens: its token-like "
                                f"inputs are conditioning (text) streams such as "
                                f"'{argument_of(seed) or seed.name}'")
    return dataclasses.replace(config, token_input=seed.name)


def token_input_without_attention(gm: torch.fx.GraphModule, config: Config) -> str | None:
    """The token input's name when the graph holds no attention over it (annotate on a
    copy); None when it does, or when annotate fails (planning then raises its error).
    Attention over the tokens is attention computed from the token input, chunkable or not:
    an op that cannot be chunked before it leaves it looking token-free to annotate.
    Without a token input: NoTokenInput, or UnknownTokenInput for a name it does not read."""
    copy = copy_graph_module(gm)
    try:
        annotation = annotate(copy, config.token_input, config.mode)
    except (NoTokenInput, UnknownTokenInput):
        raise
    except TokpipeError:
        return None
    seed = annotation.token_input
    if any(n.target in ATTENTION_OPS for n in _computed_from(seed)):
        return None
    return seed.name


def _computed_from(node: torch.fx.Node) -> set[torch.fx.Node]:
    """The nodes computed, directly or not, from `node`."""
    found: set[torch.fx.Node] = set()
    stack = list(node.users)
    while stack:
        current = stack.pop()
        if current not in found:
            found.add(current)
            stack.extend(current.users)
    return found


def _traced_code():
    """The code object Dynamo traces now, None when unknown."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        return InstructionTranslator.current_tx().f_code
    except Exception:  # a Dynamo internal: without it, nothing is known
        return None


def _called_from_user_code(traced: types.CodeType) -> bool:
    """Whether the frame Dynamo traces was called by code outside torch within the compiled
    call: by a frame Dynamo ran outside its graphs, so not the frame torch.compile was
    called with (that one is entered from torch's module call, or directly)."""
    frames = []
    frame = sys._getframe(1)
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    converting = [i for i, f in enumerate(frames) if _in_dynamo(f, "convert_frame.py")]
    if not converting or converting[-1] + 1 >= len(frames):
        return False
    if _a_hook_of(frames[converting[-1] + 1], traced):
        return True
    for caller in frames[converting[-1] + 1:]:
        if _in_dynamo(caller, "eval_frame.py"):
            return False  # reached the torch.compile wrapper: only torch frames between
        if not os.path.abspath(caller.f_code.co_filename).startswith(_TORCH_DIR):
            return True
    return False


def _a_hook_of(caller: types.FrameType, traced: types.CodeType) -> bool:
    """Whether the frame Dynamo traces is a forward hook or pre-hook run by torch's module
    call `caller` (`Module._call_impl`, or the `inner` it runs hooks in): not the forward,
    so a graph of its own beside the forward's (run as traced unless it holds attention)."""
    if caller.f_code.co_name not in _MODULE_CALL or not caller.f_code.co_filename.endswith(
            os.path.join("nn", "modules", "module.py")):
        return False
    module = caller.f_locals.get("self")
    forward = getattr(getattr(module, "forward", None), "__code__", None)
    return forward is not None and traced is not forward


def _in_dynamo(frame, filename: str) -> bool:
    path = frame.f_code.co_filename
    return path.endswith(os.path.join("_dynamo", filename))


def _first_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[0] if lines else ""
