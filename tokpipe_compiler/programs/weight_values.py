"""The values of a program's parameters as a short digest each, which the ranks compare at
each generation's start (`agreement`). Ranks that hold other values (a model initialised at
random without one seed per process, another checkpoint, a LoRA fused on one rank only)
would each run their stages with their own and return one mixed model's output, silently.

A digest is the parameter's float64 sum to 6 significant digits, hashed to 16 bits: equal
weights give equal sums on any device to far better than that, while weights that differ
(a random init) differ in the first digits. Sums run on the weights' own device, one host
transfer per device, and only when a parameter has changed since (its data or version).
"""

from __future__ import annotations

import zlib
from collections import defaultdict

import torch

from tokpipe_compiler.programs.device_copies import tensor_stamp

# Past this many parameters the per-parameter digests would crowd the fingerprint's fixed
# size: one digest of them all is compared instead (naming no parameter).
NAMED_UP_TO = 2000


class WeightValues:
    """The digests of one program's parameters, kept until one of them changes."""

    def __init__(self) -> None:
        self._stamps: tuple = ()
        self._digest = ""
        self.names: list[str] = []  # the parameters' graph inputs, in digest order

    def digest(self, weights: dict[str, torch.Tensor]) -> str:
        """Four hex digits per parameter of `weights` (graph input name -> tensor; tensors
        that are not parameters, buffers the model may fill at run time, are left out)."""
        params = {name: w for name, w in weights.items() if isinstance(w, torch.nn.Parameter)}
        stamps = tuple((id(w), tensor_stamp(w)) for w in params.values())
        if stamps != self._stamps:
            self._stamps, self._digest = stamps, _digest(list(params.values()))
            self.names = list(params)
        return self._digest


def first_differing(digests: list[str]) -> int | None:
    """The index of the first parameter whose digest differs between ranks (None: all
    alike, or too many parameters to name one)."""
    if any(len(d) != len(digests[0]) for d in digests) or len(digests[0]) % 4:
        return None
    for i in range(0, len(digests[0]), 4):
        if len({d[i : i + 4] for d in digests}) > 1:
            return i // 4
    return None


def _digest(params: list[torch.Tensor]) -> str:
    sums = _sums(params)
    each = "".join(f"{zlib.crc32(f'{s:.6e}'.encode()) & 0xFFFF:04x}" for s in sums)
    return each if len(params) <= NAMED_UP_TO else f"{zlib.crc32(each.encode()):08x}"


def _sums(params: list[torch.Tensor]) -> list[float]:
    """Each parameter's float64 sum (a quantized one's: its inner tensors'), computed on
    its device, brought to the host once per device."""
    by_device: dict[torch.device, list[tuple[int, torch.Tensor]]] = defaultdict(list)
    for i, param in enumerate(params):
        if param.device.type == "meta":  # no values: alike on every rank
            continue
        total = sum((part.sum(dtype=torch.float64) for part in _parts(param.detach())),
                    torch.zeros((), dtype=torch.float64, device=param.device))
        by_device[param.device].append((i, total))
    sums = [0.0] * len(params)
    for entries in by_device.values():
        values = torch.stack([total for _, total in entries]).cpu().tolist()
        for (i, _), value in zip(entries, values, strict=True):
            sums[i] = value
    return sums


def _parts(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors that hold `tensor`'s data (a wrapper subclass's inner ones)."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if not is_traceable_wrapper_subclass(tensor):
        return [tensor]
    names, _ = tensor.__tensor_flatten__()
    return [part for name in names for part in _parts(getattr(tensor, name))]
