"""Token-wise scheduler updates against diffusers' own denoising loops."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from diffusers import (
    DDIMScheduler,
    DPMSolverMultistepScheduler,
    EulerDiscreteScheduler,
    FlowMatchEulerDiscreteScheduler,
    PNDMScheduler,
)
from hypothesis import given
from hypothesis import strategies as st

from tokpipe_compiler.api import capture_graphs
from tokpipe_compiler.core.meta import META_KEY
from tokpipe_compiler.passes.annotate import annotate
from tokpipe_compiler.pipelines.schedulers import K, step_table, update

# diffusers' schedulers trip numpy 2's __array__ copy deprecation; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:diffusers")

SHAPE = (1, 4, 8, 8)
RTOL = 1e-5

CONFIGS: dict[str, Callable[[], object]] = {
    "flow": FlowMatchEulerDiscreteScheduler,
    "flow-shift3": lambda: FlowMatchEulerDiscreteScheduler(shift=3.0),
    # DDIM's default clip_sample=True is not linear; Stable Diffusion configs turn it off.
    "ddim-eps": lambda: DDIMScheduler(clip_sample=False),
    "ddim-v": lambda: DDIMScheduler(clip_sample=False, prediction_type="v_prediction"),
    "ddim-sample": lambda: DDIMScheduler(clip_sample=False, prediction_type="sample"),
    "ddim-sd": lambda: DDIMScheduler(
        beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", clip_sample=False,
        set_alpha_to_one=False, steps_offset=1),
    "ddim-zsnr-trailing-v": lambda: DDIMScheduler(
        clip_sample=False, prediction_type="v_prediction", rescale_betas_zero_snr=True,
        timestep_spacing="trailing"),
    "euler-eps": EulerDiscreteScheduler,
    "euler-v": lambda: EulerDiscreteScheduler(prediction_type="v_prediction"),
    "euler-sample": lambda: EulerDiscreteScheduler(prediction_type="sample"),
    "euler-karras-leading": lambda: EulerDiscreteScheduler(
        use_karras_sigmas=True, timestep_spacing="leading", steps_offset=1),
    "euler-sigma-min": lambda: EulerDiscreteScheduler(final_sigmas_type="sigma_min"),
    "dpm-eps": DPMSolverMultistepScheduler,
    "dpm-v": lambda: DPMSolverMultistepScheduler(prediction_type="v_prediction"),
    "dpm-sample": lambda: DPMSolverMultistepScheduler(prediction_type="sample"),
    "dpm-sigma-min": lambda: DPMSolverMultistepScheduler(final_sigmas_type="sigma_min"),
    "dpm-sigma-min-no-lof": lambda: DPMSolverMultistepScheduler(
        final_sigmas_type="sigma_min", lower_order_final=False),
    "dpm-heun-karras": lambda: DPMSolverMultistepScheduler(
        solver_type="heun", use_karras_sigmas=True),
    "dpm-euler-at-final": lambda: DPMSolverMultistepScheduler(
        final_sigmas_type="sigma_min", lower_order_final=False, euler_at_final=True),
    "dpm-order1": lambda: DPMSolverMultistepScheduler(solver_order=1),
    "dpm-flow": lambda: DPMSolverMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0),
}
STEPS = (4, 14, 15, 20)  # DPM's lower_order_final switches off at 15 steps


def fake_model(x_in: torch.Tensor, k: int) -> torch.Tensor:
    """A fixed function of the model input and the step: errors compound as in sampling."""
    noise = torch.randn(SHAPE, generator=torch.Generator().manual_seed(1000 + k))
    return 0.3 * x_in + noise


def diffusers_loop(scheduler: object, steps: int, x: torch.Tensor) -> list[torch.Tensor]:
    sched = copy.deepcopy(scheduler)
    sched.set_timesteps(steps)
    # Flow matching has no scale_model_input: its model input is the latents.
    scale = getattr(sched, "scale_model_input", lambda sample, t: sample)
    xs = []
    for k, t in enumerate(sched.timesteps):
        out = fake_model(scale(x, t), k)
        x = sched.step(out, t, x).prev_sample
        xs.append(x)
    return xs


def adapter_loop(scheduler: object, steps: int, x: torch.Tensor) -> list[torch.Tensor]:
    table = step_table(scheduler, steps)
    history = torch.zeros_like(x) if table.history else None
    xs = []
    for k in range(len(table.timesteps)):
        out = fake_model(x * table.input_scale[k], k)
        x, history = update(x, out, history, table.coeffs[k])
        xs.append(x)
    return xs


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("steps", STEPS)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_diffusers_every_step(name: str, steps: int) -> None:
    scheduler = CONFIGS[name]()
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(steps))
    want = diffusers_loop(scheduler, steps, x)
    got = adapter_loop(scheduler, steps, x)
    assert len(got) == len(want)
    errors = [relative_error(g, w) for g, w in zip(got, want, strict=True)]
    # all(), not max(): a NaN error must fail the test
    assert all(e <= RTOL for e in errors), f"per-step relative errors {errors}"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_table_layout(name: str) -> None:
    scheduler = CONFIGS[name]()
    table = step_table(scheduler, 7)
    reference = copy.deepcopy(scheduler)
    reference.set_timesteps(7)
    n = len(reference.timesteps)
    assert torch.equal(table.timesteps, reference.timesteps.float())
    assert table.input_scale.shape == (n,) and table.coeffs.shape == (n, K)
    assert table.coeffs.dtype == torch.float32
    assert table.history == (name.startswith("dpm") and name != "dpm-order1")
    if not table.history:
        assert not table.coeffs[:, 2:].any()
    else:
        assert not table.coeffs[0, 2]  # no previous data prediction on the first step


UNSUPPORTED = [
    (DDIMScheduler, "clip_sample"),
    (lambda: DDIMScheduler(clip_sample=False, thresholding=True), "thresholding"),
    (lambda: EulerDiscreteScheduler(prediction_type="original_sample"), "prediction_type"),
    (lambda: DPMSolverMultistepScheduler(solver_order=3), "solver_order"),
    (lambda: DPMSolverMultistepScheduler(algorithm_type="sde-dpmsolver++"), "algorithm_type"),
    (lambda: DPMSolverMultistepScheduler(variance_type="learned_range"), "variance_type"),
    (lambda: DPMSolverMultistepScheduler(thresholding=True), "thresholding"),
    (lambda: FlowMatchEulerDiscreteScheduler(stochastic_sampling=True), "stochastic_sampling"),
    (lambda: FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True), "use_dynamic_shifting"),
    (PNDMScheduler, "PNDMScheduler"),
]


@pytest.mark.parametrize(("make", "option"), UNSUPPORTED)
def test_unsupported_configs_name_the_option(make: Callable[[], object], option: str) -> None:
    with pytest.raises(ValueError, match=option) as info:
        step_table(make(), 10)
    assert "supported" in str(info.value)


@pytest.mark.parametrize("name", ["euler-eps", "dpm-eps", "ddim-eps", "flow"])
def test_user_scheduler_not_mutated(name: str) -> None:
    scheduler = CONFIGS[name]()
    scheduler.set_timesteps(30)
    t = scheduler.timesteps[0]
    x = torch.randn(SHAPE)
    scheduler.step(fake_model(x, 0), t, x)
    before = copy.deepcopy(vars(scheduler))
    step_table(scheduler, 5)
    after = vars(scheduler)
    assert before.keys() == after.keys()
    for key, value in before.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, after[key]), key
        elif isinstance(value, list):  # DPM's model_outputs: tensors or None
            assert all(a is b or torch.equal(a, b) for a, b in zip(value, after[key],
                                                                   strict=True)), key
        else:
            assert value == after[key], key


@given(
    rows=st.integers(2, 24),
    cut=st.data(),
    coeffs=st.lists(st.floats(-3, 3, width=32), min_size=K, max_size=K),
    with_history=st.booleans(),
)
def test_update_is_token_wise(rows: int, cut: st.DataObject, coeffs: list[float],
                              with_history: bool) -> None:
    lo = cut.draw(st.integers(0, rows - 1))
    hi = cut.draw(st.integers(lo + 1, rows))
    gen = torch.Generator().manual_seed(rows)
    x, out, hist = (torch.randn(2, rows, 6, generator=gen) for _ in range(3))
    row = torch.tensor(coeffs)
    hist = hist if with_history else None
    whole = update(x, out, hist, row)
    part = update(x[:, lo:hi], out[:, lo:hi], None if hist is None else hist[:, lo:hi], row)
    assert torch.equal(part[0], whole[0][:, lo:hi])
    if with_history:
        assert torch.equal(part[1], whole[1][:, lo:hi])
    else:
        assert part[1] is None and whole[1] is None


def test_update_keeps_dtype_and_computes_in_float32() -> None:
    """bfloat16 in, bfloat16 out, float32 inside: the only error is the final rounding."""
    gen = torch.Generator().manual_seed(0)
    x, out = (torch.randn(1, 8, 4, generator=gen).bfloat16() for _ in range(2))
    hist = torch.randn(1, 8, 4, generator=gen)
    row = step_table(DPMSolverMultistepScheduler(), 10).coeffs[3]
    want, want_hist = update(x.float(), out.float(), hist, row)  # the same inputs, float32
    got, got_hist = update(x, out, hist, row)
    assert got.dtype == torch.bfloat16 and got_hist.dtype == torch.float32
    assert ((got.float() - want).abs() <= want.abs() * 2**-8 + 1e-6).all()  # one rounding
    torch.testing.assert_close(got_hist, want_hist, rtol=1e-6, atol=1e-6)


def test_update_traces_to_token_wise_graph() -> None:
    """Dynamo traces `update` in one graph that the annotate pass finds token-wise."""
    table = step_table(DPMSolverMultistepScheduler(), 10)

    def last_stage_step(latents, model_output, history, coeffs):
        return update(latents, model_output, history, coeffs)

    x, out, hist = (torch.randn(1, 16, 8) for _ in range(3))
    (gm,) = capture_graphs(last_stage_step, (x, out, hist, table.coeffs[4]), None)
    annotation = annotate(gm, "latents")
    assert not annotation.unsupported
    outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    assert all(n.meta[META_KEY].carries_tokens for n in outputs)
