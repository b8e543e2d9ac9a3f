"""Token-wise scheduler updates for ring mode.

In ring mode the last stage applies the scheduler step to each token chunk as soon as its model
output is ready, so the step must be elementwise arithmetic that the compiler can run per
chunk. Every supported diffusers scheduler step is linear in the latents x_k, the model output
out_k and (DPM-Solver++ 2M) the previous step's data prediction, so one update serves them all:

    x_next      = c0 * x + c1 * out + c2 * history
    new_history = c3 * x + c4 * out          (x0_k, the data prediction; DPM-Solver++ 2M only)

`step_table` precomputes the row (c0..c4) of every step in float64 from a diffusers scheduler;
`update` applies one row. The runtime feeds `latents * input_scale[k]` and `timesteps[k]` to the
model, and starts the history at zeros (its coefficient is zero on the first step).

Tables cover the whole schedule from its first step, as a text-to-image loop runs it; `step()`
arguments that add noise (DDIM's eta, Euler's s_churn) are taken at their zero defaults.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

K = 5  # coefficient columns: x, out, history, and the history's x and out

Pair = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class StepTable:
    """Per-step coefficients of a token-wise scheduler update, precomputed from a diffusers
    scheduler.

    timesteps: [steps] float32, the model's timestep input per step.
    input_scale: [steps], model input = latents * input_scale[k] (Euler's 1/sqrt(sigma^2+1);
        1 elsewhere).
    coeffs: [steps, K], the row `update` takes at step k (see the module docstring).
    history: True when the update carries a history tensor (DPM-Solver++ 2M).
    """

    timesteps: torch.Tensor
    input_scale: torch.Tensor
    coeffs: torch.Tensor
    history: bool


def step_table(scheduler: Any, num_inference_steps: int, device: Any = "cpu") -> StepTable:
    """The coefficient table of `scheduler` for `num_inference_steps` steps.

    Works on a copy: the user's scheduler is not touched. Raises ValueError for a scheduler or
    config whose step is not token-wise linear.
    """
    build = _builder(scheduler)
    sched = copy.deepcopy(scheduler)
    input_scale, coeffs, history = build(sched, num_inference_steps)
    return StepTable(
        timesteps=sched.timesteps.to(device=device, dtype=torch.float32),
        input_scale=input_scale.to(device=device, dtype=torch.float32),
        coeffs=coeffs.to(device=device, dtype=torch.float32),
        history=history,
    )


def update(
    latents: torch.Tensor,
    model_output: torch.Tensor,
    history: torch.Tensor | None,
    coeffs: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One scheduler step as token-wise arithmetic, with `coeffs` one row of StepTable.coeffs.

    Returns (x_next in latents' dtype, new history or None when `history` is None). Like
    diffusers, the arithmetic runs in at least float32; the history stays in that precision.
    """
    dtype = torch.promote_types(latents.dtype, torch.float32)
    x = latents.to(dtype)
    out = model_output.to(dtype)
    x_next = coeffs[0] * x + coeffs[1] * out
    if history is None:
        return x_next.to(latents.dtype), None
    x_next = x_next + coeffs[2] * history.to(dtype)
    return x_next.to(latents.dtype), coeffs[3] * x + coeffs[4] * out


# A builder validates the config, sets the timesteps on the (copied) scheduler and returns
# (input_scale [steps], coeffs [steps, K] float64, history).
Builder = Callable[[Any, int], tuple[torch.Tensor, torch.Tensor, bool]]


def _builder(scheduler: Any) -> Builder:
    # Imported here: diffusers is an optional dependency of the package.
    from diffusers import (
        DDIMScheduler,
        DPMSolverMultistepScheduler,
        EulerDiscreteScheduler,
        FlowMatchEulerDiscreteScheduler,
    )

    builders: dict[type, Builder] = {
        FlowMatchEulerDiscreteScheduler: _flow_match,
        DDIMScheduler: _ddim,
        EulerDiscreteScheduler: _euler,
        DPMSolverMultistepScheduler: _dpm_solver,
    }
    for cls, build in builders.items():
        if isinstance(scheduler, cls):
            return build
    names = ", ".join(cls.__name__ for cls in builders)
    raise ValueError(
        f"ring mode has no token-wise update for {type(scheduler).__name__}; supported "
        f"schedulers: {names}"
    )


def _require(scheduler: Any, option: str, supported: Sequence[Any], why: str = "") -> None:
    value = scheduler.config[option]
    if value not in supported:
        reason = f" ({why})" if why else ""
        raise ValueError(
            f"{type(scheduler).__name__} option {option}={value!r} is not supported in ring "
            f"mode{reason}; supported values: {', '.join(map(repr, supported))}"
        )


def _f64(values: Any) -> torch.Tensor:
    return torch.as_tensor(values).to(torch.float64)


def _columns(steps: int, *columns: torch.Tensor | float) -> torch.Tensor:
    """[steps, K] float64 from up to K columns (scalars or [steps]); missing ones are zero."""
    table = torch.zeros(steps, K, dtype=torch.float64)
    for i, column in enumerate(columns):
        table[:, i] = column
    return table


def _predictions(prediction: str, alpha: torch.Tensor, sigma: torch.Tensor) -> tuple[Pair, Pair]:
    """Coefficients (p, q) of x0 = p*x + q*out and (r, u) of eps = r*x + u*out, for a sample
    x = alpha*x0 + sigma*eps, as diffusers derives them from each prediction type."""
    one, zero = torch.ones_like(alpha), torch.zeros_like(alpha)
    if prediction == "epsilon":
        return (1 / alpha, -sigma / alpha), (zero, one)
    if prediction == "v_prediction":
        return (alpha, -sigma), (sigma, alpha)
    return (zero, one), (1 / sigma, -alpha / sigma)  # "sample"


def _flow_match(sched: Any, steps: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
    _require(sched, "stochastic_sampling", (False,), "it draws fresh noise every step")
    _require(sched, "use_dynamic_shifting", (False,),
             "it needs a per-resolution mu; use shift=exp(mu) instead")
    sched.set_timesteps(steps)
    sigma = _f64(sched.sigmas)
    n = len(sched.timesteps)
    # x_next = x + (sigma_next - sigma) * v
    return torch.ones(n), _columns(n, 1.0, sigma[1:] - sigma[:-1]), False


def _euler(sched: Any, steps: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
    _require(sched, "prediction_type", ("epsilon", "v_prediction", "sample"))
    sched.set_timesteps(steps)
    sigmas = _f64(sched.sigmas)
    sigma, dt = sigmas[:-1], sigmas[1:] - sigmas[:-1]
    alpha = 1 / torch.sqrt(sigma**2 + 1)
    # Euler's x is the variance-preserving sample divided by alpha.
    (p, q), _ = _predictions(sched.config.prediction_type, alpha, sigma * alpha)
    # x_next = x + dt * (x - x0) / sigma, with x0 = p*alpha*x + q*out
    c0 = 1 + dt * (1 - p * alpha) / sigma
    c1 = -dt * q / sigma
    return alpha, _columns(len(sigma), c0, c1), False


def _ddim(sched: Any, steps: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
    _require(sched, "prediction_type", ("epsilon", "v_prediction", "sample"))
    _require(sched, "clip_sample", (False,), "clamping x0 is not linear")
    _require(sched, "thresholding", (False,), "it takes a quantile over all tokens")
    sched.set_timesteps(steps)
    t = sched.timesteps
    # diffusers takes the previous timestep as t - T // steps whatever the spacing.
    prev = t - sched.config.num_train_timesteps // sched.num_inference_steps
    cumprod = _f64(sched.alphas_cumprod)
    a = cumprod[t]
    a_prev = torch.where(prev >= 0, cumprod[prev.clamp(min=0)],
                         float(sched.final_alpha_cumprod))
    (p, q), (r, u) = _predictions(sched.config.prediction_type, a.sqrt(), (1 - a).sqrt())
    # eta = 0: x_prev = sqrt(a_prev) * x0 + sqrt(1 - a_prev) * eps
    keep, noise = a_prev.sqrt(), (1 - a_prev).sqrt()
    return torch.ones(len(t)), _columns(len(t), keep * p + noise * r, keep * q + noise * u), False


def _dpm_solver(sched: Any, steps: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
    _require(sched, "algorithm_type", ("dpmsolver++",))
    _require(sched, "solver_order", (1, 2), "order 3 would carry two history tensors")
    _require(sched, "solver_type", ("midpoint", "heun"))
    _require(sched, "prediction_type", ("epsilon", "v_prediction", "sample", "flow_prediction"))
    _require(sched, "thresholding", (False,), "it takes a quantile over all tokens")
    _require(sched, "variance_type", (None,), "it slices the model output's channels")
    sched.set_timesteps(steps)
    cfg = sched.config
    s = _f64(sched.sigmas)
    if cfg.use_flow_sigmas:
        alpha, sigma = 1 - s, s
    else:
        alpha = 1 / torch.sqrt(s**2 + 1)
        sigma = s * alpha
    if cfg.prediction_type == "flow_prediction":
        p, q = torch.ones_like(s), -s
    else:
        (p, q), _ = _predictions(cfg.prediction_type, alpha, sigma)
    n = len(sched.timesteps)
    history = cfg.solver_order == 2
    coeffs = _columns(n)
    for k in range(n):
        second = history and k > 0 and not _lower_order_final(cfg, k, n)
        # weights of x0_k and x0_{k-1} in x_next
        if second:
            w0, w1 = _second_order(cfg.solver_type, k, alpha, sigma)
        else:
            w0, w1 = _first_order(k, alpha, sigma)
        coeffs[k, 0] = sigma[k + 1] / sigma[k] + w0 * p[k]
        coeffs[k, 1] = w0 * q[k]
        if history:
            coeffs[k, 2:] = torch.stack([w1, p[k], q[k]])
    return torch.ones(n), coeffs, history


def _lower_order_final(cfg: Any, k: int, n: int) -> bool:
    """Whether diffusers falls back to first order on the last step (small step counts, or a
    final sigma of zero where the second-order term is undefined)."""
    return k == n - 1 and (
        cfg.euler_at_final
        or (cfg.lower_order_final and n < 15)
        or cfg.final_sigmas_type == "zero"
    )


def _first_order(k: int, alpha: torch.Tensor, sigma: torch.Tensor) -> Pair:
    # x_next = sigma_t/sigma_s * x + alpha_t * (1 - e^-h) * x0_k; e^-h is a ratio of
    # sigma/alpha, which stays finite (zero) when the final sigma is zero.
    decay = (sigma[k + 1] / alpha[k + 1]) / (sigma[k] / alpha[k])
    return alpha[k + 1] * (1 - decay), torch.zeros((), dtype=torch.float64)


def _second_order(solver_type: str, k: int, alpha: torch.Tensor, sigma: torch.Tensor) -> Pair:
    log_snr = torch.log(alpha / sigma)
    h = log_snr[k + 1] - log_snr[k]
    r0 = (log_snr[k] - log_snr[k - 1]) / h
    phi = -alpha[k + 1] * torch.expm1(-h)
    # D1 = (x0_k - x0_{k-1}) / r0 enters with weight `d1`
    d1 = 0.5 * phi if solver_type == "midpoint" else alpha[k + 1] * (torch.expm1(-h) / h + 1)
    return phi + d1 / r0, -d1 / r0
