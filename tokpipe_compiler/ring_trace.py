"""A Ring's step function traced: one Dynamo graph of it, or an error that says why not and
what to do (a graph break, a value read as a Python number, a diffusers scheduler's
step(), the step's own error as an eager call raises it)."""

from __future__ import annotations

import contextlib
import re
import unittest.mock
from collections.abc import Callable
from typing import Any

import torch

from tokpipe_compiler.core.errors import TokpipeError, user_line
from tokpipe_compiler.planning.argument_reads import argument_reads
from tokpipe_compiler.planning.capture import Captured, capture
from tokpipe_compiler.planning.module_attributes import attributes_changed, plain_attributes


class StepGraphBreak(TokpipeError):
    """Dynamo broke the step function into several graphs (a quantizer's tensor subclass
    it cannot trace, say), or the step needs a tensor's value as a Python number: a Ring
    refuses it; a parallelized pipeline runs the generation per call, where Dynamo's
    graphs run pipelined or as traced."""


def trace_step(step_fn: Callable[..., Any], values: dict[str, Any],
               retried: bool = False) -> Captured:
    """The graph of one call of the step function, its example inputs and placeholders.
    Where the step itself raises (the model fails on these inputs), that error, as an
    eager call raises it, rather than Dynamo's account of it ("Observed exception").
    A model that fills a cache of its own at its first call, where Dynamo breaks (Z-Image
    makes its rotary table under a device context), is traced again once the eager call
    has filled it."""
    try:
        with _constants_kept():
            traced = capture(step_fn, kwargs=values, fullgraph=True, run=False)[-1]
    except torch._dynamo.exc.TorchRuntimeError:
        _run_eagerly(step_fn, values)  # the step's own error (shapes that do not fit)
        raise
    except torch._dynamo.exc.Unsupported as err:
        # The step's own error (an exception it raises, a name it lacks) as Python gives it:
        # an eager call raises it, with its traceback; a step that runs has a graph break.
        if _run_eagerly(step_fn, values) and not retried:
            return trace_step(step_fn, values, retried=True)
        raise StepGraphBreak(f"ring mode needs the step function as one graph; Dynamo broke "
                             f"it: {_graph_break(err)}{_advice(err)}") from err
    except torch._dynamo.exc.UserError as err:
        if "data-dependent" not in str(err):
            raise
        # a Python branch on a tensor's value (`if t.item() > 0:`), or a table indexed by
        # one (`acp[t.long()]`): the graph cannot hold either
        raise StepGraphBreak(f"ring mode runs the step as a graph of tensors, and the step "
                             f"needs a tensor's value as a Python number"
                             f"{_data_dependent(err)}: "
                             "a branch on it or an index by it; keep the value a tensor: "
                             "torch.where(cond, a, b) for `a if cond else b`, and for a table "
                             "indexed by a step's value, pass the looked-up values per step "
                             "(per_step={'alpha': table[timesteps]})"
                             f"{_advice(err, branch=False)}") from err
    for node in traced.gm.graph.nodes:
        if node.op == "call_method" and node.target in ("item", "tolist"):
            raise StepGraphBreak(f"ring mode runs the step as a graph of tensors, and the "
                                 f"step reads a Python number off a tensor (.{node.target}()) "
                                 f"at {user_line(node)}; keep the value a tensor (a 0-d tensor "
                                 "works in the arithmetic)")
    _refuse_data_dependent_sizes(traced.gm)
    return traced.without_arguments(values, argument_reads(step_fn, traced.gm, values))


# Tensors the step builds from Python numbers alone, up to this many elements, keep their
# values while Dynamo traces (PyTorch keeps one element): a number read back off one
# (HiDream's patch grid, `torch.tensor([h, w]).repeat(batch, 1)`, read with `.item()` to
# cut its output) is a constant of the graph, as the Python numbers it came from are.
CONSTANT_ELEMENTS = 64


def _constants_kept() -> contextlib.AbstractContextManager:
    from torch._subclasses import fake_tensor

    kept = getattr(fake_tensor, "CONSTANT_NUMEL_LIMIT", None)
    if kept is None:  # a PyTorch without the limit: nothing to raise
        return contextlib.nullcontext()
    return unittest.mock.patch.object(fake_tensor, "CONSTANT_NUMEL_LIMIT",
                                      max(kept, CONSTANT_ELEMENTS))


def _refuse_data_dependent_sizes(gm: torch.fx.GraphModule) -> None:
    """A step with a tensor whose size depends on tensor values (Mochi's attention over
    the text tokens its mask keeps: `query[:, :, valid_indices]`) cannot be cut into
    chunks planned ahead; per call, Dynamo breaks the graph there and its graphs run
    pipelined or as traced."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    for node in gm.graph.nodes:
        value = node.meta.get("example_value")
        if isinstance(value, torch.Tensor) and free_unbacked_symbols(value):
            raise StepGraphBreak(f"ring mode plans the step's shapes ahead, and the step "
                                 f"computes a tensor whose size depends on tensor values "
                                 f"({tuple(value.shape)} at {user_line(node)})")


def _run_eagerly(step_fn: Callable[..., Any], values: dict[str, Any]) -> bool:
    """One eager call of the step, on copies of its tensors (a step writing its inputs
    leaves the caller's): where the step itself fails, its own error, as Python gives it.
    Whether the call changed an attribute of the modules the step calls (filled a cache)."""
    attributes = [a for m in _closure_modules(step_fn) for a in plain_attributes(m)]
    with torch.no_grad():
        step_fn(**{k: v.clone() if isinstance(v, torch.Tensor) else v
                   for k, v in values.items()})
    return attributes_changed(attributes)


def _closure_modules(fn: Callable[..., Any]) -> list[torch.nn.Module]:
    """The modules `fn` holds in its closure, or whose bound methods (or a diffusers
    hook's `partial(new_forward, module)`) it holds."""
    found = []
    for cell in getattr(fn, "__closure__", None) or ():
        value = cell.cell_contents
        candidates = [value, getattr(value, "__self__", None), *getattr(value, "args", ())]
        found += [c for c in candidates if isinstance(c, torch.nn.Module)]
    return found


def _advice(err: BaseException, branch: bool = True) -> str:
    """What to do instead, where Dynamo's account says: a diffusers scheduler's step()
    (it keeps its place in Python state), a Python branch on a tensor."""
    text = str(err)
    if "diffusers/schedulers/" in text.replace("\\", "/"):
        return ("; a diffusers scheduler's step() keeps its state in Python (its step "
                "index), which a ring cannot replay: take the scheduler's per-step values "
                "with tokpipe_compiler.pipelines.schedulers.step_table(scheduler, steps) and "
                "update the latents with its update(...) (README: Ring mode)")
    if branch and "data-dependent branching" in text.lower():
        return ("; keep the value a tensor: torch.where(cond, a, b) for `a if cond else b`")
    return ""


def _data_dependent(err: BaseException) -> str:
    """Where Dynamo could not guard on a tensor's value, and on what: ' (x > 0) at File
    ...', or '' where its message says neither."""
    text = str(err)
    found = re.search(r"data-dependent expression (.+?) \(unhinted", text)
    where = [line.strip() for line in text.splitlines() if line.strip().startswith("File ")]
    what = f" ({found[1]})" if found else ""
    return what + (f" at {where[-1]}" if where else "")


def _graph_break(err: BaseException) -> str:
    """Dynamo's account of a graph break in a line: what, its explanation, and where in
    the user's code."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    said = [lines[0]] if lines else [type(err).__name__]
    said += [line.removeprefix("Explanation:").strip() for line in lines
             if line.startswith("Explanation:")]
    where = [line for line in lines if line.startswith("File ")]
    return "; ".join(said) + (f" ({where[-1]})" if where else "")
