"""Identifying the guidance a pipeline applies to the transformer's output (glue.identify):
classifier-free guidance and diffusers' perturbed-attention guidance (PAG), at the call's
own scales, replayed in the pipeline's own arithmetic (bit for bit)."""

from __future__ import annotations

import pytest
import torch

from tokpipe_compiler.pipelines.glue import GlueNotFound, guide, identify

T = torch.tensor(800.0)
CANDIDATES = [20.0, 4.5, 3.0, 2.5, 4.0, 1.0]  # numbers a call passes or defaults to


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _identify(copies: int, probe: torch.Tensor, noise_pred: torch.Tensor,
              candidates: list[float] = CANDIDATES):
    sample = _randn(1, 4, 6, seed=0)
    call = {"hidden_states": torch.cat([sample] * copies), "timestep": T.expand(copies)}
    return identify([call], [probe], noise_pred, sample, T, 1.0, candidates)


def test_pag_with_classifier_free_guidance():
    """uncond + g * (cond - uncond) + s * (cond - perturbed), as diffusers writes it."""
    probe = _randn(3, 4, 6, seed=1)
    uncond, cond, perturbed = probe.chunk(3)
    noise_pred = uncond + 4.5 * (cond - uncond) + 2.5 * (cond - perturbed)
    glue = _identify(3, probe, noise_pred)
    assert (glue.combine, glue.copies, glue.guidance) == ("uncond_first_perturbed", 3, (4.5, 2.5))
    assert torch.equal(guide(glue, probe, glue.guidance), noise_pred)
    # the ring passes the scales as a tensor: the same numbers
    assert torch.equal(guide(glue, probe, torch.tensor(glue.guidance)), noise_pred)


def test_pag_alone_is_read_as_pag_at_its_own_scale():
    """cond + s * (cond - perturbed) is also classifier-free guidance at -s, or at s + 1
    with the rows read the other way; the call's own s names the form, bit for bit."""
    probe = _randn(2, 4, 6, seed=1)
    cond, perturbed = probe.chunk(2)
    noise_pred = cond + 2.5 * (cond - perturbed)
    glue = _identify(2, probe, noise_pred, [*CANDIDATES, 3.5])  # 3.5 = s + 1 is on offer
    assert (glue.combine, glue.guidance) == ("perturbed", 2.5)
    assert torch.equal(guide(glue, probe, glue.guidance), noise_pred)


@pytest.mark.parametrize("cond_first", [False, True])
def test_classifier_free_guidance_stays_itself_where_pag_also_fits(cond_first):
    """A guidance of 4 over (cond, uncond) is PAG at 3 over the same rows, and 3 is on
    offer: the pipeline's own form is the one that gives its numbers exactly."""
    probe = _randn(2, 4, 6, seed=1)
    first, second = probe.chunk(2)
    noise_pred = second + 4.0 * (first - second) if cond_first else first + 4.0 * (second - first)
    glue = _identify(2, probe, noise_pred)
    assert glue.combine == ("cond_first" if cond_first else "uncond_first")
    assert glue.guidance == 4.0


def test_scales_not_on_offer_are_fitted():
    probe = _randn(3, 4, 6, seed=1)
    uncond, cond, perturbed = probe.chunk(3)
    noise_pred = uncond + 6.25 * (cond - uncond) + 1.75 * (cond - perturbed)
    glue = _identify(3, probe, noise_pred, [])
    assert glue.combine == "uncond_first_perturbed"
    assert glue.guidance == pytest.approx((6.25, 1.75), rel=1e-6)


def test_an_unknown_combination_of_three_parts_is_refused():
    probe = _randn(3, 4, 6, seed=1)
    uncond, cond, perturbed = probe.chunk(3)
    with pytest.raises(GlueNotFound, match="perturbed-attention guidance"):
        _identify(3, probe, uncond * cond + perturbed)


@pytest.mark.parametrize("before", [True, False])
def test_a_negated_prediction_is_replayed_bit_for_bit(before):
    """HiDream negates the prediction before guidance, Lumina2 and Z-Image after it:
    negation is exact, so the guided prediction negated gives either order's numbers."""
    probe = _randn(2, 4, 6, seed=1)
    uncond, cond = (-probe if before else probe).chunk(2)
    guided = uncond + 4.5 * (cond - uncond)
    noise_pred = guided if before else -guided
    glue = _identify(2, probe, noise_pred)
    assert (glue.combine, glue.guidance, glue.negated) == ("uncond_first", 4.5, True)
    assert torch.equal(guide(glue, probe, glue.guidance), noise_pred)


def test_an_unguided_negated_prediction_of_one_sample_is_replayed():
    """Z-Image without guidance (Turbo's): one sample, the prediction negated; the forms
    that split a batch in two are not tried on one sample."""
    probe = _randn(1, 4, 6, seed=1)
    glue = _identify(1, probe, -probe)
    assert (glue.combine, glue.negated) == ("none", True)
    assert torch.equal(guide(glue, probe, glue.guidance), -probe)


def test_a_prediction_transformed_otherwise_is_refused_and_named():
    """A prediction scaled by a statistic over all tokens is no guidance form, negated or
    not: the refusal names the numbers it tried and what the pipeline may have done."""
    probe = _randn(2, 4, 6, seed=1)
    uncond, cond = probe.chunk(2)
    guided = uncond + 4.5 * (cond - uncond)
    with pytest.raises(GlueNotFound, match=r"defaults to \(20, 4.5, .*negated or not"):
        _identify(2, probe, guided / guided.norm())


def _renormed(cond: torch.Tensor, uncond: torch.Tensor, g: float, clamp: bool) -> torch.Tensor:
    """QwenImage's guidance rescaled to the conditional norm per token, or LongCat's, its
    scale clamped to at most 1 (`enable_cfg_renorm`)."""
    guided = uncond + g * (cond - uncond)
    if not clamp:
        return guided * (torch.norm(cond, dim=-1, keepdim=True) /
                         torch.norm(guided, dim=-1, keepdim=True))
    scale = torch.norm(cond, dim=-1, keepdim=True) / (torch.norm(guided, dim=-1, keepdim=True)
                                                      + 1e-8)
    return guided * scale.clamp(min=0.0, max=1.0)


@pytest.mark.parametrize(("clamp", "form"), [(False, "cond_first_rescaled"),
                                             (True, "cond_first_renormed")])
def test_a_renormalisation_clamped_at_one_is_told_from_one_that_is_not(clamp, form):
    """Two calls a step. On random probes the guided norm exceeds the conditional one at
    every token, where the clamp never acts, and LongCat's clamped form passed for
    QwenImage's (the ring then 4.4e-3 off). The second call's probe sits near the first's
    on every other row, where guidance shrinks the prediction: the clamp shows."""
    from tokpipe_compiler.pipelines.probes import Spec, probe

    spec = Spec((1, 8, 6), torch.float32, torch.device("cpu"))
    cond, uncond = probe(spec, 3, 1), probe(spec, 3, 2)
    sample = _randn(1, 8, 6, seed=0)
    calls = [{"hidden_states": sample, "timestep": T.expand(1)} for _ in range(2)]
    noise_pred = _renormed(cond, uncond, 4.5, clamp)
    glue = identify(calls, [cond, uncond], noise_pred, sample, T, 1.0, CANDIDATES)
    assert (glue.combine, glue.guidance) == (form, 4.5)
    assert torch.equal(guide(glue, torch.cat([cond, uncond]), glue.guidance), noise_pred)
