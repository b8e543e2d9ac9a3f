"""Small helpers over torch.fx nodes shared by the passes."""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.fx

from tokpipe_compiler.core.logs import LOG
from tokpipe_compiler.core.meta import POSITION_KEY, SOURCE_KEY


def example_value(node: Any) -> Any:
    """The fake (or real) value Dynamo recorded for a node, if any."""
    if not isinstance(node, torch.fx.Node):
        return None
    return node.meta.get("example_value", node.meta.get("val"))


def add_node(graph: torch.fx.Graph, kind: str, target: Any, args: tuple,
             kwargs: dict[str, Any] | None = None) -> torch.fx.Node:
    """A new call_function (`kind` "function") or call_method ("method") node at the graph's
    insertion point, its example value computed from its arguments' (fake) values."""
    kwargs = kwargs or {}
    values, named = torch.fx.node.map_arg((args, kwargs), example_value)
    if kind == "method":
        node = graph.call_method(target, args, kwargs)
        value = getattr(values[0], target)(*values[1:], **named)
    else:
        node = graph.call_function(target, args, kwargs)
        value = target(*values, **named)
    node.meta["example_value"] = value
    return node


def rewritten(gm: torch.fx.GraphModule, count: int, what: str) -> int:
    """After a rewrite pass changed `count` places: the graph checked and recompiled, and
    what was rewritten logged (at INFO). Returns `count`."""
    if count:
        gm.graph.lint()
        gm.recompile()
        LOG.info("%d %s", count, what)
    return count


def node_shape(node: Any) -> torch.Size | None:
    value = example_value(node)
    return value.shape if isinstance(value, torch.Tensor) else None


def is_tensor_node(node: Any) -> bool:
    return isinstance(example_value(node), torch.Tensor)


def record_sources(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Keep where each placeholder came from. Dynamo drops its `grapharg` metadata once the
    backend returns, and the plan is made later, on the first call."""
    for node in gm.graph.nodes:
        source = getattr(node.meta.get("grapharg"), "source", None)
        if node.op == "placeholder" and source is not None:
            node.meta[SOURCE_KEY] = source.name
    return gm


def source_name(node: torch.fx.Node) -> str:
    """Where Dynamo got a placeholder from: "L['latents']", "L['self']._modules[...]..."."""
    return node.meta.get(SOURCE_KEY, "")


# L['name'], optionally one subscript: L['kwargs']['hidden_states'], L['args'][0]; or a
# keyword on the stack of a frame resumed after a graph break: a hook's
# `args, kwargs = pre_forward(...)` leaves the call's keywords at L['___stack0'][1]['t'].
_ARGUMENT = re.compile(r"L\['(?P<name>\w+)'\](?:\['(?P<key>[^']+)'\]|\[(?P<index>\d+)\])?"
                       r"|L\['___stack\d+'\](?:\[\d+\])*\['(?P<stacked>[^']+)'\]")


def argument_of(node: torch.fx.Node) -> str | int | None:
    """The argument of the call a placeholder holds, as the user passed it, from its Dynamo
    source: a parameter ("L['latents']" -> "latents"), a keyword gathered by **kwargs
    ("L['kwargs']['hidden_states']" -> "hidden_states"), a position gathered by *args
    ("L['args'][0]" -> 0), by the forward's parameter name where the backend found it
    (`planning.traced_frame.name_positions`). An entry of a dict or list argument is named
    the same way, by its key or index, and so is a keyword held on a resumed frame's stack.
    None for module parameters and buffers, closures, globals, and anything nested deeper."""
    if node.op != "placeholder":
        return None
    if POSITION_KEY in node.meta:  # through a decorated forward's *args, named
        return node.meta[POSITION_KEY][0]
    match = _ARGUMENT.fullmatch(source_name(node))
    if match is None or match["name"] == "self":
        return None
    if match["stacked"] is not None:
        return match["stacked"]
    if match["key"] is not None:
        return match["key"]
    if match["index"] is not None:
        return int(match["index"])
    return match["name"]


# L['name'] and any chain of subscripts and attributes: L['kwargs']['controlnet_block_samples'][0],
# L['cond'].emb (a tensor read off an object the call passes)
_NESTED = re.compile(r"L\['(?P<name>\w+)'\](?P<path>(?:\['[^']+'\]|\[\d+\]|\.\w+)*)")
_SUBSCRIPT = re.compile(r"\['([^']+)'\]|\[(\d+)\]|\.(\w+)")
# what a module passed as an argument holds: its weights, not the call's
_OWNED = ("_parameters", "_buffers", "_modules")
VARARGS = ("args", "kwargs")  # what a forward's *args and **kwargs are usually called


def input_label(node: torch.fx.Node) -> str | None:
    """A name for each tensor the call passes, however deep in its arguments (None for
    weights, buffers and what is read off a module): `argument_of`'s, but an entry of a
    list or dict is named with it ("image_rotary_emb[0]", not 0; "cond['scale']", not
    "scale"), an entry nested deeper by its path ("block_controlnet_hidden_states[0]"
    of a list passed through **kwargs), and a tensor an object holds by its attribute
    ("cond.emb"), so that no two inputs share a label. A module passed as an argument
    holds weights (its parameters and buffers: None)."""
    argument, source = argument_of(node), source_name(node)
    simple = _ARGUMENT.fullmatch(source)
    if POSITION_KEY in node.meta or (simple and (simple["name"] in VARARGS or (
            simple["index"] is None and simple["key"] is None))):
        return None if argument is None else str(argument)  # argument_of's own name
    match = _NESTED.fullmatch(source)
    if match is None or match["name"] == "self":
        return None
    name, path = match["name"], _SUBSCRIPT.findall(match["path"])
    if any(attribute in _OWNED for _, _, attribute in path):
        return None
    if name in VARARGS:  # gathered by *args or **kwargs: the first subscript is its name
        (key, index, attribute), path = path[0], path[1:]
        name = key or index or attribute
    return name + "".join(f"['{key}']" if key else f".{attribute}" if attribute else
                          f"[{index}]" for key, index, attribute in path)


def position_of(node: torch.fx.Node) -> int | None:
    """The place in the call's positional arguments of an argument passed by position
    (None for one passed by keyword, and for anything not an argument)."""
    if POSITION_KEY in node.meta:
        return node.meta[POSITION_KEY][1]
    argument = argument_of(node)
    return argument if isinstance(argument, int) else None


def is_user_input(node: torch.fx.Node) -> bool:
    """A placeholder that is an argument of the call, not a module's parameter or buffer."""
    name = source_name(node)
    if name:  # L['latents'], L['kwargs']['hidden_states']; not L['self']... or a closure's
        owned = any(part in name for part in ("_parameters", "_buffers", "._modules"))
        return name.startswith("L[") and not name.startswith("L['self']") and not owned
    return not node.name.startswith(("l_self_", "l__self___", "g_"))


def is_parameter(node: torch.fx.Node) -> bool:
    """A placeholder holding a module's parameter or buffer (the weights a stage holds)."""
    name = source_name(node) or node.name
    return node.op == "placeholder" and ("_parameters" in name or "_buffers" in name)


def target_name(node: torch.fx.Node) -> str:
    """A readable name for what a node calls: 'linear', 'view', 'getitem' ..."""
    if node.op in ("call_method", "get_attr", "placeholder", "output"):
        return str(node.target)
    if node.op == "call_module":
        return f"module {node.target}"
    if isinstance(node.target, torch._ops.OpOverload):  # 'mylib::shift', 'add.Tensor'
        return node.target.name().removeprefix("aten::").removesuffix(".default")
    if isinstance(node.target, torch._ops.OpOverloadPacket):
        return node.target._qualified_op_name.removeprefix("aten::")
    name = getattr(node.target, "__name__", str(node.target))
    return name.rsplit(".", 1)[-1]


# The local (or global) a traced frame reached its root module through: `self`, a bound
# method's __self__, or args[0] of a decorated forward's `wrapped(*args, **kwargs)`.
_ROOT = re.compile(r"^(?:L\['args'\]\[0\]|[LG]\['[^']*'\](\.__self__)?)\.?")
# diffusers' hooks call a module's forward through the hook's fn_ref.
_HOOKED = re.compile(r"fn_ref\.original_forward\.__self__\.?")


def module_path(node: torch.fx.Node) -> str:
    """The innermost module path of a node ('transformer_blocks.3.attn1'), or ''."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    paths = [entry[0] for entry in stack.values()]
    # a module reached through a global (transformers' kernelized `apply_rotary_pos_emb`)
    # belongs to the model's module that called it
    inside = [path for path in paths if not path.startswith("G[")]
    return _clean_module_path((inside or paths)[-1])


def _clean_module_path(path: str) -> str:
    # Dynamo writes L['self'].transformer_blocks[3].attn1, and for a function that calls a
    # module's bound method (a ring's step) L['forward'].__self__...: keep the module path.
    path = _HOOKED.sub("", _ROOT.sub("", path))
    path = path.replace("[", ".").replace("]", "").replace("'", "")
    parts = [p for p in path.split(".") if p and p not in _CONTAINERS]
    return ".".join(parts)


_CONTAINERS = ("__dict__", "_modules", "_parameters", "_buffers")


def weight_path(node: torch.fx.Node) -> str:
    """A weight placeholder's path in its model ('blocks.0.attn.qkv.weight'), else its
    name in the graph."""
    return _clean_module_path(source_name(node)) or node.name


def node_count(gm: torch.fx.GraphModule) -> int:
    """Nodes that compute something (not inputs or the output)."""
    return sum(n.op not in ("placeholder", "output") for n in gm.graph.nodes)
