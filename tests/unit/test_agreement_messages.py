"""What `check_agreement` tells ranks whose fingerprints differ: what differs, and what to
do about it, in the caller's terms."""

from __future__ import annotations

import copy

import pytest

from tokpipe_compiler.core.errors import TokpipeError
from tokpipe_compiler.stage_programs.agreement import check_agreement


def _fingerprint() -> dict:
    """A fingerprint as `agreement.fingerprint` makes one (a ring's carried latents)."""
    return {"options": {"chunks": "2"},
            "plan": {"stages": 2, "units": 4, "tokens": 16, "chunks": [2, 2],
                     "token input": "sample", "graphs": "1a2b"},
            "inputs": {"sample": "(1, 4, 8, 8) float32", "timestep": "(1,) float32"},
            "weights": "0c0c", "token": "sample",
            "checksums": {"sample": "aaaa", "timestep": "bbbb"}}


def test_other_input_shapes_are_not_blamed_on_the_weights():
    """A buffer sized by the inputs (a positional table) differs with the input shapes: the
    error named the weights too, sending the reader to the checkpoint."""
    other = copy.deepcopy(_fingerprint())
    other["inputs"]["sample"] = "(1, 4, 16, 8) float32"
    other["weights"] = "0d0d"
    with pytest.raises(TokpipeError) as raised:
        check_agreement([_fingerprint(), other], "a generation's first call")
    assert "input 'sample'" in str(raised.value)
    assert "weights" not in str(raised.value)


def test_weights_that_differ_alone_are_named():
    """With adapters named: disable_lora() on one rank drops the adapters' weights from
    its graphs, which the error told as shapes or dtypes that differ."""
    other = {**_fingerprint(), "weights": "0d0d"}
    with pytest.raises(TokpipeError, match=r"weights: the parameters or buffers the graphs "
                                           r"read differ between ranks in number, shape or "
                                           r"dtype .*disable_lora"):
        check_agreement([_fingerprint(), other], "a generation's first call")


def test_latents_of_another_seed_name_the_pipelines_generator():
    """The hint named torch.manual_seed alone, which a pipeline called with generator=
    does not read."""
    other = copy.deepcopy(_fingerprint())
    other["checksums"]["sample"] = "cccc"
    with pytest.raises(TokpipeError, match=r"generator=torch\.Generator\(\)\.manual_seed"):
        check_agreement([_fingerprint(), other], "a generation's first call")


def test_graphs_that_differ_say_what_makes_them_differ():
    """A guidance scale read from a global, another on each rank: the hash alone sent
    the reader to the model."""
    other = copy.deepcopy(_fingerprint())
    other["plan"]["graphs"] = "3c4d"
    with pytest.raises(TokpipeError, match=r"plan 'graphs'.*\n.*a global or closure value"):
        check_agreement([_fingerprint(), other], "a generation's first call")
