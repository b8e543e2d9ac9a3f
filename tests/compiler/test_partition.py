"""The partition: the best balance over every cut position (compute plus the send at a
stage's end), the fewest live bytes at the cuts within a small slack of it, and a warning
when the stages cannot be balanced."""

from __future__ import annotations

import warnings
from itertools import pairwise

import pytest
import torch

import tokpipe_compiler as tp
from tests.fixtures.models import TinyDiT, dit_inputs
from tests.fixtures.tracing import trace
from tests.fixtures.zoo import ZOO, build
from tokpipe_compiler.core.fx import example_value
from tokpipe_compiler.costmodel.planning_costs import flops_weight
from tokpipe_compiler.passes import partition as partition_module
from tokpipe_compiler.passes.annotate import annotate
from tokpipe_compiler.passes.partition import (
    BALANCE_SLACK,
    ImbalanceWarning,
    _choose_cuts,
    cut_positions,
    live_bytes,
    live_counts,
    partition,
    token_nodes,
)
from tokpipe_compiler.planning.driver import copy_graph_module


@pytest.fixture(autouse=True)
def imbalances_unsaid():
    """Each imbalance warning is said once per layout in a process: each test says its own."""
    partition_module.IMBALANCES_SAID.clear()


def slowest(weights: list[float], cuts: list[int]) -> float:
    bounds = [0, *cuts, len(weights)]
    return max(sum(weights[a:b]) for a, b in pairwise(bounds))


def test_balanced_cut_without_sends():
    assert _choose_cuts([1.0] * 8, [1] * 9, 2, [0.0] * 9) == [4]


def test_an_expensive_send_moves_the_cut():
    sends = [0.0] * 9
    sends[4] = 10.0  # the send at the balanced cut costs more than 2 nodes of compute
    cut = _choose_cuts([1.0] * 8, [1] * 9, 2, sends)
    assert cut != [4] and cut in ([3], [5])


def test_balance_first_even_where_many_values_are_live():
    """A U-shaped model: the long skips keep more values live towards the middle. Cutting
    only where the fewest are live (the ends) would leave one stage with everything."""
    depth = 12
    weights = [1.0] * depth
    sizes = [0] + [1 + min(i, depth - i) for i in range(1, depth)] + [0]
    cuts = _choose_cuts(weights, sizes, 4, [0.0] * (depth + 1))
    assert cuts == [3, 6, 9] and slowest(weights, cuts) == 3


def test_fewest_bytes_within_the_slack():
    """Two cuts balance equally well (within the slack); the one with fewer bytes wins,
    while a cut that balances worse than the slack allows loses even if it sends none."""
    weights = [1.0] * 100
    sizes = [5.0] * 101
    sizes[49] = 1.0  # one node off the even split, cheaper to send
    sizes[30] = 0.0  # free, but 20 nodes off
    assert _choose_cuts(weights, sizes, 2, [0.0] * 101) == [49]
    assert BALANCE_SLACK * 50 >= 1  # (what makes 49 acceptable)


def test_disallowed_positions_are_not_cut():
    allowed = [False] * 9
    allowed[3] = allowed[6] = True
    assert _choose_cuts([1.0] * 8, [1] * 9, 2, [0.0] * 9, allowed) in ([3], [6])
    with pytest.raises(Exception, match="stages=4 is more than this graph can be cut into"):
        _choose_cuts([1.0] * 8, [1] * 9, 4, [0.0] * 9, allowed)


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


def annotated_zoo(name: str) -> torch.fx.GraphModule:
    model, inputs = build(name), ZOO[name].inputs(0)
    graph = copy_graph_module(trace(model, **inputs).gm)
    annotate(graph, "hidden_states")
    return graph


def test_no_cut_between_a_tuple_and_its_items():
    """A tuple of token values (chunk, split) cannot be sent: no cut while one is live."""
    order = token_nodes(annotated_zoo("FluxTransformer2DModel"))
    allowed = cut_positions(order)
    tuples = [i for i, n in enumerate(order) if isinstance(example_value(n), (tuple, list))]
    assert tuples, "the model has no tuple-valued token node to test with"
    for i in tuples:
        assert not allowed[i + 1]  # right after the tuple, its items are still to come


def test_long_skips_balance():
    """HunyuanDiT's long skips (block i to block depth-1-i): 2 stages within 10% (cutting
    only where the fewest values are live, +25%: the skips stay live up to the middle)."""
    graph = annotated_zoo("HunyuanDiT2DModel")
    cut = partition(graph, 2, flops_weight(16, 8), 0.5)
    assert cut.imbalance <= 1.10 and not cut.warning


def test_imbalance_is_reported():
    """More stages than the weight can be spread over: the partition says why."""
    graph = annotated_zoo("DiTTransformer2DModel")
    heavy = max(token_nodes(graph), key=lambda n: flops_weight(16, 8)(n))

    def weight(node: torch.fx.Node) -> float:
        return 1000.0 if node is heavy else 1.0

    with pytest.warns(ImbalanceWarning, match=rf"one node, .*\({heavy.name}\)"):
        cut = partition(graph, 4, weight, 0.5)
    assert cut.imbalance > 1.10 and heavy.name in cut.warning


def test_the_imbalance_warning_is_said_once_per_layout():
    """A server re-plans one model at each new input size: the same imbalance, by another
    percentage, warned at every one."""
    graph = annotated_zoo("DiTTransformer2DModel")
    heavy = max(token_nodes(graph), key=lambda n: flops_weight(16, 8)(n))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for load in (1000.0, 2000.0):
            partition(graph, 4, lambda n, load=load: load if n is heavy else 1.0, 0.5)
    said = [str(w.message) for w in caught if issubclass(w.category, ImbalanceWarning)]
    assert len(said) == 1, said


def test_the_imbalance_warning_is_said_again_for_a_model_of_other_widths():
    def said(width: int) -> list[str]:
        model = TinyDiT(depth=2, width=width, heads=2, grid=8).eval()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            tp.explain(model, dit_inputs(model, 8), stages=6, chunks=1, compiler="eager")
        return [str(w.message) for w in caught if issubclass(w.category, ImbalanceWarning)
                and "cannot be balanced" in str(w.message)]

    assert said(32) and not said(32) and said(64)


def test_the_imbalance_warning_names_the_heaviest_piece_by_its_module():
    """It named the graph node alone ('hidden_states_16'), which the user cannot find."""
    model = TinyDiT(depth=2, width=32, heads=2, grid=8).eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tp.explain(model, dit_inputs(model, 8), stages=6, chunks=1, compiler="eager")
    said = [str(w.message) for w in caught if issubclass(w.category, ImbalanceWarning)]
    assert any("the heaviest piece, one node, linear in blocks.0." in s for s in said), said


def test_an_empty_batch_warns_of_no_imbalance():
    """Batch 0: every node's FLOPs are 0 (or NaN), nothing to balance; the warning said the
    slowest stage carried 'nan%' more than its share. The output is eager's (empty)."""
    torch.manual_seed(0)
    model = TinyDiT(depth=2, grid=8).eval()
    latents, t, labels = dit_inputs(model, 8)
    latents, t, labels = latents[:0], t[:0], labels[:0]
    compiled = torch.compile(model, backend="tokpipe", dynamic=False,
                             options={"stages": 2, "chunks": 2, "mode": "sync",
                                      "compiler": "eager"})
    with torch.no_grad(), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = compiled(latents, t, labels)
    assert out.shape == model(latents, t, labels).shape and out.numel() == 0
    assert not [w for w in seen if issubclass(w.category, ImbalanceWarning)], \
        [str(w.message) for w in seen]
