"""The public functions besides the backend: explain(), reset(), programs()."""

from __future__ import annotations

import functools
from collections import deque
from typing import Any

import torch

from tokpipe_compiler.config import Config
from tokpipe_compiler.core.errors import NothingToPipeline, NoTokenInput, TokpipeError
from tokpipe_compiler.core.fx import argument_of, source_name
from tokpipe_compiler.dynamo_backend import LazyProgram, TokpipeBackend
from tokpipe_compiler.passes.token_input import UnknownTokenInput
from tokpipe_compiler.planning.capture import capture
from tokpipe_compiler.planning.driver import build_plan
from tokpipe_compiler.planning.graph_tail import plan_with_tail
from tokpipe_compiler.planning.pieces import Origin, plan_piece
from tokpipe_compiler.planning.plan import Plan
from tokpipe_compiler.planning.timestep_checks import check_timestep_input
from tokpipe_compiler.planning.traced_frame import signature_names
from tokpipe_compiler.stage_programs.compile_sessions import CompileSessions, sessions_for_options
from tokpipe_compiler.stage_programs.owners import programs_of as owned_programs
from tokpipe_compiler.stage_programs.pipelined import PipelinedProgram, made_order

# Attributes that lead from a torch.compile'd module to the backend Dynamo holds.
_LINKS = ("dynamo_ctx", "callback", "_torchdynamo_orig_backend", "_torchdynamo_orig_callable",
          "_inner_convert", "compiler_fn")


def backend(**options: Any) -> TokpipeBackend:
    """The tokpipe backend as a callable, options validated now:
    `torch.compile(model, backend=tokpipe_compiler.backend(stages=2, chunks=4))`."""
    return TokpipeBackend(**options)


def reset(compiled: Any) -> None:
    """Start a new generation: every K/V cache of `compiled` is dropped and warmup reruns.

    `compiled`: what torch.compile returned, a module compiled in place (`model.compile()`),
    a backend made by `backend(...)`, or a parallelized pipeline or its transformer (whose
    calls each start afresh: this drops what its per-call steps hold). A generation also
    starts by itself when the timestep goes back up (see README, "Generations").
    """
    from tokpipe_compiler.pipelines.marks import reset_parallelized

    if reset_parallelized(compiled):
        return
    for program in programs(compiled):
        program.reset()


def programs(compiled: Any) -> list[PipelinedProgram]:
    """The pipelined programs behind `compiled` (one per Dynamo graph planned so far, the
    first planned first), each with its `plan` and the `timeline` of its calls."""
    if isinstance(compiled, PipelinedProgram):
        return [compiled]
    from tokpipe_compiler.pipelines import marks  # which imports this module

    if hasattr(compiled, marks.RING) or hasattr(compiled, marks.FRESH):
        return marks.programs(compiled)  # a parallelized pipeline's
    if isinstance(compiled, (TokpipeBackend, LazyProgram)):
        return sorted(compiled.session.programs, key=made_order)
    module = getattr(compiled, "_orig_mod", compiled)
    found = _find_sessions(compiled)
    owned = owned_programs(module) if isinstance(module, torch.nn.Module) else []
    # This model's, not another's of the same class; and of this torch.compile call (or
    # the call with equal options whose graphs Dynamo served it from), not of a compile of
    # the same model with other options.
    mine = [p for p in owned if found is None or p.session in found.every]
    if mine:
        return sorted(mine, key=made_order)
    if found is None:
        raise TokpipeError(
            f"found no tokpipe program behind {type(compiled).__name__}: pass what "
            "torch.compile(..., backend='tokpipe') returned, a module compiled in place, "
            "or the backend object, after its first call (one whose every graph ran "
            "unpipelined has none: a warning at that call said why)")
    sessions = [found.own] if found.own is not None else found.alike
    every = {p for session in sessions for p in session.programs}
    if isinstance(module, torch.nn.Module):  # not another model's (compiles without options
        # share a session): a model without weights owns none by them
        every = {p for p in every if p.owner is None}
    return sorted(every, key=made_order)


def _find_sessions(obj: Any) -> CompileSessions | None:
    """The sessions of the torch.compile call (or backend object) behind `obj`."""
    queue, seen = deque([(obj, 0)]), set()
    while queue:
        item, depth = queue.popleft()
        if id(item) in seen or depth > 8:
            continue
        seen.add(id(item))
        if isinstance(item, TokpipeBackend):
            return CompileSessions(item.session, [])
        kwargs = getattr(item, "kwargs", None)
        by_object = isinstance(getattr(item, "compiler_fn", None), TokpipeBackend)
        # torch.compile's wrapper of the string backend; without options or mode (or with
        # mode "default"), its kwargs are empty: the compiles that pass none share a session
        by_name = getattr(item, "compiler_name", None) == "tokpipe"
        if isinstance(kwargs, dict) and (by_name or "options" in kwargs or "mode" in kwargs) \
                and not by_object:  # a backend object's wrapper: the object has the session
            found = sessions_for_options(kwargs.get("options"), kwargs.get("mode"))
            if found.every or by_name:  # by name: this compile, though not yet called
                return found
        children = [getattr(item, name, None) for name in _LINKS]
        # torch.compile of a plain function keeps its Dynamo context in the wrapper's closure.
        children += [cell.cell_contents for cell in getattr(item, "__closure__", None) or ()
                     if cell.cell_contents is not None]
        queue.extend((child, depth + 1) for child in children if child is not None)
    return None


def explain(model: torch.nn.Module, args: tuple = (), kwargs: dict | None = None,
            **options: Any) -> Plan:
    """The Plan the backend would run for `model(*args, **kwargs)`, without running the
    pipeline (the model runs once, unpipelined, while Dynamo traces it): the plan of its
    first graph with the token input (with graph breaks: that holds attention over it)."""
    config = Config.from_options(options)
    inputs: list[str | int] = []  # of the graphs without the named token input
    graphs = capture_graphs(model, args, kwargs)
    check_timestep_input(config.timestep_input, signature_names(model.forward),
                         [(source_name(n), argument_of(n)) for gm in graphs
                          for n in gm.graph.find_nodes(op="placeholder")])
    for gm in graphs:
        try:
            planner = functools.partial(plan_piece, config=config, where=Origin(piece=True)) \
                if len(graphs) > 1 else functools.partial(build_plan, config=config)
            return plan_with_tail(gm, planner)[0]
        except UnknownTokenInput as err:  # an error only when no graph reads it
            inputs += [name for name in err.inputs if name not in inputs]
        except (NoTokenInput, NothingToPipeline):
            continue
    if inputs:
        raise TokpipeError(f"token_input={config.token_input!r} names no input of this "
                           f"model; its inputs are {inputs}")
    raise TokpipeError("no traced graph of this model has a token input to pipeline (with "
                       "graph breaks: and attention over it)")


def capture_graphs(model: torch.nn.Module, args: tuple, kwargs: dict | None) -> list:
    """The FX graphs Dynamo makes of one call (several when the model has graph breaks)."""
    return [captured.gm for captured in capture(model, args, kwargs)]
