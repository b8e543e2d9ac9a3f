"""A rank's copies of the weights it reads from another device (a model every rank moved to
GPU 0): made at a generation's first use, and again within it when the weight changes.
Dropped at each generation's start: a LoRA fused between generations writes through
`weight.data`, which neither moves the weight nor counts as a write to it."""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass


class DeviceCopies:
    """Parameters copied to `device`, each kept until its tensor changes: another object
    at the same id, other storage (`weight.data = fused`, as LoRA fusing does) or an
    in-place write through the parameter (its version counter moves)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._copies: dict[int, tuple[weakref.ref, tuple[int, ...], torch.Tensor]] = {}

    def clear(self) -> None:
        """Every copy dropped: the next `get` copies anew."""
        self._copies.clear()

    def get(self, weight: torch.nn.Parameter) -> torch.Tensor:
        stamp = _stamp(weight)
        held = self._copies.get(id(weight))
        if held is not None and held[0]() is weight and held[1] == stamp:
            return held[2]
        # copies of weights that are gone (replaced modules) free their device memory
        self._copies = {key: entry for key, entry in self._copies.items()
                        if entry[0]() is not None}
        copy = weight.detach().to(self.device)
        self._copies[id(weight)] = (weakref.ref(weight), stamp, copy)
        return copy


def _stamp(tensor: torch.Tensor) -> tuple[int, ...]:
    """Where a tensor's data lives and how often it was written; for a wrapper subclass (a
    quantized weight, whose own pointer is 0), its inner tensors' too."""
    stamp = (tensor.data_ptr(), tensor._version)
    if is_traceable_wrapper_subclass(tensor):
        names, _ = tensor.__tensor_flatten__()
        stamp += tuple(part for name in names for part in _stamp(getattr(tensor, name)))
    return stamp
