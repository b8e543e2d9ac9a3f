"""A latent grid given for a released model is checked against its patches: an odd grid
of a model with 2x2 patches raised deep inside Dynamo (Flux's packed latent was built 52
tokens long with 49 ids), or quietly chunked the text (SD3)."""

import pytest

from tokpipe_compiler.core.errors import TokpipeError
from tokpipe_compiler.released import check_grid, inputs


@pytest.mark.parametrize("name", ["flux1-dev", "sd3-medium"])
def test_an_odd_grid_is_refused_naming_the_patch(name):
    with pytest.raises(TokpipeError, match="multiples of its patch size 2"):
        check_grid(name, (15, 15))


def test_inputs_at_an_odd_grid_are_refused():
    with pytest.raises(TokpipeError, match="multiples of its patch size 2"):
        inputs("flux1-dev", grid=(15, 15))


def test_a_packed_latent_has_a_token_for_each_2x2_patch():
    call = inputs("flux1-dev", grid=(14, 10))
    assert call["hidden_states"].shape[1] == 7 * 5 == call["img_ids"].shape[0]
