"""Reading an FX node's arguments, by position or keyword: the one reader every pass and the
cost model use.

Dynamo records a call as it was written, so `torch.cat(xs, 1)` and `torch.cat(xs, dim=1)`
give different nodes; a rule asks for "argument 1, or keyword dim" and gets either.

    arg(node, 1, "dim", 0)                  # positional, else keyword, else the default
    bound_args(node, SDPA)["attn_mask"]     # a whole signature, by name
    varargs(node, 1)                        # x.permute(0, 2, 1) and x.permute((0, 2, 1))
"""

from __future__ import annotations

from typing import Any

import torch.fx

# F.scaled_dot_product_attention's parameters, in order.
SDPA = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def arg(node: torch.fx.Node, position: int, name: str, default: Any = None) -> Any:
    """Argument `position` of the call, else its keyword `name`, else `default`."""
    if len(node.args) > position:
        return node.args[position]
    return node.kwargs.get(name, default)


def bound_args(node: torch.fx.Node, names: tuple[str, ...]) -> dict[str, Any]:
    """The call's arguments by name (`names`: the signature, in order). Arguments left to
    their defaults are absent. More positional arguments than names is a misread: it
    raises instead of dropping some."""
    if len(node.args) > len(names):
        raise TypeError(f"{node.target} got {len(node.args)} positional arguments, its "
                        f"signature here names {len(names)}: {names}")
    bound = dict(zip(names, node.args, strict=False))
    bound.update(node.kwargs)
    return bound


def varargs(node: torch.fx.Node, start: int) -> tuple[Any, ...]:
    """The arguments from `start` on, given one by one or as one list or tuple (the
    `*dims` of x.permute(0, 2, 1) against x.permute((0, 2, 1)), einsum's operands)."""
    rest = tuple(node.args[start:])
    if len(rest) == 1 and isinstance(rest[0], (tuple, list)):
        return tuple(rest[0])
    return rest
