"""Steps, guidance branches and generations, told from the timestep argument."""

from __future__ import annotations

import torch

from tokpipe_compiler.stage_programs.generations import StepClock, timestep_index


def ticks(clock: StepClock, calls: list[tuple]) -> list[tuple[bool, int, int]]:
    return [(t.new_generation, t.step, t.branch) for t in map(clock.tick, calls)]


def test_falling_timesteps_are_steps_and_a_rise_starts_a_generation():
    x = torch.zeros(2)
    calls = [(x, torch.tensor([999.0, 999.0])), (x, torch.tensor([500.0, 500.0])),
             (x, torch.tensor([1.0, 1.0])), (x, torch.tensor([999.0, 999.0]))]
    assert ticks(StepClock(1), calls) == [(True, 0, 0), (False, 1, 0), (False, 2, 0),
                                          (True, 0, 0)]


def test_two_calls_per_step_are_two_branches():
    latents, cond, uncond = torch.zeros(1), torch.ones(1), -torch.ones(1)
    calls = []
    for t in (900.0, 600.0):
        calls += [(latents, torch.tensor(t), cond), (latents, torch.tensor(t), uncond)]
    assert ticks(StepClock(1, [0, 1, 2]), calls) == [(True, 0, 0), (False, 0, 1), (False, 1, 0),
                                          (False, 1, 1)]


def test_a_call_repeated_with_equal_inputs_is_the_next_step():
    calls = [(torch.zeros(1), torch.tensor(10.0)) for _ in range(3)]  # equal, not the same
    assert ticks(StepClock(1, [0, 1]), calls) == [(True, 0, 0), (False, 1, 0), (False, 2, 0)]


def test_inputs_are_compared_only_when_the_timestep_repeats(monkeypatch):
    """Comparing device tensors waits for the device: a step whose timestep moved on
    (every step of a pipeline with one call a step) compares nothing."""
    compared = []
    equal = torch.equal
    monkeypatch.setattr(torch, "equal", lambda a, b: compared.append(1) or equal(a, b))
    clock, x = StepClock(1, [0, 1]), torch.zeros(1)
    ticks(clock, [(x + 0, torch.tensor(t)) for t in (900.0, 800.0, 700.0)])
    assert compared == []
    assert ticks(clock, [(x + 1, torch.tensor(700.0))]) == [(False, 2, 1)]
    assert compared


def test_without_a_timestep_every_call_is_a_step():
    x = torch.zeros(1)
    assert ticks(StepClock(None), [(x,), (x,)]) == [(True, 0, 0), (False, 1, 0)]


def test_python_number_timesteps_and_a_ring_in_between():
    clock = StepClock(0)
    assert ticks(clock, [(0.9,), (0.8,)]) == [(True, 0, 0), (False, 1, 0)]
    clock.advance(5)
    assert ticks(clock, [(0.1,)]) == [(False, 7, 0)]


def test_the_clock_holds_no_weight_alive():
    import weakref

    weight, x = torch.zeros(1000), torch.zeros(1)
    ref = weakref.ref(weight)
    clock = StepClock(None, [1])  # position 0 is a weight, not a user input
    clock.tick((weight, x))
    del weight
    assert ref() is None


def test_timestep_found_by_parameter_name():
    assert timestep_index(["hidden_states", "timestep", "class_labels"]) == 1
    assert timestep_index(["latents", "t"]) == 1
    assert timestep_index(["hidden_states", 0, None]) is None
    assert timestep_index(["x", "sigma", "y"]) == 1  # k-diffusion, EDM
    assert timestep_index(["x", "noise_level", "timestep"], "noise_level") == 1
    assert timestep_index(["x", "timestep"], "noise_level") is None


def test_rising_timesteps_are_steps_and_a_fall_starts_a_generation():
    """Lumina2 and Z-Image pass 1 - t / 1000: 0 at the first step, rising towards 1."""
    x = torch.zeros(1)
    calls = [(x, torch.tensor(t)) for t in (0.0, 0.25, 0.5, 0.0, 0.25)]
    assert ticks(StepClock(1), calls) == [(True, 0, 0), (False, 1, 0), (False, 2, 0),
                                          (True, 0, 0), (False, 1, 0)]


def test_each_generation_learns_its_direction_from_its_first_move():
    x = torch.zeros(1)
    calls = [(x, torch.tensor(t)) for t in (0.0, 0.5, 0.0, 999.0, 500.0, 999.0)]
    assert ticks(StepClock(1), calls) == [(True, 0, 0), (False, 1, 0), (True, 0, 0),
                                          (False, 1, 0), (True, 0, 0), (False, 1, 0)]
