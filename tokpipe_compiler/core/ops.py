"""Tables of rules keyed by op: the key of a node, merging tables, calling a rule.

The token rules (passes) and the cost rules (cost model) are both such tables:

    table = merge_tables({"views": VIEW_RULES, "compute": COMPUTE_RULES})
    info = call_rule("token", table[op_key(node)], node, ctx)

A rule that crashes is a bug in the rule, never a property of the model: `call_rule`
raises `RuleCrashed` naming the table, the op and the node, the original error chained.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch.fx

from tokpipe_compiler.core.errors import CompilerBug, TokpipeError, describe
from tokpipe_compiler.core.fx import target_name

T = TypeVar("T")


def op_key(node: torch.fx.Node) -> Any:
    """What a node calls, as a rule table key: the function itself (torch.cat, F.linear,
    operator.getitem), or "method:<name>" for a tensor method (x.view -> "method:view")."""
    return f"method:{node.target}" if node.op == "call_method" else node.target


def merge_tables(tables: Mapping[str, Mapping[Any, T]]) -> dict[Any, T]:
    """One table from named tables; an op defined in two of them is an error, not an
    override decided by the order of imports."""
    merged: dict[Any, T] = {}
    owner: dict[Any, str] = {}
    for name, table in tables.items():
        for key, rule in table.items():
            if key in merged:
                raise ValueError(f"op {key!r} has a rule in both the {owner[key]!r} and the "
                                 f"{name!r} tables")
            merged[key], owner[key] = rule, name
    return merged


class RuleCrashed(CompilerBug):
    """A rule raised on a node: a bug in tokpipe's rule for that op, not in the model."""

    def __init__(self, table: str, node: torch.fx.Node, error: Exception):
        self.table, self.op, self.node = table, target_name(node), node
        # CompilerBug's message speaks of a broken promise after a pass; this is a crash.
        TokpipeError.__init__(
            self, f"tokpipe internal error: the {table} rule for '{self.op}' crashed on "
            f"{describe(node)}: {type(error).__name__}: {error}. Please report it with the "
            "model; options={'fallback': True} runs the graph unpipelined meanwhile.")


def call_rule(table: str, rule: Callable[..., T], node: torch.fx.Node, *args: Any) -> T:
    """rule(node, *args), a crash raised as RuleCrashed (a TokpipeError passes through)."""
    try:
        return rule(node, *args)
    except TokpipeError:
        raise
    except Exception as error:
        raise RuleCrashed(table, node, error) from error
