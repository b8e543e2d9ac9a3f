"""diffusers' guider components (`diffusers.guiders`) and modular pipelines: a modular
pipeline runs per call (not in the ring table) and equals the serial one in sync mode; a
guider that hooks the transformer for one branch (perturbed-attention guidance through
layer-skip hooks) keeps each branch's stale K/V apart, and says, in stale mode, that the
first call differs from later ones.

Tolerance: 1e-5 relative to the serial pipeline's latents (float32)."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

import tokpipe_compiler as tp
from tests.fixtures.modular_pipelines import MODULAR
from tests.fixtures.pipelines import TEXT, WIDTH, _text
from tests.fixtures.tracing import rel_error
from tests.fixtures.zoo import ZOO
from tests.fixtures.zoo_build import build_entry

OPTIONS = {"stages": 2, "chunks": 2, "compiler": "eager", "warmup_steps": 1}
HOOKED = "hooks the transformer for one guidance branch"


def zimage_modular(guider):
    """Z-Image's modular denoising blocks with `guider`, a small random transformer."""
    import diffusers
    from diffusers.modular_pipelines.z_image.modular_blocks_z_image import ZImageCoreDenoiseStep

    pipe = ZImageCoreDenoiseStep().init_pipeline()
    pipe.update_components(
        transformer=build_entry("ZImageTransformer2DModel", ZOO["ZImageTransformer2DModel"]),
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0), guider=guider)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def generate(pipe) -> torch.Tensor:
    return pipe(prompt_embeds=[_text(1, TEXT, WIDTH)],
                negative_prompt_embeds=[_text(2, TEXT, WIDTH)], height=128, width=128,
                num_inference_steps=3, generator=torch.Generator().manual_seed(0), output="latents")


def perturbed():
    from diffusers import guiders
    from diffusers.hooks import LayerSkipConfig

    return guiders.PerturbedAttentionGuidance(
        guidance_scale=4.0, perturbed_guidance_scale=2.0, perturbed_guidance_start=0.0,
        perturbed_guidance_stop=1.0, perturbed_guidance_config=LayerSkipConfig(
            indices=[0], fqn="layers", skip_attention=False, skip_attention_scores=True))


def test_a_modular_pipeline_not_in_the_table_runs_per_call_and_equals_serial(monkeypatch):
    from diffusers import guiders

    from tokpipe_compiler.pipelines import table

    monkeypatch.delitem(table.RING_PIPELINES, "ZImageModularPipeline")
    serial = generate(zimage_modular(guiders.ClassifierFreeGuidance(guidance_scale=4.0)))
    pipe = tp.parallelize(zimage_modular(guiders.ClassifierFreeGuidance(guidance_scale=4.0)),
                          mode="sync", **OPTIONS)
    with pytest.warns(UserWarning, match="ZImageModularPipeline runs per call"):
        out = generate(pipe)
    assert rel_error(out, serial) <= 1e-5


def test_a_guider_that_hooks_a_branch_says_nothing_in_sync_mode():
    synced = tp.parallelize(zimage_modular(perturbed()), mode="sync", **OPTIONS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        generate(synced)
    assert not [w for w in caught if HOOKED in str(w.message)]


def test_a_hooked_branchs_graphs_read_the_k_v_of_their_own_branch(monkeypatch):
    """PAG hooks layer 0 for its perturbed branch: Dynamo traces the model again, split at
    the hook, from the perturbed branch of step 1 of the first call, and runs every branch
    through those graphs after. A graph's stale (chunked) call reads the K/V it computed
    for the same branch at the step before, never another branch's or the last call's;
    every call after the first (which ran other graphs first) gives the same latents. The
    first call's difference is said once per guider."""
    from tokpipe_compiler.pipelines.denoiser_rings import DenoiserRings
    from tokpipe_compiler.stage_programs.generations import PIPELINE_STEPS
    from tokpipe_compiler.stage_programs.pipelined import PipelinedProgram

    where = {"steps": -1, "branch": -1}  # the model call running: its step and branch
    runs: list[tuple[int, int, int, bool]] = []  # program, step, branch, stale

    def counted(self, *args, **kwargs):
        steps = PIPELINE_STEPS.get().steps
        where["branch"] = where["branch"] + 1 if steps == where["steps"] else 0
        where["steps"] = steps
        return unpipelined(self, *args, **kwargs)

    def recorded(self, *args):
        out = call(self, *args)
        runs.append((self.made, where["steps"], where["branch"], self.last_chunk_count > 1))
        return out

    unpipelined, call = DenoiserRings.unpipelined, PipelinedProgram._call
    monkeypatch.setattr(DenoiserRings, "unpipelined", counted)
    monkeypatch.setattr(PipelinedProgram, "_call", recorded)
    pipe = tp.parallelize(zimage_modular(perturbed()), mode="stale", **OPTIONS)
    outs = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            runs.clear()
            where["steps"] = -1
            outs.append(generate(pipe))
            ran = {(program, step, branch) for program, step, branch, _ in runs}
            assert {branch for _, _, branch, _ in runs} == {0, 1, 2}
            assert any(stale for *_, stale in runs)
            for program, step, branch, stale in runs:
                assert not stale or (program, step - 1, branch) in ran, (program, step, branch)
    assert torch.equal(outs[1], outs[2])
    told = [str(w.message) for w in caught if HOOKED in str(w.message)]
    assert len(told) == 1 and "PerturbedAttentionGuidance" in told[0]
    assert "in 'stale' mode" in told[0] and "differ from later calls'" in told[0]


def test_a_guider_that_changes_the_step_runs_per_call_and_equals_serial():
    """HunyuanImage 2.1 ships AdaptiveProjectedMixGuidance (adaptive projected guidance
    from a later step, with momentum): the ring, which replays one guidance form at every
    step, would refuse it partway through; it runs per call, saying why. Its
    classifier-free guider runs as a ring (test_parallelize's hunyuan_image)."""
    from diffusers import guiders

    from tests.fixtures.more_pipelines import hunyuan_image
    from tests.fixtures.pipelines import generate as generate_with
    from tests.fixtures.pipelines import parallelized

    def make():
        return hunyuan_image(guiders.AdaptiveProjectedMixGuidance(
            guidance_scale=4.0, adaptive_projected_guidance_start_step=2))

    serial = generate_with(*make(), steps=4)
    with pytest.warns(UserWarning, match="its guider, AdaptiveProjectedMixGuidance, is not "
                                         "classifier-free guidance at one scale"):
        out = generate_with(*parallelized(make, mode="sync"), steps=4)
    assert rel_error(out, serial) <= 1e-5


@pytest.mark.parametrize("name", [name if name in ("wan", "qwenimage") else
                                  pytest.param(name, marks=pytest.mark.full)
                                  for name in MODULAR])
def test_a_modular_pipeline_in_the_table_runs_as_a_ring(name):
    """A modular pipeline loops over blocks, its guider batching the branches: the ring
    finds its step as it finds a regular pipeline's (sync: the serial numbers; stale: per
    call's, and a second call the first's). QwenImage's guidance, rescaled to the
    conditional prediction's norm, is found at its guider's scale."""
    build, call = MODULAR[name]
    serial = call(build())
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="tokpipe: .* runs per call")
        synced = call(tp.parallelize(build(), mode="sync", **OPTIONS))
        pipe = tp.parallelize(build(), mode="stale", **OPTIONS)
        stale, again = call(pipe), call(pipe)
    per_call = call(tp.parallelize(build(), mode="stale", ring=False, **OPTIONS))
    assert rel_error(synced, serial) <= 1e-5
    assert rel_error(stale, per_call) <= 1e-5 and torch.equal(stale, again)


def test_a_modular_call_started_again_per_call_draws_the_same_noise():
    """A modular pipeline's `__call__(state, output, **kwargs)` takes its `generator`
    through **kwargs: a call whose step the ring cannot replay (here a loop block that
    rescales the guided prediction per token) starts again per call from the generator's
    state at the call's start, and equals the serial pipeline; the refusal leaving the
    blocks is not logged by them as an error."""
    import diffusers
    from diffusers import guiders
    from diffusers.modular_pipelines.wan.denoise import WanLoopDenoiser
    from diffusers.modular_pipelines.wan.modular_blocks_wan import WanCoreDenoiseStep

    from tests.fixtures.more_pipelines import _transformer

    class Renormed(WanLoopDenoiser):
        def __call__(self, components, block_state, i, t):
            components, block_state = super().__call__(components, block_state, i, t)
            norms = block_state.noise_pred.norm(dim=1, keepdim=True)
            block_state.noise_pred = block_state.noise_pred * (norms.mean() / norms)
            return components, block_state

    def build():
        blocks = WanCoreDenoiseStep()
        blocks.sub_blocks["denoise"].sub_blocks["denoiser"] = Renormed()
        pipe = blocks.init_pipeline()
        pipe.update_components(  # 16 channels: the latents the generator draws (the VAE's)
            transformer=_transformer("WanTransformer3DModel", in_channels=16, out_channels=16),
            scheduler=diffusers.UniPCMultistepScheduler(
                prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0),
            guider=guiders.ClassifierFreeGuidance(guidance_scale=5.0))
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def call(pipe):
        return pipe(prompt_embeds=_text(1, 1, TEXT, WIDTH),
                    negative_prompt_embeds=_text(2, 1, TEXT, WIDTH), height=64, width=64,
                    num_frames=5, num_inference_steps=3, output="latents",
                    generator=torch.Generator().manual_seed(0))

    serial = call(build())
    logged: list[str] = []  # diffusers logs each error leaving a block, with its traceback
    handler = logging.Handler(logging.ERROR)
    handler.emit = lambda record: logged.append(record.getMessage())
    blocks_log = logging.getLogger("diffusers.modular_pipelines.modular_pipeline")
    blocks_log.addHandler(handler)
    try:
        with pytest.warns(UserWarning, match="started again per call, from the same random "
                                             "state"):
            out = call(tp.parallelize(build(), mode="sync", **OPTIONS))
    finally:
        blocks_log.removeHandler(handler)
    assert rel_error(out, serial) <= 1e-5
    assert not logged  # the ring's refusal is the warning alone
