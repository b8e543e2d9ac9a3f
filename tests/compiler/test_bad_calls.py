"""A pipeline call that the pipeline itself cannot run (SD3 given one prompt's embeddings
and asked for two images per prompt) raises, parallelized, what the serial pipeline raises,
with nothing logged; the next call runs as ever."""

from __future__ import annotations

import logging

import pytest

import tokpipe_compiler as tp
from tests.fixtures.pipelines import FAMILIES, generate

pytest.importorskip("diffusers")


def _error(parallel: bool) -> str:
    pipe, kwargs = FAMILIES["sd3"]()
    if parallel:
        tp.pipelines.parallelize(pipe, stages=2, chunks=2, mode="sync", compiler="eager")
    with pytest.raises(RuntimeError) as err:
        generate(pipe, {**kwargs, "num_images_per_prompt": 2}, steps=2)
    generate(pipe, kwargs, steps=2)
    return str(err.value)


def test_a_call_the_pipeline_cannot_run_raises_the_serial_error(caplog):
    with caplog.at_level(logging.ERROR):
        assert _error(parallel=True) == _error(parallel=False)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
