"""parallelize(pipe): every covered diffusers pipeline's loop as one ring, in one process.

Tolerances (float32): sync equals the serial pipeline, and the ring equals per-call mode
with the same options, within 1e-5 of the output's largest value.
"""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch

import tokpipe_compiler as tp
from tests.fixtures import pipelines
from tests.fixtures.conditioned import CONDITIONED
from tests.fixtures.more_pipelines import MORE
from tests.fixtures.perturbed import PERTURBED
from tests.fixtures.pipelines import SMALL_RING, generate, parallelized, pixart_alpha, sd3
from tests.fixtures.tracing import rel_error
from tests.fixtures.video_pipelines import VIDEO
from tokpipe_compiler.pipelines.step_callbacks import StepCallbacks

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

OPTIONS = SMALL_RING
# One of each kind of step, and the pipelines the ring table took last.
CI_FAMILIES = ("dit", "pixart_alpha", "flux", "wan", "chroma", "cogview4", "hunyuan_video",
               "flux_img2img", "wan_video2video", "flux_kontext", "wan_image2video", "qwenimage",
               "wan22", "wan22_5b", "flux_inpaint", "wan_first_last_frame", "pixart_sigma_pag",
               "flux_ip_adapter", "cogvideox_video2video", "kandinsky5_video", "bria",
               "zimage", "pixart_ancestral", "pixart_ddpm")
FAMILIES = {**pipelines.FAMILIES, **CONDITIONED, **PERTURBED, **MORE, **VIDEO,
            **pipelines.NOISY}


def _families():
    return [name if name in CI_FAMILIES else pytest.param(name, marks=pytest.mark.full)
            for name in FAMILIES]


@pytest.mark.parametrize("family", _families())
def test_ring_equals_serial_in_sync_and_per_call_in_stale(family):
    make = FAMILIES[family]
    serial = generate(*make())
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="tokpipe: .* runs per call")
        synced = generate(*parallelized(make, mode="sync"))
        pipe, kwargs = parallelized(make, mode="stale", warmup_steps=1)
        stale = generate(pipe, kwargs)
        again = generate(pipe, kwargs)
    assert rel_error(synced, serial) <= 1e-5
    per_call = generate(*parallelized(make, mode="stale", warmup_steps=1, ring=False))
    assert rel_error(stale, per_call) <= 1e-5  # every K/V as fresh as per call
    assert not torch.equal(stale, serial)  # and stale: the chunks did not see it all
    assert torch.equal(stale, again)  # the second call is a generation of its own


# Families that plain torch.compile (Inductor, no tokpipe) already moves past 1e-5 from
# eager: Kandinsky 5 T2V by 3.8e-4 (3 steps).
INDUCTOR_DRIFT = ("kandinsky5_video",)


@pytest.mark.full
@pytest.mark.parametrize("family", FAMILIES)
def test_inductor_stages_equal_eager_stages(family):
    """The default stage compiler on every family's ring (stale: whole warmup step, then
    chunks reading the caches): Inductor only reassociates float32 arithmetic, moving the
    output no further than it moves the serial pipeline's."""
    eager = generate(*parallelized(FAMILIES[family], mode="stale", warmup_steps=1), steps=3)
    pipe, kwargs = parallelized(FAMILIES[family], mode="stale", warmup_steps=1, compiler="inductor")
    bound = 1e-5
    if family in INDUCTOR_DRIFT:
        serial, kwargs_serial = FAMILIES[family]()
        drift = rel_error(generate(serial, kwargs_serial, steps=3),
                          generate(*_inductor_compiled(FAMILIES[family]()), steps=3))
        assert drift > 1e-5  # else the family needs no entry
        bound += 1.1 * drift
    assert rel_error(generate(pipe, kwargs, steps=3), eager) <= bound


def _inductor_compiled(built):
    pipe, kwargs = built
    pipe.transformer.compile(backend="inductor")
    return pipe, kwargs


@pytest.mark.parametrize("family", [
    "cogvideox", *(pytest.param(f, marks=pytest.mark.full) for f in ("pixart_alpha", "wan"))])
def test_a_wide_image_equals_serial(family):
    """A resolution other than the configured one, wider than high. CogVideoX then builds
    its positional table in the forward, written after the text rows through `.data`: a
    write the per-call prelude once dropped (the image lost its positions)."""
    pipe, kwargs = FAMILIES[family]()
    kwargs = {**kwargs, "width": kwargs["width"] * 3 // 2}
    serial = generate(pipe, kwargs, steps=3)
    assert rel_error(generate(parallelized(FAMILIES[family], mode="sync")[0], kwargs, steps=3),
                     serial) <= 1e-5


@pytest.mark.parametrize(("family", "mode"), [
    ("pixart_sigma", "sync"), ("pixart_sigma", "stale"),
    pytest.param("sd3", "sync", marks=pytest.mark.full),
    pytest.param("sd3", "stale", marks=pytest.mark.full)])
def test_an_image_one_patch_row_high_runs_per_call_and_equals_per_call(family, mode):
    """One row of patches: the ring's plan took the batch axis for the latents' token axis,
    and refused to carry them ("an output holding whole text tokens"; in stale mode, "these
    ops mix tokens"). It now says why it runs per call, and equals per-call mode."""
    kwargs = {**FAMILIES[family]()[1], "height": 16}  # 2 latent rows: one row of 2x2 patches
    options = {"mode": mode, **({"warmup_steps": 1} if mode == "stale" else {})}
    per_call = generate(parallelized(FAMILIES[family], ring=False, **options)[0], kwargs,
                        steps=3)
    with pytest.warns(UserWarning, match="token grid is one unit"):
        pipelined = generate(parallelized(FAMILIES[family], **options)[0], kwargs, steps=3)
    assert rel_error(pipelined, per_call) <= 1e-5
    if mode == "sync":
        assert rel_error(pipelined, generate(FAMILIES[family]()[0], kwargs, steps=3)) <= 1e-5


def test_more_resolutions_than_dynamos_recompile_limit_each_run_pipelined():
    """Per call, each resolution is a recompile of the transformer's forward, whose code
    every diffusers transformer shares (its decorator's wrapper): past Dynamo's limit of 8
    for the whole process, a ninth ran unpipelined. Each parallelized transformer has a
    limit of its own, and a higher one (pipelines bin resolutions into dozens)."""
    pipe, kwargs = parallelized(pixart_alpha, mode="sync", ring=False)
    sizes = [48 + 16 * i for i in range(torch._dynamo.config.recompile_limit + 2)]
    for height in sizes:
        generate(pipe, {**kwargs, "height": height}, steps=2)
    assert len(tp.programs(pipe.transformer)) == len(sizes)


def test_a_guided_ring_counts_one_samples_tokens_as_per_call_mode_does():
    """The ring traces its step with the one latent and batches the guidance inside it
    (torch.cat([latents] * 2)): its plan counts one sample's tokens, as per-call mode's
    does, so chunk lengths in tokens cut both alike (they were refused in the ring)."""
    per_pipe, kwargs = parallelized(pixart_alpha, mode="stale", ring=False, chunks=2)
    per_call = generate(per_pipe, kwargs)
    plan = tp.pipelines.programs(per_pipe)[0].plan
    lengths = [plan.chunk_tokens(chunk) for chunk in plan.chunks]
    ring_pipe, kwargs = parallelized(pixart_alpha, mode="stale", chunks=lengths)
    ring = generate(ring_pipe, kwargs)
    ring_plan = tp.pipelines.programs(ring_pipe)[0].plan
    assert ring_plan.tokens == plan.tokens
    assert [ring_plan.chunk_tokens(chunk) for chunk in ring_plan.chunks] == lengths
    assert rel_error(ring, per_call) <= 1e-5


def test_a_call_that_raised_leaves_nothing_to_the_next_per_call():
    """A callback that raises at the first step (an app cancelling) ends the call before
    diffusers resets the transformer: the next per-call generation still starts fresh."""

    def cancel(pipe, step, t, tensors):
        raise KeyboardInterrupt

    used, kwargs = parallelized(sd3, mode="stale", ring=False)
    with pytest.raises(KeyboardInterrupt):
        generate(used, {**kwargs, "callback_on_step_end": cancel})
    after = generate(used, kwargs, seed=1)
    fresh = generate(*parallelized(sd3, mode="stale", ring=False), seed=1)
    assert torch.equal(after, fresh)


def test_per_call_steps_end_at_the_schedulers_step_even_with_equal_branches():
    """Two calls a step (Wan) whose branches have equal inputs (the negative prompt is the
    prompt): per call, the second is the step's other branch, not the next step, so per
    call equals the ring, and both branches' predictions stay equal (guidance adds none
    of their difference)."""
    def equal_branches():
        pipe, kwargs = pipelines.wan()
        return pipe, {**kwargs, "negative_prompt_embeds": kwargs["prompt_embeds"].clone()}

    ring = generate(*parallelized(equal_branches, mode="stale"))
    per_call = generate(*parallelized(equal_branches, mode="stale", ring=False))
    assert rel_error(per_call, ring) <= 1e-5


def test_each_ring_is_planned_once_and_reused():
    pipe, kwargs = parallelized(pixart_alpha, mode="stale")
    first = generate(pipe, kwargs, seed=1)
    rings = pipe._tokpipe_ring.denoisers["transformer"].rings
    (ring,) = rings.values()
    program = ring.program
    generate(pipe, {**kwargs, "guidance_scale": 7.0}, seed=2)  # guidance is an input
    assert list(rings.values()) == [ring] and ring.program is program
    assert torch.equal(generate(pipe, kwargs, seed=1), first)


@pytest.mark.parametrize("boundary_ratio", [0.875, 0.5, pytest.param(0.0, marks=pytest.mark.full)])
def test_a_second_expert_runs_its_steps_as_a_ring_of_its_own(boundary_ratio):
    """Wan 2.2: `transformer` takes the steps whose timestep is at least the boundary (of
    999, 923, 818, 667, 429: two, four, all five), `transformer_2` the rest with its own
    guidance scale. Each runs one ring over its steps, the second from the first one's
    latents and UniPC state, and the generation equals the serial pipeline's."""
    make = FAMILIES["wan22"]
    pipe, kwargs = make()
    pipe.register_to_config(boundary_ratio=boundary_ratio)
    serial = generate(pipe, kwargs)
    pipe, _ = make()
    pipe.register_to_config(boundary_ratio=boundary_ratio)
    tp.pipelines.parallelize(pipe, **OPTIONS, mode="sync")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="tokpipe: .* runs per call")
        out = generate(pipe, kwargs)
    assert rel_error(out, serial) <= 1e-5
    rings = {name: len(r.rings) for name, r in pipe._tokpipe_ring.denoisers.items()}
    assert rings == {"transformer": 1, "transformer_2": int(boundary_ratio > 0)}
    assert torch.equal(generate(pipe, kwargs), out)


def test_a_second_expert_runs_per_call_when_the_generation_does():
    """Per call (here for diffusers' guidance cutoff callback, which never cuts off at
    ratio 1), both experts still run pipelined."""
    from diffusers.callbacks import SDCFGCutoffCallback

    pipe, kwargs = parallelized(FAMILIES["wan22"], mode="sync")
    cutoff = SDCFGCutoffCallback(cutoff_step_ratio=1.0)
    with pytest.warns(UserWarning, match="callback_on_step_end=SDCFGCutoffCallback"):
        out = generate(pipe, {**kwargs, "callback_on_step_end": cutoff})
    assert rel_error(out, generate(*FAMILIES["wan22"]())) <= 1e-5
    assert len(tp.pipelines.programs(pipe)) == 2  # one per expert, none a ring


def test_a_step_that_changes_within_a_generation_raises():
    """The ring computes every step from the first step's form; later steps are checked
    against it. A guidance scale that changes per step (as CogVideoX's dynamic guidance
    does; here SD3's `guidance_scale` property, read once per step) must raise."""
    pipe, kwargs = parallelized(sd3, mode="sync")
    scales = iter([5.0])
    type(pipe).guidance_scale = property(lambda self: next(scales, 2.0))
    with pytest.raises(tp.TokpipeError, match="changed the guidance at step 1"):
        generate(pipe, kwargs, steps=4)


def test_latents_changed_between_steps_other_than_by_a_blend_raise(monkeypatch):
    """Inpainting blends the latents with a noised image between steps, which the ring
    replays; any other change (here a step-end callback let through to the probes) must
    raise."""
    monkeypatch.setattr(StepCallbacks, "call_kwargs", lambda self, kwargs: kwargs)

    def callback(pipe, step, t, tensors):
        return {"latents": tensors["latents"] * 1.01}

    pipe, kwargs = parallelized(sd3, mode="sync")
    with pytest.raises(tp.TokpipeError, match="changed the latents between two steps at "
                                              "step 1"):
        generate(pipe, {**kwargs, "callback_on_step_end": callback}, steps=3)


@pytest.mark.parametrize(("family", "cfg", "stages"), [
    ("wan", 1, 2), ("cogview4", 1, 2), ("wan_image2video", 1, 2), ("wan", 2, 2),
    *(pytest.param(*case, marks=pytest.mark.full)
      for case in [("flux", 1, 2), ("hunyuan_video", 1, 2), ("wan", 2, 1)])])
def test_several_images_from_one_prompts_embeddings_equal_serial(family, cfg, stages):
    """Given one prompt's embeddings and asked for two images, the pipelines that call the
    transformer twice a step (once per guidance branch) pass the text with one row for a
    latent batch of two, which the transformer broadcasts (Wan, Flux, HunyuanVideo);
    CogView4's repeats the prompt's rows and not the negative prompt's; Wan's
    image-to-video joins one row of image embeddings to the text. The ring gives each
    sample its row of every such input to batch the branches; ring mode once refused these
    calls or failed to trace them."""
    pipe, kwargs = FAMILIES[family]()
    per_prompt = next(name for name in ("num_images_per_prompt", "num_videos_per_prompt")
                      if name in inspect.signature(pipe.__call__).parameters)
    kwargs = {**kwargs, per_prompt: 2}
    serial = generate(pipe, kwargs)
    assert serial.shape[0] == 2
    pipe, _ = FAMILIES[family]()
    tp.pipelines.parallelize(pipe, cfg=cfg, stages=stages, chunks=2, mode="sync",
                             compiler="eager")
    assert rel_error(generate(pipe, kwargs), serial) <= 1e-5


def test_a_parallelized_pipeline_keeps_its_call_signature():
    pipe, _ = FAMILIES["sd3"]()
    own = inspect.signature(pipe.__call__)
    tp.pipelines.parallelize(pipe, **OPTIONS)
    assert inspect.signature(pipe.__call__) == own
    assert "num_images_per_prompt" in pipe.__call__.__doc__


def test_a_per_call_generation_after_a_ring_warns_again():
    """A server swapping schedulers: each generation that runs per call after one that ran
    as a ring says why, though the reason is the one said before."""
    from diffusers import DPMSolverMultistepScheduler

    pipe, kwargs = parallelized(pixart_alpha, mode="sync")
    config = pipe.scheduler.config
    said = []
    for thresholding in (True, True, False, True):  # a quantile over all tokens: per call
        pipe.scheduler = DPMSolverMultistepScheduler.from_config(config,
                                                                 thresholding=thresholding)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            generate(pipe, kwargs, steps=2)
        said.append(any("runs per call" in str(w.message) for w in caught))
    assert said == [True, False, False, True]  # the second: said already, no ring between


def test_a_stale_ring_without_warmup_is_refused_at_once():
    """Not at the first call, after the prompt is encoded: parallelize says so, and what
    runs instead."""
    with pytest.raises(tp.TokpipeError, match=r"warmup_steps >= 1; pass warmup_steps=1, or "
                                              r"ring=False"):
        tp.pipelines.parallelize(FAMILIES["dit"]()[0], warmup_steps=0)
    tp.pipelines.parallelize(FAMILIES["dit"]()[0], warmup_steps=0, ring=False)
    tp.pipelines.parallelize(FAMILIES["dit"]()[0], warmup_steps=0, mode="sync")


def test_parallelize_is_at_the_top_of_the_package():
    assert tp.parallelize is tp.pipelines.parallelize


def test_a_pipeline_keeps_the_rings_of_its_latest_sizes(monkeypatch):
    """LTX passes its grid to the transformer as Python ints: each size is another form of
    step, with a ring of its own, which a server at many sizes kept for good. The rings of
    the latest KEPT_SIGNATURES are kept; an older size comes back traced anew, exact."""
    from tokpipe_compiler.pipelines import denoiser_rings

    monkeypatch.setattr(denoiser_rings, "KEPT_SIGNATURES", 2)
    make = FAMILIES["ltx"]
    pipe, kwargs = make()
    tp.pipelines.parallelize(pipe, stages=2, chunks=2, mode="sync", compiler="eager")
    height, width = kwargs["height"], kwargs["width"]
    for h, w in [(height, width), (2 * height, width), (height, 2 * width)]:
        generate(pipe, {**kwargs, "height": h, "width": w}, steps=2)
    assert len(pipe._tokpipe_ring.denoisers["transformer"].rings) == 2
    serial = generate(*make(), steps=2)
    assert rel_error(generate(pipe, kwargs, steps=2), serial) <= 1e-5


def test_reset_of_a_parallelized_pipeline_or_its_transformer():
    """Each call starts afresh: a reset between calls has nothing to drop, and one from a
    step callback during a ring says it cannot restart the ring; neither raises."""
    pipe, kwargs = parallelized(pixart_alpha, mode="stale", warmup_steps=1)
    first = generate(pipe, kwargs, steps=3)
    tp.reset(pipe)
    tp.reset(pipe.transformer)

    def reset_at_step_1(step: int, *_):
        if step == 1:
            tp.reset(pipe.transformer)

    with pytest.warns(UserWarning, match="has no effect: its denoising loop runs as one ring"):
        during = generate(pipe, {**kwargs, "callback": reset_at_step_1, "callback_steps": 1},
                          steps=3)
    assert torch.equal(during, first)
    with pytest.raises(tp.TokpipeError, match="found no tokpipe program"):
        tp.reset(torch.nn.Linear(2, 2))


def test_reset_after_a_call_that_raised_drops_the_inputs_its_ring_held():
    """A step callback raising at the warmup step (a server's cancel) left the ring's
    program holding that call's inputs (PixArt's batched text: 9.4 MB at released widths)
    until the next call; tp.reset did not reach the rings. tp.programs takes the pipeline
    too (it said to pass what torch.compile returned)."""
    pipe, kwargs = parallelized(pixart_alpha, mode="stale", warmup_steps=1)

    def cancel(step: int, *_):
        raise KeyboardInterrupt("cancelled")

    with pytest.raises(KeyboardInterrupt):
        generate(pipe, {**kwargs, "callback": cancel, "callback_steps": 1}, steps=3)
    assert tp.programs(pipe) == tp.pipelines.programs(pipe)
    assert any(p.clock.last_inputs for p in tp.programs(pipe))
    tp.reset(pipe)
    assert not any(p.clock.last_inputs for p in tp.programs(pipe))
