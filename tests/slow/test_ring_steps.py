"""What a step function may hold that a ring runs apart from Python: values it reads from
its globals (a trace holds them as constants), writes to Python state (a ring does not
replay them), a number read off a tensor, more outputs than it carries, an update that
mixes tokens. Each is right or says what is wrong.

Tolerance: float32, sync mode, max |ring - eager loop| <= 1e-5 * max |eager loop|.
"""

from __future__ import annotations

import pytest
import torch

import tokpipe_compiler as tp
from tests.fixtures.models import TinyDiT, dit_inputs

pytestmark = pytest.mark.slow
OPTIONS = {"stages": 2, "chunks": 2, "mode": "sync", "compiler": "eager"}
PER_STEP = {"timestep": torch.tensor([900, 600, 300]), "c": torch.tensor([0.3, 0.2, 0.1])}
GUIDE = 4.0  # read by `guided` from its globals, as a user's script holds a setting


def model() -> TinyDiT:
    torch.manual_seed(0)
    return TinyDiT(depth=2, width=32, heads=2, grid=8).eval()


MODEL = model()


def guidance_scale() -> float:
    return GUIDE


class Settings:
    scale = 4.0

    def guided(self, latents, timestep, c, labels):
        return _guided(latents, timestep, c, labels, self.scale)


SETTINGS = Settings()


def _guided(latents, timestep, c, labels, scale):
    cond = MODEL(latents, timestep[None], labels)
    uncond = MODEL(latents, timestep[None], torch.zeros_like(labels))
    return (latents - c * (uncond + scale * (cond - uncond)),)


def guided(latents, timestep, c, labels):
    return _guided(latents, timestep, c, labels, GUIDE)


def guided_by_helper(latents, timestep, c, labels):
    return _guided(latents, timestep, c, labels, guidance_scale())


def guided_by_settings(latents, timestep, c, labels):
    return _guided(latents, timestep, c, labels, SETTINGS.scale)


def eager_loop(step, latents, labels):
    with torch.no_grad():
        for k in range(3):
            (latents,) = step(latents, PER_STEP["timestep"][k], PER_STEP["c"][k], labels)
    return latents


@pytest.mark.parametrize("read", ["global", "helper", "settings", "bound self"])
def test_a_setting_the_step_reads_is_read_at_each_run(read, monkeypatch):
    """A guidance scale set between runs, read as a global, by a helper, off a settings
    object or off the step's bound `self`: the ring traces anew for the new value (it held
    the first one as a constant and applied it silently)."""
    step = {"global": guided, "helper": guided_by_helper, "settings": guided_by_settings,
            "bound self": SETTINGS.guided}[read]
    latents, _, labels = dit_inputs(MODEL, 8)
    ring = tp.Ring(step, carry=["latents"], **OPTIONS)
    for scale in (4.0, 1.0, 4.0):
        monkeypatch.setitem(globals(), "GUIDE", scale)
        monkeypatch.setattr(Settings, "scale", scale)
        (out,) = ring.run({"latents": latents, "labels": labels}, per_step=PER_STEP)
        expected = eager_loop(step, latents, labels)
        assert (out - expected).abs().max() <= 1e-5 * expected.abs().max()
    assert len(ring.programs()) == 2  # 4.0's trace taken back


def test_a_global_named_like_an_attribute_the_step_reads_is_not_read():
    """`out.sample` reads an attribute: a global `sample` is no setting of the step."""
    from tokpipe_compiler.planning.free_values import free_values

    def step(latents, out):
        return latents - out.sample

    globals()["sample"] = 3
    try:
        assert free_values(step) == ()
    finally:
        del globals()["sample"]


def test_a_step_that_writes_python_state_is_warned_of():
    counter = TinyDiT(depth=1, width=16, heads=2, grid=8).eval()
    counter.k = 0

    def counting(latents, timestep, c, labels):
        counter.k = counter.k + 1
        return (latents - c * counter.k * counter(latents, timestep[None], labels),)

    latents, _, labels = dit_inputs(counter, 8)
    ring = tp.Ring(counting, carry=["latents"], **OPTIONS)
    with pytest.warns(UserWarning, match=r"writes Python state \(counter\.k\), which a ring "
                                         r"does not replay"):
        ring.run({"latents": latents, "labels": labels}, per_step=PER_STEP)


TABLE = torch.linspace(0.1, 1.0, 10)  # a schedule's table, looked up by a step's value


@pytest.mark.parametrize(("spelling", "says"), [
    ("item", r"reads a Python number off a tensor \(\.item\(\)\) at File .*test_ring_steps"),
    ("extra output", r"returns 2 tensor\(s\) \(a tensor it computes, a tensor it "
                     r"computes\); carry names 1: \['latents'\]\. A ring feeds each"),
    ("quantile", r"no token rule chunks quantile\("),
    ("item in an if", r"needs a tensor's value as a Python number \(.+ < 1000000\.0\) at "
                      r"File .*test_ring_steps.*torch\.where"),
    ("index by a value", r"needs a tensor's value as a Python number .* at File "
                         r".*test_ring_steps.*per_step=\{'alpha': table\[timesteps\]\}"),
])
def test_steps_a_ring_cannot_run_say_why(spelling, says):
    def step(latents, timestep, c, labels):
        eps = MODEL(latents, timestep[None], labels)
        if spelling == "item":
            return (latents - c.item() * eps,)
        if spelling == "extra output":
            return latents - c * eps, eps
        if spelling == "item in an if":
            return (latents - c * eps if c.item() < 10**6 else latents,)
        if spelling == "index by a value":
            return (latents - TABLE[(c * 10).long()] * eps,)
        scale = torch.quantile(eps.abs().flatten(1), 0.9, dim=1)[:, None, None, None]
        return (latents - c * eps / scale,)

    latents, _, labels = dit_inputs(MODEL, 8)
    with pytest.raises(tp.TokpipeError, match=says):
        tp.Ring(step, carry=["latents"], **OPTIONS).run(
            {"latents": latents, "labels": labels}, per_step=PER_STEP)


@pytest.mark.parametrize(("per_step", "says"), [
    ({"timestep": [900, 600, 300], "c": PER_STEP["c"]},
     r"per-step input 'timestep' must be a tensor with one entry per step .*got list"),
    ({**PER_STEP, "latents": torch.zeros(3, 1, 4, 8, 8)},
     r"\['latents'\] are carried .* and given per step too"),
])
def test_per_step_inputs_a_ring_cannot_take_are_named(per_step, says):
    """A list of floats was traced as its first value, every step alike, and a carried
    input given per step too ran, matching no reading of it: both silently."""
    def step(latents, timestep, c, labels):
        return (latents - c * MODEL(latents, timestep[None], labels),)

    latents, _, labels = dit_inputs(MODEL, 8)
    with pytest.raises(tp.TokpipeError, match=says):
        tp.Ring(step, carry=["latents"], **OPTIONS).run(
            {"latents": latents, "labels": labels}, per_step=per_step)


def test_a_tensor_the_step_closes_over_keeps_its_value():
    """A closure's tensor (guidance's null label) is read like an argument ("L['null']"):
    a kept trace held it as a meta tensor, and the ring gave NaN or raised."""
    null = torch.tensor([9])

    def guided(latents, timestep, c, labels):
        both = MODEL(torch.cat([latents, latents]), timestep[None].expand(2),
                     torch.cat([labels, null]))
        cond, uncond = both.chunk(2)
        return (latents - c * (uncond + 3.0 * (cond - uncond)),)

    latents, _, labels = dit_inputs(MODEL, 8)
    got = tp.Ring(guided, carry=["latents"], **OPTIONS).run(
        {"latents": latents, "labels": labels}, per_step=PER_STEP)[0]
    expected = latents
    with torch.no_grad():
        for k in range(len(PER_STEP["c"])):
            expected = guided(expected, PER_STEP["timestep"][k], PER_STEP["c"][k], labels)[0]
    assert (got - expected).abs().max() <= 1e-5 * expected.abs().max()


def test_a_number_read_off_a_tensor_of_python_numbers_is_a_constant():
    """HiDream builds its patch grid as a tensor from Python numbers and reads it back with
    `.item()` to cut its output: the values are the code's, not the inputs', so the ring
    keeps them (it refused the step for reading a Python number off a tensor)."""
    def cut(latents, timestep, c, labels):
        b, _, h, w = latents.shape
        grid = torch.tensor([h, w]).unsqueeze(0).repeat(b, 1)
        rows = [latents[i, :, : grid[i, 0].item()] for i in range(b)]
        return (torch.stack(rows) - c * MODEL(latents, timestep[None], labels),)

    latents, _, labels = dit_inputs(MODEL, 8)
    got = tp.Ring(cut, carry=["latents"], **OPTIONS).run(
        {"latents": latents, "labels": labels}, per_step=PER_STEP)[0]
    expected = eager_loop(cut, latents, labels)
    assert (got - expected).abs().max() <= 1e-5 * expected.abs().max()


def test_fallback_is_refused_by_a_ring():
    with pytest.raises(tp.TokpipeError, match="fallback=True does not apply to a ring"):
        tp.Ring(guided, carry=["latents"], fallback=True, **OPTIONS)


def test_a_helper_called_with_a_setting_is_read_too():
    """`guidance(SETTINGS.scale)`: the helper is loaded, then its argument, then called."""
    from tokpipe_compiler.planning.free_values import free_values

    def scaled(x):
        return x * GUIDE

    def step(latents):
        return scaled(SETTINGS.scale) * latents

    assert free_values(step) == (("GUIDE", repr(GUIDE)), ("SETTINGS.scale", "4.0"))
