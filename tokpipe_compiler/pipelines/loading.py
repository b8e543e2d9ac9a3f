"""Loading diffusers components from local folders, across diffusers releases."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def from_pretrained(cls: Any, path: str | Path, dtype: torch.dtype, **kwargs: Any) -> Any:
    """`cls.from_pretrained(path)` in `dtype`: diffusers names the argument `dtype` since it
    deprecated `torch_dtype` (with a warning on every load); older releases know only
    `torch_dtype`."""
    from diffusers.utils import deprecation_utils

    keyword = "dtype" if hasattr(deprecation_utils, "_resolve_dtype") else "torch_dtype"
    return cls.from_pretrained(path, **{keyword: dtype}, **kwargs)
