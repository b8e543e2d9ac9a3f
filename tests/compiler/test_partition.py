"""The partition's dynamic program: the slowest stage, compute plus its boundary send."""

from __future__ import annotations

import torch

from tests.fixtures.models import TinyDiT, dit_inputs
from tests.fixtures.tracing import trace
from tokpipe_compiler.costmodel.planning_costs import flops_weight
from tokpipe_compiler.passes.annotate import annotate
from tokpipe_compiler.passes.partition import (
    _choose_cuts,
    live_bytes,
    live_counts,
    partition,
    token_nodes,
)
from tokpipe_compiler.planning.driver import copy_graph_module


def test_balanced_cut_without_sends():
    assert _choose_cuts([1.0] * 8, [1] * 9, 2, [0.0] * 9) == [4]


def test_an_expensive_send_moves_the_cut():
    sends = [0.0] * 9
    sends[4] = 10.0  # the send at the balanced cut costs more than 2 nodes of compute
    cut = _choose_cuts([1.0] * 8, [1] * 9, 2, sends)
    assert cut != [4] and cut in ([3], [5])


def test_live_bytes_follow_live_values():
    torch.manual_seed(0)
    model = TinyDiT(depth=2, width=32, heads=2, grid=8).eval()
    graph = copy_graph_module(trace(model, *dit_inputs(model, 8)).gm)
    annotate(graph, None)
    order = token_nodes(graph)
    counts, sizes = live_counts(order), live_bytes(order, 0.5)
    assert len(counts) == len(sizes) == len(order) + 1
    assert all((c == 0) == (b == 0) for c, b in zip(counts, sizes, strict=True))
    # between blocks only the residual stream is live: one [1, 16, 32] float32, half of it
    assert 16 * 32 * 4 / 2 in {b for c, b in zip(counts, sizes, strict=True) if c == 1}
    assert len(partition(graph, 2, flops_weight(16, 8), 0.5).cuts) == 1
