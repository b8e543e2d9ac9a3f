"""Diffusers pipelines, pipelined: `parallelize(pipe, **options)`; the token-wise scheduler
updates that ring mode uses (`schedulers`)."""

from tokpipe_compiler.pipelines.marks import programs
from tokpipe_compiler.pipelines.parallel_pipeline import parallelize

__all__ = ["parallelize", "programs"]
