"""Pipelines that share their components (diffusers' `from_pipe`: one transformer, one
scheduler, several tasks): each parallelized pipeline runs its own rings on the shared
transformer, called in any order, and equals its serial twin within 1e-5 (float32, sync)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import tokpipe_compiler as tp
from tests.fixtures.conditioned import flux_img2img
from tests.fixtures.pipelines import flux, generate

OPTIONS = {"stages": 2, "chunks": 2, "mode": "sync", "compiler": "eager"}


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _image_to_image_and_text_to_image() -> tuple:
    """Flux image-to-image parallelized, a text-to-image pipeline made from it, and serial
    twins of both (sharing their own components likewise)."""
    from diffusers import FluxPipeline

    image, image_kwargs = flux_img2img()
    serial = copy.deepcopy(image)
    tp.pipelines.parallelize(image, **OPTIONS)
    text = FluxPipeline.from_pipe(image)
    return (image, FluxPipeline.from_pipe(serial), serial, text, image_kwargs,
            flux()[1])  # Flux's text-to-image call (its fixture's transformer is another)


def test_pipelines_made_from_one_another_each_run_their_rings():
    image, serial_text, serial_image, text, image_kwargs, text_kwargs = \
        _image_to_image_and_text_to_image()
    assert text.transformer is image.transformer and text.scheduler is image.scheduler
    tp.pipelines.parallelize(text, **OPTIONS)
    depth = None
    for pipe, serial, kwargs in [(image, serial_image, image_kwargs),
                                 (text, serial_text, text_kwargs),
                                 (image, serial_image, image_kwargs),
                                 (text, serial_text, text_kwargs)]:
        out = generate(pipe, kwargs, steps=4)
        assert _relative(out, generate(serial, kwargs, steps=4)) <= 1e-5
        # routed to each pipeline in turn, never through an earlier owner's hooks
        depth = depth or len(type(pipe.scheduler).__mro__)
        assert len(type(pipe.scheduler).__mro__) == depth
    for pipe in (image, text):
        assert pipe._tokpipe_ring.denoisers["transformer"].rings  # each ran its own ring


def test_a_pipeline_made_from_a_parallelized_one_runs_per_call_unless_parallelized():
    """Its transformer is the parallelized one: outside that pipeline's calls, per call,
    saying so once (every other per-call run says why; this one said nothing)."""
    image, serial_text, _, text, _, text_kwargs = _image_to_image_and_text_to_image()
    with pytest.warns(UserWarning, match=r"is called outside a parallelized pipeline's call "
                                         r"\(by a pipeline made from it with from_pipe"):
        out = generate(text, text_kwargs, steps=3)
    assert _relative(out, generate(serial_text, text_kwargs, steps=3)) <= 1e-5
    assert not image._tokpipe_ring.denoisers["transformer"].rings


def test_a_shared_transformer_takes_only_the_options_it_was_parallelized_with():
    *_, text, _, _ = _image_to_image_and_text_to_image()
    with pytest.raises(tp.TokpipeError, match=r"parallelized already, for a pipeline that "
                                              r"shares it .*with chunks=2 \(asked: 4\), "
                                              r"mode='sync' \(asked: 'stale'\)"):
        tp.pipelines.parallelize(text, **{**OPTIONS, "chunks": 4, "mode": "stale"})


@pytest.mark.parametrize("ring", [True, False])
def test_a_pipeline_parallelized_again_with_other_options_is_told_how(ring):
    pipe, _ = flux()
    tp.pipelines.parallelize(pipe, **OPTIONS, ring=ring)
    tp.pipelines.parallelize(pipe, **OPTIONS, ring=ring)  # the same options: nothing to do
    with pytest.raises(tp.TokpipeError, match=r"is parallelized already, with chunks=2 "
                                              r"\(asked: 4\); a transformer keeps the options "
                                              r".* load the pipeline again"):
        tp.pipelines.parallelize(pipe, **{**OPTIONS, "chunks": 4}, ring=ring)


@pytest.mark.parametrize(("first", "then", "named"), [
    ({"ring": False}, {"ring": True}, r"ring=False \(asked: True\)"),
    ({"ring": True}, {"ring": False}, r"ring=True \(asked: False\)"),
    ({}, {"cfg": 2}, r"cfg=1 \(asked: 2\)"),
])
def test_a_pipeline_keeps_how_its_loop_runs(first, then, named):
    """Parallelized again with another `ring` or `cfg`, a pipeline says so: routed a second
    time, ring=False then True lost the ring to a scheduler error, and True then False was
    ignored; the ring runs as before after the refusal."""
    pipe, kwargs = flux()
    serial = copy.deepcopy(pipe)
    tp.pipelines.parallelize(pipe, **OPTIONS, **first)
    with pytest.raises(tp.TokpipeError, match=rf"parallelized already, with {named}; a "
                                              r"pipeline keeps how its loop runs"):
        tp.pipelines.parallelize(pipe, **OPTIONS, **then)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback from the ring: it runs as it did
        out = generate(pipe, kwargs, steps=3)
    assert _relative(out, generate(serial, kwargs, steps=3)) <= 1e-5
    assert bool(first.get("ring", True)) == bool(getattr(pipe, "_tokpipe_ring", None))


@pytest.mark.parametrize("ring", [True, False])
def test_a_transformer_replaced_after_parallelize_is_named_then_taken(ring):
    """It runs as it is, with a warning naming the way to pipeline it, which works."""
    pipe, kwargs = flux()
    tp.pipelines.parallelize(pipe, **OPTIONS, ring=ring)
    pipe.transformer = flux()[0].transformer  # another, as loaded
    with pytest.warns(UserWarning, match=r"transformer was replaced after parallelize and "
                                         r"runs unpipelined; call tp.pipelines.parallelize"):
        generate(pipe, kwargs, steps=2)
    tp.pipelines.parallelize(pipe, **OPTIONS, ring=ring)
    generate(pipe, kwargs, steps=2)
    assert tp.pipelines.programs(pipe)


def test_a_serial_transformer_swapped_in_and_back_out():
    """The README's way to compare with the serial pipeline in one process: the serial
    transformer runs unpipelined, saying so; the parallelized one, set back, runs the
    rings it traced, untraced again."""
    pipe, kwargs = flux()
    tp.pipelines.parallelize(pipe, **OPTIONS)
    parallel = pipe.transformer
    first = generate(pipe, kwargs, steps=2)
    programs = tp.pipelines.programs(pipe)
    pipe.transformer = flux()[0].transformer  # the same weights, loaded again
    with pytest.warns(UserWarning, match="was replaced after parallelize and runs unpipelined"):
        serial = generate(pipe, kwargs, steps=2)
    pipe.transformer = parallel
    assert torch.equal(generate(pipe, kwargs, steps=2), first)
    assert tp.pipelines.programs(pipe) == programs
    assert _relative(first, serial) <= 1e-5
