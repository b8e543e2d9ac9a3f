"""tokpipe_compiler: a torch.compile backend that pipelines diffusion transformers over
token chunks."""

from .api import backend, capture_graphs, explain, programs, reset
from .backend import tokpipe
from .config import Config
from .errors import TokpipeError
from .logs import set_logs
from .plan import Plan
from .ring import Ring
from .simulator import simulate

__all__ = ["Config", "Plan", "Ring", "TokpipeError", "backend", "capture_graphs", "explain",
           "programs", "reset", "set_logs", "simulate", "tokpipe"]
__version__ = "0.1.0"
