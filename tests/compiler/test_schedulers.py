"""Token-wise scheduler updates against diffusers' own denoising loops."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from diffusers import (
    DDIMScheduler,
    DDPMScheduler,
    DEISMultistepScheduler,
    DPMSolverMultistepScheduler,
    DPMSolverSinglestepScheduler,
    EulerAncestralDiscreteScheduler,
    EulerDiscreteScheduler,
    FlowMatchEulerDiscreteScheduler,
    FlowMatchHeunDiscreteScheduler,
    HeunDiscreteScheduler,
    PNDMScheduler,
    UniPCMultistepScheduler,
)

from tokpipe_compiler.pipelines.schedulers import K, step_table, update, update_state

# diffusers' schedulers trip numpy 2's __array__ copy deprecation; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:diffusers")

SHAPE = (1, 4, 8, 8)
RTOL = 2e-6


def flux_mu(tokens: int = 1024) -> float:
    """Flux's `calculate_shift` with its scheduler's defaults: mu from the image's tokens."""
    slope = (1.15 - 0.5) / (4096 - 256)
    return tokens * slope + 0.5 - slope * 256


def flux_sigmas(steps: int) -> list[float]:
    return list(np.linspace(1.0, 1 / steps, steps))


Kwargs = Callable[[int], dict[str, Any]]
NONE: Kwargs = lambda steps: {}  # noqa: E731
MU: Kwargs = lambda steps: {"mu": flux_mu()}  # noqa: E731

# name -> (scheduler, the set_timesteps keyword arguments a pipeline adds for `steps` steps)
CONFIGS: dict[str, tuple[Callable[[], Any], Kwargs]] = {
    # UniPC: Wan's config (flow_shift 3.0 at 480p, 5.0 at 720p), the default epsilon one, and
    # the options around them.
    "unipc-wan": (lambda: UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0), NONE),
    "unipc-wan-720p": (lambda: UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=5.0), NONE),
    "unipc-eps": (UniPCMultistepScheduler, NONE),
    "unipc-v": (lambda: UniPCMultistepScheduler(prediction_type="v_prediction"), NONE),
    "unipc-sample": (lambda: UniPCMultistepScheduler(prediction_type="sample"), NONE),
    "unipc-sd": (lambda: UniPCMultistepScheduler(
        beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
        timestep_spacing="leading", steps_offset=1), NONE),
    "unipc-order1": (lambda: UniPCMultistepScheduler(solver_order=1), NONE),
    "unipc-order3": (lambda: UniPCMultistepScheduler(solver_order=3), NONE),
    "unipc-no-lower-order-final": (lambda: UniPCMultistepScheduler(
        lower_order_final=False, final_sigmas_type="sigma_min"), NONE),
    "unipc-disable-corrector": (lambda: UniPCMultistepScheduler(disable_corrector=[0, 1, 2]),
                                NONE),
    "unipc-karras": (lambda: UniPCMultistepScheduler(use_karras_sigmas=True), NONE),
    "unipc-trailing": (lambda: UniPCMultistepScheduler(timestep_spacing="trailing"), NONE),
    # bh1, the noise predictor and a second-order last step divide by a final sigma of zero
    # (NaN in diffusers itself)
    "unipc-bh1": (lambda: UniPCMultistepScheduler(
        solver_type="bh1", final_sigmas_type="sigma_min"), NONE),
    "unipc-predict-eps": (lambda: UniPCMultistepScheduler(
        predict_x0=False, final_sigmas_type="sigma_min"), NONE),
    "unipc-flow-dynamic": (lambda: UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, use_dynamic_shifting=True),
        MU),
    # FlowMatch Euler: SD3 / AuraFlow (shift), Flux (dynamic shifting, custom sigmas), LTX
    # (shift_terminal), Mochi (invert_sigmas), and the sigma conversions.
    "flow": (FlowMatchEulerDiscreteScheduler, NONE),
    "flow-shift3": (lambda: FlowMatchEulerDiscreteScheduler(shift=3.0), NONE),
    "flow-flux": (lambda: FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15),
        lambda steps: {"mu": flux_mu(), "sigmas": flux_sigmas(steps)}),
    "flow-dynamic-linear": (lambda: FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True, time_shift_type="linear"), MU),
    "flow-ltx": (lambda: FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05, shift_terminal=0.1), MU),
    "flow-invert-sigmas": (lambda: FlowMatchEulerDiscreteScheduler(invert_sigmas=True), NONE),
    "flow-karras": (lambda: FlowMatchEulerDiscreteScheduler(use_karras_sigmas=True), NONE),
    "flow-exponential": (lambda: FlowMatchEulerDiscreteScheduler(
        use_exponential_sigmas=True), NONE),
    "flow-beta": (lambda: FlowMatchEulerDiscreteScheduler(use_beta_sigmas=True), NONE),
    # DDIM's default clip_sample=True is not linear; Stable Diffusion configs turn it off.
    "ddim-eps": (lambda: DDIMScheduler(clip_sample=False), NONE),
    "ddim-v": (lambda: DDIMScheduler(clip_sample=False, prediction_type="v_prediction"), NONE),
    "ddim-sample": (lambda: DDIMScheduler(clip_sample=False, prediction_type="sample"), NONE),
    "ddim-sd": (lambda: DDIMScheduler(
        beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", clip_sample=False,
        set_alpha_to_one=False, steps_offset=1), NONE),
    "ddim-zsnr-trailing-v": (lambda: DDIMScheduler(
        clip_sample=False, prediction_type="v_prediction", rescale_betas_zero_snr=True,
        timestep_spacing="trailing"), NONE),
    "euler-eps": (EulerDiscreteScheduler, NONE),
    "euler-v": (lambda: EulerDiscreteScheduler(prediction_type="v_prediction"), NONE),
    "euler-karras-leading": (lambda: EulerDiscreteScheduler(
        use_karras_sigmas=True, timestep_spacing="leading", steps_offset=1), NONE),
    "dpm-eps": (DPMSolverMultistepScheduler, NONE),
    "dpm-v": (lambda: DPMSolverMultistepScheduler(prediction_type="v_prediction"), NONE),
    "dpm-sigma-min-no-lof": (lambda: DPMSolverMultistepScheduler(
        final_sigmas_type="sigma_min", lower_order_final=False), NONE),
    "dpm-heun-karras": (lambda: DPMSolverMultistepScheduler(
        solver_type="heun", use_karras_sigmas=True), NONE),
    "dpm-order1": (lambda: DPMSolverMultistepScheduler(solver_order=1), NONE),
    "dpm-order3": (lambda: DPMSolverMultistepScheduler(solver_order=3), NONE),
    # Sana's config
    "dpm-flow": (lambda: DPMSolverMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0), NONE),
    "dpm-singlestep": (DPMSolverSinglestepScheduler, NONE),
    "deis": (DEISMultistepScheduler, NONE),
    "heun": (HeunDiscreteScheduler, NONE),
    "flow-heun": (lambda: FlowMatchHeunDiscreteScheduler(shift=3.0), NONE),
    "pndm": (PNDMScheduler, NONE),
}
STEPS = (4, 10, 14, 15, 50)  # DPM's lower_order_final switches off at 15 steps
STATE_SIZES = {"unipc-wan": 3, "unipc-eps": 3, "unipc-order1": 2, "unipc-order3": 4,
               "flow": 0, "flow-flux": 0, "ddim-eps": 0, "euler-eps": 0, "dpm-eps": 1,
               "dpm-order1": 0, "dpm-order3": 2}


def fake_model(x_in: torch.Tensor, k: int) -> torch.Tensor:
    """A fixed function of the model input and the step: errors compound as in sampling."""
    noise = torch.randn(SHAPE, generator=torch.Generator().manual_seed(1000 + k))
    return 0.3 * x_in + noise


def make(name: str, steps: int) -> tuple[Any, dict[str, Any]]:
    factory, kwargs = CONFIGS[name]
    return factory(), kwargs(steps)


def diffusers_loop(scheduler: Any, steps: int, kwargs: dict, x: torch.Tensor,
                   begin: int = 0, set_begin: bool = True) -> list:
    """The scheduler's loop as a pipeline runs it (from `begin`, as image-to-image does,
    telling the scheduler with set_begin_index or, as some video-to-video pipelines, not)."""
    sched = copy.deepcopy(scheduler)
    sched.set_timesteps(steps, **kwargs)
    if begin and set_begin and hasattr(sched, "set_begin_index"):
        sched.set_begin_index(begin)
    # Flow matching has no scale_model_input: its model input is the latents.
    scale = getattr(sched, "scale_model_input", lambda sample, t: sample)
    xs = []
    for k, t in enumerate(sched.timesteps[begin:]):
        out = fake_model(scale(x, t), k)
        x = sched.step(out, t, x).prev_sample
        xs.append(x)
    return xs


def table_loop(scheduler: Any, steps: int, kwargs: dict, x: torch.Tensor,
               begin: int = 0) -> list:
    table = step_table(scheduler, steps, begin_index=begin, **kwargs)
    state = tuple(torch.zeros_like(x) for _ in range(table.state_size))
    xs = []
    for k in range(len(table.timesteps)):
        out = fake_model(x * table.input_scale[k], k)
        x, state = update_state(x, out, state, table.rows[k], table.pattern)
        xs.append(x)
    return xs


def fixed_layout_loop(scheduler: Any, steps: int, kwargs: dict, x: torch.Tensor) -> list:
    """The older API (`coeffs`, `history`, `update`), as demo.py and the benchmarks call it."""
    table = step_table(scheduler, steps, **kwargs)
    history = torch.zeros_like(x) if table.history else None
    xs = []
    for k in range(len(table.timesteps)):
        out = fake_model(x * table.input_scale[k], k)
        x, history = update(x, out, history, table.coeffs[k])
        xs.append(x)
    return xs


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


def assert_matches(got: list, want: list) -> None:
    assert len(got) == len(want)
    errors = [relative_error(g, w) for g, w in zip(got, want, strict=True)]
    # all(), not max(): a NaN error must fail the test
    assert all(e <= RTOL for e in errors), f"per-step relative errors {errors}"


@pytest.mark.parametrize("steps", STEPS)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_diffusers_every_step(name: str, steps: int) -> None:
    scheduler, kwargs = make(name, steps)
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(steps))
    assert_matches(table_loop(scheduler, steps, kwargs, x),
                   diffusers_loop(scheduler, steps, kwargs, x))


@pytest.mark.parametrize("name", ["unipc-wan", "flow-shift3", "flow-flux", "ddim-eps",
                                  "euler-eps", "dpm-eps", "dpm-order3", "heun", "pndm"])
@pytest.mark.parametrize("set_begin", [True, False])
def test_a_loop_that_starts_inside_the_schedule(name: str, set_begin: bool) -> None:
    """Image-to-image: the pipeline loops over the rest of the schedule (most set the
    scheduler's begin index first); the table covers those steps, a multistep history
    starting there."""
    scheduler, kwargs = make(name, 10)
    order = getattr(scheduler, "order", 1)
    begin = 4 * order  # diffusers' get_timesteps: t_start * scheduler.order
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(3))
    table = step_table(scheduler, 10, begin_index=begin, **kwargs)
    reference = copy.deepcopy(scheduler)
    reference.set_timesteps(10, **kwargs)
    assert torch.equal(table.timesteps, reference.timesteps[begin:].float())
    assert_matches(table_loop(scheduler, 10, kwargs, x, begin),
                   diffusers_loop(scheduler, 10, kwargs, x, begin, set_begin))


@pytest.mark.parametrize("name", ["ddim-eps", "euler-v", "flow-flux", "dpm-eps", "dpm-flow"])
def test_fixed_layout_matches_diffusers(name: str) -> None:
    scheduler, kwargs = make(name, 20)
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0))
    assert_matches(fixed_layout_loop(scheduler, 20, kwargs, x),
                   diffusers_loop(scheduler, 20, kwargs, x))


def test_custom_sigmas_without_a_step_count() -> None:
    """Flux's pipeline passes sigmas and mu, and no step count."""
    scheduler, kwargs = make("flow-flux", 12)
    table = step_table(scheduler, None, **kwargs)
    reference = copy.deepcopy(scheduler)
    reference.set_timesteps(**kwargs)
    assert torch.equal(table.timesteps, reference.timesteps.float())
    x = torch.randn(SHAPE)
    assert_matches(table_loop(scheduler, None, kwargs, x),
                   diffusers_loop(scheduler, None, kwargs, x))


def test_dynamic_shifting_follows_mu() -> None:
    scheduler, _ = make("flow-flux", 10)
    small, large = (step_table(scheduler, 10, mu=flux_mu(tokens)) for tokens in (256, 4096))
    assert (large.timesteps[1:] > small.timesteps[1:]).all()  # more tokens, more shift


@pytest.mark.parametrize("name", list(CONFIGS))
def test_table_layout(name: str) -> None:
    scheduler, kwargs = make(name, 7)
    table = step_table(scheduler, 7, **kwargs)
    reference = copy.deepcopy(scheduler)
    reference.set_timesteps(7, **kwargs)
    n, m = len(reference.timesteps), table.state_size
    assert torch.equal(table.timesteps, reference.timesteps.float())
    assert table.input_scale.shape == (n,) and table.rows.shape == (n, (1 + m) * (2 + m))
    assert table.rows.dtype == torch.float32
    assert m == STATE_SIZES.get(name, m)
    assert len(table.pattern) == 1 + m
    matrices = table.rows.view(n, 1 + m, 2 + m)
    assert not matrices[0, :, 2:].any()  # the state is zeros before the first step
    for i, columns in enumerate(table.pattern):  # the terms left out are zero at every step
        unused = [j for j in range(2 + m) if j not in columns]
        assert not matrices[:, i, unused].any()
    if m <= 1 and not name.startswith("unipc"):
        assert table.coeffs.shape == (n, K) and table.history == (m == 1)


def test_many_states_have_no_fixed_layout() -> None:
    table = step_table(UniPCMultistepScheduler(), 10)
    assert table.history
    with pytest.raises(ValueError, match="update_state"):
        _ = table.coeffs


class RollingScheduler(FlowMatchEulerDiscreteScheduler):
    """A linear step that moves values between tokens: not token-wise."""

    def step(self, model_output, timestep, sample, **kwargs):
        out = super().step(model_output, timestep, sample, **kwargs)
        out.prev_sample = out.prev_sample.roll(1, dims=-2)
        return out


UNSUPPORTED = [
    (DDIMScheduler, "clip_sample"),
    (lambda: DDIMScheduler(clip_sample=False, thresholding=True), "thresholding"),
    (lambda: DPMSolverMultistepScheduler(algorithm_type="sde-dpmsolver++"), "algorithm_type"),
    (lambda: DPMSolverMultistepScheduler(variance_type="learned_range"), "variance_type"),
    (lambda: DPMSolverMultistepScheduler(thresholding=True), "thresholding"),
    (lambda: UniPCMultistepScheduler(thresholding=True), "thresholding"),
    (lambda: UniPCMultistepScheduler(solver_p=DDIMScheduler()), "solver_p"),
    (lambda: FlowMatchEulerDiscreteScheduler(stochastic_sampling=True), "stochastic_sampling"),
    (lambda: FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True), "use_dynamic_shifting"),
    # steps that draw noise, found by the probes: a table that leaves the noise to its
    # caller is asked for with noise=True (test_a_step_that_draws_noise_...)
    (EulerAncestralDiscreteScheduler, "EulerAncestralDiscreteScheduler: its step 0 draws noise"),
    # its default clip_sample=True, and with clip_sample=False it still draws noise
    (DDPMScheduler, "clip_sample=True is not supported.*but not with that either: ring mode "
                    "has no token-wise update for DDPMScheduler: its step 0 draws noise"),
    (lambda: DDPMScheduler(clip_sample=False), "DDPMScheduler: its step 0 draws noise"),
    (RollingScheduler, "RollingScheduler.*not linear per token"),
    # diffusers' own step divides by the final sigma of zero
    (lambda: UniPCMultistepScheduler(solver_type="bh1"), "UniPCMultistepScheduler.*NaN"),
    (object, "object: it is not a diffusers scheduler"),
]


@pytest.mark.parametrize(("make_scheduler", "match"), UNSUPPORTED)
def test_unsupported_configs_name_the_option(make_scheduler: Callable[[], object],
                                             match: str) -> None:
    with pytest.raises(ValueError, match=match) as info:
        step_table(make_scheduler(), 10)
    message = str(info.value)
    assert "supported" in message and "\n" not in message


def test_an_option_a_ring_could_take_otherwise_names_that_alone():
    """DDIM with clip_sample=True runs as a ring with clip_sample=False: the message says
    just that (DDPM's goes on to say why it would not)."""
    with pytest.raises(ValueError) as info:
        step_table(DDIMScheduler(), 10)
    assert str(info.value).endswith("supported: clip_sample=False")


@pytest.mark.parametrize("name", ["euler-eps", "dpm-eps", "unipc-eps", "flow"])
def test_user_scheduler_and_rng_not_touched(name: str) -> None:
    scheduler, _ = make(name, 30)
    scheduler.set_timesteps(30)
    t = scheduler.timesteps[0]
    x = torch.randn(SHAPE)
    scheduler.step(fake_model(x, 0), t, x)
    before = copy.deepcopy(vars(scheduler))
    rng = torch.get_rng_state()
    step_table(scheduler, 5)
    assert torch.equal(torch.get_rng_state(), rng)
    after = vars(scheduler)
    assert before.keys() == after.keys()
    for key, value in before.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, after[key]), key
        elif isinstance(value, list):  # model_outputs: tensors or None
            assert all(a is b or torch.equal(a, b) for a, b in zip(value, after[key],
                                                                   strict=True)), key
        else:
            assert value == after[key], key


@pytest.mark.parametrize("steps", [2, 3])
@pytest.mark.parametrize("make_heun", [HeunDiscreteScheduler,
                                       lambda: FlowMatchHeunDiscreteScheduler(shift=1.0)])
def test_heun_in_few_steps_matches_diffusers_in_float64(make_heun, steps: int) -> None:
    """At 2-3 steps Heun's float32 step rounds by up to 3e-5 (its two stages cancel): the
    table's update is held to diffusers' loop run in float64, as close as at 4-50 steps."""
    scheduler = make_heun()
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(steps))
    want = [w.to(torch.float32) for w in diffusers_loop(scheduler, steps, {}, x.double())]
    assert_matches(table_loop(scheduler, steps, {}, x), want)


class FailingLateScheduler(FlowMatchEulerDiscreteScheduler):
    """A token-wise step that raises from its third step on."""

    def step(self, model_output, timestep, sample, **kwargs):
        if self.step_index is not None and self.step_index >= 2:
            raise RuntimeError("no third step")
        return super().step(model_output, timestep, sample, **kwargs)


def test_a_step_that_fails_after_token_wise_ones_names_its_failure():
    with pytest.raises(ValueError, match=r"FailingLateScheduler: its step 2 fails on a probe "
                                         r"tensor \(RuntimeError: no third step\)"):
        step_table(FailingLateScheduler(), 5)
