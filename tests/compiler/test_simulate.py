"""Simulator: presets give finite, sensible predictions; PixArt against published runs."""

from __future__ import annotations

import math

import pytest

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


def test_a_ring_with_fewer_chunks_than_ranks_keeps_ranks_idle():
    """At most `chunks` ranks compute at once: 4 chunks on 8 ranks give at most 4x, and at
    least half the devices idle."""
    stages, boundary = pixart_stage_costs(8)
    result = simulate_model(stages, boundary, 4096, 4, 20, 1, DEVICES["l20"], LINKS["pcie4"], 8)
    assert result.speedup <= 4
    assert result.bubble_fraction >= 0.5
