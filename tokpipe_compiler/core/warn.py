"""Warnings that point at the user's line.

A tokpipe warning is raised deep inside a pipeline call: in a scheduler hook, a Dynamo
backend, a stage's first run. A fixed `stacklevel` lands in whichever of those frames
happens to be above it (contextlib, Dynamo's eval_frame); `warn` attributes the warning to
the first frame outside this package and the libraries it runs inside.
"""

from __future__ import annotations

import sys
import warnings

# Modules whose frames are never the line the user wrote (the package's own runtime and
# passes load as tokpipe_compiler.runtime and tokpipe_compiler.passes).
_INSIDE = ("tokpipe_compiler", "torch", "diffusers", "transformers", "peft", "accelerate",
           "contextlib", "functools", "logging")


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """warnings.warn, attributed to the innermost frame outside `_INSIDE`."""
    frame, level = sys._getframe(1), 2
    while frame.f_back is not None and _inside(frame.f_globals.get("__name__", "")):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


def _inside(module: str) -> bool:
    return module.split(".", 1)[0] in _INSIDE
