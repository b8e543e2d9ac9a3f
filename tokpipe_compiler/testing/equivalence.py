"""Check a model's pipelined run against eager PyTorch, in your own test suite.

    from tokpipe_compiler.testing import assert_equivalent
    assert_equivalent(model.eval(), (latents, t, labels), stages=2, chunks=4, mode="stale")

Exact modes (sync, causal) must equal eager on every call. Stale mode must equal eager on
its warmup calls, and once the same input is repeated (its stale K/V are then the fresh
ones); then, in a new generation warmed up on another input (`other_input`: the token-like
tensors changed, the timestep moved one step), once the given input has been repeated long
enough for its K/V to replace the other's, layer by layer: a program whose caches stopped
following its calls passes the first check but not this one.

On a difference, NotEquivalent names the largest one and where it arose: the first
stage and chunk whose outputs differ from the same values of an unchunked run; where none
does and the stages were compiled, how far the compiled run is from the same calls run
with compiler="eager" (compiled code rounds differently from eager).

Hypothesis strategies (`options`, `latents_like`) live in tokpipe_compiler.testing.strategies
and are importable from tokpipe_compiler.testing too.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from tokpipe_compiler.backend import LazyProgram, TokpipeBackend
from tokpipe_compiler.config import Config
from tokpipe_compiler.programs.generations import timestep_names
from tokpipe_compiler.programs.pipelined import PipelinedProgram
from tokpipe_compiler.testing.locate import Drift, Where, compiler_drift, locate

# Also `options` and `latents_like` (see __getattr__ below).
__all__ = ["Check", "NotEquivalent", "Report", "Where", "assert_equivalent"]


@dataclass(frozen=True)
class Check:
    """One compared call: its largest difference from eager."""

    name: str
    call: int  # 1-based
    error: float  # max |pipelined - eager| over the output
    scale: float  # max |eager|
    output: int  # which tensor of the flattened output holds the largest difference
    index: tuple[int, ...]  # where in it
    expected: float
    actual: float

    def passes(self, rtol: float) -> bool:
        return self.error <= rtol * self.scale

    def __str__(self) -> str:
        return (f"{self.name} (call {self.call}): max |pipelined - eager| = {self.error:.3e} "
                f"at output[{self.output}][{', '.join(map(str, self.index))}] (eager "
                f"{self.expected:.6g}, pipelined {self.actual:.6g}); max |eager| "
                f"{self.scale:.3e}")


@dataclass
class Report:
    """What assert_equivalent compared; `str(report)` lists every check."""

    options: dict[str, Any]
    rtol: float
    checks: list[Check] = field(default_factory=list)

    @property
    def max_relative_error(self) -> float:
        return max((c.error / c.scale if c.scale else c.error for c in self.checks), default=0.0)

    def __str__(self) -> str:
        head = f"tokpipe equivalence {self.options}, rtol {self.rtol:g}:"
        return "\n".join([head, *(f"  {c}" for c in self.checks)])


class NotEquivalent(AssertionError):
    """The pipelined output differs from eager beyond the tolerance."""

    def __init__(self, message: str, check: Check, where: Where | None):
        super().__init__(message)
        self.check = check
        self.where = where


def assert_equivalent(model: torch.nn.Module, args: tuple = (), kwargs: dict | None = None,
                      *, rtol: float = 1e-5, **options: Any) -> Report:
    """Run `model` eagerly and pipelined (tokpipe backend `options`) and compare.

    rtol: allowed max |pipelined - eager| as a fraction of max |eager| (1e-5 suits float32;
    use ~1e-2 for bfloat16). `compiler` defaults to "eager" here: chunking, not Inductor,
    is under test; pass compiler="inductor" to test the compiled stages too.
    Resets Dynamo's caches first (torch.compiler.reset()), so every call traces afresh.
    """
    options = {"compiler": "eager", **options}
    config = Config.from_options(options)
    inputs = {"given": (args, kwargs or {})}
    if config.mode == "stale":
        inputs["other"] = other_input(model, args, kwargs or {}, config.timestep_input)
    with torch.no_grad():
        expected = {key: model(*a, **k) for key, (a, k) in inputs.items()}
    torch.compiler.reset()
    recorder = _Recorder(config)
    compiled = torch.compile(model, backend=recorder, dynamic=False)
    report = Report(options, rtol)
    call = first = 0  # calls made; the first call of the current generation
    for key, name in _calls(config, recorder):
        if key is None:  # a new generation
            recorder.backend.reset()
            first = call
            continue
        call += 1
        with torch.no_grad():
            actual = compiled(*inputs[key][0], **inputs[key][1])
        if name is None:
            continue
        check = _compare(name, call, expected[key], actual)
        report.checks.append(check)
        if not check.passes(rtol):
            with torch.no_grad():  # the reruns that find where, as the calls ran
                where = _locate(recorder, first, call, rtol)
                drift = _drift(recorder, first, call) if where is None else None
            raise NotEquivalent(_message(report, check, where, drift), check, where)
    return report


def _calls(config: Config, recorder: _Recorder) -> Iterator[tuple[str | None, str | None]]:
    """(input, what its output must satisfy or None) of each call in turn; (None, None)
    starts a new generation. Read lazily: the layer count is known after the first call."""
    if config.mode != "stale":
        yield from (("given", "exact mode"), ("given", "exact mode, caches reused"))
        return
    # The given input repeated: after a warmup call every stale K/V is exact; without one,
    # layer l's K/V become exact one call after layer l-1's: after L+1 calls.
    warmup = config.warmup_steps
    yield from [("given", "stale mode, warmup call")] * warmup
    if not warmup:
        yield "given", None
        yield from [("given", None)] * (_layers(recorder) - 1)
    yield "given", "stale mode, repeated input"
    # A new generation that warms up on another input: the given input's K/V replace the
    # other's layer by layer (L+1 calls), which a cache that stopped following the calls
    # (exact on the repetitions above) does not.
    yield None, None
    yield from [("other", "stale mode, warmup call on another input")] * warmup
    if not warmup:
        yield "other", None
    yield from [("given", None)] * _layers(recorder)
    yield "given", "stale mode, given input after another's K/V"


def _layers(recorder: _Recorder) -> int:
    """The most layers with K/V caches of any program made so far."""
    return max((len(p.plan.caches) for p in recorder.pipelined()), default=0)


def other_input(model: torch.nn.Module, args: tuple, kwargs: dict,
                timestep_input: str | None = None) -> tuple[tuple, dict]:
    """Another input of the same shapes: floating tensors of rank >= 3 (latents, text)
    changed, a timestep tensor moved by one (so the given input's first call is the next
    step, not another guidance branch at the same timestep). Python numbers stay."""
    signature = inspect.signature(model.forward)
    bound = signature.bind(*args, **kwargs)
    timesteps = timestep_names(timestep_input)
    for name, value in bound.arguments.items():
        kind = signature.parameters[name].kind
        if kind == inspect.Parameter.VAR_KEYWORD:  # **kwargs: each by its keyword
            value = {key: _changed(v, key in timesteps) for key, v in value.items()}
        elif kind == inspect.Parameter.VAR_POSITIONAL:
            value = tuple(_changed(v, False) for v in value)
        else:
            value = _changed(value, name in timesteps)
        bound.arguments[name] = value
    return bound.args, bound.kwargs


def _changed(value: Any, timestep: bool) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    if timestep:
        return value + 1
    if value.is_floating_point() and value.dim() >= 3:
        return 0.25 - value
    return value


class _Recorder:
    """A tokpipe backend that keeps each graph's program and the arguments of every call."""

    def __init__(self, config: Config):
        self.backend = TokpipeBackend(**config.as_dict())
        self.graphs: list[tuple[LazyProgram, list[tuple]]] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list, **_: Any):
        lazy = self.backend(gm, example_inputs)
        calls: list[tuple] = []
        self.graphs.append((lazy, calls))

        def run(*args: Any) -> Any:
            calls.append(args)
            return lazy(*args)

        return run

    def pipelined(self) -> list[PipelinedProgram]:
        return [p for lazy, _ in self.graphs for p in _programs(lazy)]


def _programs(lazy: LazyProgram) -> list[PipelinedProgram]:
    return list(lazy.pipelined)


def output_tensors(output: Any) -> list[torch.Tensor]:
    """The tensors in a model's output, in order: torch's pytree leaves, and the fields of
    the dataclasses it does not know (a plain `@dataclass` output, not registered)."""
    found: list[torch.Tensor] = []
    for leaf in tree_leaves(output):
        if dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            found += output_tensors([getattr(leaf, f.name) for f in dataclasses.fields(leaf)])
        elif isinstance(leaf, torch.Tensor):
            found.append(leaf)
    return found


def _compare(name: str, call: int, expected: Any, actual: Any) -> Check:
    pairs = list(zip(output_tensors(expected), output_tensors(actual), strict=True))
    worst: Check | None = None
    for i, (e, a) in enumerate(pairs):
        diff = (a.float() - e.float()).abs()
        flat = int(diff.argmax()) if diff.numel() else 0
        index = tuple(int(k) for k in torch.unravel_index(torch.tensor(flat), diff.shape))
        scale = e.float().abs().max().item() if e.numel() else 0.0
        check = Check(name, call, diff.max().item() if diff.numel() else 0.0, scale, i, index,
                      e.flatten()[flat].item() if e.numel() else 0.0,
                      a.flatten()[flat].item() if a.numel() else 0.0)
        if worst is None or _relative(check) > _relative(worst):
            worst = check
    if worst is None:
        raise ValueError("the model's output holds no tensor to compare")
    return worst


def _relative(check: Check) -> float:
    return check.error / check.scale if check.scale else check.error


def _locate(recorder: _Recorder, first: int, call: int, rtol: float) -> Where | None:
    """Where the generation of calls first+1..call first differs (replayed afresh)."""
    for lazy, calls in recorder.graphs:
        for program in _programs(lazy):
            where = locate(program.plan, calls[first:call], rtol)
            if where is not None:
                return where
    return None


def _drift(recorder: _Recorder, first: int, call: int) -> Drift | None:
    """The compiled program furthest from itself run eagerly on calls first+1..call; None
    where the stages ran eagerly."""
    drifts = [compiler_drift(program.plan, calls[first:call])
              for lazy, calls in recorder.graphs for program in _programs(lazy)
              if program.plan.config.compiler != "eager"]
    return max(drifts, key=lambda d: d.error / d.scale if d.scale else d.error, default=None)


def _message(report: Report, check: Check, where: Where | None, drift: Drift | None) -> str:
    lines = [f"pipelined output differs from eager; options {report.options}",
             f"  {check}", f"  tolerance: {report.rtol:g} * max |eager| = "
             f"{report.rtol * check.scale:.3e}"]
    if where is not None:
        lines.append(f"  arose at {where}")
    elif drift is not None and not drift.passes(report.rtol):
        lines.append(f"  every stage's output matches the unchunked run chunk by chunk, so "
                     f"chunking is not the cause; the stages and the per-call prelude were "
                     f"compiled with {drift.compiler}, whose code rounds differently from "
                     f"eager: {drift}. Pass compiler='eager' to test the chunking alone, or "
                     f"a larger rtol to allow for the compiler's rounding")
    else:
        outside = ("  every stage's output matches the unchunked run chunk by chunk: the "
                   "difference comes from outside the stages (assembling outputs, or the "
                   "unpipelined parts of the model)")
        lines.append(outside if drift is None else f"{outside}; {drift}, within the "
                     f"tolerance")
    return "\n".join(lines)
