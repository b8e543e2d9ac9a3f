"""compile: a specialised stage graph becomes something to call, lazily and per chunk length.

`eager` runs the FX graph as is (tests, debugging); `inductor` goes through compile_fx on
the first call, with that call's real inputs as examples, so only the stages a rank runs
are ever compiled; `max-autotune` does so with Inductor's max-autotune options (CUDA
graphs are the runtime's own, per chunk: the `cuda_graphs` option).
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch._guards import TracingContext, tracing

from tokpipe_compiler.core.errors import TokpipeError

log = logging.getLogger("tokpipe_compiler")

StageFn = Callable[..., Sequence[torch.Tensor]]

# A compile this long makes a call's latency worth explaining: at length once a process,
# then in a line for each later run of compiles (a new shape), which starts after a pause
# of this long without compiling.
SLOW_COMPILE_S = 10.0
PAUSE_S = 5.0


@dataclass
class _Notes:
    explained: bool = False  # the long note has been given (once a process)
    run_noted: bool = False  # the current run of compiles has had its line
    last_end: float = -math.inf  # when the last compile ended (perf_counter)


_notes = _Notes()


def compile_stage(gm: torch.fx.GraphModule, example_inputs: list, compiler: str) -> StageFn:
    if compiler == "eager":
        return gm
    from torch._inductor import config, list_mode_options
    from torch._inductor.compile_fx import compile_fx

    patches = {} if compiler == "inductor" else list_mode_options("max-autotune-no-cudagraphs")
    fake_mode, examples = _as_dynamo_hands_them(example_inputs)
    with torch.no_grad(), config.patch(patches), tracing(TracingContext(fake_mode)):
        return compile_fx(gm, examples)


def compile_named(what: str, gm: torch.fx.GraphModule, example_inputs: list,
                  compiler: str) -> StageFn:
    """`compile_stage`, logged with its time (INFO); a slow compile says why a call takes
    long (a pipeline compiles each stage at each chunk length at the first call that
    needs it, and nothing else would say so): at length the first time in a process, then
    in a line at the first slow compile of each later run of compiles."""
    if compiler == "eager":
        return gm
    log.info("compiling %s with Inductor (%s)", what, compiler)
    start = time.perf_counter()
    if start - _notes.last_end > PAUSE_S:  # a new run of compiles: a new shape, say
        _notes.run_noted = False
    fn = compile_stage(gm, example_inputs, compiler)
    _notes.last_end = time.perf_counter()
    seconds = _notes.last_end - start
    log.info("compiled %s in %.1f s", what, seconds)
    if seconds >= SLOW_COMPILE_S and not _notes.run_noted:
        _notes.run_noted = True
        with _between_progress_bars():
            log.warning(_slow_note(what, seconds, first=not _notes.explained))
        _notes.explained = True
    return fn


def _slow_note(what: str, seconds: float, first: bool) -> str:
    """What a slow compile says: why at length the first time, in a line later."""
    if not first:
        return (f"tokpipe: compiling with Inductor: {what} took {seconds:.0f} s (a first "
                "call at a new input shape or chunk length); this call goes on compiling "
                "the stages it needs")
    return (f"tokpipe: compiling with Inductor: {what} took {seconds:.0f} s (a process's "
            "first Inductor compile includes Inductor's own start-up, about 10 s on a small "
            "CPU). Each stage is compiled once per chunk length and input shape, at the "
            "first call that needs it, so this call goes on compiling the stages, and a "
            "first call at a new shape compiles too (said in a line); later calls reuse "
            "the code, and Inductor's cache shortens later processes' compiles. "
            "TOKPIPE_LOGS=tokpipe logs each compile; compiler='eager' skips them (slower "
            "steps)")

def _between_progress_bars() -> contextlib.AbstractContextManager:
    """Output on a line of its own while a progress bar (the ring's, the pipeline's) is
    drawn: the bars are cleared and redrawn around it."""
    try:
        from tqdm import tqdm
    except ImportError:
        return contextlib.nullcontext()
    return tqdm.external_write_mode(file=sys.stderr)


def _as_dynamo_hands_them(example_inputs: list) -> tuple[Any, list]:
    """A fake mode with a shape environment and the inputs as its static fake tensors, as
    Dynamo hands a backend its graph: Inductor's FX graph cache keys on the shape
    environment and bypasses a compile without one ("No shape env"), so every process
    compiled every stage anew."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    mode = FakeTensorMode(shape_env=ShapeEnv())
    return mode, [mode.from_tensor(x, static_shapes=True) if isinstance(x, torch.Tensor) else x
                  for x in example_inputs]


def compile_failed(what: str, compiler: str, err: BaseException) -> TokpipeError:
    """Inductor's failure on `what`, in a line that names it and the way around (its own
    error, often pages of compiler output, stays chained)."""
    return TokpipeError(f"Inductor ({compiler!r}) could not compile {what}: {gist(err)}. "
                        "compiler='eager' runs the stage graphs as traced (the same answer, "
                        "slower); the compiler's whole error is chained above")


def gist(err: BaseException, limit: int = 300) -> str:
    """An error's first line and its first compiler 'error:' line, at most `limit` long."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    found = [line for line in lines[1:] if "error:" in line.lower()][:1]
    return "; ".join([f"{type(err).__name__}: {lines[0] if lines else ''}", *found])[:limit]
