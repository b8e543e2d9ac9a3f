"""A parallelized pipeline called from a second thread while a call runs raises a clear
error (two calls at once would each run with the other's ring, scheduler and caches:
silently wrong images before), and the running call still equals the serial pipeline.

Tolerance: float32, max |parallelized - serial| <= 1e-5 * max |serial|.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

import tokpipe_compiler as tp
from tests.fixtures.pipelines import FAMILIES, generate

pytest.importorskip("diffusers")

OPTIONS = {"stages": 2, "chunks": 2, "mode": "sync", "compiler": "eager"}


@pytest.mark.parametrize("ring", [True, False], ids=["ring", "per-call"])
def test_a_second_thread_calling_a_running_pipeline_is_refused(ring):
    expected = generate(*FAMILIES["flux"](), steps=3)
    pipe, kwargs = FAMILIES["flux"]()
    tp.pipelines.parallelize(pipe, ring=ring, **OPTIONS)
    errors: list[BaseException] = []

    def from_another_thread() -> None:
        try:
            generate(pipe, kwargs, steps=3)
        except BaseException as err:
            errors.append(err)

    def second_call_at_step_one(pipe: Any, i: int, t: Any, tensors: dict) -> dict:
        if i == 1 and not errors:
            other = threading.Thread(target=from_another_thread)
            other.start()
            other.join(timeout=120)
        return tensors

    out = generate(pipe, {**kwargs, "callback_on_step_end": second_call_at_step_one}, steps=3)
    assert len(errors) == 1 and isinstance(errors[0], tp.TokpipeError)
    assert "running a call already (in another thread)" in str(errors[0])
    assert (out - expected).abs().max().item() <= 1e-5 * expected.abs().max().item()
    after = generate(pipe, kwargs, steps=3)  # the pipeline is free again
    assert (after - expected).abs().max().item() <= 1e-5 * expected.abs().max().item()
