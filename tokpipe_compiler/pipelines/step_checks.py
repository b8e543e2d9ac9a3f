"""A ring's later steps checked against its first: the ring computes every step ahead from
the first step's form, so a pipeline that changes its transformer calls, timestep input or
guidance partway raises instead of going wrong."""

from __future__ import annotations

from typing import Any

import torch

from tokpipe_compiler.core.errors import TokpipeError
from tokpipe_compiler.pipelines.call_state import Generation
from tokpipe_compiler.pipelines.glue import as_stacked, condition_part, guide, model_timesteps, same


def changed(pipe: Any, step: int, what: str) -> TokpipeError:
    """The error for a pipeline that changed `what` at `step`."""
    return TokpipeError(f"{type(pipe).__name__} changed {what} at step {step}; the ring "
                        "computed every step ahead from the first step's form, so this "
                        "generation cannot be trusted: run it per call with "
                        "parallelize(pipe, ring=False)")


def check_call(pipe: Any, gen: Generation, call: dict[str, Any], index: int) -> None:
    """The step's transformer call `index` is the first step's, but for its latents and
    its timestep (the schedule's)."""
    glue, first = gen.glue, gen.first_calls
    if index >= len(first) or call.keys() != first[index].keys():
        raise changed(pipe, gen.step, "the transformer calls")
    expected = model_timesteps(glue, gen.timesteps[gen.step: gen.step + 1],
                               call[glue.timestep_arg].shape[0])[0]
    if not torch.equal(call[glue.timestep_arg], expected.to(call[glue.timestep_arg])):
        raise changed(pipe, gen.step, f"the timestep input {glue.timestep_arg!r}")
    for name, value in call.items():
        if name not in (glue.latent_arg, glue.timestep_arg) and \
                not same(value, first[index][name]):
            raise changed(pipe, gen.step, f"the transformer input {name!r}")
    if glue.condition_dim is not None and not same(
            condition_part(glue, call[glue.latent_arg]),
            condition_part(glue, first[index][glue.latent_arg])):
        raise changed(pipe, gen.step,
                      f"the condition joined to the latent in {glue.latent_arg!r}")


def check_prediction(pipe: Any, gen: Generation, noise_pred: torch.Tensor) -> None:
    """The step guides its probes as the first step did."""
    probes = [as_stacked(gen.glue.per_item, p) for p in gen.probes]
    probe = torch.cat(probes) if len(probes) == 2 else probes[0]
    if len(gen.probes) != gen.glue.calls or \
            not same(guide(gen.glue, probe, gen.glue.guidance), noise_pred, 1e-6):
        raise changed(pipe, gen.step, "the guidance")
