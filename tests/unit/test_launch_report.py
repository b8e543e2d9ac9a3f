"""launch's report of failed ranks: a named TokpipeError without its traceback, other errors
with theirs, and ranks that failed alike reported once."""

from __future__ import annotations

from tokpipe_compiler.core.errors import TokpipeError
from tokpipe_compiler.runtime.launch import _failure_report, _Outcome, failure_text


def raised(error: BaseException) -> str:
    try:
        raise error
    except BaseException as e:  # as a rank catches it
        return failure_text(e)


def test_a_tokpipe_error_is_reported_by_its_message():
    assert raised(TokpipeError("use mode='stale'")) == "TokpipeError: use mode='stale'"


def test_other_errors_keep_their_traceback():
    text = raised(ValueError("boom"))
    assert text.startswith("Traceback (most recent call last):")
    assert "in raised" in text and text.rstrip().endswith("ValueError: boom")


def test_ranks_that_failed_alike_are_reported_once():
    same = "TokpipeError: the ranks disagree"
    outcomes = {0: _Outcome(False, same, 0.0), 1: _Outcome(False, same, 0.0),
                2: _Outcome(False, "TokpipeError: other", 0.0)}
    text = _failure_report(outcomes, 4, 10.0)
    assert text.count(same) == 1
    assert f"--- rank 0, 1 ---\n{same}" in text
    assert "--- rank 2 ---\nTokpipeError: other" in text
    assert "rank(s) 0, 1, 2 of 4 failed" in text and "Rank(s) 3 still running" in text
