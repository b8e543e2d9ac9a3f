"""diffusers' guider components (`diffusers.guiders`, in modular pipelines and some
others) that hook the transformer for one guidance branch, and what that means for stale
K/V."""

from __future__ import annotations

import weakref
from typing import Any

from tokpipe_compiler.core.warn import warn

# The guider components a pipeline may have (HunyuanImage's OCR guider, the guider of Wan
# 2.2's second expert).
GUIDERS = ("guider", "guider_2", "ocr_guider")
# Guiders already warned of: once per guider.
_TOLD: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


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
    stale (or causal) pipeline's numbers depend on the graphs Dynamo traced before (in
    sync mode they equal the serial pipeline's)."""
    if mode == "sync":
        return
    for component in GUIDERS:
        guider = getattr(pipe, component, None)
        if guider is not None and hooks_a_branch(guider) and _first_time(guider):
            _warn(pipe, guider, mode)


def _first_time(guider: Any) -> bool:
    try:
        if guider in _TOLD:
            return False
        _TOLD[guider] = True
    except TypeError:  # not weakly referable: said at every call
        pass
    return True


def _warn(pipe: Any, guider: Any, mode: str) -> None:
    warn(f"tokpipe: {type(pipe).__name__}'s guider, {type(guider).__name__}, hooks the "
         "transformer for one guidance branch at each step, and Dynamo traces the hooked "
         f"model as other graphs partway through a generation; in {mode!r} mode each graph "
         "keeps K/V per branch from the steps it has run, so the generation's numbers depend "
         "on the graphs traced before it (a later call with the same seed may differ). "
         "mode='sync' gives the serial pipeline's numbers, and guiders without hooks "
         "(ClassifierFreeGuidance, AdaptiveProjectedGuidance) keep stale mode reproducible")
