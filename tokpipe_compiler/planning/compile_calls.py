"""Keywords for torch.compile that give one compile call recompile accounting of its own,
where this torch has them (`isolate_recompiles`, `recompile_limit`: newer than 2.6).

By default every torch.compile of one code object shares Dynamo's recompile limit (8), and
diffusers' transformers share one: the forward decorator's wrapper. Compiling a ninth model
or input shape in a process then falls back to running the frame eagerly, unpipelined, and
a graph capture past the limit traces nothing.
"""

from __future__ import annotations

import inspect

import torch

_KEYWORDS = inspect.signature(torch.compile).parameters


def own_recompiles(limit: int | None = None) -> dict[str, object]:
    """torch.compile keywords: this call's entries in a region of their own, with `limit`
    recompiles of its own where given."""
    found: dict[str, object] = {}
    if "isolate_recompiles" in _KEYWORDS:
        found["isolate_recompiles"] = True
        if limit is not None and "recompile_limit" in _KEYWORDS:
            found["recompile_limit"] = limit
    return found
