"""A map over pieces of the token axis, rejoined, rewritten as the map of the whole, before
annotate.

    pieces = x.chunk(4, dim=1)                   ->   out = f(x)
    out = torch.cat([f(p) for p in pieces], dim=1)

diffusers' feed-forward chunking (`transformer.enable_forward_chunking(size, dim=1)`, which
SD3 and HunyuanDiT offer to save memory) runs the MLP this way. The pieces are fixed ranges
of tokens that need not line up with a pipeline's chunks, so annotate refuses the chunk op;
but a map that keeps tokens apart gives the same rows whole as piece by piece, and a
pipeline chunk then runs it on its own rows.

The rewrite applies only where it is exact: every piece runs the same ops on the same other
operands (weights), the pieces' ops read nothing of each other and nothing outside reads
them, the token rules follow each token through the map unmixed (no attention, sum or sort
over the axis inside a piece), and the map computed on the whole input (on fake tensors)
has the joined output's shape.
"""

from __future__ import annotations

import operator
from fractions import Fraction
from typing import Any

import torch
import torch.fx

from tokpipe_compiler.core.fx import example_value, rewritten
from tokpipe_compiler.core.meta import INVARIANT, INVARIANT_INFO, SLICES_KEY, TOKEN, TokenInfo
from tokpipe_compiler.core.ops import call_rule, op_key
from tokpipe_compiler.passes.rule_base import RuleContext
from tokpipe_compiler.passes.rules import RULES

_PIECES = {"method:chunk", torch.chunk, "method:split", torch.split}
_JOINS = {torch.cat, "method:cat", torch.concat, torch.concatenate}


def join_piecewise_maps(gm: torch.fx.GraphModule) -> None:
    """Rewrites every map over pieces the module docstring describes."""
    joined = 0
    for join in [n for n in gm.graph.nodes if op_key(n) in _JOINS]:
        found = _piecewise_map(join)
        if found is not None and _rewrite(gm, join, *found):
            joined += 1
    rewritten(gm, joined, "maps over pieces of the token axis computed whole")


def _axis(node: torch.fx.Node, position: int) -> int | None:
    """The axis a split cuts or a join joins along (`position`: of its dim argument)."""
    dim = node.kwargs.get("dim", node.args[position] if len(node.args) > position else 0)
    tensor = example_value(node.args[0] if op_key(node) in _PIECES else node)
    if not isinstance(dim, int) or not isinstance(tensor, torch.Tensor) or not tensor.dim():
        return None
    return dim % tensor.dim()


def _piecewise_map(join: torch.fx.Node) -> tuple | None:
    """(pieces op, per-piece getitems, per-piece regions in graph order) of a join whose
    parts are one map of each piece, in order; None otherwise."""
    parts = join.args[0] if join.args else None
    if not isinstance(parts, (list, tuple)) or len(parts) < 2 or join.kwargs.keys() - {"dim"}:
        return None
    if not all(isinstance(p, torch.fx.Node) and len(p.users) == 1 for p in parts):
        return None
    split = _split_above(parts[0])
    if split is None or _axis(split, 2) is None or _axis(split, 2) != _axis(join, 1):
        return None
    getitems = _getitems(split)
    if getitems is None or len(getitems) != len(parts):
        return None
    order = {n: i for i, n in enumerate(join.graph.nodes)}
    regions = [_region(g, p, order) for g, p in zip(getitems, parts, strict=True)]
    if any(r is None for r in regions):
        return None
    if len({_shape_of(r) for r in regions}) != 1:
        return None  # the pieces run different ops
    return split, getitems, regions


def _split_above(part: torch.fx.Node) -> torch.fx.Node | None:
    """The chunk or split by one size whose pieces `part` is computed from (the nearest)."""
    seen, stack = set(), [part]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node) \
                and op_key(node.args[0]) in _PIECES:
            split = node.args[0]
            sizes = split.kwargs.get("split_size", split.args[1] if len(split.args) > 1 else None)
            return split if isinstance(sizes, int) or op_key(split) in (
                "method:chunk", torch.chunk) else None
        stack.extend(node.all_input_nodes)
    return None


def _getitems(split: torch.fx.Node) -> list[torch.fx.Node] | None:
    """The pieces, each read once through getitem, in order (None if read otherwise)."""
    pieces = example_value(split)
    if not isinstance(pieces, (tuple, list)):
        return None
    by_index = {u.args[1]: u for u in split.users
                if u.target is operator.getitem and isinstance(u.args[1], int)}
    if len(by_index) != len(split.users) or sorted(by_index) != list(range(len(pieces))):
        return None
    return [by_index[i] for i in range(len(pieces))]


def _region(piece: torch.fx.Node, part: torch.fx.Node,
            order: dict[torch.fx.Node, int]) -> list[torch.fx.Node] | None:
    """The nodes between `piece` and `part` (both in), in graph order, if nothing outside
    reads them but the join reads `part`; None otherwise."""
    below, stack = set(), [piece]
    while stack:
        node = stack.pop()
        if node not in below and order[node] <= order[part]:
            below.add(node)
            stack.extend(node.users)
    if part not in below:
        return None
    above, stack = set(), [part]
    while stack:
        node = stack.pop()
        if node not in above and node in below:
            above.add(node)
            stack.extend(node.all_input_nodes)
    region = sorted(above, key=order.__getitem__)
    inside = set(region)
    if any(u not in inside for n in region if n is not part for u in n.users):
        return None
    if any(n.op != "call_function" and n.op != "call_method" for n in region):
        return None
    return region


def _shape_of(region: list[torch.fx.Node]) -> tuple:
    """The region's ops with its own nodes numbered: equal for the same map of two pieces."""
    piece, local = region[0], {node: i for i, node in enumerate(region)}

    def name(value: Any) -> Any:
        if isinstance(value, torch.fx.Node):
            return ("local", local[value]) if value in local else ("outside", value)
        if isinstance(value, (list, tuple)):
            return tuple(name(v) for v in value)
        if isinstance(value, dict):
            return tuple(sorted((k, name(v)) for k, v in value.items()))
        return ("value", repr(value))

    return tuple((n.op, n.target if n is not piece else "piece", () if n is piece
                  else name(n.args), () if n is piece else name(n.kwargs)) for n in region)


def _keeps_tokens_apart(region: list[torch.fx.Node], axis: int) -> bool:
    """The token rules follow the piece's tokens through the region without mixing them,
    out along the same axis, one row per row."""
    piece, part = region[0], region[-1]
    row = TokenInfo(TOKEN, axis, Fraction(1))
    infos: dict[torch.fx.Node, TokenInfo] = {piece: row}
    ctx = RuleContext(infos)
    for node in region[1:]:
        for arg in node.all_input_nodes:
            infos.setdefault(arg, INVARIANT_INFO)  # weights, conditioning
        info = _rule_info(node, ctx)
        node.meta.pop(SLICES_KEY, None)  # annotate decides what the whole graph slices
        # only rows that stay rows: an op that mixes them (attention, a sum, an unsupported
        # slice of the piece such as `p[:, :1]`) leaves the map as written
        if info is None or info.kind not in (TOKEN, INVARIANT) or info.segmented:
            return False
        infos[node] = info
    return infos[part] == row


def _rule_info(node: torch.fx.Node, ctx: RuleContext) -> TokenInfo | None:
    """The token rule's info for `node` (None where there is none, or it fails here,
    outside annotate: the map is then left as written)."""
    if not ctx.token_args(node):
        return INVARIANT_INFO
    rule = RULES.get(op_key(node))
    if rule is None:
        return None
    try:
        return call_rule("token", rule, node, ctx)
    except Exception:  # a rule that cannot read this node: annotate will say so
        return None


def _rewrite(gm: torch.fx.GraphModule, join: torch.fx.Node, split: torch.fx.Node,
             getitems: list[torch.fx.Node], regions: list[list[torch.fx.Node]]) -> bool:
    """The first piece's map reads the whole input and replaces the join, if it keeps
    tokens apart and its values on the whole input have the join's shape."""
    axis, first = _axis(split, 2), regions[0]
    if not _keeps_tokens_apart(first, axis):
        return False
    whole = split.args[0]
    values = _values_on(first, whole)
    if values is None or values[-1].shape != example_value(join).shape \
            or values[-1].dtype != example_value(join).dtype:
        return False
    for node, value in zip(first[1:], values, strict=True):
        node.meta["example_value"] = value
    getitems[0].replace_all_uses_with(whole)
    join.replace_all_uses_with(first[-1])
    gm.graph.erase_node(join)
    for region in reversed(regions[1:]):
        for node in reversed(region):
            gm.graph.erase_node(node)
    gm.graph.erase_node(getitems[0])
    gm.graph.erase_node(split)
    return True


def _values_on(region: list[torch.fx.Node], whole: torch.fx.Node) -> list[Any] | None:
    """Fake values of the region's nodes after its piece, run on `whole` instead (None if
    an op refuses the whole input's shape)."""
    start = example_value(whole)
    mode = getattr(start, "fake_mode", None)
    if mode is None:
        return None
    values: dict[torch.fx.Node, Any] = {region[0]: start}

    def value(arg: Any) -> Any:
        return torch.fx.node.map_arg(arg, lambda n: values.get(n, example_value(n)))

    out = []
    try:
        with mode:
            for node in region[1:]:
                args, kwargs = value(node.args), value(node.kwargs)
                if node.op == "call_method":
                    result = getattr(args[0], node.target)(*args[1:], **kwargs)
                else:
                    result = node.target(*args, **kwargs)
                values[node] = result
                out.append(result)
    except (RuntimeError, ValueError, TypeError, IndexError):
        return None
    return out
