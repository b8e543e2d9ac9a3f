"""tokpipe_compiler: a torch.compile backend that pipelines diffusion transformers over
token chunks."""

from tokpipe_compiler import pipelines
from tokpipe_compiler.api import backend, capture_graphs, explain, programs, reset
from tokpipe_compiler.config import Config
from tokpipe_compiler.core.errors import PeerStopped, TokpipeError
from tokpipe_compiler.core.logs import set_logs
from tokpipe_compiler.dynamo_backend import tokpipe
from tokpipe_compiler.pipelines import parallelize
from tokpipe_compiler.planning.plan import Plan
from tokpipe_compiler.ring import Ring

__all__ = ["Config", "PeerStopped", "Plan", "Ring", "TokpipeError", "backend", "capture_graphs",
           "explain", "parallelize", "pipelines", "programs", "reset", "set_logs", "simulate",
           "tokpipe"]
__version__ = "0.1.0"


def simulate(plan, device="h200", link="nvlink4", world=None, steps=20):
    """Predicted serial and pipelined times of `steps` steps of `plan` (from explain()) on
    one `device` a stage ("h200", "a100-pcie", "l20", "cpu" or a DeviceModel) joined by
    `link` ("nvlink4", "pcie4", "pcie4-no-p2p" or a LinkModel), in the plan's dtype.

    Counts each stage's kernels per chunk, the warmup steps and the stale ring, and sends
    overlapping compute; leaves out the work outside the transformer, memory, and the
    host's time (kernel launches, the runtime's bookkeeping), which `tokpipe inspect --for`
    adds: that predicts more time where the host bounds small chunks. See
    tokpipe_compiler.costmodel.simulator.simulate (imported on use so `python -m` runs it
    cleanly)."""
    from tokpipe_compiler.costmodel.simulator import simulate as run

    return run(plan, device, link, world, steps)
