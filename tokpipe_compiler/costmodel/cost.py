"""Cost pass: FLOPs and bytes of each node when it processes one chunk of tokens.

A chunk holds `n` tokens (`N`) of a `tokens`-long sequence and attends over `c` tokens of
context (`C`). A TOKEN value's token axis of full size S becomes S * n / tokens; an
INVARIANT value keeps its full shape, so its cost is a constant. Rules are keyed by op
name; an op without a rule is costed as elementwise over its output.

    linear(x[1, 256, 384] token(1), w[1536, 384])
      -> flops 2*384*1536*n + 1536*n,  bytes 4*(384*n + 1536*384 + 1536 + 1536*n)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import sympy
import torch
import torch.fx

from tokpipe_compiler.core.fx import example_value, target_name
from tokpipe_compiler.core.meta import META_KEY, TokenInfo

N, C = sympy.symbols("n c", positive=True, integer=True)
# Key positions per tile of the device's causal attention kernel: a kernel skips masked
# tiles, not masked elements, so a chunk's own causal block costs min(n, tile) / 2 more keys
# per query than its unmasked half. 0 (the default) counts useful work only.
TILE = sympy.Symbol("tile", nonnegative=True, integer=True)

Dims = list[sympy.Expr]


@dataclass(frozen=True)
class Cost:
    """Work of one node or a sum of nodes, as expressions of N and C.

    flops counts all arithmetic; matmul_flops and attention_flops are the parts of it done
    by matrix-multiply and attention kernels (they run at their own rates). launches counts
    the nodes that run a kernel (views launch nothing).
    """

    flops: sympy.Expr
    bytes: sympy.Expr
    matmul_flops: sympy.Expr = sympy.S.Zero
    attention_flops: sympy.Expr = sympy.S.Zero
    launches: int = 0

    def __add__(self, other: Cost) -> Cost:
        return Cost(
            self.flops + other.flops,
            self.bytes + other.bytes,
            self.matmul_flops + other.matmul_flops,
            self.attention_flops + other.attention_flops,
            self.launches + other.launches,
        )

    def at(self, n: int, c: int, tile: int = 0) -> tuple[float, float, float, float]:
        """(flops, bytes, matmul_flops, attention_flops) as numbers for n and c."""
        values = {N: n, C: c, TILE: tile}
        exprs = (self.flops, self.bytes, self.matmul_flops, self.attention_flops)
        return tuple(float(sympy.sympify(e).subs(values)) for e in exprs)


ZERO = Cost(sympy.Integer(0), sympy.Integer(0))


# ---- symbolic shapes -------------------------------------------------------------------


def _info(node: torch.fx.Node) -> TokenInfo | None:
    return node.meta.get(META_KEY)


def _tensors(value: object) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


def _int(size: object) -> sympy.Expr:
    # SymInts (dynamic shapes) become symbols by name; plain ints stay exact.
    try:
        return sympy.Integer(int(size))
    except (TypeError, ValueError, RuntimeError):
        return sympy.sympify(str(size))


def _scaled(t: torch.Tensor, info: TokenInfo | None, tokens: int, sym: sympy.Symbol) -> Dims:
    dims = [_int(s) for s in t.shape]
    if info is None or not info.carries_tokens or info.axis is None:
        return dims
    if not -len(dims) <= info.axis < len(dims):
        return dims
    dims[info.axis] = sym * dims[info.axis] / tokens
    return dims


def dims(arg: object, tokens: int, sym: sympy.Symbol = N) -> Dims | None:
    """Chunk shape of a tensor node: its token axis scaled to `sym` tokens."""
    value = example_value(arg)
    if not isinstance(value, torch.Tensor):
        return None
    return _scaled(value, _info(arg), tokens, sym)


def _numel(d: Dims | None) -> sympy.Expr:
    return sympy.Mul(*d) if d else sympy.Integer(0 if d is None else 1)


def _nbytes(arg: object, tokens: int, sym: sympy.Symbol = N) -> sympy.Expr:
    value = example_value(arg)
    info = _info(arg) if isinstance(arg, torch.fx.Node) else None
    return sum(
        (_numel(_scaled(t, info, tokens, sym)) * t.element_size() for t in _tensors(value)),
        sympy.Integer(0),
    )


def _out_numel(node: torch.fx.Node, tokens: int) -> sympy.Expr:
    info = _info(node)
    parts = [_numel(_scaled(t, info, tokens, N)) for t in _tensors(example_value(node))]
    return sum(parts, sympy.Integer(0))


def _io_bytes(node: torch.fx.Node, tokens: int) -> sympy.Expr:
    """Bytes read from every tensor input plus bytes written to the output."""
    read = sum((_nbytes(a, tokens) for a in node.all_input_nodes), sympy.Integer(0))
    return read + _nbytes(node, tokens)


def _arg(node: torch.fx.Node, index: int, name: str, default: object = None) -> object:
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


# ---- rules -----------------------------------------------------------------------------

Rule = Callable[[torch.fx.Node, int], Cost]


def _free(node: torch.fx.Node, tokens: int) -> Cost:
    return ZERO


def _elementwise(flops_per_element: int) -> Rule:
    def rule(node: torch.fx.Node, tokens: int) -> Cost:
        flops = flops_per_element * _out_numel(node, tokens)
        return Cost(flops, _io_bytes(node, tokens), launches=1)

    return rule


def _copy(node: torch.fx.Node, tokens: int) -> Cost:
    return Cost(sympy.Integer(0), _io_bytes(node, tokens), launches=1)


def _cast(node: torch.fx.Node, tokens: int) -> Cost:
    # .to()/.float() to the dtype a tensor already has returns it unchanged.
    source = example_value(node.args[0]) if node.args else None
    target = example_value(node)
    same = (
        isinstance(source, torch.Tensor)
        and isinstance(target, torch.Tensor)
        and (source.dtype, source.device) == (target.dtype, target.device)
    )
    if same:
        return ZERO
    return _copy(node, tokens)


def _dropout(node: torch.fx.Node, tokens: int) -> Cost:
    training = _arg(node, 2, "training", True)
    return _elementwise(2)(node, tokens) if training else ZERO


def _embedding(node: torch.fx.Node, tokens: int) -> Cost:
    # A gather: reads one table row per output row and writes it.
    return Cost(sympy.Integer(0), 2 * _nbytes(node, tokens), launches=1)


def _creation(node: torch.fx.Node, tokens: int) -> Cost:
    return Cost(_out_numel(node, tokens), _nbytes(node, tokens), launches=1)


def _matmul_cost(node: torch.fx.Node, tokens: int, k: sympy.Expr, bias: bool) -> Cost:
    out = _out_numel(node, tokens)
    mm = 2 * out * k
    return Cost(mm + (out if bias else 0), _io_bytes(node, tokens), mm, launches=1)


def _linear(node: torch.fx.Node, tokens: int) -> Cost:
    k = dims(node.args[0], tokens)[-1]
    return _matmul_cost(node, tokens, k, _arg(node, 2, "bias") is not None)


def _matmul(node: torch.fx.Node, tokens: int) -> Cost:
    k = dims(node.args[0], tokens)[-1]
    return _matmul_cost(node, tokens, k, bias=False)


def _addmm(node: torch.fx.Node, tokens: int) -> Cost:
    k = dims(node.args[1], tokens)[-1]
    return _matmul_cost(node, tokens, k, bias=True)


def _conv(node: torch.fx.Node, tokens: int) -> Cost:
    # weight [C_out, C_in/groups, *kernel]: each output element is a dot of that length.
    weight = dims(node.args[1], tokens)
    return _matmul_cost(node, tokens, _numel(weight[1:]), _arg(node, 2, "bias") is not None)


def _conv_transpose(node: torch.fx.Node, tokens: int) -> Cost:
    # weight [C_in, C_out/groups, *kernel]: each input element scatters into that many.
    inp, weight = dims(node.args[0], tokens), dims(node.args[1], tokens)
    mm = 2 * _numel(inp) * _numel(weight[1:])
    return Cost(mm, _io_bytes(node, tokens), mm, launches=1)


def _einsum(node: torch.fx.Node, tokens: int) -> Cost:
    equation = str(node.args[0]).replace(" ", "")
    operands = node.args[1:]
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = operands[0]
    if len(operands) < 2:
        return _copy(node, tokens)  # a permutation or reduction of one operand
    sizes: dict[str, sympy.Expr] = {}
    for letters, operand in zip(equation.split("->")[0].split(","), operands, strict=False):
        for letter, size in zip(letters, dims(operand, tokens), strict=False):
            sizes[letter] = size
    mm = 2 * (len(operands) - 1) * sympy.Mul(*sizes.values())
    return Cost(mm, _io_bytes(node, tokens), mm, launches=1)


_SOFTMAX_FLOPS = 5  # scale, max, exp, sum, divide per score


def _attention(node: torch.fx.Node, tokens: int) -> Cost:
    """q of n tokens against k/v of c tokens (or a fixed length for token-free k/v).

    A fused kernel never writes the score matrix, so bytes are q, k, v and the output.
    """
    q, k, v = (_arg(node, i, name) for i, name in enumerate(("query", "key", "value")))
    qd, kd, vd = dims(q, tokens), dims(k, tokens, C), dims(v, tokens, C)
    keys = kd[-2]
    key_info = _info(k)
    if _arg(node, 5, "is_causal", False) and key_info is not None and key_info.carries_tokens:
        keys = C - N / 2 + sympy.Min(N, TILE) / 2  # the chunk's own block is half masked
    rows = _numel(dims(node, tokens)[:-1])  # batch * heads * query tokens
    flops = rows * keys * (2 * qd[-1] + 2 * vd[-1] + _SOFTMAX_FLOPS)
    nbytes = _nbytes(q, tokens) + _nbytes(k, tokens, C) + _nbytes(v, tokens, C)
    mask = _arg(node, 3, "attn_mask")
    if isinstance(mask, torch.fx.Node):
        nbytes += _nbytes(mask, tokens, N)
    return Cost(flops, nbytes + _nbytes(node, tokens), attention_flops=flops, launches=1)


def _reduction(node: torch.fx.Node, tokens: int) -> Cost:
    # One flop per element read, not per element written.
    source = node.args[0] if node.args else None
    flops = _numel(dims(source, tokens)) if isinstance(source, torch.fx.Node) else 0
    return Cost(sympy.sympify(flops), _io_bytes(node, tokens), launches=1)


_VIEWS = (
    "view", "reshape", "transpose", "permute", "unsqueeze", "squeeze", "flatten", "unflatten",
    "expand", "expand_as", "view_as", "getitem", "chunk", "split", "unbind", "narrow", "select",
    "movedim", "t", "detach", "size", "dim",
)  # fmt: skip
_COPIES = ("cat", "stack", "clone", "contiguous", "pad", "repeat", "roll", "index_select")
_CASTS = ("to", "float", "half", "bfloat16", "type", "type_as")
_NORMS = ("layer_norm", "group_norm", "rms_norm", "batch_norm", "instance_norm", "normalize")
_TRANSCENDENTAL = ("exp", "log", "sin", "cos", "tanh", "sigmoid", "rsqrt", "sqrt", "erf", "pow")
_REDUCTIONS = ("sum", "mean", "amax", "amin", "max", "min", "var", "std", "norm")

RULES: dict[str, Rule] = {
    **dict.fromkeys(_VIEWS, _free),
    **dict.fromkeys(_COPIES, _copy),
    **dict.fromkeys(_CASTS, _cast),
    **dict.fromkeys(_NORMS, _elementwise(8)),  # mean, variance, normalise, affine
    **dict.fromkeys(_TRANSCENDENTAL, _elementwise(4)),
    **dict.fromkeys(("softmax", "log_softmax"), _elementwise(_SOFTMAX_FLOPS)),
    **dict.fromkeys(("gelu", "silu", "mish"), _elementwise(8)),
    **dict.fromkeys(("arange", "zeros", "ones", "full", "empty", "randn", "rand"), _creation),
    "dropout": _dropout,
    "embedding": _embedding,
    "linear": _linear,
    **dict.fromkeys(("matmul", "mm", "bmm"), _matmul),
    **dict.fromkeys(("addmm", "baddbmm"), _addmm),
    **dict.fromkeys(("conv1d", "conv2d", "conv3d"), _conv),
    **dict.fromkeys(("conv_transpose1d", "conv_transpose2d", "conv_transpose3d"), _conv_transpose),
    "einsum": _einsum,
    "scaled_dot_product_attention": _attention,
    **dict.fromkeys(_REDUCTIONS, _reduction),
}


_DEFAULT = _elementwise(1)
_ROLES_WITHOUT_WORK = ("placeholder", "get_attr", "output")


def node_cost(node: torch.fx.Node, tokens: int) -> Cost:
    """FLOPs and bytes of `node` on a chunk of N tokens with C tokens of context."""
    if node.op in _ROLES_WITHOUT_WORK or not _tensors(example_value(node)):
        return ZERO
    rule = RULES.get(target_name(node), _DEFAULT)
    try:
        return rule(node, tokens)
    except (TypeError, ValueError, IndexError, KeyError, AttributeError):
        # Arguments in an unexpected form: an estimate beats failing the compile.
        return _DEFAULT(node, tokens)


def graph_cost(nodes: Iterable[torch.fx.Node], tokens: int) -> Cost:
    """Sum of `node_cost` over `nodes`."""
    costs = [node_cost(node, tokens) for node in nodes]
    return Cost(
        sympy.Add(*(c.flops for c in costs)),
        sympy.Add(*(c.bytes for c in costs)),
        sympy.Add(*(c.matmul_flops for c in costs)),
        sympy.Add(*(c.attention_flops for c in costs)),
        sum(c.launches for c in costs),
    )
