"""Ring mode equals the per-call loop with the same options, in process and across ranks."""

from __future__ import annotations

import pytest
import torch

import tokpipe_compiler as tp
from tests.fixtures.models import TinyDiT, dit_inputs
from tokpipe_compiler.runtime.launch import launch

OPTIONS = {"stages": 2, "chunks": 4, "mode": "stale", "warmup_steps": 1, "compiler": "eager"}
STEPS = 5


def make_step(seed: int = 0):
    torch.manual_seed(seed)
    model = TinyDiT(depth=3, width=32, heads=2, grid=8).eval()

    def step(latents, timestep, c, labels):
        eps = model(latents, timestep[None], labels)
        return (latents - c * eps,)

    latents, _, labels = dit_inputs(model, 8)
    per_step = {"timestep": torch.linspace(900, 100, STEPS).long(),
                "c": torch.linspace(0.3, 0.1, STEPS)}
    return step, latents, labels, per_step


def loop(fn, latents, labels, per_step):
    x = latents
    with torch.no_grad():
        for k in range(STEPS):
            (x,) = fn(x, per_step["timestep"][k], per_step["c"][k], labels)
    return x


def ring_run(options: dict) -> torch.Tensor:
    step, latents, labels, per_step = make_step()
    ring = tp.Ring(step, carry=["latents"], **options)
    (out,) = ring.run({"latents": latents, "labels": labels}, per_step=per_step)
    return out


def test_ring_equals_per_call_loop_bit_for_bit():
    torch._dynamo.reset()
    step, latents, labels, per_step = make_step()
    compiled = torch.compile(step, backend=tp.backend(**OPTIONS), dynamic=False)
    assert torch.equal(ring_run(OPTIONS), loop(compiled, latents, labels, per_step))


def test_ring_with_warmup_covering_every_step_equals_eager():
    step, latents, labels, per_step = make_step()
    out = ring_run({**OPTIONS, "warmup_steps": STEPS})
    expected = loop(step, latents, labels, per_step)
    assert (out - expected).abs().max() <= 1e-5 * expected.abs().max()


def test_ring_progress_reports_every_step():
    step, latents, labels, per_step = make_step()
    seen: list[int] = []
    tp.Ring(step, carry=["latents"], **OPTIONS).run(
        {"latents": latents, "labels": labels}, per_step=per_step, progress=seen.append)
    assert seen == list(range(STEPS))


def loop_steps(fn, latents, labels, per_step) -> list[torch.Tensor]:
    """The latents after each step of the per-call loop."""
    x, seen = latents, []
    with torch.no_grad():
        for k in range(STEPS):
            (x,) = fn(x, per_step["timestep"][k], per_step["c"][k], labels)
            seen.append(x.clone())
    return seen


def ring_steps(options: dict) -> tuple[list[tuple[int, torch.Tensor]], torch.Tensor]:
    """What a ring's `each_step` sees, in order, and what the ring returns."""
    step, latents, labels, per_step = make_step()
    seen: list[tuple[int, torch.Tensor]] = []
    (out,) = tp.Ring(step, carry=["latents"], **options).run(
        {"latents": latents, "labels": labels}, per_step=per_step,
        each_step=lambda k, value: seen.append((k, value.clone())))
    return seen, out


@pytest.mark.parametrize("chunks", [1, 4])
def test_ring_shows_each_step_as_the_per_call_loop_has_it(chunks):
    torch._dynamo.reset()
    options = {**OPTIONS, "chunks": chunks}
    step, latents, labels, per_step = make_step()
    compiled = torch.compile(step, backend=tp.backend(**options), dynamic=False)
    expected = loop_steps(compiled, latents, labels, per_step)
    seen, out = ring_steps(options)
    assert [k for k, _ in seen] == list(range(STEPS))
    for (_, got), want in zip(seen, expected, strict=True):
        assert torch.equal(got, want)
    assert torch.equal(seen[-1][1], out)


def test_ring_frees_its_kv_caches_when_the_generation_ends():
    """What the pipeline runs after the loop (the VAE decode, its memory peak) gets the
    K/V memory back; the memory report still says what the generation held."""
    from tokpipe_compiler.inspection.memory import format_memory, memory_report

    step, latents, labels, per_step = make_step()
    ring = tp.Ring(step, carry=["latents"], **OPTIONS)
    outs = [ring.run({"latents": latents, "labels": labels}, per_step=per_step)[0]
            for _ in range(2)]
    assert torch.equal(outs[0], outs[1])  # a second generation in fresh buffers
    assert not ring.program.branches
    report = memory_report(ring.program)
    assert report.released and "then freed" in format_memory(report)
    assert all(s.branches == 1 and s.kv_measured == s.kv_predicted > 0 for s in report.stages)


def test_ring_rejects_stale_without_warmup_and_missing_carry():
    step, _, labels, per_step = make_step()
    with pytest.raises(ValueError, match="warmup_steps"):
        tp.Ring(step, carry=["latents"], **{**OPTIONS, "warmup_steps": 0})
    with pytest.raises(tp.TokpipeError, match="latents"):
        tp.Ring(step, carry=["latents"], **OPTIONS).run({"labels": labels}, per_step=per_step)


def _ring_on_rank(rank: int, world: int, options: dict) -> torch.Tensor:
    return ring_run(options)


@pytest.mark.slow
@pytest.mark.ranks
@pytest.mark.parametrize("world", [2, 3])
def test_ring_across_ranks_equals_in_process_bit_for_bit(world):
    options = {**OPTIONS, "stages": world, "timeout": 60.0}
    torch.set_num_threads(1)  # the ranks run one thread each: same kernels, same bits
    expected = ring_run(options)
    for got in launch(_ring_on_rank, world, args=(options,), timeout=240):
        assert torch.equal(got, expected)


def _ring_steps_on_rank(rank: int, world: int, options: dict) -> list:
    return ring_steps(options)[0]


@pytest.mark.slow
@pytest.mark.ranks
def test_ring_shows_each_step_on_every_rank():
    """The rank that computes the latents sees each step as it is done, the other after the
    run; both see what one process sees."""
    options = {**OPTIONS, "timeout": 60.0}
    torch.set_num_threads(1)
    expected, _ = ring_steps(options)
    for seen in launch(_ring_steps_on_rank, 2, args=(options,), timeout=240):
        assert [k for k, _ in seen] == list(range(STEPS))
        for (_, got), (_, want) in zip(seen, expected, strict=True):
            assert torch.equal(got, want)


def scheduler_step(name: str):
    """A DiT step with a diffusers scheduler's token-wise update; DPM carries its history."""
    from diffusers import (
        DDIMScheduler,
        DPMSolverMultistepScheduler,
        EulerDiscreteScheduler,
        FlowMatchEulerDiscreteScheduler,
    )

    from tokpipe_compiler.pipelines.schedulers import step_table, update

    scheduler = {"ddim": DDIMScheduler(clip_sample=False), "euler": EulerDiscreteScheduler(),
                 "flow": FlowMatchEulerDiscreteScheduler(),
                 "dpm": DPMSolverMultistepScheduler()}[name]
    table = step_table(scheduler, STEPS)
    torch.manual_seed(0)
    model = TinyDiT(depth=2, width=32, heads=2, grid=8).eval()

    def step(latents, history, timestep, input_scale, coeffs, labels):
        eps = model(latents * input_scale, timestep[None], labels)
        x, h = update(latents, eps, history if table.history else None, coeffs)
        return (x, h) if table.history else (x,)

    latents, _, labels = dit_inputs(model, 8)
    per_step = {"timestep": table.timesteps.round().long(), "input_scale": table.input_scale,
                "coeffs": table.coeffs}
    carry = ["latents", "history"] if table.history else ["latents"]
    return step, latents, labels, per_step, carry


@pytest.mark.parametrize("name", ["ddim", "euler", "flow", "dpm"])
def test_ring_equals_per_call_loop_for_each_scheduler(name):
    torch._dynamo.reset()
    step, latents, labels, per_step, carry = scheduler_step(name)
    history = torch.zeros_like(latents)
    ring = tp.Ring(step, carry=carry, **OPTIONS)
    got = ring.run({"latents": latents, "history": history, "labels": labels},
                   per_step=per_step)[0]
    compiled = torch.compile(step, backend=tp.backend(**OPTIONS), dynamic=False)
    state = [latents, history]
    with torch.no_grad():
        for k in range(STEPS):
            out = compiled(*state, *(per_step[n][k] for n in ("timestep", "input_scale",
                                                              "coeffs")), labels)
            state[: len(out)] = out
    assert torch.equal(got, state[0])


def unipc_step():
    """A DiT step with UniPC's token-wise update (Wan's config): three state tensors carried
    by name, passed through **state."""
    from diffusers import UniPCMultistepScheduler

    from tokpipe_compiler.pipelines.schedulers import step_table, update_state

    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction",
                                        use_flow_sigmas=True, flow_shift=3.0)
    table = step_table(scheduler, STEPS)
    names = [f"state_{i}" for i in range(table.state_size)]
    torch.manual_seed(0)
    model = TinyDiT(depth=2, width=32, heads=2, grid=8).eval()

    def step(latents, timestep, input_scale, row, labels, **state):
        out = model(latents * input_scale, timestep[None], labels)
        x, new_state = update_state(latents, out, [state[n] for n in names], row,
                                    table.pattern)
        return (x, *new_state)

    latents, _, labels = dit_inputs(model, 8)
    per_step = {"timestep": table.timesteps.round().long(), "input_scale": table.input_scale,
                "row": table.rows}
    state = {n: torch.zeros_like(latents) for n in names}

    def diffusers_loop():
        scheduler.set_timesteps(STEPS)
        x = latents
        with torch.no_grad():
            for t in scheduler.timesteps:
                x = scheduler.step(model(x, t[None], labels), t, x).prev_sample
        return x

    return step, latents, labels, per_step, state, diffusers_loop


def test_ring_runs_a_unipc_table_like_the_per_call_loop():
    torch._dynamo.reset()
    step, latents, labels, per_step, state, diffusers_loop = unipc_step()
    assert len(state) == 3
    ring = tp.Ring(step, carry=["latents", *state], **OPTIONS)
    got = ring.run({"latents": latents, "labels": labels, **state}, per_step=per_step)
    compiled = torch.compile(step, backend=tp.backend(**OPTIONS), dynamic=False)
    values = [latents, *state.values()]
    with torch.no_grad():
        for k in range(STEPS):
            values = list(compiled(values[0], *(per_step[n][k] for n in per_step), labels,
                                   **dict(zip(state, values[1:], strict=True))))
    assert all(torch.equal(g, w) for g, w in zip(got, values, strict=True))
    # all steps synchronous: the scheduler's own loop with the same model
    (x, *_) = tp.Ring(step, carry=["latents", *state], **{**OPTIONS, "warmup_steps": STEPS}).run(
        {"latents": latents, "labels": labels, **state}, per_step=per_step)
    expected = diffusers_loop()
    assert (x - expected).abs().max() <= 1e-5 * expected.abs().max()


@pytest.mark.slow
def test_ring_with_inductor_stages_equals_eager_stages():
    """Chunks cut from the input and chunks carried from the last stage differ in strides;
    compiled stages must take both."""
    inductor = ring_run({**OPTIONS, "compiler": "inductor"})
    eager = ring_run(OPTIONS)
    assert (inductor - eager).abs().max() <= 1e-5 * eager.abs().max()


def test_ring_holds_two_steps_of_values_however_long():
    """A ring of 12 steps holds no more (step, chunk) value sets at once than one of 4: the
    executor drops a chunk's values two steps after it computed them (the bit-for-bit tests
    above show nothing still needed is dropped)."""
    torch.manual_seed(0)
    model = TinyDiT(depth=2, width=16, heads=2, grid=8).eval()
    latents, _, labels = dit_inputs(model, 8)

    def step(latents, timestep, labels):
        return (latents - 0.1 * model(latents, timestep[None], labels),)

    peaks = []
    for steps in (4, 12):
        ring = tp.Ring(step, carry=["latents"], **OPTIONS)
        ring.run({"latents": latents, "labels": labels},
                 per_step={"timestep": torch.arange(steps, 0, -1) * 50})
        peaks.append(ring.program.peak_values_held)
    assert peaks[0] == peaks[1] <= 3 * OPTIONS["chunks"] + 1, peaks


@pytest.mark.parametrize("chunks", [4, "auto"])
def test_generations_of_other_lengths_reuse_the_trace(chunks, monkeypatch):
    """One trace for every generation length; a plan per length only where chunks="auto"
    chooses for it, and a program per chunk table it chose."""
    import tokpipe_compiler.ring as ring_module

    calls: list[int | None] = []
    real = ring_module.build_plan

    def counted(gm, config, ring_steps=None):
        calls.append(ring_steps)
        return real(gm, config, ring_steps=ring_steps)

    monkeypatch.setattr(ring_module, "build_plan", counted)
    step, latents, labels, per_step = make_step()
    ring = tp.Ring(step, carry=["latents"], **{**OPTIONS, "chunks": chunks})
    for steps in (2, STEPS, 2):
        ring.run({"latents": latents, "labels": labels},
                 per_step={k: v[:steps] for k, v in per_step.items()})
    assert len(ring._traces) == 1
    assert calls == ([1] if chunks == 4 else [1, STEPS - 1])
    tables = {tuple(p.plan.chunks) for p in ring.programs()}
    assert len(ring.programs()) == len(tables)  # one program per chunk table chosen
