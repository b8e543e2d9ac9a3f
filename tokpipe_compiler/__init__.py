"""tokpipe_compiler: a torch.compile backend that pipelines diffusion transformers over token chunks."""

from .config import Config
from .errors import TokpipeError

__all__ = ["Config", "TokpipeError"]
__version__ = "0.1.0"
