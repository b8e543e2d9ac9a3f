"""Check a model's pipelined run against eager PyTorch, in your own test suite.

    from tokpipe_compiler.testing import assert_equivalent, latents_like, options

`assert_equivalent` lives in `equivalence`, its report types in `checks`, the inputs it
makes in `inputs`, its check of guidance branches in `branches`, stale mode's semantics
run on the eager model in `stale_reference` and its check in `stale_check`, where a run
first goes wrong in `locate`, hypothesis strategies in `strategies` (imported on first
use: hypothesis is a test-only dependency).
"""

from __future__ import annotations

from typing import Any

from tokpipe_compiler.testing.checks import Check, NotEquivalent, Report
from tokpipe_compiler.testing.equivalence import Where, assert_equivalent

__all__ = ["Check", "NotEquivalent", "Report", "Where", "assert_equivalent", "latents_like",
           "options"]


def __getattr__(name: str) -> Any:
    if name in ("options", "latents_like"):
        from tokpipe_compiler.testing import strategies

        return getattr(strategies, name)
    raise AttributeError(name)
