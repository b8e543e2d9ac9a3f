"""Graphs Dynamo traces again for one model and input shapes: said once, with the guard,
and not caused by the pipeline's own outputs (their strides follow the traced graph's)."""

from __future__ import annotations

import re
import warnings

import pytest
import torch

import tokpipe_compiler as tp
from tests.fixtures.models import TinyDiT, dit_inputs
from tests.fixtures.tracing import assert_rel_close

OPTIONS = {"compiler": "eager", "stages": 2, "chunks": 2, "mode": "stale",
           "warmup_steps": 1}
RETRACED = "traced .* again for the same model and input shapes"


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()


class CountingDiT(TinyDiT):
    """Reads an int attribute that changes at every call: Dynamo specialises on it."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.calls = 0

    def forward(self, latents, timestep, labels):
        self.calls += 1
        return super().forward(latents, timestep, labels) * (1.0 + 0.0 * self.calls)


class ConvLayoutTokens(TinyDiT):
    """Returns its tokens in the layout the patch embedding gives them (a transposed view,
    kept by the blocks' elementwise ops): not contiguous."""

    def forward(self, latents, timestep, labels):
        x = self.embed(latents).flatten(2).transpose(1, 2) + self.pos
        cond = self.t_mlp(timestep.float()[:, None].expand(-1, 16)) + self.label(labels)
        for block in self.blocks:
            x = block(x, cond)
        return x


class BrokenTransposed(TinyDiT):
    """A graph break between blocks whose first graph returns a transposed token value."""

    def forward(self, latents, timestep, labels):
        x = self.embed(latents).flatten(2).transpose(1, 2) + self.pos
        cond = self.t_mlp(timestep.float()[:, None].expand(-1, 16)) + self.label(labels)
        x = self.blocks[0](x, cond)
        torch._dynamo.graph_break()
        return self.blocks[1](x, cond)


def steps(compiled, model, calls: int = 3, batch: int = 1) -> list[warnings.WarningMessage]:
    """`calls` denoising steps (timesteps 900, 800, ...); the warnings they gave."""
    latents, _, labels = dit_inputs(model, 8, batch=batch)
    with warnings.catch_warnings(record=True) as seen, torch.no_grad():
        warnings.simplefilter("always")
        for k in range(calls):
            compiled(latents, torch.tensor([900 - 100 * k] * batch), labels)
    return list(seen)


def retraced(seen: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in seen if re.search(RETRACED, str(w.message))]


def test_a_graph_traced_again_per_call_is_said_once_with_its_guard():
    torch.manual_seed(0)
    model = CountingDiT(depth=2, width=32, heads=2, grid=8).eval()
    compiled = torch.compile(model, backend="tokpipe", dynamic=False, options=OPTIONS)
    said = retraced(steps(compiled, model, calls=4))
    assert len(said) == 1, said
    assert "forward" in said[0] and "graph 2 of it" in said[0]
    assert "self.calls" in said[0]  # the guard that failed
    assert "pass it as a tensor" in said[0]


def test_two_models_with_one_options_dict_are_not_taken_for_a_retrace():
    """One options object for two models' torch.compile: one session, two models."""
    torch.manual_seed(0)
    first, second = (TinyDiT(depth=2, width=32, heads=2, grid=8).eval() for _ in range(2))
    compiled = [torch.compile(m, backend="tokpipe", dynamic=False, options=OPTIONS)
                for m in (first, second)]
    seen = steps(compiled[0], first) + steps(compiled[1], second)
    assert retraced(seen) == []


@pytest.mark.parametrize("mode", ["sync", "stale"])
def test_a_token_output_has_the_models_strides(mode):
    torch.manual_seed(0)
    model = ConvLayoutTokens(depth=2, width=32, heads=2, grid=8).eval()
    compiled = torch.compile(model, backend="tokpipe", dynamic=False,
                             options={**OPTIONS, "mode": mode})
    latents, _, labels = dit_inputs(model, 8)
    with torch.no_grad():
        for k in range(3):  # a warmup step, then chunked ones (stale)
            t = torch.tensor([900 - 100 * k])
            expected, out = model(latents, t, labels), compiled(latents, t, labels)
            assert not expected.is_contiguous() and out.stride() == expected.stride()
            if mode == "sync":
                assert_rel_close(out, expected, 1e-5)


def test_the_graph_after_a_graph_break_is_traced_once():
    """Its input, the first graph's transposed output joined from chunks, used to come
    contiguous at the first chunked step: Dynamo traced (and tokpipe planned) it again."""
    torch.manual_seed(0)
    model = BrokenTransposed(depth=2, width=32, heads=2, grid=8).eval()
    compiled = torch.compile(model, backend="tokpipe", dynamic=False, options=OPTIONS)
    assert retraced(steps(compiled, model)) == []


def test_a_dynamo_reset_is_not_taken_for_a_retrace():
    """After torch._dynamo.reset() the user asked for the trace: Dynamo has no graph of
    the function left to miss."""
    torch.manual_seed(0)
    model = TinyDiT(depth=2, width=32, heads=2, grid=8).eval()
    compiled = torch.compile(model, backend="tokpipe", dynamic=False, options=OPTIONS)
    seen = steps(compiled, model, calls=1)
    torch._dynamo.reset()
    assert retraced(seen + steps(compiled, model, calls=1)) == []


def test_a_second_shape_after_a_dynamo_reset_is_not_taken_for_a_retrace():
    """Two shapes, a reset, the two shapes again: the second shape's graph after the reset
    is Dynamo's second graph of the function, as before it, and no retrace."""
    torch.manual_seed(0)
    model = TinyDiT(depth=2, width=32, heads=2, grid=8).eval()
    seen = []
    for _ in range(2):
        compiled = torch.compile(model, backend="tokpipe", dynamic=False, options=OPTIONS)
        seen += steps(compiled, model, calls=1) + steps(compiled, model, calls=1, batch=2)
        torch.compiler.reset()
    assert retraced(seen) == []


def test_a_grad_mode_switch_is_named_with_its_own_advice():
    torch.manual_seed(0)
    model = TinyDiT(depth=2, width=32, heads=2, grid=8).eval()
    compiled = torch.compile(model, backend="tokpipe", dynamic=False, options=OPTIONS)
    latents, _, labels = dit_inputs(model, 8)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with torch.no_grad():
            compiled(latents, torch.tensor([900]), labels)
        with torch.enable_grad():
            compiled(latents, torch.tensor([800]), labels)
    (said,) = retraced(list(seen))
    assert "grad_mode" in said and "under one grad mode" in said
    assert "pass it as a tensor" not in said


def test_a_step_caches_graphs_per_state_are_not_taken_for_retraces():
    """diffusers' First Block Cache traces a graph per guidance branch and cache state, as
    documented, and its hooks' shared forward once per block."""
    from diffusers import FirstBlockCacheConfig

    from tests.fixtures.pipelines import flux, generate

    pipe, kwargs = flux()
    tp.pipelines.parallelize(pipe, stages=2, chunks=2, compiler="eager")
    pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=0.5))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        generate(pipe, kwargs, steps=3)
    assert retraced(list(seen)) == []


def test_latents_made_outside_inference_mode_are_named_with_their_advice():
    """A loop under torch.inference_mode() whose first latents were drawn before it: step
    2's latents are inference tensors, step 1's were not, and Dynamo traces again. The
    advice said to call the model under one grad mode, which the loop did; and where the
    same options' compile had warned of a grad mode switch before (one backend, one
    warning a function), it said nothing."""
    torch.manual_seed(0)
    model = TinyDiT(depth=2, width=32, heads=2, grid=8).eval()
    latents, _, labels = dit_inputs(model, 8)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        compiled = torch.compile(model, backend="tokpipe", dynamic=False, options=OPTIONS)
        with torch.no_grad():
            compiled(latents, torch.tensor([900]), labels)
        with torch.enable_grad():
            compiled(latents, torch.tensor([800]), labels)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="tokpipe", dynamic=False, options=OPTIONS)
        with torch.inference_mode():
            for t in (900, 800):
                latents = latents - 0.1 * compiled(latents, torch.tensor([t]), labels)
    (inference,) = [said for said in retraced(list(seen)) if "dispatch key" in said]
    assert "draw the latents inside torch.inference_mode()" in inference


@pytest.mark.parametrize("ring", [True, False], ids=["ring", "per-call"])
def test_a_forward_reading_its_dtype_is_traced_once_across_calls(ring):
    """Allegro's forward reads `self.dtype`, which looks for diffusers' hook registry on
    every module; the pipeline creates the registry at the end of its first call, and the
    second call was traced and compiled again. A refused ring (DDPM clamps its x0) runs
    per call."""
    import diffusers

    from tests.fixtures.more_pipelines import allegro
    from tests.fixtures.pipelines import generate

    pipe, kwargs = allegro()
    pipe.scheduler = diffusers.DDPMScheduler.from_config(pipe.scheduler.config,
                                                         clip_sample=True)
    tp.pipelines.parallelize(pipe, ring=ring, **{**OPTIONS, "mode": "sync"})
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=f".*{RETRACED}")
        for _ in range(3):
            generate(pipe, kwargs, steps=2)
