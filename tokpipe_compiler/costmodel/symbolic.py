"""The cost model's symbols and shapes: a node's work as sympy expressions of the chunk
length N, the attention context C and the share TEXT of joint attention's text segments
the chunk computes, and the chunk shape of each FX value: its token axis of full size S
becomes S * N / tokens, and with text segments of G tokens around the image rows,
TEXT * G + (S - G) * N / tokens (the context C always holds the whole text, fresh or
cached); other axes keep their size.

    q = cat([txt_q, img_q], 2)  [1, 2, 512 + 4096, 64]  ->  [1, 2, 512 TEXT + n, 64]
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy
import torch
import torch.fx
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from tokpipe_compiler.core.fx import example_value
from tokpipe_compiler.core.meta import META_KEY, TokenInfo
from tokpipe_compiler.core.tensor_bytes import storage_bytes

N, C = sympy.symbols("n c", positive=True, integer=True)
# Key positions per tile of the device's causal attention kernel: a kernel skips masked
# tiles, not masked elements, so a chunk's own causal block costs min(n, tile) / 2 more keys
# per query than its unmasked half. 0 (the default) counts useful work only.
TILE = sympy.Symbol("tile", nonnegative=True, integer=True)
# The share of the text segments a chunk computes: 1 where it computes them (every chunk
# with text_chunks="every", a step's first chunk with "first", a whole pass), 0 where it
# attends to their cached K/V; a stage's mean over a step's chunks weighs the partition.
TEXT = sympy.Symbol("text", nonnegative=True)

Dims = list[sympy.Expr]
# GPU attention kernels run a head dim padded up to a multiple of this (on an H200, heads
# of 72 cost per score what heads of 128 cost: BENCHMARKS.md, "GPU: one H200").
ATTENTION_HEAD_STEP = 64


def padded_head(dim: sympy.Expr) -> sympy.Expr:
    """`dim` rounded up to a multiple of ATTENTION_HEAD_STEP (as is, if symbolic)."""
    if not sympy.sympify(dim).is_Integer:
        return dim
    return -(-int(dim) // ATTENTION_HEAD_STEP) * ATTENTION_HEAD_STEP


@dataclass(frozen=True)
class Gemm:
    """`count` matrix products of a chunk, [rows, depth] @ [depth, cols] each (leading
    batch dims folded into the rows). On a GPU their time is set by how many output tiles
    they make for its multiprocessors, not by their FLOPs alone (calibrate.DeviceRates)."""

    rows: sympy.Expr
    cols: int
    depth: int
    count: int = 1

    @property
    def flops(self) -> sympy.Expr:
        return 2 * self.count * self.rows * self.cols * self.depth


def merged(gemms: tuple[Gemm, ...]) -> tuple[Gemm, ...]:
    """`gemms` with the same shapes counted once each (a stage repeats a block's few)."""
    counts: dict[tuple, int] = {}
    for g in gemms:
        key = (g.rows, g.cols, g.depth)
        counts[key] = counts.get(key, 0) + g.count
    return tuple(Gemm(*key, count) for key, count in counts.items())


@dataclass(frozen=True)
class Cost:
    """Work of one node or a sum of nodes, as expressions of N and C.

    flops counts all arithmetic; matmul_flops and attention_flops are the parts of it done
    by matrix-multiply and attention kernels (they run at their own rates). launches counts
    the nodes that run a kernel (views launch nothing); text_launches, those of them that
    compute only joint attention's text stream, which a chunk leaving the text to the
    step's first chunk does not run. text_rows: the rows of the text segments a chunk that
    computes them carries (the most of any node): they count in the rows of its matrix
    products, whose rate grows with their rows. gemms: the shapes of the matrix products
    whose shapes are known (most of matmul_flops; the rest runs at the rate by rows).
    attention_scores: the query-key scores the attention kernels compute; attention_padded:
    their matrix products' FLOPs with each head dim padded as a GPU kernel pads it
    (ATTENTION_HEAD_STEP), for devices that time attention by score (calibrate.DeviceRates).
    """

    flops: sympy.Expr
    bytes: sympy.Expr
    matmul_flops: sympy.Expr = sympy.S.Zero
    attention_flops: sympy.Expr = sympy.S.Zero
    launches: int = 0
    text_rows: int = 0
    text_launches: int = 0
    gemms: tuple[Gemm, ...] = ()
    attention_scores: sympy.Expr = sympy.S.Zero
    attention_padded: sympy.Expr = sympy.S.Zero

    def __add__(self, other: Cost) -> Cost:
        return Cost(
            self.flops + other.flops,
            self.bytes + other.bytes,
            self.matmul_flops + other.matmul_flops,
            self.attention_flops + other.attention_flops,
            self.launches + other.launches,
            max(self.text_rows, other.text_rows),
            self.text_launches + other.text_launches,
            merged(self.gemms + other.gemms),
            self.attention_scores + other.attention_scores,
            self.attention_padded + other.attention_padded,
        )

    def times(self, k: int) -> Cost:
        """`k` copies of this work (k identical layers)."""
        return Cost(k * self.flops, k * self.bytes, k * self.matmul_flops,
                    k * self.attention_flops, k * self.launches, self.text_rows,
                    k * self.text_launches,
                    tuple(Gemm(g.rows, g.cols, g.depth, k * g.count) for g in self.gemms),
                    k * self.attention_scores, k * self.attention_padded)

    def launches_at(self, text: float = 1.0) -> float:
        """Kernel launches of a chunk that computes `text` of the text segments (a share
        over a step's chunks: the mean)."""
        return self.launches - (1.0 - text) * self.text_launches

    def at(self, n: int, c: int, tile: int = 0,
           text: float = 1.0) -> tuple[float, float, float, float]:
        """(flops, bytes, matmul_flops, attention_flops) as numbers for n, c and the
        chunk's share of the text segments."""
        exprs = (self.flops, self.bytes, self.matmul_flops, self.attention_flops)
        return tuple(_number(e, n, c, tile, text) for e in exprs)

    def attention_at(self, n: int, c: int, tile: int = 0,
                     text: float = 1.0) -> tuple[float, float]:
        """(attention_scores, attention_padded) as numbers."""
        return tuple(_number(e, n, c, tile, text)
                     for e in (self.attention_scores, self.attention_padded))

    def gemms_at(self, n: int, c: int, text: float = 1.0) -> list[tuple[float, int, int, int]]:
        """(rows, cols, depth, count) of each of `gemms` for n, c and the text share."""
        return [(_number(g.rows, n, c, 0, text), g.cols, g.depth, g.count) for g in self.gemms]


def _number(expr: sympy.Expr, n: int, c: int, tile: int, text: float) -> float:
    values = {N: sympy.Integer(n), C: sympy.Integer(c), TILE: sympy.Integer(tile),
              TEXT: sympy.sympify(text)}
    # xreplace: a plain substitution, an order of magnitude faster than subs on the
    # thousands of nodes a full-depth model plans.
    return float(sympy.sympify(expr).xreplace(values))


ZERO = Cost(sympy.Integer(0), sympy.Integer(0))


# ---- symbolic shapes -------------------------------------------------------------------


def token_info(node: torch.fx.Node) -> TokenInfo | None:
    return node.meta.get(META_KEY)


def tensors(value: object) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in tensors(v)]
    return []


def sym_int(size: object) -> sympy.Expr:
    # SymInts (dynamic shapes) become symbols by name; plain ints stay exact.
    try:
        return sympy.Integer(int(size))
    except (TypeError, ValueError, RuntimeError):
        return sympy.sympify(str(size))


def scaled(t: torch.Tensor, info: TokenInfo | None, tokens: int, sym: sympy.Symbol) -> Dims:
    """The shape of `t` with its token axis (per `info`) scaled to `sym` of `tokens`."""
    sizes = [sym_int(s) for s in t.shape]
    if info is None or not info.carries_tokens or info.axis is None:
        return sizes
    if not -len(sizes) <= info.axis < len(sizes):
        return sizes
    full = sizes[info.axis]
    text = info.outer * (info.lead + info.trail)
    if not info.segmented or not full.is_Integer or int(full) < text:
        sizes[info.axis] = sym * full / tokens
        return sizes
    share = 1 if sym == C else TEXT
    sizes[info.axis] = share * text + sym * (full - text) / tokens
    return sizes


def dims(value_node: object, tokens: int, sym: sympy.Symbol = N) -> Dims | None:
    """Chunk shape of a tensor node: its token axis scaled to `sym` tokens."""
    value = example_value(value_node)
    if not isinstance(value, torch.Tensor):
        return None
    return scaled(value, token_info(value_node), tokens, sym)


def numel(d: Dims | None) -> sympy.Expr:
    return sympy.Mul(*d) if d else sympy.Integer(0 if d is None else 1)


def nbytes(value_node: object, tokens: int, sym: sympy.Symbol = N) -> sympy.Expr:
    """Bytes of a node's value (all its tensors) on a chunk of `sym` tokens."""
    value = example_value(value_node)
    info = token_info(value_node) if isinstance(value_node, torch.fx.Node) else None
    return sum(
        (sympy.Integer(storage_bytes(t)) if is_traceable_wrapper_subclass(t)  # quantized
         else numel(scaled(t, info, tokens, sym)) * t.element_size() for t in tensors(value)),
        sympy.Integer(0),
    )


def out_numel(node: torch.fx.Node, tokens: int) -> sympy.Expr:
    info = token_info(node)
    parts = [numel(scaled(t, info, tokens, N)) for t in tensors(example_value(node))]
    return sum(parts, sympy.Integer(0))


def io_bytes(node: torch.fx.Node, tokens: int) -> sympy.Expr:
    """Bytes read from every tensor input plus bytes written to the output."""
    read = sum((nbytes(a, tokens) for a in node.all_input_nodes), sympy.Integer(0))
    return read + nbytes(node, tokens)
