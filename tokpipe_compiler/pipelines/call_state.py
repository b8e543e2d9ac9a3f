"""One parallelized pipeline call in progress (`Generation`: its steps, the segment its
loop is in, what it learnt at its first step), and the guidance scales the call may use.
`ring_call` drives it."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from tokpipe_compiler.pipelines.blends import Blends
from tokpipe_compiler.pipelines.denoiser_rings import Carried, RunSegment
from tokpipe_compiler.pipelines.glue import Glue
from tokpipe_compiler.pipelines.guiders import guiders_of
from tokpipe_compiler.pipelines.schedulers import StepTable
from tokpipe_compiler.pipelines.step_callbacks import StepCallbacks


@dataclass
class Generation:
    """One pipeline call in progress. Its loop runs as segments, one per transformer it
    calls in turn; `glue`, `first_calls` and `run` are those of the current segment."""

    reasons: list[str]  # why it runs per call (empty: ring)
    guidance_candidates: list[float]
    step: int = 0
    calls: list[dict[str, Any]] = field(default_factory=list)
    probes: list[torch.Tensor] = field(default_factory=list)
    table: StepTable | None = None
    timesteps: torch.Tensor | None = None  # the pipeline's own, as its loop iterates them
    denoiser: str | None = None  # the transformer of the current segment
    begin: int = 0  # the step the current segment starts at
    glue: Glue | None = None
    first_calls: list[dict[str, Any]] = field(default_factory=list)
    run: RunSegment | None = None  # the current segment's prepared ring
    previous: torch.Tensor | None = None  # the last scheduler step's latents (on probes)
    blends: Blends = field(default_factory=Blends)  # the latents blended between steps
    noises: dict[int, torch.Tensor] = field(default_factory=dict)  # scaled, drawn by step
    carried: Carried | None = None  # the real values the current segment starts from
    callbacks: StepCallbacks | None = None  # a ring generation's stand-in for its callbacks
    finished: bool = False  # the last segment's ring has run: the loop's values are real
    agreed_end: torch.Tensor | None = None  # several ranks: the latents every rank ends at

    @property
    def ring(self) -> bool:
        return not self.reasons

    def next_loop(self) -> None:
        """As at the call's start, for another denoising loop of the same call (Helios'
        windows, each with its own timesteps): what the loop before learnt dropped, the
        call's reasons, guidance candidates and step callbacks kept."""
        fresh = Generation(self.reasons, self.guidance_candidates, callbacks=self.callbacks)
        for item in fields(Generation):
            setattr(self, item.name, getattr(fresh, item.name))

    @property
    def probing(self) -> bool:
        """Whether the loop runs on probes now (a ring generation before its last ring)."""
        return self.ring and not self.finished

    @property
    def interrupted(self) -> torch.Tensor | None:
        """The latents of the step a callback interrupted the generation at, if one did (on
        several ranks: the earliest step any rank's interrupted it at, `segment_ends`)."""
        if self.agreed_end is not None:
            return self.agreed_end
        return None if self.callbacks is None else self.callbacks.interrupted


def guidance_candidates(pipe: Any, kwargs: dict[str, Any]) -> list[float]:
    """The numbers a pipeline call may scale its guidance by: those passed, those its
    `__call__` defaults to (PixArt's guidance_scale=4.5 when none is passed; a least-squares
    fit of it in bfloat16, 4.4997, rounds the products otherwise than the pipeline), and
    the last call's `_guidance_scale`, and its guider components' scales (a modular
    pipeline's)."""
    passed = list(kwargs.values())
    try:
        parameters = inspect.signature(pipe.__call__).parameters.values()
        passed += [p.default for p in parameters if p.name not in kwargs]
    except (TypeError, ValueError):  # no signature to read
        pass
    passed.append(getattr(pipe, "_guidance_scale", 1.0) or 1.0)
    passed += [getattr(guider, "guidance_scale", None) for _, guider in guiders_of(pipe)]
    numbers = [float(v) for v in passed if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return list(dict.fromkeys(numbers))
