"""Simulator: presets give finite, sensible predictions; PixArt against published runs."""

from __future__ import annotations

import math

import pytest

from tokpipe_compiler.costmodel import simulator as simulate_module
from tokpipe_compiler.costmodel.hardware import DEVICES, LINKS
from tokpipe_compiler.costmodel.simulator import pixart_stage_costs, simulate_model


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


def test_pixart_within_a_factor_of_two_of_published(capsys):
    for _, sim, serial, pipelined in simulate_module.pixart_comparison(chunks=4):
        assert 0.5 < sim.serial_s / serial < 2
        assert 0.5 < sim.pipelined_s / pipelined < 2
    simulate_module.main(["--pixart"])
    assert capsys.readouterr().out.count("published") == 2 * 3


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
