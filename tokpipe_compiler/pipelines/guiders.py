"""diffusers' guider components (`diffusers.guiders`, in modular pipelines and some
others): which the ring replays, and those that hook the transformer for one guidance
branch, and what that means for stale K/V."""

from __future__ import annotations

import weakref
from typing import Any

from tokpipe_compiler.core.warn import warn

# The guider components a pipeline may have (HunyuanImage's OCR guider, the guider of Wan
# 2.2's second expert).
GUIDERS = ("guider", "guider_2", "ocr_guider")
# Guiders already warned of: once per guider.
_TOLD: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def guiders_of(pipe: Any) -> list[tuple[str, Any]]:
    """(component name, guider) of each guider component `pipe` has."""
    return [(name, getattr(pipe, name)) for name in GUIDERS
            if getattr(pipe, name, None) is not None]


def hooks_a_branch(guider: Any) -> bool:
    """Whether `guider` registers hooks on the transformer for a branch of its own
    (perturbed attention, AutoGuidance, skip-layer and smoothed-energy guidance: they
    override `prepare_models`)."""
    try:
        from diffusers.guiders.guider_utils import BaseGuidance
    except ImportError:
        return False
    return isinstance(guider, BaseGuidance) and \
        type(guider).prepare_models is not BaseGuidance.prepare_models


def warn_hooked_guider(pipe: Any, mode: str) -> None:
    """Says once per guider that a guider hooking the transformer for one branch makes a
    stale (or causal) pipeline's first call differ from later ones, which ran other graphs
    from their first step (in sync mode every call equals the serial pipeline)."""
    if mode == "sync":
        return
    for _, guider in guiders_of(pipe):
        if hooks_a_branch(guider) and _first_time(guider):
            _warn(pipe, guider, mode)


def _first_time(guider: Any) -> bool:
    told = guider in _TOLD
    _TOLD[guider] = True
    return not told


def _warn(pipe: Any, guider: Any, mode: str) -> None:
    warn(f"tokpipe: {type(pipe).__name__}'s guider, {type(guider).__name__}, hooks the "
         "transformer for one guidance branch at each step, and Dynamo traces the hooked "
         "model as other graphs partway through the first call; in "
         f"{mode!r} mode each graph keeps K/V of its own, so that call's numbers differ from "
         "later calls' with the same seed (which agree with one another). mode='sync' gives "
         "the serial pipeline's numbers at every call, and guiders without hooks "
         "(ClassifierFreeGuidance, AdaptiveProjectedGuidance) one image per seed from the "
         "first call")


def guider_reasons(pipe: Any) -> list[str]:
    """Why a pipeline's guider components (diffusers' `guiders`: HunyuanImage's `guider`
    and `ocr_guider`) keep its calls per call: the ring replays classifier-free guidance
    at one scale at every step, and other guiders change the step (a start/stop window,
    momentum, statistics over all tokens, hooks on the transformer). A disabled guider
    runs one branch, which the ring takes."""
    reasons = []
    for component, guider in guiders_of(pipe):
        if getattr(guider, "_enabled", True):
            why = _guider_change(guider)
            if why:
                reasons.append(f"its {component}, {type(guider).__name__}, {why}")
    return reasons


def _guider_change(guider: Any) -> str:
    """How `guider` changes the step from step to step ("" where it does not)."""
    from diffusers.guiders import ClassifierFreeGuidance

    if type(guider) is not ClassifierFreeGuidance:
        return ("is not classifier-free guidance at one scale, the form the ring replays at "
                "every step")
    if guider.guidance_rescale:
        return "rescales the guidance by statistics over all tokens (guidance_rescale)"
    if (guider._start, guider._stop) != (0.0, 1.0):
        return "turns the guidance on or off partway through the generation (start, stop)"
    return ""
