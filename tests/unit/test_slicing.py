"""Slicing: TeraPipe DP against brute force, chunk choice."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokpipe_compiler.costmodel.slicing import (
    choose_chunks,
    terapipe_slices,
)


def objective(lengths, stages, time_fn):
    ends = itertools.accumulate(lengths)
    times = [time_fn(length, end) for length, end in zip(lengths, ends, strict=True)]
    return sum(times) + (stages - 1) * max(times)


def brute_force(total, stages, time_fn, max_slices=None):
    best = float("inf")
    for cuts in itertools.product((False, True), repeat=total - 1):
        bounds = [0, *(i + 1 for i, cut in enumerate(cuts) if cut), total]
        lengths = [b - a for a, b in itertools.pairwise(bounds)]
        if max_slices is None or len(lengths) <= max_slices:
            best = min(best, objective(lengths, stages, time_fn))
    return best


coefficients = st.floats(0.0, 2.0, allow_nan=False)


@settings(max_examples=60, deadline=None)
@given(
    total=st.integers(1, 8),
    stages=st.integers(1, 6),
    fixed=st.floats(0.01, 2.0),
    per_token=coefficients,
    per_pair=coefficients,
    max_slices=st.one_of(st.none(), st.integers(1, 4)),
)
def test_terapipe_is_optimal(total, stages, fixed, per_token, per_pair, max_slices):
    def time_fn(length, end):
        return fixed + per_token * length + per_pair * length * end

    lengths = terapipe_slices(total, stages, time_fn, max_slices=max_slices, tolerance=0.0)
    assert sum(lengths) == total
    assert max_slices is None or len(lengths) <= max_slices
    assert objective(lengths, stages, time_fn) == pytest.approx(
        brute_force(total, stages, time_fn, max_slices)
    )


def test_terapipe_granularity_and_shape():
    def time_fn(length, end):
        return 1e-3 + 1e-5 * length + 1e-7 * length * end

    lengths = terapipe_slices(250, 4, time_fn, granularity=8)
    assert sum(lengths) == 250
    assert all(length % 8 == 0 for length in lengths[:-1])
    # Later slices attend to more context, so they are no longer than earlier ones.
    assert lengths[0] >= lengths[-2]


def test_terapipe_tolerance_bounds_the_loss():
    def time_fn(length, end):
        return 2e-4 + 1e-5 * length + 1e-8 * length * end

    exact = objective(terapipe_slices(64, 8, time_fn, tolerance=0.0), 8, time_fn)
    rough = objective(terapipe_slices(64, 8, time_fn, tolerance=0.05), 8, time_fn)
    assert exact <= rough <= exact * 1.05 + 1e-12


def test_choose_chunks_picks_the_minimiser():
    assert choose_chunks(32, 4, lambda m: (m - 11) ** 2) == 11
    assert choose_chunks(32, 4, lambda m: m) == 4  # fewer chunks than stages are not tried
    assert choose_chunks(2, 4, lambda m: -m) == 2
    assert choose_chunks(32, 4, lambda m: -m, candidates=[3, 5, 99]) == 5
    with pytest.raises(ValueError):
        choose_chunks(4, 2, lambda m: m, candidates=[9])
