"""The per-call prelude as the runtime calls it: the work every chunk shares (timestep and
text conditioning, per-layer modulation, positional tables), run once per step.

Under the `inductor` stage compiler it is compiled too, lazily at its first call with that
call's inputs as examples. Left eager, it would launch one kernel per op: for a 28-block
DiT that is hundreds of launches a step (each block's text K/V projections and modulation
live here), where the serial model compiles them with the rest.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

import torch.fx

from tokpipe_compiler.programs.compile import compile_stage


class Prelude:
    """`gm` (returning the values named `outputs`) compiled by `compiler` on first call.

    A prelude Inductor cannot compile runs eagerly from then on, with a warning.
    """

    def __init__(self, gm: torch.fx.GraphModule, outputs: list[str], compiler: str):
        self.gm = gm
        self.outputs = outputs
        self.compiler = compiler
        self._fn: Callable[..., Sequence] | None = gm if compiler == "eager" else None

    def __call__(self, *args) -> dict:
        """The prelude's values by name."""
        if self._fn is None:
            self._fn = self._compiled(list(args))
        return dict(zip(self.outputs, self._fn(*args), strict=True))

    def _compiled(self, args: list) -> Callable[..., Sequence]:
        if not self.outputs:
            return self.gm
        try:
            return compile_stage(self.gm, args, self.compiler)
        except Exception as e:
            warnings.warn(f"tokpipe: the per-call prelude runs eagerly: inductor could not "
                          f"compile it ({type(e).__name__}: {str(e)[:200]})", stacklevel=3)
            return self.gm
