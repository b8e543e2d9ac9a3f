"""A rank's copies of weights that live on another device follow the weights: copied once,
and again after an in-place write, a `.data` swap (LoRA fusing) or a replaced parameter.
The meta device stands in for the rank's GPU; the copy's identity tells a new copy."""

from __future__ import annotations

import gc

import torch

from tests.fixtures.quantized import Int8Weight
from tokpipe_compiler.stage_programs.device_copies import DeviceCopies


def weight() -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.ones(4, 4))


def test_an_unchanged_weight_is_copied_once():
    copies, w = DeviceCopies(torch.device("meta")), weight()
    first = copies.get(w)
    assert first.device.type == "meta" and first.shape == w.shape
    assert copies.get(w) is first


def test_an_in_place_write_makes_a_new_copy():
    copies, w = DeviceCopies(torch.device("meta")), weight()
    first = copies.get(w)
    with torch.no_grad():
        w.mul_(2)
    assert copies.get(w) is not first


def test_a_data_swap_makes_a_new_copy():
    copies, w = DeviceCopies(torch.device("meta")), weight()
    first = copies.get(w)
    w.data = torch.full((4, 4), 3.0)  # how LoRA fusing replaces a weight
    assert copies.get(w) is not first


def test_a_copy_is_a_true_copy_of_the_current_values():
    copies, w = DeviceCopies(torch.device("cpu")), weight()
    copies.get(w)
    w.data = torch.full((4, 4), 3.0)
    assert torch.equal(copies.get(w), w.detach())


def test_copies_of_weights_that_are_gone_are_freed():
    copies = DeviceCopies(torch.device("meta"))
    gone, kept = weight(), weight()  # both alive at once: two ids
    copies.get(gone)
    del gone
    gc.collect()
    copies.get(kept)
    assert len(copies._copies) == 1


def test_a_quantized_weight_written_in_place_makes_a_new_copy():
    """A wrapper subclass has no data pointer of its own: its inner tensors tell."""
    copies = DeviceCopies(torch.device("cpu"))
    w = torch.nn.Parameter(Int8Weight.of(torch.randn(4, 4)), requires_grad=False)
    first = copies.get(w)
    assert copies.get(w) is first
    w.qdata.mul_(2)
    assert copies.get(w) is not first


def test_a_write_through_data_is_seen_after_a_clear():
    """How PEFT fuses a LoRA by default (`weight.data += delta`): no new pointer, no write
    counted on the weight. The program clears its copies at each generation's start."""
    copies, w = DeviceCopies(torch.device("cpu")), weight()
    copies.get(w)
    w.data += 1.0
    copies.clear()
    assert torch.equal(copies.get(w), torch.full((4, 4), 2.0))
