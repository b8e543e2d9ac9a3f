"""The token rules of elementwise and pointwise ops on hand-built FX graphs: broadcasting
tables cut per chunk, comparisons, masks and the rest of the pointwise maths act on each
token alone."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F

from tests.fixtures.fx_graphs import Graph, tok
from tokpipe_compiler.core.meta import SLICES_KEY, TOKEN, UNSUPPORTED, TokenInfo


def test_elementwise_keeps_outer_blocks_and_cuts_a_per_row_table_in_every_block():
    g = Graph()
    x = g.input("x", (8, 16), TokenInfo(TOKEN, 0, 1, outer=2))
    table = g.input("table", (8, 1))  # a timestep embedding repeated per frame
    node = g.call(torch.add, x, table)
    assert g.infer(node) == TokenInfo(TOKEN, 0, 1, outer=2)
    [(operand, axis, sliced)] = node.meta[SLICES_KEY]
    assert operand is table and axis == 0 and sliced.outer == 2


@pytest.mark.parametrize("build", [
    lambda g, x: g.call(torch.where, g.call(operator.gt, x, 0.0), x, 0.0),
    lambda g, x: g.call(operator.invert, g.call(torch.isnan, x)),
    lambda g, x: g.method("masked_fill", x, g.call(torch.isinf, x), 0.0),
    lambda g, x: g.call(torch.logical_and, g.call(torch.isfinite, x), g.method("le", x, 1.0)),
    lambda g, x: g.call(torch.sign, x), lambda g, x: g.call(torch.reciprocal, x),
    lambda g, x: g.call(torch.log1p, x), lambda g, x: g.call(torch.expm1, x),
    lambda g, x: g.call(torch.floor, x), lambda g, x: g.call(F.elu, x),
    lambda g, x: g.call(F.hardtanh, x), lambda g, x: g.method("tanh_", x),
    lambda g, x: g.call(F.glu, x, -1),
], ids=["where-gt", "invert-isnan", "masked_fill-isinf", "and-isfinite-le", "sign",
        "reciprocal", "log1p", "expm1", "floor", "elu", "hardtanh", "tanh_", "glu-features"])
def test_pointwise_ops_keep_the_token_layout(build):
    """Comparisons, masks and the rest of the pointwise maths act on each token alone."""
    g = Graph()
    x = g.input("x", (2, 8, 16), tok(1))
    last = build(g, x)
    for node in g.graph.nodes:
        if node not in g.infos:
            assert g.infer(node) == tok(1), node
    assert g.infos[last] == tok(1)


def test_glu_along_the_token_axis_is_refused():
    g = Graph()
    x = g.input("x", (2, 8, 16), tok(1))
    info = g.infer(g.call(F.glu, x, 1))
    assert info.kind == UNSUPPORTED and "token axis" in info.reason


@pytest.mark.parametrize(("args", "kwargs", "kind"), [
    ((), {"dim": -1}, TOKEN), ((2.0, 2), {}, TOKEN), ((), {"dim": 1}, UNSUPPORTED),
    ((), {}, UNSUPPORTED),  # F.normalize's default dim is 1: here the token axis
], ids=["features-by-name", "features-by-position", "tokens", "default-dim"])
def test_normalize_is_token_wise_unless_along_the_tokens(args, kwargs, kind):
    """L2 QK-norm and cosine attention: `F.normalize(q, dim=-1)`."""
    g = Graph()
    x = g.input("x", (2, 8, 16), tok(1))
    assert g.infer(g.call(F.normalize, x, *args, **kwargs)).kind == kind
