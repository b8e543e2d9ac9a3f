"""Perturbed-attention guidance pipelines between calls: they swap their attention
processors at each call, for other classes when the guidance turns on or off; the ring
traces anew then and says which processors changed, and equals the serial pipeline (sync,
within 1e-5 relative, float32)."""

from __future__ import annotations

import warnings

import pytest

from tests.fixtures.perturbed import PERTURBED
from tests.fixtures.pipelines import generate, parallelized
from tests.fixtures.tracing import rel_error

pytest.importorskip("diffusers")


def test_guidance_turned_off_names_the_processors_swapped():
    make = PERTURBED["pixart_sigma_pag"]
    serial, kwargs = make()
    pipe, _ = parallelized(make, mode="sync")
    generate(pipe, kwargs, steps=3)
    unguided = {**kwargs, "guidance_scale": 1.0}
    with pytest.warns(UserWarning, match=r"changed since its rings were traced \(in "
                                         r"transformer_blocks\.1\.attn1; attention processors "
                                         r"swapped, transformer_blocks\.1\.attn1: "
                                         r"PAGCFGIdentitySelfAttnProcessor2_0 -> "
                                         r"PAGIdentitySelfAttnProcessor2_0\)"):
        out = generate(pipe, unguided, steps=3)
    assert rel_error(out, generate(serial, unguided, steps=3)) <= 1e-5


def test_pag_turned_on_and_off_traces_each_form_once():
    """pag_scale=0 puts the original processors back; PAG's come back at the next call.
    Each switch traced and compiled anew; now the rings of the form before are kept aside
    (the weights are the same) and taken back."""
    make = PERTURBED["sd3_pag"]
    serial, kwargs = make()
    pipe, _ = parallelized(make, mode="sync")
    calls = [kwargs, {**kwargs, "pag_scale": 0.0}] * 3
    traced_anew = []
    for call in calls:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = generate(pipe, call, steps=2)
        traced_anew.append(any("changed since its rings were traced" in str(w.message)
                               for w in caught))
        assert rel_error(out, generate(serial, call, steps=2)) <= 1e-5
    assert traced_anew == [False, True, False, False, False, False]
