"""The ambient `torch.autocast` state: what a graph traced, planned or run under it depends
on besides its inputs (the dtypes of its values, and so of the K/V caches and messages)."""

from __future__ import annotations

import torch

# The device types whose autocast a call on this machine's devices may run under.
DEVICE_TYPES = ("cpu", "cuda")


def autocast_state() -> tuple[tuple[str, torch.dtype], ...]:
    """(device type, dtype) of each device type whose autocast is on; () when none is."""
    return tuple((device, torch.get_autocast_dtype(device)) for device in DEVICE_TYPES
                 if torch.is_autocast_enabled(device))


def describe(state: tuple[tuple[str, torch.dtype], ...]) -> str:
    """`torch.autocast("cpu", dtype=torch.bfloat16)`, for a message."""
    return ", ".join(f'torch.autocast("{device}", dtype={dtype})' for device, dtype in state)
