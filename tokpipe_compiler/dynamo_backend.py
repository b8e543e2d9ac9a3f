"""The torch.compile backend: `torch.compile(model, backend="tokpipe", options={...})`.

Dynamo calls the backend while it traces; the backend only records the graph and returns a
program that plans on its first call. Planning there (not inside Dynamo's compile step)
lets a TokpipeError or a bad option reach the user as itself, not wrapped in Dynamo's
BackendCompilerFailed, and lets the plan see the real inputs.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import weakref
from typing import Any

import torch
import torch.fx

from tokpipe_compiler.config import Config
from tokpipe_compiler.core.errors import NothingToPipeline, NoTokenInput, TokpipeError
from tokpipe_compiler.core.fx import (
    argument_of,
    is_parameter,
    position_of,
    record_sources,
    source_name,
)
from tokpipe_compiler.core.warn import warn
from tokpipe_compiler.core.wrapped_bodies import inline_wrapped_bodies
from tokpipe_compiler.passes.token_input import UnknownTokenInput
from tokpipe_compiler.planning.driver import build_plan
from tokpipe_compiler.planning.graph_head import GraphHead, plan_with_head
from tokpipe_compiler.planning.graph_share import summary
from tokpipe_compiler.planning.graph_tail import GraphTail, plan_with_tail
from tokpipe_compiler.planning.pieces import origin, plan_piece
from tokpipe_compiler.planning.plan import Plan
from tokpipe_compiler.planning.recompile_limit import note_traced
from tokpipe_compiler.planning.regional import repeated_block
from tokpipe_compiler.planning.retrace import traced_again
from tokpipe_compiler.planning.static import (
    StaticGraph,
    has_symbolic_shapes,
    shape_key,
    wrapped_floats,
)
from tokpipe_compiler.planning.timestep_checks import (
    check_timestep_input,
    missing_timestep,
    number_timestep,
    reads_last_call,
)
from tokpipe_compiler.planning.traced_frame import (
    frame_parameters,
    name_positions,
    number_arguments,
    traced_function,
)
from tokpipe_compiler.stage_programs.compile_sessions import session_for, warn_if_changed
from tokpipe_compiler.stage_programs.distributed import make_program, planned_alike
from tokpipe_compiler.stage_programs.generations import PIPELINE_STEPS, timestep_index
from tokpipe_compiler.stage_programs.owners import PerOwner, owner_of, register
from tokpipe_compiler.stage_programs.pipelined import PipelinedProgram
from tokpipe_compiler.stage_programs.session import Session

log = logging.getLogger("tokpipe_compiler")

class TokpipeBackend:
    """`tokpipe_compiler.backend(**options)`: a backend object with its options checked now."""

    def __init__(self, **options: Any):
        self.config = Config.from_options(options)
        self.session = Session()
        self.__name__ = "tokpipe"

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list,
                 mode: str | None = None, **_: Any):
        return LazyProgram(gm, lambda: self.config.with_torch_mode(mode), self.session,
                           example_inputs)

    def reset(self) -> None:
        """A new generation for every program this backend made."""
        self.session.reset()


def tokpipe(gm: torch.fx.GraphModule, example_inputs: list, options: dict | None = None,
            mode: str | None = None, **_: Any):
    """The function registered as the "tokpipe" Dynamo backend. `mode`: torch.compile's,
    as the options it stands for (config.TORCH_MODES)."""
    session, copied = session_for(options, mode)
    return LazyProgram(gm, lambda: Config.from_options(copied, mode), session, example_inputs,
                       lambda: warn_if_changed(options, mode))


# Per session: the parameter names of every function Dynamo traced for it (a model's forward
# is traced first), to tell a misspelt token_input from one a graph break left out.
_PARAMETERS: weakref.WeakKeyDictionary[Session, set[str]] = weakref.WeakKeyDictionary()


def _traced_parameters(session: Session) -> set[str]:
    """Adds the parameters of the function Dynamo traces now (called while it does);
    returns the session's set, which grows as Dynamo traces more of the model."""
    known = _PARAMETERS.setdefault(session, set())
    found = frame_parameters()
    known |= {"**"} if found is None else found  # unknown: any name may be a parameter
    return known


SYMBOLIC = ("tokpipe: Dynamo made a graph symbolic (a second input shape under torch.compile "
            "without dynamic=False, or dynamic=True): tokpipe traces, plans and compiles it "
            "again for each shape it is called with, a shape an earlier static graph held "
            "included; torch.compile(..., dynamic=False) keeps one static graph per shape")


class LazyProgram:
    """What Dynamo gets back: plans on the first call, then runs the pipeline. A graph with
    symbolic shapes gets one plan per concrete input shape; each model whose weights the
    graph is called with gets its own program (caches, generation) from the shared plan.
    A piece of a model split by graph breaks is pipelined only when it holds attention
    over its tokens (`planning.pieces`)."""

    def __init__(self, gm: torch.fx.GraphModule, config_fn, session: Session,
                 example_inputs: list, check_options=None):
        gm = inline_wrapped_bodies(gm)  # checkpointed blocks: their ops in line
        self.origin = origin(gm)  # while Dynamo traces: whether the model has graph breaks
        # A block traced on its own. Under parallelize, whose pipeline tells steps and
        # branches apart, one that hooks break out of the blocks' loop runs per call.
        self.block = None if self.origin.piece and session.outside_call is not None \
            else repeated_block(self.origin.piece)
        self.gm = name_positions(record_sources(gm))
        self.config_fn = config_fn
        self.check_options = check_options  # at each new model's program: a changed dict
        self.session = session
        self.parameters = _traced_parameters(session)  # of this graph's frame and others
        self.dynamic = has_symbolic_shapes(gm)
        self.floats = wrapped_floats(gm) if self.dynamic else ()  # dynamic=True's floats
        self.numbers = number_arguments()  # the call's Python numbers: specialised on
        self.owner_index = owner_placeholder(gm)
        traced = traced_function()
        if traced is not None:
            note_traced(traced[0])
        self.block_round = 0 if self.block is None or traced is None \
            else session.block_traced(traced[1])
        # said at the first call, not inside Dynamo's trace
        self.retraced = traced_again(session, traced, example_inputs, self.owner_index)
        self.plans: dict[Any, Any] = {}  # input shapes (dynamic graphs) -> _plan's
        self.programs = PerOwner()  # per model: input shapes -> callable
        # A piece's timestep argument, for its model's pieces that read none.
        self.timestep_at = timestep_index(self._arguments(), _timestep_choice(config_fn)) \
            if self.origin.piece else None
        self.pipelined: weakref.WeakSet = weakref.WeakSet()  # the pipelined programs made

    def __call__(self, *args: Any) -> Any:
        key = shape_key(args, self.floats) if self.dynamic else None
        owner = owner_of(args, self.owner_index)
        if self.timestep_at is not None:
            publisher = (id(self), None if owner is None else id(owner))
            self.session.timesteps.publish(publisher, args[self.timestep_at])
        table = self.programs.table(owner)
        # within a parallelized pipeline's call, parallelize gives the line at its end
        if PIPELINE_STEPS.get() is None:
            if self.session.outside_call is not None:
                self._warn_once("outside call", self.session.outside_call)
            if self.session.graphs.call_done(self):
                self._summarize_graphs()
        if key not in table:
            table[key] = self._program(key, args, owner)
        return table[key](*args)

    def _summarize_graphs(self) -> None:
        """A model compiled directly and split at graph breaks: after its first call, how
        many graphs it ran as and how much of it is pipelined (`parallelize` says so at the
        end of the pipeline's call)."""
        line = summary(f"the model traced from {self.origin.where or 'its forward'}",
                       self.session.graphs.take_new())
        if line is not None:
            warn(line)

    def _program(self, key: Any, args: tuple, owner: torch.Tensor | None):
        if self.check_options is not None:
            self.check_options()
        if key not in self.plans:
            self.plans[key] = self._plan(args)
            if self.origin.piece and len(self.plans) == 1:  # not a new shape's plan
                self.session.graphs.record(self.gm, self.plans[key][0] is not None, self)
        plan, select, head, tail = self.plans[key]
        if plan is None:
            return self.gm.forward
        program = make_program(plan, self.session, None if owner is None else id(owner))
        if self.origin.piece and program.clock.timestep_index is None:
            program.clock.source = self.session.timesteps.follow()
        self._warn_about_timesteps(program)
        register(owner, program)
        self.pipelined.add(program)
        headed = program if head is None else functools.partial(head.run, program)
        body = headed if select is None else lambda *a: headed(*select(a))
        return body if tail is None else functools.partial(tail.run, body)

    def _warn_about_timesteps(self, program: PipelinedProgram) -> None:
        """Once per compile: a pipeline that cannot tell steps apart says so, and once per
        function a graph traced again for the same inputs."""
        config, clock = program.plan.config, program.clock
        number = number_timestep(self.numbers, config.timestep_input)
        if number is not None:
            self._warn_once("number timestep", number)  # the reason a graph was traced again
            return
        if self.retraced is not None:
            self._warn_once(*self.retraced)
        elif config.mode == "stale" and clock.timestep_index is None and \
                clock.source is None and reads_last_call(program.plan.caches):
            inputs = [a for a in self._arguments() if a is not None]
            self._warn_once("no timestep", missing_timestep(inputs, config.timestep_input))

    def _warn_once(self, kind: str, message: str) -> None:
        if kind not in self.session.warned:
            self.session.warned.add(kind)
            warn(message)

    def _arguments(self) -> list[str | int | None]:
        return [argument_of(n) for n in placeholders(self.gm)]

    def _may_read(self, name: str) -> bool:
        """Whether a graph of this model may read input `name`."""
        return name in self.parameters or "**" in self.parameters

    def _plan(self, args: tuple) -> tuple[Plan | None, Any, GraphHead | None,
                                          GraphTail | None]:
        """The plan for these input shapes (None where the graph runs unpipelined), how a
        symbolic graph's arguments reach it, the writes into its inputs that run before it
        and the graph's tail that runs after it."""
        config = self._timestep_named(self.config_fn())
        if self.block is not None and not self._block_runs(config):
            return self._whole_model_only(config)  # before the options naming the inputs
        check_timestep_input(config.timestep_input, self.parameters,
                             [(source_name(n), argument_of(n)) for n in placeholders(self.gm)])
        gm, select = self.gm, None
        if self.dynamic:
            self._warn_once("symbolic", SYMBOLIC)
            static = StaticGraph(self.gm, args, self.floats)
            gm, select = static.gm, static.select
        planner = functools.partial(plan_piece, config=config, where=self.origin) \
            if self.origin.piece else functools.partial(build_plan, config=config)
        try:
            with planned_alike(None, config.timeout):
                (plan, tail), head = plan_with_head(
                    gm, functools.partial(plan_with_tail, plan=planner))
                return plan, select, head, tail
        except UnknownTokenInput as err:
            # Misspelt, unless this graph is one piece of several (graph breaks) and the
            # name a parameter of a function Dynamo traced for the model: another may read
            # it. A whole model's graph is the only one (even with a forward's **kwargs).
            if not config.fallback and (not self.origin.piece or
                                        not self._may_read(err.choice)):
                raise
            warn(f"tokpipe: running this graph unpipelined: {err}")
        except (NoTokenInput, NothingToPipeline) as err:
            warn(f"tokpipe: running this graph unpipelined: {err}")
        except TokpipeError as err:
            if not config.fallback:
                raise
            warn(f"tokpipe: running this graph unpipelined (fallback=True): {err.found}")
        return None, None, None, None

    def _timestep_named(self, config: Config) -> Config:
        """`config` with a timestep_input given as a position naming the argument there,
        where the backend named the call's positional arguments (a decorated forward's
        *args: `traced_frame.name_positions`)."""
        choice = config.timestep_input
        if isinstance(choice, int):
            for node in placeholders(self.gm):
                if position_of(node) == choice and isinstance(argument_of(node), str):
                    return dataclasses.replace(config, timestep_input=argument_of(node))
        return config

    def _block_runs(self, config: Config) -> bool:
        """Whether a block traced on its own runs as a pipeline of its own (saying what that
        costs): where Dynamo skipped its model's forward, in sync and causal mode, or
        following the timestep an earlier graph of the model read (`SharedTimesteps`)."""
        if not self.block.skipped or (config.mode == "stale" and
                                      self.session.timesteps.follow() is None):
            return False
        if self.block_round > self.session.block_round_said:  # once per trace of the blocks
            self.session.block_round_said = self.block_round
            warn(self.block.warning())
        return True

    def _whole_model_only(self, config: Config) -> tuple[None, None, None, None]:
        """A block traced on its own is refused (run as traced with fallback=True)."""
        err = TokpipeError(self.block.refusal())
        if not config.fallback:
            raise err
        warn(f"tokpipe: running this graph unpipelined (fallback=True): {err.found}")
        return None, None, None, None


def _timestep_choice(config_fn) -> str | None:
    """The option timestep_input, read while Dynamo traces (bad options raise later, at
    the first call, as themselves)."""
    try:
        return config_fn().timestep_input
    except ValueError:
        return None


def owner_placeholder(gm: torch.fx.GraphModule) -> int | None:
    """The position of the weight that tells models apart: the first parameter, else the
    first buffer (a hook may rebuild a buffer at every call, as accelerate's model
    offloading does to Wan's rotary tables, which would make every call a new model)."""
    weights = [(i, n) for i, n in enumerate(placeholders(gm)) if is_parameter(n)]
    parameters = [i for i, n in weights if "_parameters" in (source_name(n) or n.name)]
    return next(iter(parameters or [i for i, _ in weights]), None)


def placeholders(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]
