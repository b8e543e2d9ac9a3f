"""Per layer persistent buffers: the K/V of each attention layer and the per-unit partial
sums of each sum over tokens (`runtime/token_sums.py`); allocated on first use, reset per
generation."""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import NamedTuple

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
    lead: int = 0  # tokens before the chunked ones (joint attention's text, a start token)
    trail: int = 0  # tokens after them
    causal: bool = False  # is_causal: a chunk reads keys of its own and earlier chunks only

    @property
    def bytes(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return itemsize * (prod(self.k_shape) + prod(self.v_shape))

    @property
    def names(self) -> tuple[str, ...]:
        return (self.k_name, self.v_name)

    def buffers(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        return [(self.k_name, self.k_shape, self.dtype), (self.v_name, self.v_shape, self.dtype)]


@dataclass(frozen=True)
class SumCacheSpec:
    """One sum over tokens' persistent partial sums: [units, *one unit's partial]; or,
    for a convolution across rows (`rows`), its input rows: [units, *one unit's rows]."""

    layer: int
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    rows: bool = False

    @property
    def bytes(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size() * prod(self.shape)

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name,)

    def buffers(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        return [(self.name, self.shape, self.dtype)]


AnyCacheSpec = CacheSpec | SumCacheSpec


class KVCaches:
    """The K/V caches (and partial-sum caches) of the layers one process runs.

    `filled` says whether every position holds K/V from an earlier call of this generation;
    until then a chunk may only look at positions this call has already written.
    """

    def __init__(self, specs: list[AnyCacheSpec]):
        self.specs = specs
        self.buffers: dict[str, torch.Tensor] = {}
        self.filled = False

    def tensors(self, device: torch.device) -> dict[str, torch.Tensor]:
        if not self.buffers:
            for spec in self.specs:
                for name, shape, dtype in spec.buffers():
                    # zeros: a partial sum never written this generation adds nothing
                    self.buffers[name] = torch.zeros(shape, dtype=dtype, device=device)
        return self.buffers

    def reset(self) -> None:
        """A new generation: forget every K/V (buffers are freed, not silently reused)."""
        self.buffers.clear()
        self.filled = False

    def restart(self) -> None:
        """A new generation in the same buffers, zeroed (for CUDA graphs, which read and
        write them where they were captured)."""
        for buffer in self.buffers.values():
            buffer.zero_()
        self.filled = False

    @property
    def bytes(self) -> int:
        return sum(spec.bytes for spec in self.specs)


class Released(NamedTuple):
    """What a generation's K/V buffers held when `end_generation` freed them."""

    held: dict[str, int]  # bytes per buffer name, over every guidance branch
    branches: int
    device: torch.device


def held_bytes(branches: dict[int, KVCaches]) -> dict[str, int]:
    """Bytes of each cache buffer, summed over the guidance branches' sets."""
    held: dict[str, int] = {}
    for caches in branches.values():
        for name, tensor in caches.buffers.items():
            held[name] = held.get(name, 0) + tensor.numel() * tensor.element_size()
    return held
