"""Step callbacks in a ring generation: each sees the latents of its step as the pipeline's own
loop has them, an interrupt ends the generation at its step, and a callback that changes
the generation raises.

Tolerances (float32): sync equals the serial pipeline, stale equals per-call mode with the
same options, within 1e-5 of the largest value (each step's latents and the output).
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

import tokpipe_compiler as tp
from tests.fixtures import pipelines
from tests.fixtures.conditioned import CONDITIONED
from tests.fixtures.pipelines import generate
from tokpipe_compiler.pipelines.probes import RingUnavailable
from tokpipe_compiler.pipelines.step_callbacks import StepCallbacks

pytest.importorskip("diffusers")

OPTIONS = {"stages": 2, "chunks": 2, "compiler": "eager"}
FAMILIES = {**pipelines.FAMILIES, **CONDITIONED}
STEPS = 5


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item() / b.abs().max().item()


class Seen:
    """A step-end callback that keeps what it is shown and what it reads off the pipeline
    (the scheduler's step index, as previews read the step's sigma); `interrupt_at`: sets
    the pipeline's interrupt there."""

    def __init__(self, interrupt_at: int | None = None):
        self.steps: list[tuple[tuple, torch.Tensor]] = []
        self.interrupt_at = interrupt_at

    def __call__(self, pipe: Any, i: int, t: Any, tensors: dict[str, Any]) -> dict[str, Any]:
        now = getattr(pipe, "_current_timestep", None)  # not every pipeline keeps it
        read = (i, float(t), pipe.scheduler.step_index, None if now is None else float(now))
        self.steps.append((read, tensors["latents"].clone()))
        if i == self.interrupt_at:
            pipe._interrupt = True
        return tensors

    def agrees_with(self, other: Seen) -> None:
        assert [read for read, _ in self.steps] == [read for read, _ in other.steps]
        for (_, mine), (_, theirs) in zip(self.steps, other.steps, strict=True):
            assert mine.dtype == theirs.dtype and mine.shape == theirs.shape
            assert _relative(mine, theirs) <= 1e-5


def _run(make, callback: Any, parallel: dict[str, Any] | None = None,
         **call: Any) -> torch.Tensor:
    pipe, kwargs = make()
    if parallel is not None:
        tp.pipelines.parallelize(pipe, **parallel)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="tokpipe: .* runs per call")
        return generate(pipe, {**kwargs, "callback_on_step_end": callback, **call},
                        steps=STEPS)


@pytest.mark.parametrize("family", [
    "flux", "wan22", "flux_inpaint", "flux_kontext",
    *(pytest.param(f, marks=pytest.mark.full) for f in ("sd3", "wan", "cogview4", "ltx"))])
def test_a_callback_sees_each_step_as_the_serial_pipeline_shows_it(family):
    """Two experts (wan22), latents blended between steps (inpainting) and the image's
    tokens carried with the latents (Kontext) included."""
    make = FAMILIES[family]
    serial, ring = Seen(), Seen()
    expected = _run(make, serial)
    out = _run(make, ring, {**OPTIONS, "mode": "sync"})
    assert len(serial.steps) >= STEPS - 1  # inpainting starts a step in (strength 0.8)
    ring.agrees_with(serial)
    assert _relative(out, expected) <= 1e-5


def test_in_stale_mode_a_callback_sees_what_it_sees_per_call():
    make = FAMILIES["flux"]
    per_call, ring = Seen(), Seen()
    options = {**OPTIONS, "mode": "stale", "warmup_steps": 1}
    expected = generate(*_with(make, per_call, {**options, "ring": False}), steps=STEPS)
    out = _run(make, ring, options)
    ring.agrees_with(per_call)
    assert _relative(out, expected) <= 1e-5


def _with(make, callback: Any, parallel: dict[str, Any]) -> tuple:
    pipe, kwargs = make()
    tp.pipelines.parallelize(pipe, **parallel)
    return pipe, {**kwargs, "callback_on_step_end": callback}


def test_a_callback_is_live_each_step_is_shown_as_the_ring_completes_it():
    """In one process the callback runs inside the ring, before its last step is computed."""
    pipe, kwargs = _with(FAMILIES["flux"], None, {**OPTIONS, "mode": "sync"})
    bars: list[int] = []
    rings = pipe._tokpipe_ring.denoisers["transformer"]
    progress = rings._progress
    rings._progress = lambda steps: (lambda k: bars.append(k))
    shown: list[int] = []

    def callback(p: Any, i: int, t: Any, tensors: dict[str, Any]) -> dict[str, Any]:
        shown.append(len(bars))  # ring steps finished when step i is shown
        return tensors

    generate(pipe, {**kwargs, "callback_on_step_end": callback}, steps=STEPS)
    rings._progress = progress
    # step i is shown by the time step i + 1 is done (after the ring: all at STEPS)
    assert all(shown[i] <= i + 1 for i in range(STEPS - 1)), shown


def test_the_old_style_callback_sees_its_steps():
    """PixArt's `callback(step, timestep, latents)` every `callback_steps` steps."""
    make = FAMILIES["pixart_alpha"]
    calls: dict[str, list] = {"serial": [], "ring": []}

    def run(key: str, parallel: dict[str, Any] | None) -> torch.Tensor:
        pipe, kwargs = make()
        if parallel:
            tp.pipelines.parallelize(pipe, **parallel)
        return generate(pipe, {**kwargs, "callback_steps": 2, "callback": lambda i, t, x:
                               calls[key].append((i, float(t), x.clone()))}, steps=STEPS)

    expected = run("serial", None)
    out = run("ring", {**OPTIONS, "mode": "sync"})
    assert [c[:2] for c in calls["ring"]] == [c[:2] for c in calls["serial"]]
    assert len(calls["ring"]) == 3
    for (_, _, mine), (_, _, theirs) in zip(calls["ring"], calls["serial"], strict=True):
        assert _relative(mine, theirs) <= 1e-5
    assert _relative(out, expected) <= 1e-5


@pytest.mark.parametrize(("family", "at"), [("flux", 2), ("wan22", 1)])
def test_an_interrupt_ends_the_generation_at_its_step(family, at):
    """wan22: the interrupt falls in the first expert's steps, before the second takes
    over."""
    make = FAMILIES[family]
    serial, ring = Seen(interrupt_at=at), Seen(interrupt_at=at)
    expected = _run(make, serial)
    out = _run(make, ring, {**OPTIONS, "mode": "sync"})
    assert len(ring.steps) == at + 1
    ring.agrees_with(serial)
    assert _relative(out, expected) <= 1e-5
    assert _relative(out, _run(make, Seen())) > 1e-3  # the interrupt changed the output


@pytest.mark.parametrize("how", ["interrupt", "cancel"])
def test_in_one_process_the_ring_stops_at_the_step_a_callback_ends(how, monkeypatch):
    """A server's cancel cost the whole generation: the ring ran every step before the
    callback's interrupt or error took effect."""
    from tokpipe_compiler.runtime.executor import Executor

    computed: list[int] = []
    compute = Executor._compute

    def counted(self, action, *args):
        computed.append(action.step)
        return compute(self, action, *args)

    def end_at_1(pipe: Any, i: int, t: Any, tensors: dict[str, Any]) -> dict[str, Any]:
        if i == 1 and how == "cancel":
            raise KeyboardInterrupt
        pipe._interrupt = pipe._interrupt or i == 1
        return tensors

    monkeypatch.setattr(Executor, "_compute", counted)
    pipe, kwargs = FAMILIES["sd3"]()
    tp.pipelines.parallelize(pipe, **OPTIONS, mode="sync")
    generate(pipe, kwargs, steps=STEPS)
    every = len(computed)
    computed.clear()
    if how == "cancel":
        with pytest.raises(KeyboardInterrupt):
            generate(pipe, {**kwargs, "callback_on_step_end": end_at_1}, steps=STEPS)
    else:
        generate(pipe, {**kwargs, "callback_on_step_end": end_at_1}, steps=STEPS)
    assert every == 2 * STEPS  # two stages, one whole chunk a step (sync)
    assert len(computed) == 2 * 2  # steps 0 and 1


@pytest.mark.parametrize("when", ["ring", "probes"])
def test_a_cancel_from_outside_the_loop_ends_the_generation(when, monkeypatch):
    """A server cancels from another thread (`pipe._interrupt = True`) with no step
    callback: the ring ran every step and returned the uncancelled image. Set while the
    ring computes step 2, the pipeline gets step 2's latents, as the serial loop gives them
    where a callback interrupts there; set while the loop runs on probes (before the ring
    computed anything), the ring's first step's: the loop skipping its steps then would
    have returned probes."""
    from tokpipe_compiler.pipelines import ring_call

    make = FAMILIES["flux"]
    at = 2 if when == "ring" else 0  # the last step the cancelled generation runs
    expected = _run(make, Seen(interrupt_at=at))
    pipe, kwargs = make()
    tp.pipelines.parallelize(pipe, **OPTIONS, mode="sync")
    if when == "ring":
        see = StepCallbacks.see

        def cancelling(self, step, latents):  # before the ring shows step 2
            pipe._interrupt = pipe._interrupt or step == at
            return see(self, step, latents)

        monkeypatch.setattr(StepCallbacks, "see", cancelling)
    else:
        probe = ring_call.probe

        def cancelling(structure, step, *args):  # in the loop's step 3, on probes
            pipe._interrupt = pipe._interrupt or step == 3
            return probe(structure, step, *args)

        monkeypatch.setattr(ring_call, "probe", cancelling)
    out = generate(pipe, kwargs, steps=STEPS)
    assert _relative(out, expected) <= 1e-5
    assert _relative(out, generate(*make(), steps=STEPS)) > 1e-3  # the cancel took


def test_a_pipeline_without_an_interrupt_ignores_the_flag():
    """PixArt's loop reads no interrupt: a `_interrupt` a server set on it (left from an
    earlier cancel) cut every later ring call to one step (0.94 off)."""
    make = FAMILIES["pixart_alpha"]
    expected = generate(*make(), steps=STEPS)
    pipe, kwargs = make()
    tp.pipelines.parallelize(pipe, **OPTIONS, mode="sync")
    pipe._interrupt = True
    assert _relative(generate(pipe, kwargs, steps=STEPS), expected) <= 1e-5


def test_a_callback_that_changes_the_generation_raises():
    def louder(pipe: Any, i: int, t: Any, tensors: dict[str, Any]) -> dict[str, Any]:
        return {"latents": tensors["latents"] * 1.01} if i == 1 else tensors

    def cutoff(pipe: Any, i: int, t: Any, tensors: dict[str, Any]) -> dict[str, Any]:
        pipe._guidance_scale = 1.0
        return tensors

    for callback, what in [(louder, "'latents' at step 1"), (cutoff, "the guidance scale")]:
        with pytest.raises(tp.TokpipeError, match=f"callback changed {what}"):
            _run(FAMILIES["sd3"], callback, {**OPTIONS, "mode": "sync"})


def test_a_callback_that_writes_a_tensor_in_place_raises():
    """The pipeline's loop goes on with a tensor the callback wrote in place, so a ring
    that went on without the edit was silently another generation (6e-2 from serial)."""
    def louder(pipe: Any, i: int, t: Any, tensors: dict[str, Any]) -> dict[str, Any]:
        if i == 1:
            tensors["latents"].mul_(1.05)
        return tensors

    def quieter_prompt(pipe: Any, i: int, t: Any, tensors: dict[str, Any]) -> dict[str, Any]:
        if i == 2:
            tensors["prompt_embeds"].mul_(0.5)
        return tensors

    with pytest.raises(tp.TokpipeError, match="callback changed 'latents' at step 1"):
        _run(FAMILIES["sd3"], louder, {**OPTIONS, "mode": "sync"})
    with pytest.raises(tp.TokpipeError, match="callback changed 'prompt_embeds' at step 2"):
        _run(FAMILIES["flux"], quieter_prompt, {**OPTIONS, "mode": "sync"},
             callback_on_step_end_tensor_inputs=["latents", "prompt_embeds"])


def test_an_old_style_callback_that_writes_the_latents_raises():
    pipe, kwargs = FAMILIES["pixart_alpha"]()
    tp.pipelines.parallelize(pipe, **OPTIONS, mode="sync")
    with pytest.raises(tp.TokpipeError, match=r"^the step callback changed 'latents'"):
        generate(pipe, {**kwargs, "callback_steps": 1,
                        "callback": lambda i, t, x: x.mul_(1.05) if i == 1 else None},
                 steps=STEPS)


def test_a_pipeline_callback_object_gets_the_tensors_it_asks_for():
    from diffusers.callbacks import PipelineCallback

    class Embeddings(PipelineCallback):
        tensor_inputs = ["latents", "prompt_embeds"]

        def __init__(self):
            super().__init__()
            self.seen: list[tuple[str, ...]] = []

        def callback_fn(self, pipe, i, t, tensors):
            self.seen.append(tuple(sorted(tensors)))
            return tensors

    callback = Embeddings()
    _run(FAMILIES["flux"], callback, {**OPTIONS, "mode": "sync"})
    assert callback.seen == [("latents", "prompt_embeds")] * STEPS


def test_cfg_parallel_shows_each_step():
    make = FAMILIES["wan"]
    serial, ring = Seen(), Seen()
    expected = _run(make, serial)
    out = _run(make, ring, {"cfg": 2, "stages": 1, "compiler": "eager"})
    ring.agrees_with(serial)
    assert _relative(out, expected) <= 1e-5


def test_a_tensor_asked_for_that_changes_each_step_leaves_the_ring():
    """The probes are new each step: a tensor the pipeline derives from them would show the
    callback made-up values, so the call starts again per call."""
    step = [1]
    callbacks = StepCallbacks(object(), {"callback_on_step_end": lambda *a: a[-1]},
                              lambda: step[0], lambda: True)
    record = callbacks.call_kwargs({"callback_on_step_end": None})["callback_on_step_end"]
    fixed = torch.ones(2)
    record(None, 0, 1.0, {"latents": torch.zeros(2), "prompt_embeds": fixed,
                          "noise_pred": torch.zeros(2)})
    step[0] = 2
    record(None, 1, 1.0, {"latents": torch.ones(2), "prompt_embeds": fixed,
                          "noise_pred": torch.zeros(2)})
    with pytest.raises(RingUnavailable, match="'noise_pred', which the pipeline derives"):
        record(None, 2, 1.0, {"latents": torch.ones(2), "prompt_embeds": fixed,
                              "noise_pred": torch.ones(2)})


@pytest.mark.full
def test_callbacks_see_every_window_of_an_autoregressive_video():
    """Helios runs a denoising loop per window of frames, a ring each: the callback sees
    each window's steps, counted from 0 in each, with the serial pipeline's latents."""
    from tests.fixtures.tracing import rel_error
    from tests.fixtures.video_pipelines import helios

    def run(pipe: Any, kwargs: dict[str, Any]) -> list[tuple[int, float, torch.Tensor]]:
        seen = []

        def record(_: Any, i: int, t: Any, tensors: dict[str, Any]) -> dict[str, Any]:
            seen.append((i, float(t), tensors["latents"].clone()))
            return tensors

        generate(pipe, {**kwargs, "callback_on_step_end": record,
                        "callback_on_step_end_tensor_inputs": ["latents"]}, steps=3)
        return seen

    serial = run(*helios())
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="tokpipe: .* runs per call")
        pipe, kwargs = helios()
        ringed = run(tp.pipelines.parallelize(pipe, mode="sync", **OPTIONS), kwargs)
    assert [(i, t) for i, t, _ in ringed] == [(i, t) for i, t, _ in serial]
    assert [i for i, _, _ in serial] == [0, 1, 2, 0, 1, 2]  # two windows
    assert all(rel_error(r, s) <= 1e-5 for (_, _, r), (_, _, s) in zip(ringed, serial,
                                                                          strict=True))
