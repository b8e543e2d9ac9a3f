"""The one Dynamo graph recorder: every place that needs Dynamo's graphs of a call uses it.

`capture(fn, args, kwargs)` runs `torch.compile(fn, dynamic=False)` once, under no_grad, with
a backend that records each graph Dynamo makes (with where its placeholders came from, its
example inputs and placeholder names) and runs it as is.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import re
import types
import weakref
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch._dynamo.exc import FailOnRecompileLimitHit

from tokpipe_compiler.core.errors import TokpipeError
from tokpipe_compiler.core.fx import argument_of, record_sources
from tokpipe_compiler.core.wrapped_bodies import inline_wrapped_bodies
from tokpipe_compiler.planning.compile_calls import own_recompiles
from tokpipe_compiler.planning.returned_values import Returned, returned_values
from tokpipe_compiler.planning.traced_frame import name_positions

log = logging.getLogger("tokpipe_compiler")


@dataclass
class Captured:
    """One Dynamo graph of a call, and the inputs it was traced with."""

    gm: torch.fx.GraphModule
    inputs: list[Any]  # example inputs, in placeholder order
    names: list[str]  # placeholder names
    # Python state the traced call writes (`m.k`, a global), which Dynamo replays after
    # running the graph and a program running the graph alone does not
    mutations: tuple[str, ...] = ()
    # (placeholder index, source) of the inputs read from the call's arguments, where a
    # trace kept for later calls reads them again (`planning.argument_reads`)
    reads: tuple[tuple[int, str], ...] = ()
    # each value the call returns, where Dynamo says (`planning.returned_values`)
    returned: tuple[Returned, ...] | None = None

    @property
    def arguments(self) -> list[str | int | None]:
        """The user-facing argument of each placeholder (`core.fx.argument_of`)."""
        return [argument_of(n) for n in self.gm.graph.nodes if n.op == "placeholder"]

    def placeholder(self, argument: str | int) -> str | None:
        """The placeholder name of a user argument, None when the graph does not read it."""
        arguments = self.arguments
        return self.names[arguments.index(argument)] if argument in arguments else None

    def without_arguments(self, passed: Collection[str | int],
                          reads: tuple[tuple[int, str], ...] = ()) -> Captured:
        """This capture with the example inputs of the arguments `passed`, and of the
        inputs `reads` found in them, as meta tensors of their shapes and dtypes: a trace
        kept for later calls, which pass their own, would keep its first call's tensors (a
        server's first request at each size) alive. What else the graph reads keeps its
        value: a closure's tensor is named like an argument ("L['null']") but no call
        passes it."""
        read = {index for index, _ in reads}
        inputs = [_stand_in(x) if (argument is not None and argument in passed) or i in read
                  else x for i, (x, argument) in
                  enumerate(zip(self.inputs, self.arguments, strict=True))]
        return dataclasses.replace(self, inputs=inputs, reads=reads)

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


def _mutated_state() -> tuple[str, ...]:
    """What the call Dynamo traces now writes outside its graph (attributes, globals,
    lists), by where the call reached it: ('m.k', 'LOG'); () where Dynamo does not say."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        sources = InstructionTranslator.current_tx().output.side_effects.mutated_sources
        names = [s.name() if callable(s.name) else s.name for s in sources]
    except Exception:  # a Dynamo internal: without it, nothing is known
        return ()
    return tuple(re.sub(r"[GL]\['([^']+)'\]", r"\1", str(name)) for name in names)


def _record_once(fn: Callable[..., Any], args: tuple, kwargs: dict, fullgraph: bool,
                 run: bool) -> list[Captured]:
    """The graphs of one compiled call; [] when Dynamo hit its recompile limit."""
    graphs: list[Captured] = []
    codes: list[types.CodeType] = []
    modes: list[Any] = []

    def record(gm: torch.fx.GraphModule, example_inputs: list, **_: Any):
        codes.append(_traced_code())
        modes.append(torch._guards.detect_fake_mode(example_inputs))
        names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        returned = returned_values(gm)
        gm = name_positions(record_sources(inline_wrapped_bodies(gm)))
        graphs.append(Captured(gm, list(example_inputs), names, _mutated_state(),
                               returned=returned))
        return gm.forward if run else _stop_here

    compiled = torch.compile(fn, backend=record, dynamic=False, fullgraph=fullgraph,
                             **_OWN_REGION)
    try:
        # A hard failure at the limit, not a partly traced call that looks complete.
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True), torch.no_grad():
            compiled(*args, **kwargs)
    except FailOnRecompileLimitHit:
        return []
    except _Traced:
        pass
    finally:
        _forget(compiled, codes, record)
        _untrack_fakes(modes)
    found = list(graphs)
    graphs.clear()  # the backend's closure outlives the call wherever _forget cannot reach
    return found


# Each capture's cache entries in a region of their own: they never count against the
# recompile limit of the user's own torch.compile of the same function, nor theirs against
# ours (a capture of the 9th pipeline would otherwise fail the limit and reset Dynamo).
_OWN_REGION = own_recompiles()


def _traced_code() -> types.CodeType | None:
    """The code object of the frame Dynamo is tracing (called from a backend)."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        return InstructionTranslator.current_tx().f_code
    except Exception:  # a Dynamo internal: without it, nothing is dropped
        return None


def _forget(compiled: Callable[..., Any], codes: list[types.CodeType | None],
            backend: Callable[..., Any]) -> None:
    """Drops the cache entries a capture left on the code objects it traced.

    Dynamo keeps an entry per compiled frame for as long as its code object lives, which
    for a function defined once (a pipeline's ring step, a model class's forward) is the
    process; the entry holds the backend, whose graphs hold their example inputs: the
    model's weights. Every pipeline parallelized in a process would stay in memory. An
    entry is dropped the way Dynamo drops one whose guarded object died (an internal
    API: where it is missing, the entries stay, without the graphs)."""
    try:
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list
        from torch._dynamo.guards import DeletedGuardManagerWrapper
    except ImportError:
        return
    region = getattr(compiled, "_isolate_recompiles_id", None)
    dropped = []
    for code in {c for c in codes if c is not None}:
        entries = (_debug_get_cache_entry_list(code) if region is None else
                   torch._C._dynamo.eval_frame._get_cache_entries_for_region(code, region))
        for entry in entries:
            if getattr(entry.backend, "compiler_fn", None) is not backend:
                continue
            manager = entry.guard_manager
            try:
                manager.extra_state.invalidate(
                    manager.cache_entry, DeletedGuardManagerWrapper("tokpipe capture done"))
            except AttributeError:
                return
            dropped.append(manager)
    _detach_finalizers(dropped)


def _untrack_fakes(modes: list[Any]) -> None:
    """Drops the list of fake inputs each trace's shape environment keeps for guards.

    A fake copy of a view (a buffer made by `unsqueeze`, as SD3's position table; a step's
    `timesteps[k]`) holds its fake base, or a symbol of the trace, from C++ where the
    garbage collector cannot see it; with that list, the fakes, their mode and the shape
    environment form a cycle it never frees: every trace's fakes (about 50, 5 MB at
    released widths) would outlive the graphs that use them. Dynamo has made its guards
    by now; the graphs keep the fakes they read."""
    for mode in modes:
        env = getattr(mode, "shape_env", None)
        if env is not None and hasattr(env, "tracked_fakes"):
            env.tracked_fakes = None
    modes.clear()  # the backend's closure, which holds the list, outlives the call


def _detach_finalizers(managers: list[Any]) -> None:
    """Detach the finalizers Dynamo put on the objects the dropped entries' guards matched
    by identity (to drop an entry when its object dies): on objects that live as long as
    the process (classes, functions) they never run, and each keeps its guards' manager,
    about 2 MiB a parallelized pipeline (an internal API: where it is missing, they stay)."""
    registry = getattr(weakref.finalize, "_registry", None)
    if not managers or not isinstance(registry, dict):
        return
    for finalizer, info in _snapshot(registry).items():
        owner = getattr(getattr(info.func, "func", None), "__self__", None)
        if any(getattr(owner, "guard_manager", None) is m for m in managers):
            finalizer.detach()


def _snapshot(registry: dict) -> dict:
    """A copy of the finalizer registry, taken with the collector off: a collection during
    the copy runs finalizers, which change the registry under the copy."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return registry.copy()
    finally:
        if enabled:
            gc.enable()


class _Traced(Exception):
    """Raised instead of running a whole graph that is only traced."""


def _stop_here(*_: Any) -> None:
    raise _Traced


def _stand_in(value: Any) -> Any:
    """A tensor's shape and dtype without its data; other values as they are."""
    if isinstance(value, torch.Tensor):
        return torch.empty_like(value, device="meta")
    return value
