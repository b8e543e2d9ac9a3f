"""Simulator: presets give finite, sensible predictions; PixArt against published runs."""

from __future__ import annotations

import math
import re
from dataclasses import replace

import pytest
import torch

from tokpipe_compiler.costmodel import published, released_runs
from tokpipe_compiler.costmodel import simulator as simulate_module
from tokpipe_compiler.costmodel.hardware import DEVICES, LINKS
from tokpipe_compiler.costmodel.host import HostModel
from tokpipe_compiler.costmodel.published import pixart_stage_costs
from tokpipe_compiler.costmodel.simulator import simulate_model


@pytest.mark.parametrize("device", ["h200", "a100-pcie", "l20"])
@pytest.mark.parametrize(("link", "world"), [("nvlink4", 8), ("pcie4", 4), ("pcie4-no-p2p", 2)])
def test_presets_give_sensible_speedups(device, link, world):
    stages, boundary = pixart_stage_costs(world)
    result = simulate_model(stages, boundary, 4096, 8, 20, 1, DEVICES[device], LINKS[link], world)
    assert all(math.isfinite(t) and t > 0 for t in (result.serial_s, result.pipelined_s))
    assert 1 < result.speedup < world
    assert 0 <= result.bubble_fraction < 1
    assert len(result.per_stage_s) == world


def test_more_warmup_steps_cost_more():
    stages, boundary = pixart_stage_costs(4)
    device, link = DEVICES["a100-pcie"], LINKS["pcie4"]
    one = simulate_model(stages, boundary, 4096, 4, 20, 1, device, link, 4)
    five = simulate_model(stages, boundary, 4096, 4, 20, 5, device, link, 4)
    assert five.pipelined_s > one.pipelined_s and five.serial_s == one.serial_s


def test_world_must_match_stages():
    stages, boundary = pixart_stage_costs(2)
    with pytest.raises(ValueError, match="per rank"):
        simulate_model(stages, boundary, 4096, 4, 20, 1, DEVICES["l20"], LINKS["pcie4"], 4)


def test_pixart_pipelined_within_20_percent_of_published(capsys):
    """The device rate is fitted to the published serial time; the pipelined time (warmup,
    ring, sends on the compute stream, text encoder and VAE) is predicted."""
    for row in published.compare(chunks=4):
        assert row.serial_s == pytest.approx(row.published_serial_s, rel=1e-3)
        assert 0.8 < row.pipelined_s / row.published_pipelined_s < 1.2, row
        assert 0.2 < row.fraction < 1.0 and 0 < row.outside_s < 0.5
    simulate_module.main(["--pixart"])
    assert capsys.readouterr().out.count("published") == 2 * 2


def test_the_vae_figures_are_what_the_decoder_counts():
    flops, nbytes = published.count_vae_decoder()
    assert flops == pytest.approx(published.VAE_DECODE_FLOPS, rel=1e-3)
    assert nbytes == pytest.approx(published.VAE_DECODE_OUTPUT_BYTES, rel=1e-3)


@pytest.mark.full  # 10-20 s of FLOP counting per decoder
@pytest.mark.parametrize(("name", "cls_name", "latent"), [
    ("ltx", "AutoencoderKLLTXVideo", (1, 128, 21, 16, 22)),
    ("cogvideox", "AutoencoderKLCogVideoX", (1, 16, 13, 60, 90)),
    ("wan", "AutoencoderKLWan", (1, 16, 21, 60, 104)),
])
def test_the_video_vae_figures_are_what_their_decoders_count(name, cls_name, latent):
    flops, nbytes = released_runs.count_decoder(cls_name, latent)
    assert flops == pytest.approx(released_runs.VIDEO_VAE[name][0], rel=1e-3)
    assert nbytes == pytest.approx(released_runs.VIDEO_VAE[name][1], rel=1e-3)


def test_outside_work_sends_and_launches_only_add_time():
    stages, boundary = pixart_stage_costs(4)
    device, link = DEVICES["a100-pcie"], LINKS["pcie4"]
    base = simulate_model(stages, boundary, 4096, 4, 20, 1, device, link, 4)
    outside = simulate_model(stages, boundary, 4096, 4, 20, 1, device, link, 4, outside_s=0.5)
    assert outside.serial_s == pytest.approx(base.serial_s + 0.5)
    assert outside.pipelined_s == pytest.approx(base.pipelined_s + 0.5)
    blocking = simulate_model(stages, boundary, 4096, 4, 20, 1, device, LINKS["pcie4-no-p2p"],
                              4, overlap_sends=False)
    assert blocking.pipelined_s > base.pipelined_s
    launch_bound = simulate_model(stages, boundary, 4096, 64, 20, 1, device, link, 4,
                                  host=HostModel(per_launch_s=1e-3))  # 7 x 30 launches
    assert min(launch_bound.per_stage_s) >= 7 * 30 * 1e-3  # 0.21 s a chunk
    call_bound = simulate_model(stages, boundary, 4096, 64, 20, 1, device, link, 4,
                                host=HostModel(per_call_s=0.5))
    assert min(call_bound.per_stage_s) == pytest.approx(0.5)  # 64 small chunks: the host's


def test_simulate_a_plan_from_explain():
    import tokpipe_compiler as tp
    from tests.fixtures.models import TinyDiT, dit_inputs

    model = TinyDiT(depth=4, width=64, heads=2, grid=16).eval()
    plan = tp.explain(model, dit_inputs(model, 16), stages=2, chunks=4)
    fast = tp.simulate(plan, "h200", "nvlink4")
    slow = tp.simulate(plan, "a100-pcie", "pcie4")
    assert 0 < fast.speedup < 2 and 0 < slow.speedup < 2
    assert fast.serial_s < slow.serial_s
    with pytest.raises(ValueError, match="world=3"):
        tp.simulate(plan, world=3)


@pytest.fixture(scope="module")
def tiny_plans():
    """A PixArt-alpha-wide block on a 32 x 32 latent, on meta: in float32 and bfloat16."""
    import tokpipe_compiler as tp
    from tokpipe_compiler import released

    name, grid = "pixart-alpha-xl-2-1024-ms", (32, 32)
    plans = []
    for dtype in (torch.float32, torch.bfloat16):
        model = released.build(name, layers=2, device="meta", grid=grid).to(dtype)
        inputs = {k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point()
                  else v for k, v in released.inputs(name, batch=2, grid=grid,
                                                     device="meta").items()}
        plans.append(tp.explain(model, (), inputs, stages=2, chunks=4))
    return plans


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"device": "H200"}, "unknown device 'H200': use one of h200, a100-pcie, l20, cpu"),
    ({"device": ""}, "unknown device '': use one of h200"),
    ({"link": "nvlink"}, "unknown link 'nvlink': use one of nvlink4, pcie4, pcie4-no-p2p"),
    ({"steps": 0}, "steps=0: need a whole number of denoising steps >= 1"),
    ({"steps": -5}, "steps=-5"),
    ({"steps": 2.5}, "steps=2.5"),
    ({"world": 0}, "world=0: need a whole number of devices >= 1"),
    ({"world": 3}, "world=3 but the plan has 2 stages"),
])
def test_simulate_refuses_bad_arguments_naming_the_valid_ones(tiny_plans, kwargs, message):
    """Bare KeyErrors, a ZeroDivisionError, negative times and world=0 taken as 'one a
    stage' before."""
    import tokpipe_compiler as tp

    with pytest.raises(ValueError, match=re.escape(message)):
        tp.simulate(tiny_plans[0], **kwargs)


def test_simulate_computes_in_the_plans_dtype(tiny_plans):
    """A float32 plan runs its products at the GPU's FP32 rate, a bf16 one at its tensor
    cores': the float32 plan's matrix products take 989 / 67 times as long on the H200."""
    import tokpipe_compiler as tp
    from tokpipe_compiler.costmodel.simulator import plan_dtype

    full, half = tiny_plans
    assert (plan_dtype(full), plan_dtype(half)) == (torch.float32, torch.bfloat16)
    fast = replace(DEVICES["h200"], mem_bandwidth=1e30)  # compute alone
    ratio = tp.simulate(full, fast).serial_s / tp.simulate(half, fast).serial_s
    assert ratio == pytest.approx(989 / 67, rel=0.05)


@pytest.mark.parametrize(("argv", "message"), [
    (["--pixart", "--chunks", "0"], "from 1 to 4096 (PixArt's tokens), got '0'"),
    (["--pixart", "--chunks", "-2"], "got '-2'"),
    (["--pixart", "--chunks", "100000"], "got '100000'"),
    (["--pixart", "--chunks", "x"], "got 'x'"),
    (["--chunks", "4"], "nothing to predict: pass --pixart"),
    ([], "nothing to predict: pass --pixart"),
])
def test_the_simulator_command_refuses_bad_arguments(capsys, argv, message):
    """A ZeroDivisionError, max() of an empty sequence, 100000 one-token chunks of 4096
    tokens predicted, and the help printed with exit code 0 before."""
    with pytest.raises(SystemExit) as exited:
        simulate_module.main(argv)
    assert exited.value.code == 2 and message in capsys.readouterr().err


def test_simulate_model_needs_a_token_a_chunk():
    stages, boundary = pixart_stage_costs(2)
    device, link = DEVICES["l20"], LINKS["pcie4"]
    for chunks in (0, -2, 4097):
        with pytest.raises(ValueError, match=f"chunks={chunks}: need 1 <= chunks <= tokens"):
            simulate_model(stages, boundary, 4096, chunks, 20, 1, device, link, 2)
    with pytest.raises(ValueError, match="steps=0"):
        simulate_model(stages, boundary, 4096, 4, 0, 1, device, link, 2)


def test_a_ring_with_fewer_chunks_than_ranks_keeps_ranks_idle():
    """At most `chunks` ranks compute at once: 4 chunks on 8 ranks give at most 4x, and at
    least half the devices idle."""
    stages, boundary = pixart_stage_costs(8)
    result = simulate_model(stages, boundary, 4096, 4, 20, 1, DEVICES["l20"], LINKS["pcie4"], 8)
    assert result.speedup <= 4
    assert result.bubble_fraction >= 0.5


def test_per_stage_seconds_are_a_chunks_whether_or_not_the_chunks_are_even():
    """A table a few tokens uneven gives about the even table's seconds (the step's sum
    over 8 chunks was given instead, 8x as much)."""
    from tokpipe_compiler.costmodel.simulator import simulate_chunks

    stages, boundary = pixart_stage_costs(2)
    device, link = DEVICES["h200"], LINKS["nvlink4"]
    even = simulate_chunks(stages, boundary, 4096, [(512, 4096, 0.0)] * 8, 20, 1, device,
                           link, 2)  # stale chunks: each attends to all 4096 tokens
    uneven = simulate_chunks(stages, boundary, 4096,
                             [(n, 4096, 0.0) for n in [576, *[512] * 6, 448]],
                             20, 1, device, link, 2)
    for a, b in zip(even.per_stage_s, uneven.per_stage_s, strict=True):
        assert b == pytest.approx(a, rel=0.1)
