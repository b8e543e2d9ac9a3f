"""Bytes a tensor holds in memory, quantized weights included."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass


def storage_bytes(tensor: torch.Tensor) -> int:
    """numel x element size, or for a wrapper subclass (torchao's quantized weights: int8
    or float8 data with their scales, which report the dtype they compute in) the sum of
    its inner tensors' bytes."""
    if is_traceable_wrapper_subclass(tensor):
        names, _ = tensor.__tensor_flatten__()
        return sum(storage_bytes(getattr(tensor, name)) for name in names)
    return tensor.numel() * tensor.element_size()
