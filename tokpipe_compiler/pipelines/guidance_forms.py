"""The guidance forms a pipeline applies to its transformer's output, and finding which
one (and at which scales) turns the transformer's probes into what the pipeline passed to
`scheduler.step`: classifier-free guidance (uncond first or cond first, DiT's written to
both halves, QwenImage's rescaled to the conditional prediction's norm, LongCat's with
that scale clamped to at most 1), the prediction negated or not, and diffusers'
perturbed-attention guidance (PAG), in the pipelines' own order of operations.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch

from tokpipe_compiler.core.errors import TokpipeError

COMBINES = ("none", "uncond_first", "cond_first", "cond_first_both", "cond_first_rescaled",
            "perturbed", "uncond_first_perturbed")
# Two calls a step (cond, then uncond): the pipelines' forms. cond_extrapolated is Krea 2's
# `cond + s * (cond - uncond)`: classifier-free guidance at g = s + 1, which in bfloat16
# rounds otherwise than `uncond + g * (cond - uncond)`. Not tried on one batched call, whose
# batch of two it would take from a PAG pipeline (`perturbed`, the same arithmetic).
TWO_CALL_COMBINES = ("cond_first", "cond_first_rescaled", "cond_extrapolated",
                     "cond_first_renormed")
# cond_first_renormed is LongCat-Image's `enable_cfg_renorm`: QwenImage's rescale with the
# factor clamped to [0, 1] (cfg_renorm_min = 0) and 1e-8 added to the guided norm; the
# second call's probe (`probes.probe`) makes the clamp tell the two apart.
# diffusers' PAG pipelines: (cond, perturbed) with scale s, or (uncond, cond, perturbed) with
# scales (g, s); their attention processors split the batch inside the transformer call.
PERTURBED = ("perturbed", "uncond_first_perturbed")
EXACT = 1e-6  # relative: a form matches when it reproduces the pipeline's own arithmetic


class GlueNotFound(TokpipeError):
    """The pipeline's step is not one of the token-wise forms ring mode can replay."""


def combine(form: str, out: torch.Tensor, g: Any, calls: int) -> torch.Tensor:
    """The guided prediction of guidance `form` over `out` (see COMBINES) at scale(s) `g`."""
    if form == "none":
        return out
    if form in PERTURBED:
        return _perturbed(form, out, g)
    first, second = out.chunk(2)
    if form == "cond_extrapolated":
        return first + _times(g, first - second)
    if form == "uncond_first":
        return first + _times(g, second - first)
    guided = second + _times(g, first - second)  # cond first: DiT, and the two-call pipelines
    if form == "cond_first_rescaled":
        return guided * (torch.norm(first, dim=-1, keepdim=True) /
                         torch.norm(guided, dim=-1, keepdim=True))
    if form == "cond_first_renormed":
        scale = torch.norm(first, dim=-1, keepdim=True) / (
            torch.norm(guided, dim=-1, keepdim=True) + 1e-8)
        return guided * scale.clamp(min=0.0, max=1.0)
    return torch.cat([guided, guided]) if form == "cond_first_both" else guided


def _perturbed(combine: str, out: torch.Tensor, g: Any) -> torch.Tensor:
    """diffusers' PAG guidance, in its order of operations: `cond + s * (cond - perturbed)`,
    or `uncond + g * (cond - uncond) + s * (cond - perturbed)` with g = (g, s)."""
    if combine == "perturbed":
        cond, perturbed = out.chunk(2)
        return cond + _times(g, cond - perturbed)
    uncond, cond, perturbed = out.chunk(3)
    return uncond + _times(g[0], cond - uncond) + _times(g[1], cond - perturbed)


def _times(g: Any, x: torch.Tensor) -> torch.Tensor:
    """g * x as the pipeline computes it with a Python float g. The ring passes g as a
    float32 tensor, which a bfloat16 or float16 product would round to x's dtype first
    (3.7 -> 3.703125); the product in float32, rounded once, is the pipeline's."""
    if isinstance(g, torch.Tensor) and x.dtype in (torch.bfloat16, torch.float16):
        return (g.to(torch.float32) * x.to(torch.float32)).to(x.dtype)
    return g * x


def fit_guidance(probe: torch.Tensor, noise_pred: torch.Tensor, calls: int,
                 candidates: Sequence[float]) -> tuple[str, torch.dtype, int | None, Any, bool]:
    """The guidance form, the dtype it is computed in, the channels kept, the scale, and
    whether the pipeline negates the prediction (HiDream before guidance, Lumina2 and
    Z-Image after it: negation is exact in floating point, so both orders give the
    negated guided prediction bit for bit). The call's own numbers are tried in every form
    before fitted ones, and the form that gives the pipeline's numbers most closely wins:
    one batch fits several forms (a batch of two is classifier-free guidance at g, or PAG
    at s = g - 1 with the rows read the other way), which differ only in rounding."""
    refusals = []
    for negated in (False, True):
        try:
            target = -noise_pred if negated else noise_pred
            return (*_fit_guidance(probe, target, calls, candidates), negated)
        except GlueNotFound as refusal:
            refusals.append(refusal)
    raise refusals[0]


def _fit_guidance(probe: torch.Tensor, noise_pred: torch.Tensor, calls: int,
                  candidates: Sequence[float]) -> tuple[str, torch.dtype, int | None, Any]:
    channels = None
    if probe.dim() > 1 and noise_pred.dim() > 1 and probe.shape[1] != noise_pred.shape[1]:
        channels = noise_pred.shape[1]
        probe = probe[:, :channels]
    forms = TWO_CALL_COMBINES if calls == 2 else COMBINES
    for own in (True, False):
        best: tuple[float, Any] | None = None
        for form in forms:
            if probe.shape[0] % _parts(form):
                continue  # a batch the form does not split (one sample, unguided)
            for dtype in dict.fromkeys((probe.dtype, noise_pred.dtype)):
                cast = probe.to(dtype)
                for g in _scales(form, cast, noise_pred, candidates, own):
                    guided = combine(form, cast, g, calls)
                    if guided.shape != noise_pred.shape:
                        continue
                    error = _error(guided.to(noise_pred.dtype), noise_pred)
                    if error <= EXACT and (best is None or error < best[0]):
                        best = error, (form, dtype, channels, g)
                    if error == 0:
                        return best[1]
        if best is not None:
            return best[1]
    tried = ", ".join(f"{c:g}" for c in candidates)
    raise GlueNotFound("the prediction the pipeline passes to scheduler.step is neither the "
                       "transformer's output nor classifier-free or perturbed-attention "
                       "guidance over it, at a scale fitted to it or among the numbers the "
                       f"call passed or defaults to ({tried}), each in the order of "
                       "operations diffusers' pipelines use (the transformer's output is "
                       f"{probe.dtype}, in which another order rounds otherwise): a "
                       "prediction the pipeline "
                       "transforms further (rescaled by statistics over all tokens, say), "
                       "negated or not, is not replayed")


def _scales(combine: str, probe: torch.Tensor, noise_pred: torch.Tensor,
            candidates: Sequence[float], own: bool) -> list[Any]:
    """Guidance scales to try: the call's own values (own), or the least-squares fit."""
    if combine == "none":
        return [1.0] if own else []
    if combine in ("cond_first_rescaled", "cond_first_renormed"):  # not linear in g: the
        # pipeline's own values only
        return [float(c) for c in candidates] if own else []
    parts = _parts(combine)
    if combine == "cond_first_both" and noise_pred.shape[0] == probe.shape[0]:
        target = noise_pred.chunk(2)[0]
    elif noise_pred.shape[0] * parts == probe.shape[0]:
        target = noise_pred
    else:
        return []
    base, directions = _directions(combine, probe.double().chunk(parts))
    fitted = _least_squares(target.double() - base, directions)
    if not own:
        return [fitted[0] if len(fitted) == 1 else tuple(fitted)]
    near = [[float(c) for c in candidates if abs(float(c) - f) <= 1e-3 * max(1, abs(f))]
            for f in fitted]
    return near[0] if len(near) == 1 else list(itertools.product(*near))


def _parts(form: str) -> int:
    """The parts of the batch guidance `form` combines."""
    return {"none": 1, "uncond_first_perturbed": 3}.get(form, 2)


def _directions(combine: str, parts: Sequence[torch.Tensor]
                ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The guided prediction's base and the directions its scales multiply."""
    if combine == "uncond_first":
        return parts[0], [parts[1] - parts[0]]
    if combine in ("perturbed", "cond_extrapolated"):
        return parts[0], [parts[0] - parts[1]]
    if combine == "uncond_first_perturbed":
        return parts[0], [parts[1] - parts[0], parts[1] - parts[2]]
    return parts[1], [parts[0] - parts[1]]  # cond first


def _least_squares(target: torch.Tensor, directions: list[torch.Tensor]) -> list[float]:
    """The scales that best make `target` from `directions` (0 where they do not fix it)."""
    matrix = torch.stack([d.flatten() for d in directions], 1)
    solution = torch.linalg.lstsq(matrix, target.flatten()[:, None]).solution
    return [float(x) for x in solution.flatten()]


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return _error(a, b) <= EXACT


def _error(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| relative to max |b|."""
    return (a - b).abs().max().item() / max(b.abs().max().item(), 1e-30)
