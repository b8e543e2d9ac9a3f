"""`released.pipeline(name)`: every released model runs in its family's diffusers pipeline,
guided, and the pipeline calls its transformer with what `released.inputs` says the family
passes (the same keywords, shapes and dtypes): the inputs the released plans are traced
from are the pipelines' own."""

from __future__ import annotations

import inspect

import pytest
import torch

from tokpipe_compiler import released
from tokpipe_compiler.core.errors import TokpipeError
from tokpipe_compiler.released.pipelines import pipeline, small_grid

pytest.importorskip("transformers")

# Blocks of 0.3-1 B parameters (or 14B widths): seconds each to build and run on two cores.
HEAVY = {"flux1-dev", "flux1-schnell", "auraflow", "sd35-large", "wan2.1-t2v-14b",
         "cogvideox-5b"}


def _described(value: object) -> object:
    """A call argument as what it must match: tensors by shape and dtype."""
    if isinstance(value, torch.Tensor):
        return "tensor", tuple(value.shape), value.dtype
    if isinstance(value, (tuple, list)):
        return tuple(_described(v) for v in value)
    if isinstance(value, dict):
        return {k: _described(v) for k, v in value.items()}
    return value


def _transformer_calls(pipe, kwargs: dict, steps: int = 2) -> list[dict]:
    """Every call of the pipeline's transformer, positional arguments by their names."""
    names = list(inspect.signature(pipe.transformer.forward).parameters)
    calls: list[dict] = []
    pipe.transformer.register_forward_pre_hook(
        lambda module, args, kw: calls.append({**dict(zip(names, args, strict=False)), **kw}),
        with_kwargs=True)
    with torch.no_grad():
        pipe(**kwargs, num_inference_steps=steps, generator=torch.Generator().manual_seed(0))
    return calls


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.full) if n in HEAVY else n
                                  for n in released.NAMES])
def test_the_pipeline_calls_its_transformer_with_the_released_inputs(name):
    pipe, kwargs = pipeline(name, layers=1)
    calls = _transformer_calls(pipe, kwargs)
    batch = calls[0]["hidden_states"].shape[0]  # 2: guidance batched, 1: two calls a step
    assert len(calls) == 2 * (2 // batch), "guided: both branches every step"
    expected = released.inputs(name, batch=batch, grid=small_grid(name))
    for key in set(calls[0]) | set(expected):
        passed = _described(calls[0].get(key))
        if key == "return_dict" or (key not in expected and passed in (None, {})):
            continue  # defaults the pipeline passes along (attention kwargs: None or {})
        assert passed == _described(expected.get(key)), key


def test_layers_grid_and_dtype_reach_the_transformer():
    pipe, kwargs = pipeline("sd3-medium", layers=3, grid=(8, 12), dtype=torch.bfloat16)
    assert len(pipe.transformer.transformer_blocks) == 3
    assert pipe.transformer.dtype == torch.bfloat16
    assert kwargs["prompt_embeds"].dtype == torch.bfloat16
    assert (kwargs["height"], kwargs["width"]) == (64, 96)  # the VAE's 8x


def test_a_grid_of_the_wrong_rank_is_refused():
    with pytest.raises(TokpipeError, match=r"wan2.1-t2v-1.3b: a latent grid of 3 sizes"):
        pipeline("wan2.1-t2v-1.3b", grid=(16, 16))


def test_an_unknown_name_suggests_the_close_ones():
    with pytest.raises(TokpipeError, match=r"did you mean flux1-dev or flux1-schnell\?"):
        pipeline("flux")
    with pytest.raises(TokpipeError, match=r"did you mean pixart-alpha-xl-2-1024-ms\?"):
        pipeline("PixArt-alpha")  # the names are lower case
