"""The one Dynamo graph recorder: every place that needs Dynamo's graphs of a call uses it.

`capture(fn, args, kwargs)` runs `torch.compile(fn, dynamic=False)` once, under no_grad, with
a backend that records each graph Dynamo makes (with where its placeholders came from, its
example inputs and placeholder names) and runs it as is.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch._dynamo.exc import FailOnRecompileLimitHit

from tokpipe_compiler.core.errors import TokpipeError
from tokpipe_compiler.core.fx import argument_of, record_sources

log = logging.getLogger("tokpipe_compiler")


@dataclass
class Captured:
    """One Dynamo graph of a call, and the inputs it was traced with."""

    gm: torch.fx.GraphModule
    inputs: list[Any]  # example inputs, in placeholder order
    names: list[str]  # placeholder names

    @property
    def arguments(self) -> list[str | int | None]:
        """The user-facing argument of each placeholder (`core.fx.argument_of`)."""
        return [argument_of(n) for n in self.gm.graph.nodes if n.op == "placeholder"]

    def placeholder(self, argument: str | int) -> str | None:
        """The placeholder name of a user argument, None when the graph does not read it."""
        arguments = self.arguments
        return self.names[arguments.index(argument)] if argument in arguments else None

    def with_arguments(self, values: Mapping[str | int, Any], strict: bool = True) -> list[Any]:
        """The example inputs with user arguments replaced by `values` (keyed by argument
        name, or position in *args). `strict`: a key the graph does not read raises."""
        out, arguments = list(self.inputs), self.arguments
        for key, value in values.items():
            if key in arguments:
                out[arguments.index(key)] = value
            elif strict:
                raise KeyError(f"the graph reads no argument {key!r}; it reads "
                               f"{[a for a in arguments if a is not None]}")
        return out


def capture(fn: Callable[..., Any], args: tuple = (), kwargs: dict | None = None, *,
            fullgraph: bool = False, fresh: bool = False, run: bool = True) -> list[Captured]:
    """Dynamo's graphs of `fn(*args, **kwargs)` (several when it has graph breaks), in the
    order Dynamo made them. `fresh`: reset Dynamo first (tests trace many models of one
    class). `run=False` (with `fullgraph`): trace the graph without running it, for a
    function whose run has effects (a ring's step that talks to other ranks). Raises
    TokpipeError when Dynamo traced nothing."""
    if fresh:
        torch.compiler.reset()
    for attempt in range(2):
        graphs = _record_once(fn, args, kwargs or {}, fullgraph, run or not fullgraph)
        if graphs:
            return graphs
        if attempt == 0:
            # Past its recompile limit Dynamo would run the function eagerly and trace nothing
            # (or only some of its frames); start its caches afresh once (compiled models
            # recompile on their next call).
            log.warning("Dynamo traced nothing (recompile limit); resetting its caches")
            torch.compiler.reset()
    raise TokpipeError("Dynamo traced no graph of this model; is it a torch.nn.Module with "
                       "tensor inputs? (TORCH_LOGS=graph_breaks shows why)")


def _record_once(fn: Callable[..., Any], args: tuple, kwargs: dict, fullgraph: bool,
                 run: bool) -> list[Captured]:
    """The graphs of one compiled call; [] when Dynamo hit its recompile limit."""
    graphs: list[Captured] = []

    def record(gm: torch.fx.GraphModule, example_inputs: list, **_: Any):
        names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        graphs.append(Captured(record_sources(gm), list(example_inputs), names))
        return gm.forward if run else _stop_here

    try:
        # A hard failure at the limit, not a partly traced call that looks complete.
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True), torch.no_grad():
            torch.compile(fn, backend=record, dynamic=False, fullgraph=fullgraph)(
                *args, **kwargs)
    except FailOnRecompileLimitHit:
        return []
    except _Traced:
        pass
    return graphs


class _Traced(Exception):
    """Raised instead of running a whole graph that is only traced."""


def _stop_here(*_: Any) -> None:
    raise _Traced


def frame_parameters() -> frozenset[str] | None:
    """Called by a backend while Dynamo traces: the parameter names of the function whose
    frame it traces, and of `self.forward` when the frame has a module `self` (a decorated
    forward, a resume function after a graph break); "**" among them when a signature takes
    **kwargs. None when unknown."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
        code, module = tx.f_code, tx.f_locals.get("self")
    except Exception:  # a Dynamo internal: without it, nothing is known
        return None
    names = set(code.co_varnames[:code.co_argcount + code.co_kwonlyargcount])
    if code.co_flags & inspect.CO_VARKEYWORDS:
        names.add("**")
    if isinstance(module, torch.nn.Module):
        # diffusers decorates forward as wrapper(self, *args, **kwargs): its signature
        # (functools.wraps) names the real parameters.
        names.discard("**")
        names |= _signature_names(module.forward)
    return frozenset(names)


def _signature_names(fn: Callable[..., Any]) -> set[str]:
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return {"**"}
    return {"**" if p.kind == p.VAR_KEYWORD else p.name for p in parameters}
