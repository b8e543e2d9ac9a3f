"""chunk_sums: each sum over the token axis becomes one partial-sum op with a cache.

    m = x.mean(dim=1)                       ->  m = tokpipe.token_sum(x, sum_cache_0, tokpipe_chunk,
                                                                      1, per_unit, [1], False, True)
    s = torch.matmul(v, k)   (over tokens)  ->  s = tokpipe.token_matmul(v, k, sum_cache_1, ...)
    y = F.group_norm(x, 32, w, b)           ->  y = tokpipe.token_group_norm(x, 32, w, b, eps,
                                                                             sum_cache_2, ...)
    y = F.conv2d(x, w, b, padding=1)        ->  y = tokpipe.halo_conv(x, w, b, sum_cache_3, ...)

Each cache holds one slot per grid unit: partial sums (`runtime/token_sums.py`), or the
convolution's input rows (`runtime/halo_conv.py`). A chunk sees this step's values of the
units up to its own and the previous step's after it (stale), the whole sequence when it
is the whole sequence (sync, warmup). In sync mode the one chunk is the whole sequence, so
the ops stay as they are. Causal mode is exact, and these ops need tokens after the chunk:
it refuses them.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from tokpipe_compiler.core.args import arg, bound_args
from tokpipe_compiler.core.errors import TokpipeError, describe
from tokpipe_compiler.core.fx import example_value, target_name
from tokpipe_compiler.core.meta import INVARIANT_INFO, META_KEY, TOKEN, TOKEN_SUM
from tokpipe_compiler.passes.chunk_attention import add_input
from tokpipe_compiler.passes.grid_rules import conv_param
from tokpipe_compiler.runtime import halo_conv, token_sums  # noqa: F401  (define the ops)
from tokpipe_compiler.runtime.caches import SumCacheSpec
from tokpipe_compiler.runtime.kv_attention import CHUNK_INPUT

GROUP_NORM = ("input", "num_groups", "weight", "bias", "eps", "cudnn_enabled")
CONV = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
_CONVS = {torch.conv1d, torch.conv2d, torch.conv3d, torch.nn.functional.conv1d,
          torch.nn.functional.conv2d, torch.nn.functional.conv3d}
_MATMULS = {operator.matmul, torch.matmul, torch.bmm, "matmul", "bmm"}
_FIRST_LAYER = 1000  # sum caches number after attention layers, so names never clash


def chunk_sums(gm: torch.fx.GraphModule, mode: str) -> list[SumCacheSpec]:
    sums = [n for n in gm.graph.nodes if n.meta.get(META_KEY, INVARIANT_INFO).kind == TOKEN_SUM]
    if not sums:
        return []
    if mode == "sync":  # the one chunk is the whole sequence: the op runs as written
        for node in sums:
            node.meta[META_KEY] = node.meta[META_KEY].moved(node.meta[META_KEY].axis, TOKEN)
        return []
    if mode == "causal":
        what = "convolves rows after the chunk" if sums[0].target in _CONVS else \
            "sums over every token, those after the chunk too"
        raise TokpipeError(
            f"mode='causal' is exact, but {describe(sums[0])} {what}; use mode='stale' "
            "(a cache per grid unit, stale for later chunks) or 'sync'")
    chunk = _chunk_input(gm)
    specs = [_rewrite(gm, node, chunk, _FIRST_LAYER + i) for i, node in enumerate(sums)]
    gm.recompile()
    return specs


def _rewrite(gm: torch.fx.GraphModule, node: torch.fx.Node, chunk: torch.fx.Node,
             layer: int) -> SumCacheSpec:
    """Replaces `node` by its partial-sum op; returns the op's cache."""
    name = f"sum_cache_{layer - _FIRST_LAYER}"
    dtype = torch.promote_types(example_value(node).dtype, torch.float32)
    if node.target in (torch.nn.functional.group_norm, torch.group_norm):
        op, args, shape = _group_norm(node)
    elif node.target in _MATMULS:
        op, args, shape = _matmul(node)
    elif node.target in _CONVS:
        op, args, shape = _conv(node)
        dtype = example_value(node).dtype  # input rows, not sums: kept as they are
    else:
        op, args, shape = _reduction(node)
    spec = SumCacheSpec(layer, name, shape, dtype, rows=node.target in _CONVS)
    cache = add_input(gm, name, _example(example_value(node), shape, dtype))
    with gm.graph.inserting_before(node):
        new = gm.graph.call_function(op, (*args[:1 + _SPLIT[op]], cache, chunk,
                                          *args[1 + _SPLIT[op]:]))
    new.meta.update(node.meta)
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)
    return spec


def _example(like: torch.Tensor, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """The cache's example: a fake tensor on the value's device where the value is fake
    (as Dynamo's are), so that planning allocates no cache (gigabytes at high resolution)."""
    mode = getattr(like, "fake_mode", None)
    if mode is None:
        return torch.zeros(shape, dtype=dtype, device=like.device)
    with mode:
        return torch.empty(shape, dtype=dtype, device=like.device)


def _reduction(node: torch.fx.Node) -> tuple:
    x = arg(node, 0, "input")
    info, value = x.meta[META_KEY], example_value(x)
    dims = arg(node, 1, "dim")
    dims = sorted(d % value.dim() for d in (dims if isinstance(dims, (tuple, list)) else [dims]))
    keepdim = arg(node, 2, "keepdim", False) is True
    mean = target_name(node) == "mean"
    rest = [d for d in dims if d != info.axis]
    partial = value.sum(rest, keepdim=True) if rest else value
    shape = [*partial.shape[:info.axis], *partial.shape[info.axis + 1:]]
    units = value.shape[info.axis] // info.per_unit
    op = torch.ops.tokpipe.token_sum.default
    return op, (x, info.axis, info.per_unit, dims, keepdim, mean), (units, *shape)


def _matmul(node: torch.fx.Node) -> tuple:
    a, b = arg(node, 0, "input"), arg(node, 1, "other")
    info = a.meta[META_KEY]
    units = example_value(a).shape[-1] // info.per_unit
    op = torch.ops.tokpipe.token_matmul.default
    return op, (a, b, info.per_unit), (units, *example_value(node).shape)


def _group_norm(node: torch.fx.Node) -> tuple:
    bound = bound_args(node, GROUP_NORM)
    x, groups = bound["input"], bound["num_groups"]
    info, value = x.meta[META_KEY], example_value(x)
    units = value.shape[info.axis] // info.per_unit
    op = torch.ops.tokpipe.token_group_norm.default
    args = (x, groups, bound.get("weight"), bound.get("bias"), bound.get("eps", 1e-5),
            info.axis, info.per_unit)
    return op, args, (units, 2, value.shape[0], groups)


def _conv(node: torch.fx.Node) -> tuple:
    bound = bound_args(node, CONV)
    x = bound["input"]
    info, value = x.meta[META_KEY], example_value(x)
    padding = conv_param(node, 4, "padding", value.dim() - 2)
    per_unit = int(info.per_unit)
    units = value.shape[info.axis] // per_unit
    shape = (units, *value.shape[:info.axis], per_unit, *value.shape[info.axis + 1:])
    op = torch.ops.tokpipe.halo_conv.default
    args = (x, bound["weight"], bound.get("bias"), info.axis, per_unit, padding,
            bound.get("groups", 1))
    return op, args, shape


# Operands before the cache and chunk arguments, per op (the rest follow them).
_SPLIT = {torch.ops.tokpipe.token_sum.default: 0, torch.ops.tokpipe.token_matmul.default: 1,
          torch.ops.tokpipe.token_group_norm.default: 4, torch.ops.tokpipe.halo_conv.default: 2}


def _chunk_input(gm: torch.fx.GraphModule) -> torch.fx.Node:
    """The chunk descriptor input (chunk_attention's, when it added one)."""
    for node in gm.graph.nodes:
        if node.op == "placeholder" and node.target == CHUNK_INPUT:
            return node
    return add_input(gm, CHUNK_INPUT, torch.zeros(3, dtype=torch.long))
