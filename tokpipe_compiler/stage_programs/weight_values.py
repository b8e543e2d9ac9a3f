"""The values of a program's parameters as a short digest each, which the ranks compare at
each generation's start (`agreement`). Ranks that hold other values (a model initialised at
random without one seed per process, another checkpoint, a LoRA fused on one rank only)
would each run their stages with their own and return one mixed model's output, silently.

A digest reads a sample of the parameter, up to SAMPLE evenly spaced values (all of a
smaller one), made anew at each generation's first agreement: a write through `.data`, as
peft's LoRA fusing makes, moves no version counter, so nothing cheaper tells that a
parameter changed. The sample's bit patterns are summed as integers, plain and weighted by
position (a reordering moves the second), hashed to 16 bits: integer sums are exact in
any order, so equal weights give equal digests on any device, and any change to a sampled
value shows. A change to values outside the sample of a large weight can pass.
"""

from __future__ import annotations

import zlib
from collections import defaultdict

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

SAMPLE = 1 << 14  # values read of each parameter
# Past this many parameters the per-parameter digests would crowd the fingerprint's fixed
# size: one digest of them all is compared instead (naming no parameter).
NAMED_UP_TO = 2000


class WeightValues:
    """The digests of one program's parameters, made once a generation, and their names."""

    def __init__(self) -> None:
        self.names: list[str] = []  # the parameters' graph inputs, in digest order
        self.stale = True  # a new generation: the next digest reads the weights again
        self._last = ""

    def digest(self, weights: dict[str, torch.Tensor]) -> str:
        """Four hex digits per parameter of `weights` (graph input name -> tensor; tensors
        that are not parameters, buffers the model may fill at run time, are left out); the
        generation's first, where it has one (its later calls and ring runs compare it)."""
        if not self.stale:
            return self._last
        params = {name: w for name, w in weights.items() if isinstance(w, torch.nn.Parameter)}
        self.names = list(params)
        each = "".join(f"{zlib.crc32(f'{a} {b}'.encode()) & 0xFFFF:04x}"
                       for a, b in _sums(list(params.values())))
        self._last = each if len(params) <= NAMED_UP_TO else f"{zlib.crc32(each.encode()):08x}"
        self.stale = False
        return self._last


def first_differing(digests: list[str], parameters: int) -> int | None:
    """The index of the first of `parameters` whose digest differs between ranks (None: all
    alike, or digests that name no parameter: one of them all)."""
    if any(len(d) != 4 * parameters for d in digests):
        return None
    for i in range(0, 4 * parameters, 4):
        if len({d[i : i + 4] for d in digests}) > 1:
            return i // 4
    return None


def _sums(params: list[torch.Tensor]) -> list[tuple[int, int]]:
    """Each parameter's sample's sums of bits (plain, weighted by position; a quantized
    one's: its inner tensors'). Samples of one device, dtype and length are summed as one
    stack, so a model's hundreds of parameters take a few kernels and host transfers."""
    groups: dict[tuple, list[tuple[int, torch.Tensor]]] = defaultdict(list)
    for i, param in enumerate(params):
        if param.device.type == "meta":  # no values: alike on every rank
            continue
        for part in _parts(param.detach()):
            sample = _sample(part)
            groups[sample.device, sample.dtype, len(sample)].append((i, sample))
    sums = [(0, 0)] * len(params)
    for (device, _, length), entries in groups.items():
        bits = _bits(torch.stack([sample for _, sample in entries]))
        # weights under 2**10: 32-bit patterns times them sum within int64, unwrapped
        weighted = bits * (torch.arange(length, device=device) % 1021)
        pairs = torch.stack([bits.sum(1), weighted.sum(1)], 1).cpu().tolist()
        for (i, _), (plain, by_position) in zip(entries, pairs, strict=True):
            sums[i] = (sums[i][0] + plain, sums[i][1] + by_position)
    return sums


def _sample(tensor: torch.Tensor) -> torch.Tensor:
    """Up to SAMPLE evenly spaced values of `tensor`, flat (a view where it is contiguous)."""
    flat = tensor.reshape(-1)
    return flat[:: max(1, flat.numel() // SAMPLE)][:SAMPLE]


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(values: torch.Tensor) -> torch.Tensor:
    """`values`' bit patterns as int64, row by row (int64 sums wrap alike everywhere)."""
    if values.dtype == torch.bool:
        values = values.to(torch.uint8)
    if values.is_complex():
        values = torch.view_as_real(values).flatten(1)
    return values.view(_BITS[values.element_size()]).to(torch.int64)


def _parts(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors that hold `tensor`'s data (a wrapper subclass's inner ones)."""
    if not is_traceable_wrapper_subclass(tensor):
        return [tensor]
    names, _ = tensor.__tensor_flatten__()
    return [part for name in names for part in _parts(getattr(tensor, name))]
