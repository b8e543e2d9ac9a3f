"""specialize: a stage graph at one chunk length.

Dynamo graphs are traced with static shapes, so views carry literal sizes:
    view = x.view(1, 256, 6, 64)        # full sequence
becomes, for a chunk of 4 of 16 units,
    view = x.view(1, 64, 6, 64)
Every token value's expected chunk shape is known from its TokenInfo; a fake-tensor run
then checks that each node really produces it, so an op with a literal size that no rule
rewrites fails here, by name, instead of computing a wrong answer.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode

from tokpipe_compiler.errors import TokpipeError, describe
from tokpipe_compiler.graph_utils import example_value
from tokpipe_compiler.tokens import INVARIANT_INFO, META_KEY, TokenInfo

from .rules import op_key

_SHAPE_ARG_OPS = {"method:view", "method:reshape", "method:expand", torch.reshape}
_UNFLATTEN_OPS = {"method:unflatten", torch.unflatten}


def chunk_shape(shape: torch.Size, info: TokenInfo, units: int) -> tuple[int, ...]:
    out = list(shape)
    out[info.axis] = units * info.per_unit
    return tuple(out)


def specialize(stage_gm: torch.fx.GraphModule, units: int) -> torch.fx.GraphModule:
    """A copy of `stage_gm` whose token values have `units` grid units."""
    graph = torch.fx.Graph()
    output = graph.graph_copy(stage_gm.graph, {})
    graph.output(output)
    for node in graph.nodes:
        info = node.meta.get(META_KEY, INVARIANT_INFO)
        if info.carries_tokens and isinstance(example_value(node), torch.Tensor):
            _rewrite_sizes(node, chunk_shape(example_value(node).shape, info, units))
    gm = torch.fx.GraphModule(stage_gm, graph, class_name=f"{type(stage_gm).__name__}_{units}u")
    check_shapes(gm, units)
    return gm


def _rewrite_sizes(node: torch.fx.Node, shape: tuple[int, ...]) -> None:
    key = op_key(node)
    if key in _SHAPE_ARG_OPS:
        node.args = (node.args[0], shape)
        node.kwargs = {}
    elif key in _UNFLATTEN_OPS:
        dim = node.args[1] % (len(shape) - len(node.args[2]) + 1)
        node.args = (node.args[0], node.args[1], shape[dim : dim + len(node.args[2])])


def input_shapes(gm: torch.fx.GraphModule, units: int) -> list[tuple[tuple[int, ...], Any]]:
    """(shape, example value) of each placeholder at this chunk length."""
    shapes = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        value = example_value(node)
        info = node.meta.get(META_KEY, INVARIANT_INFO)
        shape = chunk_shape(value.shape, info, units) if info.carries_tokens else value.shape
        shapes.append((tuple(shape), value))
    return shapes


class _ShapeCheck(torch.fx.Interpreter):
    def __init__(self, gm: torch.fx.GraphModule, units: int):
        super().__init__(gm)
        self.units = units

    def run_node(self, node: torch.fx.Node) -> Any:
        try:
            result = super().run_node(node)
        except TokpipeError:
            raise
        except Exception as err:
            raise TokpipeError(
                f"{describe(node)} fails on a chunk of {self.units} token rows: {err}. "
                "It probably uses a literal size of the full sequence; compute sizes from "
                "the tensor (x.shape) or report the op."
            ) from err
        info = node.meta.get(META_KEY, INVARIANT_INFO)
        full = example_value(node)
        if info.carries_tokens and isinstance(result, torch.Tensor):
            expected = chunk_shape(full.shape, info, self.units)
            if tuple(result.shape) != expected:
                raise TokpipeError(
                    f"{describe(node)} gives shape {tuple(result.shape)} on a chunk of "
                    f"{self.units} token rows, expected {expected}; the op has a literal "
                    "size that tokpipe does not rewrite"
                )
        return result


def check_shapes(gm: torch.fx.GraphModule, units: int) -> None:
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        fakes = [torch.empty(shape, dtype=value.dtype, device=value.device)
                 for shape, value in input_shapes(gm, units)]
        _ShapeCheck(gm, units).run(*fakes)
