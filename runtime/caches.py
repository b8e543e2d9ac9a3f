"""Per attention layer K/V buffers: allocated on first use, reset per generation."""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

import torch


@dataclass(frozen=True)
class CacheSpec:
    """One attention layer's persistent K/V buffers (full sequence length)."""

    layer: int
    k_name: str
    v_name: str
    k_shape: tuple[int, ...]
    v_shape: tuple[int, ...]
    dtype: torch.dtype
    per_unit: int

    @property
    def bytes(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return itemsize * (prod(self.k_shape) + prod(self.v_shape))




class KVCaches:
    """The K/V caches of the attention layers one process runs.

    `filled` says whether every position holds K/V from an earlier call of this generation;
    until then a chunk may only look at positions this call has already written.
    """

    def __init__(self, specs: list[CacheSpec]):
        self.specs = specs
        self.buffers: dict[str, torch.Tensor] = {}
        self.filled = False

    def tensors(self, device: torch.device) -> dict[str, torch.Tensor]:
        if not self.buffers:
            for spec in self.specs:
                self.buffers[spec.k_name] = torch.zeros(spec.k_shape, dtype=spec.dtype,
                                                        device=device)
                self.buffers[spec.v_name] = torch.zeros(spec.v_shape, dtype=spec.dtype,
                                                        device=device)
        return self.buffers

    def reset(self) -> None:
        """A new generation: forget every K/V (buffers are freed, not silently reused)."""
        self.buffers.clear()
        self.filled = False

    @property
    def bytes(self) -> int:
        return sum(spec.bytes for spec in self.specs)
