"""The coverage table's regression check (the full run is a CI step of its own)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "coverage_table.py"


def _load():
    spec = importlib.util.spec_from_file_location("coverage_table", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_a_class_that_stops_matching_is_a_regression():
    cov = _load()
    old = cov.render([cov.Row("AModel", "yes", {"sync": "matches", "stale": "matches",
                                                "causal": "n/a (no causal attention)"})], 1)
    worse = cov.render([cov.Row("AModel", "yes", {"sync": "matches", "stale": "fails: x",
                                                  "causal": "n/a (no causal attention)"})], 1)
    better = cov.render([cov.Row("AModel", "yes", {"sync": "matches", "stale": "matches",
                                                   "causal": "matches"})], 1)
    assert cov.regressions(old, worse) == ["AModel stale: matches -> fails"]
    assert cov.regressions(old, better) == []
    assert cov.regressions(old, cov.render([], 1)) != []


def test_the_committed_table_lists_every_class_it_covers():
    cov = _load()
    table = cov.statuses(cov.DOC.read_text())
    assert ("DiTTransformer2DModel", "sync") in table
    assert table[("FluxTransformer2DModel", "stale")] == "matches"


def test_the_committed_table_reads_back_row_for_row():
    """`--update` replaces some rows and keeps the others as committed: reading the table
    back gives the same rows, the run time included."""
    cov = _load()
    rows = [cov.Row("AModel", "yes", {"sync": "matches", "stale": "fails: a, b",
                                      "causal": "n/a (no causal attention)"}, "1.0e-03",
                    "matches"),
            cov.Row("BModel", "unbuilt: no small config", {})]
    text = cov.render(rows, 42)
    assert cov.committed_rows(text) == rows
    assert cov.committed_seconds(text) == 42
    assert cov.committed_rows(cov.DOC.read_text())[0].name.endswith("Model")
