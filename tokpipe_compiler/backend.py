"""The torch.compile backend: `torch.compile(model, backend="tokpipe", options={...})`.

Dynamo calls the backend while it traces; the backend only records the graph and returns a
program that plans on its first call. Planning there (not inside Dynamo's compile step)
lets a TokpipeError or a bad option reach the user as itself, not wrapped in Dynamo's
BackendCompilerFailed, and lets the plan see the real inputs.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import torch
import torch.fx

from tokpipe_compiler.config import Config
from tokpipe_compiler.core.errors import NoTokenInput, TokpipeError
from tokpipe_compiler.core.fx import record_sources
from tokpipe_compiler.planning.driver import build_plan
from tokpipe_compiler.planning.static import StaticGraph, has_symbolic_shapes, shape_key
from tokpipe_compiler.programs.distributed import make_program
from tokpipe_compiler.programs.pipelined import Session

log = logging.getLogger("tokpipe_compiler")

# Sessions of string-backend compiles, keyed by the identity of their `options` dict (the
# one object Dynamo hands every recompile of the same torch.compile call).
_SESSIONS: dict[int, tuple[Any, Session]] = {}


class TokpipeBackend:
    """`tokpipe_compiler.backend(**options)`: a backend object with its options checked now."""

    def __init__(self, **options: Any):
        self.config = Config.from_options(options)
        self.session = Session()
        self.__name__ = "tokpipe"

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list, **_: Any):
        return LazyProgram(gm, lambda: self.config, self.session)

    def reset(self) -> None:
        """A new generation for every program this backend made."""
        self.session.reset()


def tokpipe(gm: torch.fx.GraphModule, example_inputs: list, options: dict | None = None,
            **_: Any):
    """The function registered as the "tokpipe" Dynamo backend."""
    key = id(options)
    if key not in _SESSIONS:
        _SESSIONS[key] = (options, Session())
    session = _SESSIONS[key][1]
    return LazyProgram(gm, lambda: Config.from_options(options), session)


def session_for_options(options: dict | None) -> Session | None:
    entry = _SESSIONS.get(id(options))
    return entry[1] if entry is not None else None


class LazyProgram:
    """What Dynamo gets back: plans on the first call, then runs the pipeline. A graph with
    symbolic shapes gets one plan per concrete input shape."""

    def __init__(self, gm: torch.fx.GraphModule, config_fn, session: Session):
        self.gm = record_sources(gm)
        self.config_fn = config_fn
        self.session = session
        self.dynamic = has_symbolic_shapes(gm)
        self.programs: dict[Any, Any] = {}  # input shapes (dynamic graphs) -> callable
        self.pipelined: list[Any] = []  # the pipelined programs among them

    def __call__(self, *args: Any) -> Any:
        key = shape_key(args) if self.dynamic else None
        if key not in self.programs:
            self.programs[key] = self._plan(args)
        return self.programs[key](*args)

    def _plan(self, args: tuple):
        config = self.config_fn()
        gm, select = self.gm, None
        if self.dynamic:
            static = StaticGraph(self.gm, args)
            gm, select = static.gm, static.select
        try:
            program = make_program(build_plan(gm, config), self.session)
        except NoTokenInput as err:
            warnings.warn(f"tokpipe: running this graph unpipelined: {err}", stacklevel=3)
            return self.gm.forward
        except TokpipeError as err:
            if not config.fallback:
                raise
            warnings.warn(f"tokpipe: running this graph unpipelined (fallback=True): {err}",
                          stacklevel=3)
            return self.gm.forward
        self.pipelined.append(program)
        return program if select is None else lambda *a: program(*select(a))
