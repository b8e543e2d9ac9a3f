"""The one-line summary of a model split at graph breaks (planning/graph_share.py)."""

from __future__ import annotations

import torch

from tokpipe_compiler.planning.graph_share import GraphOutcome, GraphTally, summary


def test_a_model_traced_whole_gets_no_summary():
    assert summary("M", [GraphOutcome(True, 10.0)]) is None
    assert summary("M", []) is None


def test_the_pipelined_share_of_the_flops():
    line = summary("M", [GraphOutcome(True, 75.0), GraphOutcome(False, 20.0),
                         GraphOutcome(False, 5.0)])
    assert "M ran as 3 graphs" in line
    assert "1 pipelined, holding 75% of its FLOPs, 2 run as traced" in line


def test_no_share_where_a_graph_could_not_be_counted():
    line = summary("M", [GraphOutcome(True, 75.0), GraphOutcome(False, None)])
    assert "1 pipelined, 1 run as traced" in line and "%" not in line


def test_none_pipelined_says_it_ran_unpipelined():
    line = summary("M", [GraphOutcome(False, 1.0), GraphOutcome(False, 2.0)])
    assert "none holds attention over its tokens: it ran unpipelined" in line


def test_the_tally_hands_over_each_outcome_once():
    gm = torch.fx.symbolic_trace(torch.nn.Linear(4, 4))
    tally = GraphTally()
    tally.record(gm, True)
    assert [o.pipelined for o in tally.take_new()] == [True]
    assert tally.take_new() == []
    tally.record(gm, False)
    assert [o.pipelined for o in tally.take_new()] == [False]
