"""The one exception type users see, and helpers that make its messages useful."""

from __future__ import annotations

import torch.fx


class TokpipeError(RuntimeError):
    """A model, input or option that the pipeline cannot handle, with what to do about it."""


class CompilerBug(TokpipeError):
    """A pass broke what it promises the passes after it: a bug in tokpipe, not the model."""

    def __init__(self, pass_name: str, node: torch.fx.Node, what: str):
        super().__init__(f"tokpipe internal error: after pass '{pass_name}', {describe(node)} "
                         f"{what}. Please report it with the model; options={{'fallback': "
                         "True}} runs the graph unpipelined meanwhile.")


class NoTokenInput(TokpipeError):
    """A graph (one piece of a model split by graph breaks, say) without the token input."""


def user_line(node: torch.fx.Node) -> str:
    """The innermost user-code frame of a node's stack trace, or '<unknown>'."""
    trace = node.meta.get("stack_trace") or ""
    frames = [line.strip() for line in trace.strip().splitlines() if line.strip()]
    # Frames come in pairs: 'File "...", line N, in f' then the source line.
    for i in range(len(frames) - 2, -1, -1):
        if frames[i].startswith("File "):
            return f"{frames[i]}: {frames[i + 1]}"
    return "<unknown source line>"


def describe(node: torch.fx.Node) -> str:
    """'op(shape, shape) at File ...' for error messages."""
    from tokpipe_compiler.core.fx import node_shape, target_name

    shapes = [node_shape(a) for a in node.all_input_nodes]
    shown = ", ".join(str(tuple(s)) for s in shapes if s is not None)
    return f"{target_name(node)}({shown}) -> {_shape_str(node)} at {user_line(node)}"


def _shape_str(node: torch.fx.Node) -> str:
    from tokpipe_compiler.core.fx import node_shape

    shape = node_shape(node)
    return str(tuple(shape)) if shape is not None else "?"
