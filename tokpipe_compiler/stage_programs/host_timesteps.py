"""A call's timestep read on the host without waiting for the device, where it can be.

The runtime reads each call's timestep on the host to tell steps and generations apart
(generations.StepClock). Reading a device tensor waits for everything queued before it,
so the host cannot launch a step's work while the device still runs the last one. But a
pipeline passes the same tensor every step, viewed: `t.expand(batch)` of an element `t`
of its scheduler's timesteps. That tensor (the view's base) is copied to the host once
(one wait) and each later view is read from the copy. The copy is dropped when the base
is written in place (its version counter moves) or freed (held by a weak reference); any
other timestep (a fresh tensor, `t / 1000`) is read as before.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

# A base with more elements than this is not a schedule's timesteps: not copied.
MAX_BASE_ELEMENTS = 4096


class HostTimesteps:
    """Reads timesteps (a tensor's largest value: guidance batches repeat one), keeping the
    host copy of the last base a view came from."""

    def __init__(self) -> None:
        self._base: weakref.ref | None = None
        self._version = -1
        self._host: torch.Tensor | None = None
        self.copies = 0  # bases copied to the host (for tests)

    def value(self, timestep: Any) -> float | None:
        if not isinstance(timestep, torch.Tensor):
            return float(timestep) if isinstance(timestep, (int, float)) else None
        if not timestep.numel():
            return None
        host = self._host_view(timestep)
        return float((timestep if host is None else host).max())

    def _host_view(self, view: torch.Tensor) -> torch.Tensor | None:
        """`view`'s values from the host copy of its base; None where there is none."""
        base = view._base
        if base is None or not base.is_contiguous() or base.numel() > MAX_BASE_ELEMENTS:
            return None
        try:
            version = base._version
        except RuntimeError:  # an inference tensor tracks no version: writes go unseen
            return None
        if self._base is None or self._base() is not base or version != self._version:
            # a copy even of a CPU base: holding the base itself would keep it alive
            self._host = base.detach().to("cpu", copy=True).flatten()
            self._base, self._version = weakref.ref(base), version
            self.copies += 1
        offset = view.storage_offset() - base.storage_offset()
        return self._host.as_strided(view.shape, view.stride(), offset)
