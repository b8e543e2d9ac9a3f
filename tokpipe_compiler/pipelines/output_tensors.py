"""What the transformer returns besides the prediction, as the ring's first step sees it.

The ring follows one latent: it replays the prediction (the output's first tensor) into
the scheduler's step. A transformer that returns more (LTX-2's audio prediction beside the
video's) has outputs the pipeline uses some other way, which the ring neither carries nor
recomputes: a second output shaped like another of the transformer's float inputs is a
second latent the pipeline steps itself (LTX-2 with a copy of its scheduler), and the
probes' stand-ins for every other output reached the first step's code.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

from tokpipe_compiler.pipelines.probes import Spec


def output_tensors(structure: Any) -> list[Spec]:
    """The tensors of a transformer output's structure (`probes.output_structure`)."""
    return [leaf for leaf in pytree.tree_leaves(structure) if isinstance(leaf, Spec)]


def second_latent(structure: Any, call: dict[str, Any], latent_arg: str) -> str | None:
    """Why the call has a second latent (an output after the first shaped like a float
    input other than `latent_arg`), or None."""
    for spec in output_tensors(structure)[1:]:
        for name, value in call.items():
            if name != latent_arg and isinstance(value, torch.Tensor) and \
                    value.is_floating_point() and tuple(value.shape) == spec.shape:
                return (f"the transformer predicts {name!r} too (an output shaped "
                        f"{spec.shape}): a second latent, which the pipeline steps outside "
                        "the scheduler.step the ring replays (ring mode follows one latent, "
                        f"{latent_arg!r})")
    return None
