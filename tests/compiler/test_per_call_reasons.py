"""parallelize(pipe) runs a call per call (each step one pipelined call) where a ring
cannot follow it, and says why in a warning: a scheduler without a token-wise step, a
diffusers step cache, one step left, a step it cannot replay, a cutoff callback, a
pipeline outside the ring table, a ControlNet. A step the compiler cannot chunk raises
(or, asked, falls back).

Tolerances (float32): sync equals the serial pipeline within 1e-5 of the output's largest
value.
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch

import tokpipe_compiler as tp
from tests.fixtures import pipelines
from tests.fixtures.conditioned import CONDITIONED, flux_controlnet, wan22_5b_image2video
from tests.fixtures.perturbed import PERTURBED
from tests.fixtures.pipelines import generate, hunyuan, parallelized, pixart_alpha, sd3
from tests.fixtures.tracing import rel_error
from tokpipe_compiler import ring
from tokpipe_compiler.pipelines import table
from tokpipe_compiler.ring_trace import trace_step

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

FAMILIES = {**pipelines.FAMILIES, **CONDITIONED}


def test_a_scheduler_without_a_token_wise_step_runs_per_call_and_says_why():
    serial = generate(*hunyuan(), steps=3)
    pipe, kwargs = parallelized(hunyuan, mode="sync")
    with pytest.warns(UserWarning, match=r"runs per call .*DDPMScheduler"):
        out = generate(pipe, kwargs, steps=3)
    assert rel_error(out, serial) <= 1e-5


def test_adaptive_perturbed_attention_guidance_runs_per_call_and_says_why():
    """Its scale falls with the timestep, step after step: per call, as serial."""
    make = PERTURBED["sd3_pag"]
    serial, kwargs = make()
    kwargs = {**kwargs, "pag_adaptive_scale": 0.002}
    expected = generate(serial, kwargs, steps=3)
    pipe, _ = parallelized(make, mode="sync")
    with pytest.warns(UserWarning, match=r"runs per call .*pag_adaptive_scale=0.002: adaptive"):
        out = generate(pipe, kwargs, steps=3)
    assert rel_error(out, expected) <= 1e-5


@pytest.mark.full
def test_z_image_guidance_normalised_over_the_image_runs_per_call_and_says_why():
    """Z-Image's `cfg_normalization` clamps the guided prediction's norm over the whole
    image: a statistic over every token, per call."""
    pipe, kwargs = parallelized(pipelines.zimage, mode="sync")
    kwargs = {**kwargs, "cfg_normalization": 1.0}
    with pytest.warns(UserWarning, match=r"runs per call .*cfg_normalization=1.0: guidance"):
        out = generate(pipe, kwargs, steps=3)
    assert rel_error(out, generate(pipelines.zimage()[0], kwargs, steps=3)) <= 1e-5


@pytest.mark.full
def test_temporal_reasoning_that_drops_frames_midway_runs_per_call_and_says_why():
    """ChronoEdit's temporal reasoning keeps only the first and last frames from step k on:
    the step changes its shape partway (a ring refuses that loudly); per call, as serial."""
    from tests.fixtures.video_pipelines import chronoedit

    def make():
        return chronoedit(enable_temporal_reasoning=True, num_frames=9,
                          num_temporal_reasoning_steps=2)

    serial = generate(*make(), steps=4)
    pipe, kwargs = parallelized(make, mode="sync")
    with pytest.warns(UserWarning, match=r"runs per call .*num_temporal_reasoning_steps=2"):
        out = generate(pipe, kwargs, steps=4)
    assert rel_error(out, serial) <= 1e-5


def test_a_transformer_with_a_diffusers_cache_runs_per_call_and_says_why():
    """diffusers' step caches (here First Block Cache) skip blocks by comparing whole
    tensors with earlier steps', which a ring cannot replay: per call, as the cache decides,
    with a warning that names the cache and points at the line that called the pipeline."""
    from diffusers import FirstBlockCacheConfig

    make = FAMILIES["flux"]
    serial, kwargs = make()
    serial.transformer.enable_cache(FirstBlockCacheConfig(threshold=0.5))
    expected = generate(serial, kwargs, steps=4)
    pipe, _ = parallelized(make, mode="sync")
    pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=0.5))
    with pytest.warns(UserWarning, match="runs per call.*FirstBlockCacheConfig on") as record:
        out = generate(pipe, kwargs, steps=4)
    assert rel_error(out, expected) <= 1e-5
    said = [w for w in record if "runs per call" in str(w.message)]
    assert said[0].filename.endswith("fixtures/pipelines.py")  # generate()'s pipeline call


def test_a_cache_applied_by_its_hooks_is_named_as_a_cache():
    """`apply_first_block_cache` registers the cache's hooks without `enable_cache`: the
    reason names them as a step cache (they were taken for hooks that cast or move
    weights)."""
    from diffusers import FirstBlockCacheConfig
    from diffusers.hooks import apply_first_block_cache

    make = FAMILIES["flux"]
    serial, kwargs = make()
    apply_first_block_cache(serial.transformer, FirstBlockCacheConfig(threshold=0.5))
    expected = generate(serial, kwargs, steps=3)
    pipe, _ = parallelized(make, mode="sync")
    apply_first_block_cache(pipe.transformer, FirstBlockCacheConfig(threshold=0.5))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = generate(pipe, kwargs, steps=3)
    said = " ".join(str(w.message) for w in caught if "runs per call" in str(w.message))
    assert re.search(r"diffusers' step cache \(diffusers' fbc_", said)
    assert "cast or move" not in said
    assert rel_error(out, expected) <= 1e-5


def test_a_step_the_compiler_cannot_chunk_raises_or_falls_back_when_asked():
    """Sana in causal mode (linear attention sums over every token, those after the chunk
    too): the ring's plan fails after the first step's probes. The compiler's error, as
    per call; with fallback=True that step is computed for real and the generation goes on
    per call, where the backend runs the graph unpipelined (both say so)."""
    make = FAMILIES["sana"]
    serial = generate(*make(), steps=3)
    with pytest.raises(tp.TokpipeError, match="sums over every token"):
        generate(*parallelized(make, mode="causal"), steps=3)
    pipe, kwargs = parallelized(make, mode="causal", fallback=True)
    with pytest.warns(UserWarning, match="runs per call .*cannot be pipelined"):
        out = generate(pipe, kwargs, steps=3)
    assert rel_error(out, serial) <= 1e-5


def _with_graph_break() -> pipelines.Built:
    """PixArt-alpha whose attention processors break Dynamo's graph, as a quantizer's
    tensor subclass Dynamo cannot trace does (optimum-quanto's quantized activations)."""
    from diffusers.models.attention_processor import AttnProcessor2_0

    class Breaking(AttnProcessor2_0):
        def __call__(self, *args, **kwargs):
            torch._dynamo.graph_break()
            return super().__call__(*args, **kwargs)

    pipe, kwargs = pixart_alpha()
    pipe.transformer.set_attn_processor(Breaking())
    return pipe, kwargs


def test_a_step_dynamo_breaks_runs_per_call_and_says_why(monkeypatch):
    """The ring needs the step as one graph; per call, Dynamo's pieces run pipelined or as
    traced, so the generation goes on per call with a warning that names the break. The
    next generation does not trace the step again (it did at every call)."""
    traces = []
    monkeypatch.setattr(ring, "trace_step",
                        lambda *a, **k: traces.append(1) or trace_step(*a, **k))
    serial = generate(*_with_graph_break(), steps=3)
    pipe, kwargs = parallelized(_with_graph_break, mode="sync")
    with pytest.warns(UserWarning, match="runs per call .*Dynamo broke it.*graph_break"):
        out = generate(pipe, kwargs, steps=3)
    assert rel_error(out, serial) <= 1e-5
    assert rel_error(generate(pipe, kwargs, steps=3), serial) <= 1e-5
    assert len(traces) == 1


@pytest.mark.parametrize("family", ["flux_img2img", "wan_video2video"])
def test_a_loop_left_with_one_step_runs_per_call_and_says_why(family):
    """Strength 0.25 of 4 steps leaves one step: nothing to overlap. Flux tells the scheduler
    where its loop starts (per call from the start); Wan's video-to-video does not, so the
    ring sees it at the first step's probes, which it then computes for real."""
    make = FAMILIES[family]
    kwargs = {**make()[1], "strength": 0.25}
    serial = generate(make()[0], kwargs, steps=4)
    pipe, _ = parallelized(make, mode="sync")
    with pytest.warns(UserWarning, match="runs per call .*1 step: nothing to overlap"):
        out = generate(pipe, kwargs, steps=4)
    assert rel_error(out, serial) <= 1e-5


def test_a_step_the_ring_cannot_replay_starts_again_per_call_and_says_why():
    """Wan 2.2 TI2V-5B's image-to-video gives its first frame's tokens timestep 0: the first
    step's probes show a step the ring does not replay. Only probes ran, so the call starts
    again per call, from the same random state: the serial pipeline's latents."""
    serial = generate(*wan22_5b_image2video(), steps=3)
    pipe, kwargs = parallelized(wan22_5b_image2video, mode="sync")
    with pytest.warns(UserWarning, match="could not replay .* started again per call"):
        out = generate(pipe, kwargs, steps=3)
    assert rel_error(out, serial) <= 1e-5


def test_a_diffusers_cutoff_callback_runs_per_call_and_says_why():
    """SD3's guidance cutoff drops the negative branch partway through, which a ring cannot
    follow: per call, equal to the serial pipeline with the same callback. (Other step
    callbacks run in the ring: test_step_callbacks.)"""
    from diffusers.callbacks import SD3CFGCutoffCallback

    def with_cutoff(kwargs):
        return {**kwargs, "callback_on_step_end": SD3CFGCutoffCallback(cutoff_step_ratio=0.5)}

    serial, kwargs = sd3()
    expected = generate(serial, with_cutoff(kwargs), steps=4)
    pipe, kwargs = parallelized(sd3, mode="sync")
    with pytest.warns(UserWarning, match="runs per call.*SD3CFGCutoffCallback: diffusers' "
                                         "cutoff callbacks"):
        out = generate(pipe, with_cutoff(kwargs), steps=4)
    assert rel_error(out, expected) <= 1e-5
    assert rel_error(out, generate(serial, kwargs, steps=4)) > 1e-3  # the cutoff mattered


def test_a_pipeline_outside_the_table_runs_per_call(monkeypatch):
    monkeypatch.delitem(table.RING_PIPELINES, "PixArtAlphaPipeline")
    pipe, kwargs = parallelized(pixart_alpha, mode="sync")
    with pytest.warns(UserWarning, match="PixArtAlphaPipeline is not in the ring table"):
        generate(pipe, kwargs, steps=2)


def test_a_controlnet_pipeline_runs_per_call_and_says_why():
    """The ControlNet runs on each step's latents before the transformer, outside what a
    ring's step holds: per call, pipelined as any other call (ControlNet's per-block
    outputs are per-token inputs, cut to each chunk)."""
    serial = generate(*flux_controlnet(), steps=3)
    pipe, kwargs = parallelized(flux_controlnet, mode="sync")
    with pytest.warns(UserWarning, match="runs per call.*runs its ControlNet"):
        assert rel_error(generate(pipe, kwargs, steps=3), serial) <= 1e-5
    pipe, kwargs = parallelized(flux_controlnet, mode="stale", warmup_steps=1)
    with pytest.warns(UserWarning, match="runs its ControlNet"):
        stale = generate(pipe, kwargs, steps=3)
    assert 0 < rel_error(stale, serial) < 0.05  # stale K/V after the warmup step


def test_a_config_option_the_scheduler_never_reads_keeps_the_ring():
    """CogVideoX's DDIM scheduler carries clip_sample=True by default and never clamps: the
    call ran per call, blamed on 'clamping x0'. DDIM's own clip_sample=True still does."""
    from diffusers import CogVideoXDDIMScheduler, DDIMScheduler

    def cogvideox_default_scheduler():
        pipe, kwargs = pipelines.cogvideox()
        pipe.scheduler = CogVideoXDDIMScheduler()  # clip_sample=True
        return pipe, kwargs

    serial = generate(*cogvideox_default_scheduler(), steps=3)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="tokpipe: .* runs per call")
        out = generate(*parallelized(cogvideox_default_scheduler, mode="sync"), steps=3)
    assert rel_error(out, serial) <= 1e-5

    def dit_clipping():
        pipe, kwargs = pipelines.dit()
        pipe.scheduler = DDIMScheduler(clip_sample=True)
        return pipe, kwargs

    with pytest.warns(UserWarning, match=r"runs per call .*clip_sample=True"):
        generate(*parallelized(dit_clipping, mode="sync"), steps=3)


def test_a_step_that_needs_more_arguments_is_named():
    """CogVideoX's DPM step takes the last x0 and the timestep back: per call, said as such,
    not as the TypeError a probe call raised."""
    from diffusers import CogVideoXDPMScheduler

    def cogvideox_dpm():
        pipe, kwargs = pipelines.cogvideox()
        pipe.scheduler = CogVideoXDPMScheduler()
        return pipe, kwargs

    serial = generate(*cogvideox_dpm(), steps=3)
    with pytest.warns(UserWarning, match=r"runs per call .*its step needs "
                                         r"old_pred_original_sample, timestep_back besides"):
        out = generate(*parallelized(cogvideox_dpm, mode="sync"), steps=3)
    assert rel_error(out, serial) <= 1e-5


def test_programs_of_a_pipeline_without_any_says_both_causes():
    """Before its first call a parallelized pipeline has none to list (a server's stats
    of a pipeline loaded but not yet asked for raised); a pipeline never parallelized
    raises, naming both causes of none."""
    pipe, _ = parallelized(FAMILIES["pixart_alpha"], mode="sync")
    assert tp.pipelines.programs(pipe) == []
    unparallelized, _ = FAMILIES["pixart_alpha"]()
    with pytest.raises(tp.TokpipeError, match="not parallelized and called yet, or every "
                                              "graph of its transformer ran unpipelined"):
        tp.pipelines.programs(unparallelized)


def test_a_transformer_that_writes_its_input_before_the_blocks_runs_per_call():
    """GLM-Image (outside the ring table) zeroes the unconditional call's prior tokens in
    place (`prior[drop] *= 0.0`, a graph break) in the graph its blocks are in: that graph
    raised UnchunkableOps, in sync too. The write now runs before the pipeline: sync equals
    the serial pipeline, stale runs."""
    from tests.fixtures.more_pipelines import glm_image

    serial = generate(*glm_image(), steps=3)
    outputs = {}
    for mode in ("sync", "stale"):
        pipe, kwargs = parallelized(glm_image, mode=mode)
        with pytest.warns(UserWarning, match="runs per call"):
            outputs[mode] = generate(pipe, kwargs, steps=3)
        assert tp.programs(pipe)
    assert rel_error(outputs["sync"], serial) <= 1e-5
    assert rel_error(outputs["stale"], serial) > 1e-5


def _ltx2_per_call(monkeypatch, says: str) -> None:
    """LTX-2 with every step alike, its class in the ring table: per call, saying `says`,
    its video and audio latents equal the serial pipeline's."""
    from tests.fixtures.audio_video_pipelines import ltx2_alike, outputs

    monkeypatch.setitem(table.RING_PIPELINES, "LTX2Pipeline", {})
    expected = outputs(*ltx2_alike(), steps=3)
    pipe, kwargs = parallelized(ltx2_alike, mode="sync")
    with pytest.warns(UserWarning, match=says):
        got = outputs(pipe, kwargs, steps=3)
    for latents, serial in zip(got, expected, strict=True):
        assert rel_error(latents, serial) <= 1e-5


def test_a_second_latent_the_pipeline_steps_itself_keeps_the_call_per_call(monkeypatch):
    """LTX-2 steps its audio latents with a copy of its scheduler, beside the video's: as
    a ring it carried the video alone and held the audio at its first value, 0.37 from
    the serial pipeline's, without a word. A transformer output shaped like another of
    its float inputs is a second latent: the call runs per call."""
    _ltx2_per_call(monkeypatch, r"runs per call .*predicts 'audio_hidden_states' too")


def test_a_ring_refused_after_its_probes_starts_the_call_again(monkeypatch):
    """A ring refused at planning went on per call from its probed first step, which had
    used zeros for every output but the prediction: LTX-2's audio missed its first update
    (8.9e-2 from serial). Where the transformer returns more than the prediction, the call
    starts again per call."""
    from tokpipe_compiler.pipelines import ring_call

    monkeypatch.setattr(ring_call, "second_latent", lambda *args: None)
    _ltx2_per_call(monkeypatch, r"runs per call .*returns 2 tensors")
