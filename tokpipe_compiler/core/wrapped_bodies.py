"""Bodies Dynamo wraps in a higher-order op, put back in line.

Research code often leaves `torch.utils.checkpoint` around its blocks; Dynamo traces each
checkpointed call as `tag_activation_checkpoint(body, *args)` (`wrap(body, *args)` for its
own wrapped calls), a call of a subgraph. For inference both are the body itself, and
only ops in line can be given token rules and cut into stages, so the graph Dynamo hands
over gets each such call replaced by its body's nodes.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

_WRAPPERS = tuple(
    op for name in ("tag_activation_checkpoint", "wrap")
    if (op := getattr(torch.ops.higher_order, name, None)) is not None)


def inline_wrapped_bodies(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """`gm` with every wrapper call whose results are only indexed replaced by its body,
    nested ones too; others are left as they are (the planner then names them)."""
    inlined = False
    while any(_inline(gm, node) for node in list(gm.graph.nodes) if _is_wrapper(node)):
        inlined = True
    if inlined:  # the graph as Dynamo made it otherwise (its dead in-place ops kept)
        gm.recompile()
    return gm


def _is_wrapper(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target in _WRAPPERS


def _inline(gm: torch.fx.GraphModule, call: torch.fx.Node) -> bool:
    """Replace `call` by its body's nodes; False where a result is used other than by
    index (nothing changes then)."""
    body_ref, *operands = call.args
    if body_ref.op != "get_attr" or any(
            user.op != "call_function" or user.target is not operator.getitem
            for user in call.users):
        return False
    body: torch.fx.GraphModule = getattr(gm, body_ref.target)
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    placeholders = iter(operands)
    with gm.graph.inserting_before(call):
        for node in body.graph.nodes:
            if node.op == "placeholder":
                env[node] = next(placeholders)
            elif node.op == "output":
                results = node.args[0]
            elif node.op == "get_attr":
                env[node] = gm.graph.get_attr(_adopt(gm, body, node.target))
                env[node].meta = dict(node.meta)
            else:
                env[node] = gm.graph.node_copy(node, lambda n: env[n])
    for user in list(call.users):
        user.replace_all_uses_with(env[results[user.args[1]]])
        gm.graph.erase_node(user)
    gm.graph.erase_node(call)
    return True


def _adopt(gm: torch.fx.GraphModule, body: torch.fx.GraphModule, target: str) -> str:
    """`body`'s attribute `target` (a nested body, a constant) set on `gm` under a name
    of its own there."""
    value = body
    for part in target.split("."):
        value = getattr(value, part)
    stem, index = target.replace(".", "_"), 0
    while hasattr(gm, f"{stem}_{index}"):
        index += 1
    name = f"{stem}_{index}"
    if isinstance(value, torch.nn.Module):
        gm.add_submodule(name, value)
    else:
        setattr(gm, name, value)
    return name
