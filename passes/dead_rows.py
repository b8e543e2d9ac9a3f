"""Rows a graph computes and then overwrites whole, made constants, before annotate.

    padded = cat([x, x[-1:].repeat(8, 1)])      ->   padded = cat([x, zeros(1, C).repeat(8, 1)])
    h = linear(padded, w, b)
    out = where(pad_mask, pad_token, h)              (pad_mask True on the 8 padded rows)

Z-Image pads each image's tokens to a multiple of 32 by repeating the last token, then
puts its learnt pad token in those rows through a mask built from Python numbers. The last
token cuts through the chunks (annotate refuses `x[-1:]`), but no value computed from it
reaches the output: the `where` takes the pad token in every row it went to.

The rewrite applies only where it is exact: the slice's values are followed forward, row by
row along one axis, through ops that keep rows apart (concatenation, repeats of the whole
value, splits and slices, linear layers, out-of-place elementwise ops), and every row they
reach ends at a `where` whose mask, computed from Python numbers alone, takes the other
operand there. Anything else that reads them (another op, an in-place write, the output)
leaves the graph as it is.
"""

from __future__ import annotations

import heapq
import operator
from dataclasses import dataclass

import torch
import torch.fx
import torch.nn.functional as F

from tokpipe_compiler.core.fx import example_value, rewritten
from tokpipe_compiler.core.ops import op_key

_JOINS = {torch.cat, torch.concat, torch.concatenate}
_SPLITS = {"method:split", torch.split, "method:chunk", torch.chunk}
_ROW_MAPS = {  # out-of-place, each output element from the same element of the operands
    operator.add, operator.sub, operator.mul, operator.truediv, operator.neg, torch.add,
    torch.sub, torch.mul, torch.div, F.silu, F.gelu, "method:to", "method:float",
    "method:type_as", "method:contiguous", "method:clone",
}
# What a mask computed from Python numbers alone may be built with (no random draws).
_CONSTANT_OPS = {
    torch.zeros, torch.ones, torch.full, torch.arange, torch.cat, torch.stack, torch.flatten,
    torch.unsqueeze, operator.getitem, operator.invert, operator.and_, operator.or_,
    operator.eq, operator.ne, operator.lt, operator.le, operator.gt, operator.ge,
    torch.logical_not, "method:unsqueeze", "method:view", "method:reshape", "method:to",
    "method:bool", "method:repeat", "method:expand", "method:flatten",
}
_CONSTANT_LIMIT = 1 << 20  # elements: masks over a sequence, not weights


class _Kept(Exception):
    """A reader the rows cannot be followed through: the slice stays as it is."""


@dataclass(frozen=True)
class Rows:
    """The elements of a value computed from the slice: rows `rows` of `axis`, every
    element of the other axes; `axis` None: every element."""

    axis: int | None
    rows: frozenset[int] = frozenset()


def constant_dead_rows(gm: torch.fx.GraphModule) -> int:
    """Replaces each slice the module docstring describes with zeros of its shape."""
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    dead = [n for n in gm.graph.nodes if _is_slice(n) and _overwritten(n, order)]
    for node in dead:
        value = example_value(node)
        with gm.graph.inserting_before(node):
            zeros = gm.graph.call_function(torch.zeros, (tuple(value.shape),),
                                           {"dtype": value.dtype, "device": value.device})
        zeros.meta.update(example_value=value, stack_trace=node.meta.get("stack_trace"))
        node.replace_all_uses_with(zeros)
        gm.graph.erase_node(node)
    return rewritten(gm, len(dead), "values overwritten before they are read made zeros")


def _is_slice(node: torch.fx.Node) -> bool:
    """A slice of a tensor: `x[a:b]`, `x[:, a:b]`."""
    if node.target is not operator.getitem or _tensor(node.args[0]) is None:
        return False
    items = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
    value = _tensor(node)
    return (all(isinstance(i, slice) for i in items) and value is not None
            and all(isinstance(size, int) for size in value.shape))  # zeros of a fixed shape


def _overwritten(start: torch.fx.Node, order: dict[torch.fx.Node, int]) -> bool:
    """Whether no element computed from `start` reaches anything but a `where` that drops
    it (followed in graph order, so each node's rows are complete when it is read)."""
    taken: dict[torch.fx.Node, Rows | tuple] = {start: Rows(None)}
    queue = [(order[u], u) for u in start.users]
    heapq.heapify(queue)
    seen: set[torch.fx.Node] = set()
    try:
        while queue:
            _, node = heapq.heappop(queue)
            if node in seen:
                continue
            seen.add(node)
            rows = _through(node, taken)
            if rows is not None:
                taken[node] = rows
                for user in node.users:
                    heapq.heappush(queue, (order[user], user))
    except _Kept:
        return False
    return True


def _through(node: torch.fx.Node, taken: dict) -> Rows | tuple | None:
    """The rows of `node` computed from the slice, given its inputs'; None: none."""
    key = op_key(node)
    if node.op == "output" or node.kwargs.get("out") is not None:
        raise _Kept
    if key is operator.getitem and isinstance(taken.get(node.args[0]), tuple):
        return taken[node.args[0]][node.args[1]]
    if key is operator.getitem:
        return _sliced(node, taken[node.args[0]])
    if key in _JOINS:
        return _joined(node, taken)
    if key in _SPLITS:
        return _split(node, taken[node.args[0]])
    if key == "method:repeat" and taken.get(node.args[0]) == Rows(None):
        return Rows(None)
    if key is F.linear and node.args[0] in taken and not set(node.args[1:]) & set(taken):
        return _last_axis_kept(node, taken[node.args[0]])
    if key in _ROW_MAPS:
        return _mapped(node, [a for a in node.args if isinstance(a, torch.fx.Node)], taken)
    if key is torch.where and node.args[0] not in taken:
        return _where(node, taken)
    raise _Kept


def _tensor(value) -> torch.Tensor | None:
    found = example_value(value) if isinstance(value, torch.fx.Node) else None
    return found if isinstance(found, torch.Tensor) else None


def _sliced(node: torch.fx.Node, rows: Rows) -> Rows | None:
    index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
    if not all(isinstance(i, slice) for i in index):
        raise _Kept
    if rows.axis is None or rows.axis >= len(index):
        return rows
    size = _tensor(node.args[0]).shape[rows.axis]
    kept = range(*index[rows.axis].indices(size))
    return _rows(rows.axis, {i for i, r in enumerate(kept) if r in rows.rows})


def _joined(node: torch.fx.Node, taken: dict) -> Rows | None:
    parts = node.args[0]
    dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0)
    dim %= _tensor(node).dim()
    found, offset = set(), 0
    for part in parts:
        size = _tensor(part).shape[dim]
        rows = taken.get(part)
        if isinstance(rows, Rows):
            if rows.axis not in (None, dim):
                raise _Kept
            found |= {offset + r for r in (range(size) if rows.axis is None else rows.rows)}
        elif part in taken:
            raise _Kept
        offset += size
    return _rows(dim, found)


def _split(node: torch.fx.Node, rows: Rows) -> tuple:
    """Each piece's rows, by cutting the input along its split axis as the op does."""
    value = _tensor(node.args[0])
    dim = node.kwargs.get("dim", node.args[2] if len(node.args) > 2 else 0) % value.dim()
    size = node.args[1] if len(node.args) > 1 else node.kwargs.get("split_size_or_sections")
    if op_key(node) in ("method:chunk", torch.chunk):
        pieces = torch.arange(value.shape[dim]).chunk(size)
    else:
        pieces = torch.arange(value.shape[dim]).split(size)
    if rows.axis is None:
        return tuple(Rows(None) for _ in pieces)
    if rows.axis != dim:
        return tuple(rows for _ in pieces)
    return tuple(_rows(dim, {i for i, r in enumerate(p.tolist()) if r in rows.rows})
                 for p in pieces)


def _last_axis_kept(node: torch.fx.Node, rows: Rows) -> Rows:
    """A linear layer mixes its input's last axis only."""
    if rows.axis is not None and rows.axis == _tensor(node.args[0]).dim() - 1:
        raise _Kept
    return rows


def _mapped(node: torch.fx.Node, operands: list[torch.fx.Node], taken: dict) -> Rows | None:
    """Rows through broadcasting: each operand's axis counted from the right."""
    out = _tensor(node)
    found: Rows | None = None
    for operand in (o for o in operands if o in taken):
        rows, value = taken[operand], _tensor(operand)
        if rows.axis is not None:
            axis = rows.axis + out.dim() - value.dim()
            if value.shape[rows.axis] != out.shape[axis]:
                raise _Kept  # a broadcast row reaches every row
            rows = Rows(axis, rows.rows)
        found = _union(found, rows)
    return found


def _where(node: torch.fx.Node, taken: dict) -> Rows | None:
    """The rows of each taken branch that the mask, a constant, selects in some element."""
    mask = _constant(node.args[0])
    if mask is None:
        raise _Kept
    out = _tensor(node)
    mask = mask.to(torch.bool).expand(out.shape)
    found: Rows | None = None
    for branch, chosen in ((node.args[1], mask), (node.args[2], ~mask)):
        rows = _mapped(node, [branch], taken) if branch in taken else None
        if rows is None:
            continue
        if rows.axis is None:
            found = _union(found, Rows(None) if chosen.any() else None)
            continue
        used = chosen.movedim(rows.axis, 0).flatten(1).any(dim=1)
        found = _union(found, _rows(rows.axis, {r for r in rows.rows if used[r]}))
    return found


def _constant(node) -> torch.Tensor | None:
    """The value of `node` where it is computed from Python numbers alone, on the CPU."""
    values: dict[torch.fx.Node, object] = {}

    def value_of(current: torch.fx.Node):
        if current not in values:
            if op_key(current) not in _CONSTANT_OPS or _too_big(current):
                raise _Kept
            args = torch.fx.node.map_arg(current.args, value_of)
            kwargs = {k: v for k, v in current.kwargs.items() if k != "device"}
            kwargs = torch.fx.node.map_arg(kwargs, value_of)
            if current.op == "call_method":
                values[current] = getattr(args[0], current.target)(*args[1:], **kwargs)
            else:
                values[current] = current.target(*args, **kwargs)
        return values[current]

    if not isinstance(node, torch.fx.Node):
        return None
    try:
        found = value_of(node)
    except Exception:  # an op that is not a known constant, or will not run on the CPU
        return None
    return found.cpu() if isinstance(found, torch.Tensor) else None


def _too_big(node: torch.fx.Node) -> bool:
    value = example_value(node)
    return isinstance(value, torch.Tensor) and value.numel() > _CONSTANT_LIMIT


def _rows(axis: int, rows: set[int]) -> Rows | None:
    return Rows(axis, frozenset(rows)) if rows else None


def _union(a: Rows | None, b: Rows | None) -> Rows | None:
    if a is None or b is None:
        return a or b
    if a.axis is None or b.axis is None:
        return Rows(None)
    if a.axis != b.axis:
        raise _Kept
    return Rows(a.axis, a.rows | b.rows)
