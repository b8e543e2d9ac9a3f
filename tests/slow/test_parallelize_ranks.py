"""parallelize(pipe) on two gloo ranks: each rank calls the pipeline as written, the loop
runs as one ring across them, and every rank returns what one process computes (within
1e-5 relative, float32). The two-rank runs share one launch (tests/fixtures/ranks.py)."""

from __future__ import annotations

import time
import warnings
from typing import Any

import pytest
import torch

import tokpipe_compiler as tp
from tests.fixtures import pipelines
from tests.fixtures.conditioned import CONDITIONED
from tests.fixtures.more_pipelines import MORE, glm_image, zimage_padded
from tests.fixtures.perturbed import PERTURBED
from tests.fixtures.pipelines import generate, in_dtype
from tests.fixtures.ranks import launch_cases, selected
from tests.fixtures.video_pipelines import VIDEO

pytestmark = [pytest.mark.slow, pytest.mark.ranks]
pytest.importorskip("transformers")

FAMILIES = {**pipelines.FAMILIES, **CONDITIONED, **PERTURBED, **MORE, **VIDEO, **pipelines.NOISY,
            "glm_image": glm_image, "zimage_padded": zimage_padded}
OPTIONS = {"stages": 2, "chunks": 2, "mode": "stale", "warmup_steps": 1, "compiler": "eager"}


def _pipelined(family: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    pipe, kwargs = in_dtype(FAMILIES[family](), dtype)
    tp.pipelines.parallelize(pipe, **OPTIONS)
    return generate(pipe, kwargs, steps=4)


def _rank(rank: int, world: int, family: str, dtype: torch.dtype = torch.float32
          ) -> torch.Tensor:
    return _pipelined(family, dtype)


@pytest.mark.parametrize("family", [
    "pixart_alpha",  # one batched call, DPM-Solver++
    "wan",  # two calls per step, UniPC (three carried states)
    "pixart_classic_attention",  # attention as baddbmm, softmax, bmm (folded into sdpa)
    "flux",  # joint attention, dynamic shift
    "ltx",
    "hunyuan_video",  # video, joint attention, true guidance (two calls per step)
    "flux_kontext",  # the image's tokens carried in the ring's sample, true guidance
    "wan_image2video",  # the image's latents joined to the channels, from the first step
    "wan22",  # two experts: a ring each, the second from the first one's latents and state
    "wan22_5b",  # the timestep passed for every token, cut per chunk like the latent
    "flux_inpaint",  # the latents blended with the noised image after every step
    "sd3_pag",  # perturbed-attention guidance: three parts of the batch, one perturbed
    "pixart_ancestral",  # each step's noise drawn on every rank, from its own generator
    pytest.param("wan_video2video", marks=pytest.mark.full),  # starts inside the schedule
    # the latents written in place; guidance from a guider component; joint attention
    *(pytest.param(f, marks=pytest.mark.full)
      for f in ("kandinsky5_video", "hunyuan_image", "ovis", "skyreels_v2")),
    # a ring per window; VACE's control; a latent list, negated (Z-Image Turbo); the rest
    *(pytest.param(f, marks=pytest.mark.full)
      for f in ("helios", "wan_vace", "chronoedit", "motif_video", "zimage_turbo", "zimage",
                "ernie_image", "kandinsky5_image", "nucleus_moe_image", "hidream")),
    # its image tokens padded (the last one repeated, then overwritten) in both branches
    pytest.param("zimage_padded", marks=pytest.mark.full),
    # per call, its prior tokens zeroed in place before the pipeline on every rank
    pytest.param("glm_image", marks=pytest.mark.full),
])
def test_two_ranks_equal_one_process(family, two_rank_runs):
    alone = _pipelined(family)
    ranks = two_rank_runs["ring", family]
    for result in ranks:
        assert (result - alone).abs().max().item() <= 1e-5 * alone.abs().max().item()


@pytest.mark.parametrize("family", [
    "flux",  # the timestep rounded to bfloat16 before it is divided
    "sana",  # float32 latents cast to bfloat16 for the transformer, guidance upcast
])
def test_two_ranks_in_bfloat16_equal_one_process(family, two_rank_runs):
    """Released models run in bfloat16: the ranks send bfloat16 activations and K/V and
    carry the scheduler's float32 state; they compute what one process computes."""
    alone = _pipelined(family, torch.bfloat16)
    for result in two_rank_runs["ring bfloat16", family]:
        assert result.dtype == alone.dtype  # Sana keeps its latents in float32
        assert (result - alone).abs().max().item() <= 1e-5 * alone.abs().max().item()


def _two_videos(rank: int = 0, world: int = 1) -> torch.Tensor:
    pipe, kwargs = FAMILIES["wan"]()
    tp.pipelines.parallelize(pipe, **OPTIONS)
    return generate(pipe, {**kwargs, "num_videos_per_prompt": 2}, steps=4)


def test_two_videos_from_one_prompts_embeddings_on_two_ranks(two_rank_runs):
    """One prompt's embeddings (one row) for a batch of two videos, two transformer calls
    a step: the ring gives each sample its row of each branch's text, on every rank."""
    alone = _two_videos()
    assert alone.shape[0] == 2
    for result in two_rank_runs["two videos"]:
        assert (result - alone).abs().max().item() <= 1e-5 * alone.abs().max().item()


def _lora_added(rank: int = 0, world: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    from tests.fixtures.changes import add_lora

    pipe, kwargs = FAMILIES["flux"]()
    tp.pipelines.parallelize(pipe, **OPTIONS)
    before = generate(pipe, kwargs, steps=4)
    add_lora(pipe.transformer)
    with pytest.warns(UserWarning, match="changed since its rings were traced"):
        return before, generate(pipe, kwargs, steps=4)


def test_a_lora_added_between_generations_on_two_ranks(two_rank_runs):
    """Every rank adds the adapter after a generation: each traces its ring anew and the
    ranks compute what one process computes with the adapter."""
    pytest.importorskip("peft")
    alone = _lora_added()
    assert (alone[1] - alone[0]).abs().max() > 1e-3 * alone[0].abs().max()
    for result in two_rank_runs["lora"]:
        for got, want in zip(result, alone, strict=True):
            assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()


def _from_pipe(rank: int = 0, world: int = 1) -> list[torch.Tensor]:
    from diffusers import FluxPipeline

    image, image_kwargs = CONDITIONED["flux_img2img"]()
    tp.pipelines.parallelize(image, **OPTIONS)
    text = tp.pipelines.parallelize(FluxPipeline.from_pipe(image), **OPTIONS)
    text_kwargs = FAMILIES["flux"]()[1]
    return [generate(image, image_kwargs, steps=4), generate(text, text_kwargs, steps=4),
            generate(image, image_kwargs, steps=4)]


def test_pipelines_made_from_one_another_on_two_ranks(two_rank_runs):
    """Image-to-image, then text-to-image made from it (one transformer, one scheduler),
    then image-to-image again: each rank computes what one process computes."""
    alone = _from_pipe()
    for result in two_rank_runs["from_pipe"]:
        for got, want in zip(result, alone, strict=True):
            assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()


def _noisy_steps(rank: int, world: int) -> tuple[str, torch.Tensor]:
    """SD3 with a scheduler that draws noise at each step (per call), from each rank's own
    random state: seeded apart, then alike (sync: the serial pipeline's numbers)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    pipe, kwargs = pipelines.sd3()
    pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, stochastic_sampling=True)
    tp.pipelines.parallelize(pipe, **{**OPTIONS, "mode": "sync"})
    torch.manual_seed(rank)
    try:
        generate(pipe, kwargs, steps=3)
        said = ""
    except tp.TokpipeError as err:
        said = str(err)
    torch.manual_seed(7)
    result = generate(pipe, kwargs, steps=3)
    torch.manual_seed(7)
    other = {**kwargs, "prompt_embeds": kwargs["prompt_embeds"] + rank}
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        generate(pipe, other, steps=3)
    differ = sum("inputs differ between ranks" in str(w.message)
                 and "Pass the same inputs on every rank" in str(w.message) for w in seen)
    pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)  # a ring again
    torch.manual_seed(rank)
    try:  # the latents drawn from each rank's own random state
        pipe(**kwargs, num_inference_steps=3)
        ring_said = ""
    except tp.TokpipeError as err:
        ring_said = str(err)
    return said, result, differ, ring_said


def test_ranks_whose_scheduler_noise_parts_them_raise(two_rank_runs):
    """Per call, each rank's scheduler steps its own latents: ones drawn from random
    states seeded apart made the ranks return other images, silently. A ring's first
    step's latents drawn apart raise at its start."""
    pipe, kwargs = pipelines.sd3()
    from diffusers import FlowMatchEulerDiscreteScheduler

    pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, stochastic_sampling=True)
    torch.manual_seed(7)
    alone = generate(pipe, kwargs, steps=3)
    for said, result, differ, ring_said in two_rank_runs["noisy steps"]:
        assert "At step 1 of a per-call generation" in said and "Seed it alike" in said
        assert (result - alone).abs().max().item() <= 1e-5 * alone.abs().max().item()
        assert differ == 1  # other prompts: said at the generation's start, not each step
        # a ring's check names its carried latents as the caller knows them
        assert "the token input 'sample' (the latents) has other values" in ring_said


RAISING_TIMEOUT = 20  # seconds a rank waits for another in these runs


def _raising_pipeline(split: bool) -> tuple:
    """A pipeline that runs per call: SD3 with ring=False, or (split) Flux under diffusers'
    First Block Cache, which Dynamo traces as several graphs, a program each."""
    from diffusers import FirstBlockCacheConfig

    pipe, kwargs = pipelines.flux(true_cfg=False) if split else pipelines.sd3()
    tp.pipelines.parallelize(pipe, **{**OPTIONS, "mode": "sync", "timeout": RAISING_TIMEOUT},
                             ring=False)
    if split:
        pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=0.5))
    return pipe, kwargs


def _one_rank_raises(rank: int, world: int, split: bool) -> tuple[list[str], list[float], Any]:
    """Per call, one rank raises: rank 0's step callback at step 1 (then both ranks idle
    longer than the timeout, as a server between requests), rank 0's at the last step,
    rank 1's at step 0, rank 1's inputs before the loop (a prompt beside its embeddings);
    then a call as ever."""
    pipe, kwargs = _raising_pipeline(split)

    def fail(who: int, step: int):
        def callback(pipe, i, t, tensors):
            if rank == who and i == step:
                raise ValueError(f"rank {who} stops at {step}")
            return tensors
        return callback

    calls = [{"callback_on_step_end": fail(0, 1)}, {"callback_on_step_end": fail(0, 2)},
             {"callback_on_step_end": fail(1, 0)}, {"prompt": "a cat"} if rank == 1 else {}]
    said, seconds = [], []
    for k, call in enumerate(calls):
        start = time.monotonic()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                generate(pipe, {**kwargs, **call}, steps=3)
            said.append("")
        except (ValueError, tp.TokpipeError) as err:
            said.append(str(err))
        seconds.append(time.monotonic() - start)
        if k == 0 and not split:
            time.sleep(RAISING_TIMEOUT + 5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if not split:  # outside a parallelized call, what the raises left is passed over
            said.append(generate(type(pipe).__mro__[1].from_pipe(pipe), kwargs, steps=3))
        return said, seconds, generate(pipe, kwargs, steps=3)


@pytest.mark.parametrize("split", [False, True], ids=["one graph", "graph breaks"])
def test_a_rank_whose_per_call_step_raises_stops_the_others_at_once(split, two_rank_runs):
    """Rank 1 waited `timeout` for rank 0's next step, then the gloo group closed and every
    later call failed. With graph breaks each graph's program exchanges its own checks:
    the peers are told once, and the next call runs as ever. A peer told does not wait for
    the leaver's next call (which may come later than `timeout`)."""
    from diffusers import FirstBlockCacheConfig

    serial, kwargs = pipelines.flux(true_cfg=False) if split else pipelines.sd3()
    if split:
        serial.transformer.enable_cache(FirstBlockCacheConfig(threshold=0.5))
    alone = generate(serial, kwargs, steps=3)
    (said, seconds, after), (peer_said, peer_seconds, peer_after) = \
        two_rank_runs["one rank raises", split]
    assert said[:2] == ["rank 0 stops at 1", "rank 0 stops at 2"]
    assert peer_said[2] == "rank 1 stops at 0" and "prompt_embeds" in peer_said[3]
    for stopped in (peer_said[0], said[2], said[3]):  # told by the other rank
        assert "left this pipeline call, their call raising" in stopped, stopped
        assert "ValueError: " in stopped
    assert peer_said[1] == ""  # its last step was done: its call returns as ever
    assert max(seconds + peer_seconds) < RAISING_TIMEOUT
    unparallelized = [] if split else [said[4], peer_said[4]]  # a from_pipe sibling's
    for result in (after, peer_after, *unparallelized):
        assert (result - alone).abs().max().item() <= 1e-5 * alone.abs().max().item()


@pytest.fixture(scope="module")
def two_rank_runs(request) -> dict:
    """Per-rank results of the selected two-rank runs, from one launch."""
    cases = {("ring", p["family"]): (_rank, (p["family"],))
             for p in selected(request, test_two_ranks_equal_one_process)}
    cases.update({("ring bfloat16", p["family"]): (_rank, (p["family"], torch.bfloat16))
                  for p in selected(request, test_two_ranks_in_bfloat16_equal_one_process)})
    if selected(request, test_two_videos_from_one_prompts_embeddings_on_two_ranks):
        cases["two videos"] = (_two_videos, ())
    if selected(request, test_a_lora_added_between_generations_on_two_ranks):
        cases["lora"] = (_lora_added, ())
    if selected(request, test_pipelines_made_from_one_another_on_two_ranks):
        cases["from_pipe"] = (_from_pipe, ())
    cases.update({("one rank raises", p["split"]): (_one_rank_raises, (p["split"],))
                  for p in selected(request,
                                    test_a_rank_whose_per_call_step_raises_stops_the_others_at_once)})
    if selected(request, test_ranks_whose_scheduler_noise_parts_them_raise):
        cases["noisy steps"] = (_noisy_steps, ())
    return launch_cases(cases, 2, timeout=600 * len(cases))
