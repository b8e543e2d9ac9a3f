"""Buffers filled by slice writes rewritten as concatenations, before annotate.

    joint = x.new_zeros(B, T + N, C)
    joint[i, :T] = text[i]                 ->   joint2 = cat([cat([text[0] ...], 1), ...], 0)
    joint[i, T:T + N] = image[i]

Lumina2 builds its joint text+image sequence this way, one batch item at a time. Written
in place, the buffer is made without tokens and the tokens only enter it by mutation,
which annotate cannot follow (it refuses the write). As a concatenation of the written
values it is the joint sequence SD3 and Flux build with `torch.cat`, which annotate
chunks: the text becomes a whole segment riding with every chunk.

A write spelled `buffer[index].copy_(value)`, or through `.data` (CogVideoX fills its
joint positional table with `joint.data[:, T:].copy_(pos)` when the resolution is not the
configured one), is the same write and is first rewritten as `buffer[index] = value`.

The rewrite is exact and applies only where nothing can observe the difference: the buffer
is made in the graph by a factory (zeros, empty, full ...), nothing reads it before the
last write, and the writes' boxes (ints and step-1 slices on leading axes) never partly
overlap. What no write covers is read from the buffer as made, so it keeps its fill.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from tokpipe_compiler.core.fx import example_value, rewritten
from tokpipe_compiler.core.ops import op_key

_FACTORIES = {torch.zeros, torch.empty, torch.ones, torch.full, torch.zeros_like,
              torch.empty_like, torch.ones_like, torch.full_like, "method:new_zeros",
              "method:new_empty", "method:new_ones", "method:new_full"}

Range = tuple[int, int]


@dataclass(frozen=True)
class _Write:
    """One `buffer[index] = value`: the box it covers and which of its axes an int index
    removes from the written view."""

    node: torch.fx.Node
    box: tuple[Range, ...]  # one range per indexed leading axis
    dropped: tuple[int, ...]  # axes indexed by an int
    value: Any  # a node or a Python scalar


def concatenate_buffer_fills(gm: torch.fx.GraphModule) -> None:
    """Rewrites every buffer the module docstring describes."""
    _copies_as_setitems(gm)
    for buffer in [n for n in gm.graph.nodes if op_key(n) in _FACTORIES]:
        writes = _writes(buffer)
        if writes and any(isinstance(w.value, torch.fx.Node) for w in writes):
            _rewrite(gm, buffer, writes)


def _copies_as_setitems(gm: torch.fx.GraphModule) -> None:
    """`buffer[index].copy_(value)` (or `buffer.data[index]...`) whose result and view
    nothing else reads -> `buffer[index] = value`: both broadcast and cast `value` alike."""
    changed = 0
    for copy in [n for n in gm.graph.nodes if op_key(n) == "method:copy_"]:
        view = copy.args[0]
        if copy.users or copy.kwargs or len(copy.args) != 2 or not _is_index(view) \
                or len(view.users) != 1:
            continue
        base = view.args[0]
        alias = base if base.target is torch._C._autograd._get_data_attr else None
        buffer = alias.args[0] if alias is not None else base
        with gm.graph.inserting_before(copy):
            gm.graph.call_function(operator.setitem, (buffer, view.args[1], copy.args[1]))
        gm.graph.erase_node(copy)
        gm.graph.erase_node(view)
        if alias is not None and not alias.users:
            gm.graph.erase_node(alias)
        changed += 1
    rewritten(gm, changed, "copies into slices of a buffer written as setitems")


def _is_index(node: Any) -> bool:
    return isinstance(node, torch.fx.Node) and node.target is operator.getitem \
        and isinstance(node.args[0], torch.fx.Node)


def _writes(buffer: torch.fx.Node) -> list[_Write] | None:
    """The writes into `buffer`, in graph order, or None where the rewrite does not apply."""
    value = example_value(buffer)
    if not isinstance(value, torch.Tensor) or value._is_view():
        return None
    if not all(isinstance(s, int) for s in value.shape):
        return None
    order = {n: i for i, n in enumerate(buffer.graph.nodes)}
    users = sorted(buffer.users, key=order.__getitem__)
    updates = [u for u in users if u.target is operator.setitem and u.args[0] is buffer]
    if not updates or users[:len(updates)] != updates:
        return None  # read (or viewed) before the last write: the partial fill is observed
    writes = [_write(u, tuple(value.shape)) for u in updates]
    return None if any(w is None for w in writes) else writes


def _write(update: torch.fx.Node, shape: tuple[int, ...]) -> _Write | None:
    _, index, value = update.args
    items = index if isinstance(index, tuple) else (index,)
    if len(items) > len(shape) or update.kwargs:
        return None
    box, dropped = [], []
    for axis, item in enumerate(items):
        size = shape[axis]
        if isinstance(item, int) and not isinstance(item, bool) and -size <= item < size:
            start = item % size
            box.append((start, start + 1))
            dropped.append(axis)
        elif (isinstance(item, slice) and item.step in (None, 1)
              and all(b is None or isinstance(b, int) for b in (item.start, item.stop))):
            start, stop, _ = item.indices(size)
            box.append((start, max(start, stop)))
        else:
            return None
    if not (isinstance(value, (torch.fx.Node, int, float, bool))):
        return None
    return _Write(update, tuple(box), tuple(dropped), value)


def _rewrite(gm: torch.fx.GraphModule, buffer: torch.fx.Node, writes: list[_Write]) -> None:
    shape = tuple(example_value(buffer).shape)
    depth = max(len(w.box) for w in writes)
    region = tuple((0, size) for size in shape[:depth])
    readers = [u for u in buffer.users if u.target is not operator.setitem]
    builder = _Builder(gm.graph, buffer, shape)
    with gm.graph.inserting_before(writes[-1].node.next):
        built = builder.fill(writes, region, 0)
    if built is None:
        for node in reversed(builder.made):  # a build that gave up: drop its nodes
            gm.graph.erase_node(node)
        return
    for node in builder.made:  # errors then point at the model's own writes
        node.meta["stack_trace"] = writes[-1].node.meta.get("stack_trace")
    for reader in readers:
        reader.replace_input_with(buffer, built)
    for write in reversed(writes):
        gm.graph.erase_node(write.node)
    gm.recompile()


class _Builder:
    """Nodes that compute the filled buffer from its writes, axis by axis."""

    def __init__(self, graph: torch.fx.Graph, buffer: torch.fx.Node, shape: tuple[int, ...]):
        self.graph, self.buffer, self.shape = graph, buffer, shape
        self.made: list[torch.fx.Node] = []

    def fill(self, writes: list[_Write], region: tuple[Range, ...],
             axis: int) -> torch.fx.Node | None:
        """The buffer's `region`, from the writes inside it (split from `axis` on)."""
        if axis == len(region):
            if len(writes) != 1:
                return None  # two writes of the same box: the later one wins; not handled
            return self._leaf(writes[0], region)
        spans = _spans(writes, region, axis)
        if spans is None:
            return None
        parts = []
        for span, inside in spans:
            part = (self._unwritten(_with(region, axis, span)) if not inside
                    else self.fill(inside, _with(region, axis, span), axis + 1))
            if part is None:
                return None
            parts.append(part)
        if len(parts) == 1:
            return parts[0]
        return self._call(torch.cat, (parts, axis),
                          torch.cat([example_value(p) for p in parts], axis))

    def _leaf(self, write: _Write, region: tuple[Range, ...]) -> torch.fx.Node:
        """The written value, broadcast to its box, in the buffer's dtype, with the axes an
        int index removed put back."""
        like = example_value(self.buffer)
        view = [b - a for a, b in region] + list(self.shape[len(region):])
        kept = [size for axis, size in enumerate(view) if axis not in write.dropped]
        if not isinstance(write.value, torch.fx.Node):
            return self._method("new_full", (self.buffer, view, write.value),
                                like.new_full(view, write.value))
        node, value = write.value, example_value(write.value)
        if tuple(value.shape) != tuple(kept):
            value = value.expand(kept)
            node = self._method("expand", (node, kept), value)
        if value.dtype != like.dtype:
            value = value.to(like.dtype)
            node = self._method("to", (node, like.dtype), value)
        for axis in write.dropped:
            node = self._method("unsqueeze", (node, axis), example_value(node).unsqueeze(axis))
        return node

    def _unwritten(self, region: tuple[Range, ...]) -> torch.fx.Node:
        """The buffer's region no write covers, as the buffer was made."""
        node = self.buffer
        for axis, (start, stop) in enumerate(region):
            if (start, stop) != (0, self.shape[axis]):
                node = self._call(torch.narrow, (node, axis, start, stop - start),
                                  example_value(node).narrow(axis, start, stop - start))
        return node

    def _call(self, target, args: tuple, value: torch.Tensor) -> torch.fx.Node:
        return self._add(self.graph.call_function(target, args), value)

    def _method(self, name: str, args: tuple, value: torch.Tensor) -> torch.fx.Node:
        return self._add(self.graph.call_method(name, args), value)

    def _add(self, node: torch.fx.Node, value: torch.Tensor) -> torch.fx.Node:
        node.meta["example_value"] = value
        self.made.append(node)
        return node


def _spans(writes: list[_Write], region: tuple[Range, ...],
           axis: int) -> list[tuple[Range, list[_Write]]] | None:
    """The region's ranges along `axis`, in order, each with the writes that span exactly
    it (none: nothing is written there); None where two writes partly overlap."""
    def span_of(write: _Write) -> Range:
        return write.box[axis] if axis < len(write.box) else region[axis]

    spans: list[tuple[Range, list[_Write]]] = []
    at, end = region[axis]
    for start, stop in sorted({span_of(w) for w in writes}):
        if start < at:
            return None
        if start > at:
            spans.append(((at, start), []))
        spans.append(((start, stop), [w for w in writes if span_of(w) == (start, stop)]))
        at = stop
    if end > at:
        spans.append(((at, end), []))
    return spans


def _with(region: tuple[Range, ...], axis: int, span: Range) -> tuple[Range, ...]:
    return (*region[:axis], span, *region[axis + 1:])
