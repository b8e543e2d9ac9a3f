"""specialize: a stage graph at one chunk length.

Dynamo graphs are traced with static shapes, so views carry literal sizes:
    view = x.view(1, 256, 6, 64)        # full sequence
becomes, for a chunk of 4 of 16 units,
    view = x.view(1, 64, 6, 64)
A token value's `view` becomes a `reshape` (the same values, a copy where the strides
do not allow a view): a chunk's attention may lay out its output otherwise than the
whole sequence's did (sdpa picks its kernel by shape; SD3's IP-Adapter processor views
the transposed output). Every token value's expected chunk shape is known from its
TokenInfo; a fake-tensor run
then checks that each node really produces it, so an op with a literal size that no rule
rewrites fails here, by name, instead of computing a wrong answer. A chunk that leaves the
text segments to the step's first chunk gets a graph without them (`text_once.py`).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode

from tokpipe_compiler.core.args import arg
from tokpipe_compiler.core.errors import TokpipeError, describe
from tokpipe_compiler.core.fx import example_value
from tokpipe_compiler.core.meta import INVARIANT_INFO, META_KEY, TokenInfo
from tokpipe_compiler.core.ops import op_key
from tokpipe_compiler.passes.axis_rules import split_pieces
from tokpipe_compiler.passes.segments import to_chunk
from tokpipe_compiler.passes.shape_rules import expand_index, getitem_axis, item_range
from tokpipe_compiler.passes.text_once import drop_segments

_SHAPE_ARG_OPS = {"method:view", "method:reshape", "method:expand", torch.reshape}
_UNFLATTEN_OPS = {"method:unflatten", torch.unflatten}


def chunk_shape(shape: torch.Size, info: TokenInfo, units: int,
                segments: bool = True) -> tuple[int, ...]:
    if info.axis is None:
        return tuple(shape)  # a whole scalar (segments.whole): the same in every chunk
    out = list(shape)
    out[info.axis] = info.extent(units, segments)
    return tuple(out)


def specialize(stage_gm: torch.fx.GraphModule, units: int,
               segments: bool = True) -> torch.fx.GraphModule:
    """A copy of `stage_gm` whose token values have `units` grid units, with the text
    segments or (`segments=False`) without them."""
    graph = torch.fx.Graph()
    output = graph.graph_copy(stage_gm.graph, {})
    graph.output(output)
    for node in graph.nodes:
        info = node.meta.get(META_KEY, INVARIANT_INFO)
        if info.carries_tokens and isinstance(example_value(node), torch.Tensor):
            _rewrite_sizes(node, chunk_shape(example_value(node).shape, info, units, segments))
        _rewrite_token_bounds(node, units, segments)
    if not segments:
        drop_segments(graph)
    name = f"{type(stage_gm).__name__}_{units}u{'' if segments else '_rows'}"
    gm = torch.fx.GraphModule(stage_gm, graph, class_name=name)
    check_shapes(gm, units, segments)
    return gm


def _rewrite_sizes(node: torch.fx.Node, shape: tuple[int, ...]) -> None:
    key = op_key(node)
    if key in _SHAPE_ARG_OPS:
        node.args = (arg(node, 0, "input"), shape)
        node.kwargs = {}
        if key == "method:view":  # a reshape: see the module docstring
            node.target = "reshape"
    elif key in _UNFLATTEN_OPS:
        src, dim, sizes = arg(node, 0, "input"), arg(node, 1, "dim"), arg(node, 2, "sizes")
        at = dim % (len(shape) - len(sizes) + 1)
        node.args = (src, dim, shape[at : at + len(sizes)])
        node.kwargs = {}


def _rewrite_token_bounds(node: torch.fx.Node, units: int, segments: bool) -> None:
    """Slices, positions and splits of a segmented token axis (`x[:, 16:]`, `x[:, -1]`,
    `x.split([5, 16], 1)`) are literal on the full axis: move them to the chunk's axis."""
    src = arg(node, 0, "input")
    info = src.meta.get(META_KEY, INVARIANT_INFO) if isinstance(src, torch.fx.Node) else None
    if info is None or not info.carries_tokens or info.axis is None \
            or not isinstance(example_value(src), torch.Tensor):
        return  # no token axis: a value summed whole (a sync run's x.sum()), the same each chunk
    full = example_value(src).shape[info.axis]
    key = op_key(node)
    if key in (operator.getitem, operator.setitem):
        shape = example_value(src).shape
        items = expand_index(arg(node, 1, "index"), len(shape))
        moved = getitem_axis(items, info.axis, shape)
        if not isinstance(moved, str) and moved[1] is not None:
            start, stop = item_range(items[moved[1]], full)
            at = to_chunk(start, info, full, units, segments)
            items[moved[1]] = (slice(at, to_chunk(stop, info, full, units, segments))
                               if isinstance(items[moved[1]], slice) else at)
            node.args = (src, tuple(items), *node.args[2:])
    elif split_pieces(node, info) is not None:
        sizes = [piece.extent(units, segments) for piece in split_pieces(node, info)]
        node.args = (src, sizes, *node.args[2:])
        node.kwargs = {k: v for k, v in node.kwargs.items()
                       if k not in ("split_size", "split_size_or_sections", "split_sizes")}


def input_shapes(gm: torch.fx.GraphModule, units: int,
                 segments: bool = True) -> list[tuple[tuple[int, ...], Any]]:
    """(shape, example value) of each placeholder at this chunk length."""
    shapes = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        value = example_value(node)
        info = node.meta.get(META_KEY, INVARIANT_INFO)
        shape = (chunk_shape(value.shape, info, units, segments) if info.carries_tokens
                 else value.shape)
        shapes.append((tuple(shape), value))
    return shapes


class _ShapeCheck(torch.fx.Interpreter):
    def __init__(self, gm: torch.fx.GraphModule, units: int, segments: bool):
        super().__init__(gm)
        self.units, self.segments = units, segments

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
            expected = chunk_shape(full.shape, info, self.units, self.segments)
            if tuple(result.shape) != expected:
                raise TokpipeError(
                    f"{describe(node)} gives shape {tuple(result.shape)} on a chunk of "
                    f"{self.units} token rows, expected {expected}; the op has a literal "
                    "size that tokpipe does not rewrite"
                )
        return result


def check_shapes(gm: torch.fx.GraphModule, units: int, segments: bool = True) -> None:
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        fakes = [torch.empty(shape, dtype=value.dtype, device=value.device)
                 for shape, value in input_shapes(gm, units, segments)]
        _ShapeCheck(gm, units, segments).run(*fakes)
