"""The one exception type users see, and helpers that make its messages useful."""

from __future__ import annotations

import linecache
import os
import re

import torch
import torch.fx

# Frames inside torch itself (functorch's vmap, nn.functional wrappers, ...) are never the
# line the user wrote; an error names the innermost frame outside it.
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_FRAME_FILE = re.compile(r'File "([^"]+)"')
_FRAME_LINE = re.compile(r'File "([^"]+)", line (\d+)')
_MAX_CONTINUED = 8  # lines of a statement quoted after its first


class TokpipeError(RuntimeError):
    """A model, input or option that the pipeline cannot handle, with what to do about it.
    `found`: the message without the advice (what a fallback's warning shows: the advice
    names options the user already chose)."""

    def __init__(self, message: str, advice: str = ""):
        super().__init__(message + advice)
        self.found = message


class CompilerBug(TokpipeError):
    """A pass broke what it promises the passes after it: a bug in tokpipe, not the model."""

    def __init__(self, pass_name: str, node: torch.fx.Node, what: str):
        super().__init__(f"tokpipe internal error: after pass '{pass_name}', {describe(node)} "
                         f"{what}. Please report it with the model; options={{'fallback': "
                         "True}} runs the graph unpipelined meanwhile.")


class NoTokenInput(TokpipeError):
    """A graph (one piece of a model split by graph breaks, say) without the token input."""


class OneUnitGrid(TokpipeError):
    """A graph whose token grid is one unit (an image one patch row high) that annotate
    could not chunk: one unit has nothing to cut, and its token axis cannot be told from a
    whole (text) segment's. A parallelized pipeline runs such a call per call."""


class UnchunkableOps(TokpipeError):
    """Ops that mix tokens with no way to chunk them; `nodes`: their names in the graph
    annotated (a check at the end of a forward can run after the pipeline: graph_tail)."""

    def __init__(self, message: str, advice: str, nodes: tuple[str, ...]):
        super().__init__(message, advice)
        self.nodes = nodes


class NothingToPipeline(TokpipeError):
    """A piece of a model split by graph breaks with no attention over its tokens: it runs
    as traced (the backend warns), like a graph without the token input."""


def user_line(node: torch.fx.Node) -> str:
    """The innermost frame of a node's stack trace outside torch (the model's own line),
    else the innermost frame, or '<unknown source line>'."""
    trace = node.meta.get("stack_trace") or ""
    lines = [line.strip() for line in trace.strip().splitlines() if line.strip()]
    # Frames come in pairs: 'File "...", line N, in f' then the source line.
    frames = [f"{lines[i]}: {_whole_statement(lines[i], lines[i + 1])}"
              for i in range(len(lines) - 1) if lines[i].startswith("File ")]
    outside = [f for f in frames if not _in_torch(f)]
    return (outside or frames or ["<unknown source line>"])[-1]


def _whole_statement(frame: str, source: str) -> str:
    """A frame's source line with the lines that continue its statement: a trace gives the
    first line of a call spread over several, which would read as cut off mid-call. Ends
    in '...' where the file cannot tell the rest."""
    match = _FRAME_LINE.match(frame)
    if match is None or _open_brackets(source) <= 0:
        return source
    path, first = match.group(1), int(match.group(2))
    for number in range(first + 1, first + 1 + _MAX_CONTINUED):
        line = linecache.getline(path, number).strip()
        if not line:
            break
        source = f"{source} {line}"
        if _open_brackets(source) <= 0:
            return source
    return f"{source} ..."


def _open_brackets(code: str) -> int:
    return sum(code.count(c) for c in "([{") - sum(code.count(c) for c in ")]}")


def _in_torch(frame: str) -> bool:
    match = _FRAME_FILE.match(frame)
    return bool(match) and os.path.abspath(match.group(1)).startswith(_TORCH_DIR)


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


class PeerStopped(TokpipeError):
    """A peer stopped this call: its parallelized pipeline call raised between two per-call
    steps and left it (`stage_programs.agreement.send_leave`), or a step raised on it mid-run
    (`runtime.run_stops`)."""
