"""Weight transforms computed where they are used.

A value derived from weights alone (a quantized weight unpacked: GGUF's linear dequantizes
its weight in its forward) is the same at every chunk and every call, so split would
compute it once per call in the prelude, ahead of the stages. Every unpacked weight of
the model would then be held for the whole call, as floats, where eager holds one at a
time (GGUF's point is not to hold them). A weight transform that one stage reads is
computed in that stage instead, at each chunk, and freed after it, as eager computes it at
each call. One that several stages (or the graph's output) read stays in the prelude.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from tokpipe_compiler.core.fx import example_value, is_parameter
from tokpipe_compiler.core.meta import INVARIANT_INFO, META_KEY, STAGE_KEY
from tokpipe_compiler.passes.split import alias_of, vmap_regions, writes_into


def place_weight_transforms(gm: torch.fx.GraphModule) -> None:
    """Puts each weight transform that one stage alone reads in that stage (STAGE_KEY)."""
    staged = {n: n.meta[STAGE_KEY] for n in gm.graph.nodes if n.meta.get(STAGE_KEY) is not None}
    for node, stage in transform_stages(gm, staged).items():
        node.meta[STAGE_KEY] = stage


def transform_stages(gm: torch.fx.GraphModule,
                     stage_of: Mapping[torch.fx.Node, int]) -> dict[torch.fx.Node, int]:
    """The stage each weight transform goes to, given the stage of the nodes placed so far
    (a partition's `stage_of`): the one stage that reads it. Not in-place writes and traced
    vmaps, which run in the prelude (`split`), nor what reads a value such a write changes:
    the prelude writes before any stage runs, so a stage would read the new value where
    eager read the old. Leaves `gm` as it is."""
    keep = {n for n in gm.graph.nodes if writes_into(n) is not None}
    changed = _changed_values(gm, keep)
    keep |= {n for n in gm.graph.nodes if changed.intersection(n.all_input_nodes)}
    derived = _weight_derived(gm, keep.union(*vmap_regions(gm)), stage_of)
    placed: dict[torch.fx.Node, int] = {}
    for node in reversed(gm.graph.nodes):  # users first: a chain follows its last op
        if node not in derived or node.op in ("placeholder", "get_attr"):
            continue
        stages = {placed.get(user, stage_of.get(user)) for user in node.users}
        if len(stages) == 1 and None not in stages:
            placed[node] = stages.pop()
    for node in gm.graph.nodes:  # a stage reads tensors: not the tuple of a weight's split
        if node in placed and any(arg not in placed and arg.op.startswith("call_") and
                                  not isinstance(example_value(arg), torch.Tensor)
                                  for arg in node.all_input_nodes):
            del placed[node]
    return placed


def _changed_values(gm: torch.fx.GraphModule,
                    writes: set[torch.fx.Node]) -> set[torch.fx.Node]:
    """The values in-place `writes` change: what each writes (and the values it views, up
    to its base), and every view of those."""
    changed: set[torch.fx.Node] = set()
    for write in writes:
        target = writes_into(write)
        while target is not None:  # up to the written base
            changed.add(target)
            target = alias_of(target)
    for node in gm.graph.nodes:  # views of a changed value, in graph order
        if node not in writes and alias_of(node) in changed:
            changed.add(node)
    return changed


def _weight_derived(gm: torch.fx.GraphModule, keep: set[torch.fx.Node],
                    stage_of: Mapping[torch.fx.Node, int]) -> set[torch.fx.Node]:
    """The weights (parameters, buffers, module attributes) and the values computed from
    them alone, no token or per-call input among their inputs."""
    derived: set[torch.fx.Node] = set()
    for node in gm.graph.nodes:
        weight = node.op == "get_attr" or (node.op == "placeholder" and is_parameter(node))
        if weight or _transforms(node, derived, keep, stage_of):
            derived.add(node)
    return derived


def _transforms(node: torch.fx.Node, derived: set[torch.fx.Node], keep: set[torch.fx.Node],
                stage_of: Mapping[torch.fx.Node, int]) -> bool:
    """Whether `node` is a pure op of `derived` values alone, in no stage yet."""
    return (node.op in ("call_function", "call_method", "call_module")
            and node not in keep and not node.is_impure()
            and not node.meta.get(META_KEY, INVARIANT_INFO).carries_tokens
            and node not in stage_of and bool(node.all_input_nodes)
            and all(arg in derived for arg in node.all_input_nodes))
