"""tokpipe_compiler: a torch.compile backend that pipelines diffusion transformers over
token chunks."""

from .api import backend, capture_graphs, explain, programs, reset
from .backend import tokpipe
from .config import Config
from .errors import TokpipeError
from .logs import set_logs
from .plan import Plan
from .ring import Ring

__all__ = ["Config", "Plan", "Ring", "TokpipeError", "backend", "capture_graphs", "explain",
           "programs", "reset", "set_logs", "simulate", "tokpipe"]
__version__ = "0.1.0"


def simulate(plan, device="h200", link="nvlink4", world=None, steps=20):
    """Predicted serial and pipelined times of a plan on preset devices and links (see
    tokpipe_compiler.simulator.simulate; imported on use so `python -m` runs it cleanly)."""
    from .simulator import simulate as run

    return run(plan, device, link, world, steps)
