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


def test_a_height_the_patch_size_does_not_divide_is_named(caplog):
    """PixArt at 72 px: 9 latent rows, patch 2; the transformer returns 8. The serial
    pipeline fails in its scheduler step; the ring used to fail inside its traced step in
    a page of Dynamo's fake-tensor errors."""
    from tests.fixtures.pipelines import pixart_alpha

    serial, kwargs = pixart_alpha()
    with pytest.raises(RuntimeError, match="must match"):
        generate(serial, {**kwargs, "height": 72}, steps=2)
    pipe, _ = pixart_alpha()
    tp.pipelines.parallelize(pipe, stages=2, chunks=2, mode="sync", compiler="eager")
    with caplog.at_level(logging.ERROR), pytest.raises(
            tp.TokpipeError, match=r"prediction of shape \(1, 4, 8, 8\) for latents of "
                                   r"\(1, 4, 9, 8\), which do not combine.*patch size"):
        generate(pipe, {**kwargs, "height": 72}, steps=2)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    generate(pipe, kwargs, steps=2)
