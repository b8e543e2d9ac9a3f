"""tokpipe_compiler: a torch.compile backend that pipelines diffusion transformers over
token chunks."""

from tokpipe_compiler import pipelines
from tokpipe_compiler.api import backend, capture_graphs, explain, programs, reset
from tokpipe_compiler.backend import tokpipe
from tokpipe_compiler.config import Config
from tokpipe_compiler.core.errors import TokpipeError
from tokpipe_compiler.core.logs import set_logs
from tokpipe_compiler.planning.plan import Plan
from tokpipe_compiler.ring import Ring

__all__ = ["Config", "Plan", "Ring", "TokpipeError", "backend", "capture_graphs", "explain",
           "pipelines", "programs", "reset", "set_logs", "simulate", "tokpipe"]
__version__ = "0.1.0"


def simulate(plan, device="h200", link="nvlink4", world=None, steps=20):
    """Predicted serial and pipelined times of a plan on preset devices and links (see
    tokpipe_compiler.costmodel.simulator.simulate; imported on use so `python -m` runs it
    cleanly)."""
    from tokpipe_compiler.costmodel.simulator import simulate as run

    return run(plan, device, link, world, steps)
