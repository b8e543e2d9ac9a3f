"""compile: a specialised stage graph becomes something to call, lazily and per chunk length.

`eager` runs the FX graph as is (tests, debugging); `inductor` goes through compile_fx on
the first call, with that call's real inputs as examples, so only the stages a rank runs
are ever compiled; `max-autotune` does so with Inductor's max-autotune options (CUDA
graphs are the runtime's own, per chunk: the `cuda_graphs` option).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
import torch.fx

log = logging.getLogger("tokpipe_compiler")

StageFn = Callable[..., Sequence[torch.Tensor]]


def compile_stage(gm: torch.fx.GraphModule, example_inputs: list, compiler: str) -> StageFn:
    if compiler == "eager":
        return gm
    from torch._inductor import config, list_mode_options
    from torch._inductor.compile_fx import compile_fx

    patches = {} if compiler == "inductor" else list_mode_options("max-autotune-no-cudagraphs")
    log.info("compiling %s with inductor%s", type(gm).__name__, f" ({compiler})" * bool(patches))
    with torch.no_grad(), config.patch(patches):
        return compile_fx(gm, example_inputs)
