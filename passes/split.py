"""split: one GraphModule per stage, plus the prelude of invariant values.

Every value a stage reads from outside comes in as a placeholder: a boundary value sent by
an earlier stage, a per-call tensor sliced to the chunk, or a per-call value (the kinds of
`core/stage_graph.py`). The prelude computes the invariant values once per call; it never
sees a token. A stage computes the nodes that carry its STAGE_KEY: partition's, and the
weight transforms `passes/weight_transforms.py` placed with their one stage's readers.
"""

from __future__ import annotations

import operator

import torch
import torch.fx
from torch._functorch import predispatch

from tokpipe_compiler.core.errors import TokpipeError, describe
from tokpipe_compiler.core.meta import INVARIANT_INFO, META_KEY, STAGE_KEY
from tokpipe_compiler.core.stage_graph import (
    BOUNDARY,
    CALL,
    SLICED,
    OutputKind,
    OutputSpec,
    SplitGraphs,
    StageGraph,
    StageInput,
)
from tokpipe_compiler.runtime.chunking import chunk_slice


def is_chunk_source(node: torch.fx.Node) -> bool:
    """Token values the runtime cuts from a full per-call tensor instead of computing."""
    return node.op == "placeholder" or node.target is chunk_slice


# torch.vmap traced into the graph (flex_attention's block masks are built this way): its
# nesting levels are global state that must rise and fall within one run of one graph.
_VMAP_IN = (predispatch._vmap_increment_nesting, torch._C._functorch._vmap_increment_nesting)
_VMAP_OUT = (predispatch._vmap_decrement_nesting, torch._C._functorch._vmap_decrement_nesting)


def vmap_regions(gm: torch.fx.GraphModule) -> list[list[torch.fx.Node]]:
    """The nodes of each outermost traced vmap, from its first nesting call to its last."""
    regions: list[list[torch.fx.Node]] = []
    depth = 0
    for node in gm.graph.nodes:
        if node.target in _VMAP_IN:
            if not depth:
                regions.append([])
            depth += 1
        if depth:
            regions[-1].append(node)
        if node.target in _VMAP_OUT:
            depth -= 1
    return regions


def _check_vmap_regions(regions: list[list[torch.fx.Node]]) -> None:
    """A vmapped region runs whole in the prelude; one that touches tokens cannot."""
    for region in regions:
        staged = next((n for n in region if n.meta.get(STAGE_KEY) is not None), None)
        if staged is not None:
            raise TokpipeError(
                f"tokpipe cannot split {describe(staged)}: it is computed inside a traced "
                "torch.vmap (flex_attention's create_block_mask, say) from the tokens, and "
                "a vmapped region must run in one piece. Build the mask outside the "
                "compiled call, use another attention backend, or pass "
                "options={'fallback': True} to run this graph unpipelined.")


def _is_impure(node: torch.fx.Node) -> bool:
    return node.is_impure() or node.target in _VMAP_IN + _VMAP_OUT


def split(gm: torch.fx.GraphModule, stages: int, runtime_inputs: set[str]) -> SplitGraphs:
    """`runtime_inputs`: placeholders the runtime provides itself (K/V caches, the chunk)."""
    regions = vmap_regions(gm)
    _check_vmap_regions(regions)
    _check_written_inputs(gm, runtime_inputs)
    graph_outputs = _output_nodes(gm)
    autocast = autocast_regions(gm)
    stage_graphs = [_stage_graph(gm, s, graph_outputs, autocast) for s in range(stages)]
    needed = {i.source for g in stage_graphs for i in g.inputs if i.kind != BOUNDARY}
    needed |= {n.name for n in graph_outputs if not _info(n).carries_tokens}
    prelude, prelude_outputs = _prelude(gm, needed - runtime_inputs, runtime_inputs, regions,
                                        autocast)
    return SplitGraphs(
        prelude=prelude,
        prelude_outputs=prelude_outputs,
        input_names=[n.name for n in gm.graph.nodes
                     if n.op == "placeholder" and n.name not in runtime_inputs],
        stages=stage_graphs,
        outputs=_output_specs(gm),
    )


def _info(node: torch.fx.Node):
    return node.meta.get(META_KEY, INVARIANT_INFO)


def _output_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    out = next(n for n in gm.graph.nodes if n.op == "output")
    return list(out.all_input_nodes)


def autocast_regions(gm: torch.fx.GraphModule
                     ) -> list[tuple[torch.fx.Node, torch.fx.Node, set[torch.fx.Node]]]:
    """Each `torch.autocast` region of the forward, as Dynamo traces it: its enter and exit
    calls and the nodes between them."""
    order = list(gm.graph.nodes)
    at = {node: i for i, node in enumerate(order)}
    regions = []
    for enter in order:
        if enter.target is torch.amp.autocast_mode._enter_autocast:
            exit_ = next((u for u in enter.users
                          if u.target is torch.amp.autocast_mode._exit_autocast), None)
            if exit_ is not None:
                regions.append((enter, exit_, set(order[at[enter] + 1:at[exit_]])))
    return regions


def _with_autocast(nodes: set[torch.fx.Node], regions: list) -> set[torch.fx.Node]:
    """`nodes` with the enter and exit calls of every autocast region one of them is in:
    a graph that computes an op of the region computes it under the region's autocast."""
    return nodes.union(*({enter, exit_} for enter, exit_, inside in regions
                         if not nodes.isdisjoint(inside)))


def _stage_graph(gm: torch.fx.GraphModule, stage: int, graph_outputs: list,
                 autocast: list) -> StageGraph:
    """`autocast`: the graph's `autocast_regions`."""
    staged = {n for n in gm.graph.nodes if n.meta.get(STAGE_KEY) == stage}
    member_set = _with_autocast(staged, autocast)
    members = [n for n in gm.graph.nodes if n in member_set]
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    inputs: list[StageInput] = []

    def bring(arg: torch.fx.Node) -> torch.fx.Node:
        if arg not in env and arg.op == "get_attr":
            # A module attribute (a higher-order op's subgraph, such as flex_attention's
            # score_mod) is the stage's own, not a value to pass in.
            env[arg] = graph.node_copy(arg)
        if arg not in env:
            inputs.append(_stage_input(arg))
            env[arg] = graph.placeholder(inputs[-1].name)
            env[arg].meta.update(arg.meta)
        return env[arg]

    for node in members:
        for arg in node.all_input_nodes:
            if arg not in member_set:
                bring(arg)
        env[node] = graph.node_copy(node, lambda a: env[a])
    exported = [n for n in members
                if n in graph_outputs or any(u not in member_set and u.op != "output"
                                             and u.meta.get(STAGE_KEY) is not None
                                             for u in n.users)]
    graph.output(tuple(env[n] for n in exported))
    module = torch.fx.GraphModule(gm, graph, class_name=f"stage_{stage}")
    infos = {n.name: _info(n) for n in exported}
    return StageGraph(stage, module, inputs, [n.name for n in exported], infos)


def _stage_input(arg: torch.fx.Node) -> StageInput:
    info = _info(arg)
    if is_chunk_source(arg) and info.carries_tokens:
        source = arg.name if arg.op == "placeholder" else arg.args[0].name
        return StageInput(arg.name, SLICED, source, info.axis, info.per_unit)
    if info.carries_tokens:
        return StageInput(arg.name, BOUNDARY, arg.name, info.axis, info.per_unit,
                          arg.meta[STAGE_KEY])
    return StageInput(arg.name, CALL, arg.name)


def _prelude(
    gm: torch.fx.GraphModule, needed: set[str], runtime_inputs: set[str],
    vmap_regions: list[list[torch.fx.Node]], autocast: list,
) -> tuple[torch.fx.GraphModule, list[str]]:
    """A graph from the original inputs to every invariant value the stages read, and to
    every write into an input (annotate refused those of token values); a traced vmap it
    reads from comes whole (its last nesting call has no users)."""
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    by_name = {n.name: n for n in gm.graph.nodes}
    roots = [by_name[name] for name in needed] + input_writes(gm.graph, runtime_inputs)
    wanted = _with_writes(gm.graph, _ancestors(roots))
    for region in vmap_regions:
        if wanted.intersection(region):
            wanted |= _ancestors(region)
    wanted = _with_autocast(wanted, autocast)
    for node in gm.graph.nodes:
        if node.op == "placeholder" and node.name not in runtime_inputs:
            env[node] = graph.placeholder(node.name)
            env[node].meta.update(node.meta)
        elif node in wanted and node.op != "output":
            env[node] = graph.node_copy(node, lambda a: env[a])
    names = sorted(needed, key=lambda name: list(by_name).index(name))
    graph.output(tuple(env[by_name[name]] for name in names))
    return torch.fx.GraphModule(gm, graph, class_name="prelude"), names


def live_nodes(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """What the graph's outputs and effects need, with the in-place writes into it
    (`m.mul_(g)`, `F.silu(m, inplace=True)`): fx's dead code elimination drops a write,
    which has no users, and the value read after it then misses it."""
    roots = [n for n in graph.nodes
             if n.op == "output" or (n.op != "placeholder" and n.is_impure())]
    return _with_writes(graph, _ancestors(roots))


def _with_writes(graph: torch.fx.Graph, wanted: set[torch.fx.Node]) -> set[torch.fx.Node]:
    """`wanted` plus the in-place writes into its values (`ids[..., 0] = rows`, `x.add_(y)`,
    and through views: `x[:, 5:].copy_(y)`, `x.data[...]`): they have no users, so following
    inputs alone would drop them."""
    while True:
        writes = [n for n in graph.nodes if n not in wanted and written_base(n) in wanted]
        if not writes:
            return wanted
        wanted |= _ancestors(writes)


# Python's augmented assignments, in place on a tensor (`x += y`, `x[i] = y`).
_IN_PLACE_OPERATORS = {operator.setitem, operator.iadd, operator.isub, operator.imul,
                       operator.itruediv, operator.ifloordiv, operator.ipow, operator.imod,
                       operator.iand, operator.ior, operator.ixor, operator.ilshift,
                       operator.irshift}

# Python's operators whose names end in "_" and write nothing (`a & b`, `a | b`, `not a`).
_NAMED_LIKE_IN_PLACE = {operator.and_, operator.or_, operator.not_, operator.is_}


def writes_into(node: torch.fx.Node) -> torch.fx.Node | None:
    """The tensor an op writes in place: `x.add_(y)`, `torch.relu_(x)`, `x += y`,
    `x[i] = y`, `F.relu(x, inplace=True)`, `torch.add(a, b, out=x)`."""
    if node.op not in ("call_method", "call_function"):
        return None
    out = node.kwargs.get("out")
    if isinstance(out, torch.fx.Node):
        return out
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    in_place = (node.target in _IN_PLACE_OPERATORS or node.kwargs.get("inplace") is True
                or (name.endswith("_") and not name.startswith("_")
                    and node.target not in _NAMED_LIKE_IN_PLACE))
    target = node.args[0] if in_place and node.args else None
    return target if isinstance(target, torch.fx.Node) else None


# Ops whose result may share its input's storage: a write into it may write the input.
# Following one that copied (a reshape) only keeps a write that changes nothing read.
_VIEWS = {operator.getitem, torch.narrow, torch.select, torch.transpose, torch.permute,
          torch.unsqueeze, torch.squeeze, torch.detach, torch.reshape, torch.flatten,
          torch._C._autograd._get_data_attr}
_VIEW_METHODS = {"view", "narrow", "select", "transpose", "permute", "unsqueeze", "squeeze",
                 "detach", "reshape", "flatten", "expand", "view_as", "unflatten", "movedim"}


def alias_of(node: torch.fx.Node) -> torch.fx.Node | None:
    """What `node`'s value shares storage with: the input of a view, the target of an
    in-place write (`x.mul_(a).add_(b)` writes `x` twice); None for a value of its own."""
    if node.args and (node.target in _VIEWS
                      or (node.op == "call_method" and node.target in _VIEW_METHODS)):
        return node.args[0] if isinstance(node.args[0], torch.fx.Node) else None
    return writes_into(node)


def written_base(node: torch.fx.Node) -> torch.fx.Node | None:
    """The value an in-place write changes: its target, or what that target views or was
    (through an earlier write: `x.mul_(a).add_(b)` changes `x`)."""
    target = writes_into(node)
    while target is not None and (alias := alias_of(target)) is not None:
        target = alias
    return target


def input_writes(graph: torch.fx.Graph, runtime_inputs: set[str]) -> list[torch.fx.Node]:
    """The in-place writes into the graph's inputs (buffers, parameters, arguments, or views
    of them), but not the runtime's own (K/V caches): they outlive the call, so each runs
    once per call, though nothing in the graph reads what it wrote."""
    return [n for n in graph.nodes if (base := written_base(n)) is not None
            and base.op == "placeholder" and base.name not in runtime_inputs]


def _check_written_inputs(gm: torch.fx.GraphModule, runtime_inputs: set[str]) -> None:
    """A write into an input runs in the per-call prelude, ahead of every stage: a stage (or
    a chunk cut of a table) reading that input, or a view of it, before the write, where
    eager reads the old value, would read the new one."""
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    last: dict[torch.fx.Node, torch.fx.Node] = {}  # an input -> the last write into it
    for write in input_writes(gm.graph, runtime_inputs):
        last[written_base(write)] = write
    for base, write in last.items():
        shared = {base}
        for node in gm.graph.nodes:
            if alias_of(node) in shared:
                shared.add(node)
        reader = next((u for n in shared for u in n.users
                       if _info(u).carries_tokens and order[u] < order[write]), None)
        if reader is not None:
            raise TokpipeError(
                f"tokpipe cannot pipeline {describe(reader)}: it reads '{base.name}' before "
                f"{describe(write)} writes it in place. The write runs once per call ahead "
                "of the stages, so they would read the new value where eager reads the old. "
                "Read a copy (`.clone()`), update it after the call, outside the compiled "
                "model, or pass options={'fallback': True} to run this graph unpipelined.")


def _ancestors(nodes: list[torch.fx.Node]) -> set[torch.fx.Node]:
    seen: set[torch.fx.Node] = set()
    stack = list(nodes)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        stack.extend(node.all_input_nodes)
    return seen


def _output_specs(gm: torch.fx.GraphModule) -> list[OutputSpec]:
    out = next(n for n in gm.graph.nodes if n.op == "output")
    values = out.args[0] if isinstance(out.args[0], (tuple, list)) else [out.args[0]]
    specs = []
    for value in values:
        if not isinstance(value, torch.fx.Node):
            specs.append(OutputSpec(OutputKind.CONST, value))
        elif _info(value).carries_tokens and not is_chunk_source(value):
            info = _info(value)
            specs.append(OutputSpec(OutputKind.TOKEN, value.name, info.axis, info.per_unit,
                                    value.meta[STAGE_KEY]))
        else:
            specs.append(OutputSpec(OutputKind.CALL, value.name))
    return specs


def prelude_for(graphs: SplitGraphs, stages: set[int]) -> tuple[torch.fx.GraphModule, list[str]]:
    """The prelude cut down to what `stages` read (and the graph's invariant outputs): on
    one rank per stage, a rank computes and holds only its own stages' conditioning."""
    live, kept = prelude_part(graphs, stages)
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in graphs.prelude.graph.nodes:
        if node.op == "placeholder" or (node in live and node.op != "output"):
            env[node] = graph.node_copy(node, lambda a: env[a])
    graph.output(tuple(env[node] for node in kept.values()))
    return torch.fx.GraphModule(graphs.prelude, graph, class_name="prelude"), list(kept)


def prelude_part(graphs: SplitGraphs, stages: set[int]
                 ) -> tuple[set[torch.fx.Node], dict[str, torch.fx.Node]]:
    """(the prelude's nodes that what `stages` read needs, the output values kept by name,
    in output order). Writes into needed values (`mask.masked_fill_(...)`, which FX does
    not take for impure) and into the inputs (every rank's copy of a buffer updated alike)
    and vmap levels are needed too."""
    needed = {i.source for g in graphs.stages if g.index in stages for i in g.inputs
              if i.kind != BOUNDARY}
    needed |= {o.source for o in graphs.outputs if o.kind == OutputKind.CALL}
    graph = graphs.prelude.graph
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    kept = {name: node for name, node in zip(graphs.prelude_outputs, output.args[0],
                                             strict=True) if name in needed}
    writes = _with_writes(graph, _ancestors(list(kept.values()) + input_writes(graph, set())))
    roots = list(kept.values()) + [n for n in writes if writes_into(n) is not None] + [
        n for n in graph.nodes if n.op not in ("placeholder", "output") and _is_impure(n)]
    return _ancestors(roots), kept
