"""Check a model's pipelined run against eager PyTorch, in your own test suite.

    from tokpipe_compiler.testing import assert_equivalent
    assert_equivalent(model.eval(), (latents, t, labels), stages=2, chunks=4, mode="stale")

Exact modes (sync, causal) must equal eager on every call: the given input twice, another
input (`other_input`: the token-like tensors changed, the timestep moved one step), and the
given one again (caches that kept an earlier call's values show there). Stale mode must
equal eager on its warmup calls, and once the same input is repeated (its stale K/V are
then the fresh ones); then, in a new generation warmed up on another input, once the given
input has been repeated long enough for its K/V to replace the other's, layer by layer: a
program whose caches stopped following its calls passes the first check but not this one.
Then a generation whose inputs change at every step runs against stale semantics computed
on the eager model (`stale_reference`: each chunk attends to the fresh K/V of the chunks up
to its own and the previous step's of the rest; joined tokens, as joint attention's text,
computed by the first chunk), where that reference applies (scaled_dot_product_attention
over the chunked tokens; the report says why not elsewhere).
Then two guidance branches (the given input and one with other token inputs, at one
timestep per step) run interleaved, and each call must equal its branch run alone
(`branches`): branches that shared caches would pass every check before. Each check says
how many chunks its call ran as.

On a difference, NotEquivalent names the largest one and where it arose: the first
stage and chunk whose outputs differ from the same values of an unchunked run; where none
does and the stages were compiled, how far the compiled run is from the same calls run
with compiler="eager" (compiled code rounds differently from eager).

Hypothesis strategies (`options`, `latents_like`) live in tokpipe_compiler.testing.strategies
and are importable from tokpipe_compiler.testing too.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from tokpipe_compiler.config import Config
from tokpipe_compiler.dynamo_backend import LazyProgram, TokpipeBackend
from tokpipe_compiler.stage_programs.pipelined import PipelinedProgram
from tokpipe_compiler.testing.branches import branch_calls, check_branches
from tokpipe_compiler.testing.checks import Check, NotEquivalent, Report, compare
from tokpipe_compiler.testing.inputs import Inputs, other_input
from tokpipe_compiler.testing.locate import Drift, Where, compiler_drift, locate
from tokpipe_compiler.testing.stale_check import (
    applies,
    check_reference,
    reference_calls,
    reference_for,
)

# Also `options` and `latents_like` (see __getattr__ below).
__all__ = ["Check", "NotEquivalent", "Report", "Where", "assert_equivalent"]


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
    inputs = {"given": (args, kwargs or {}),
              "other": other_input(model, args, kwargs or {}, config.timestep_input)}
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
        actual, chunks = _run(compiled, recorder, inputs[key])
        if name is None:
            continue
        check = compare(name, call, expected[key], actual, chunks)
        report.checks.append(check)
        if not check.passes(rtol):
            with torch.no_grad():  # the reruns that find where, as the calls ran
                where = _locate(recorder, first, call, rtol)
                drift = _drift(recorder, first, call) if where is None else None
            raise NotEquivalent(_message(report, check, where, drift), check, where)
    if config.mode == "stale":
        call = _check_reference(model, compiled, recorder, inputs["given"], config, report,
                                call)
    if config.mode == "stale" and _tells_steps(recorder):
        _check_branches(model, compiled, recorder, inputs["given"], config, report, call)
    elif config.mode == "stale":
        report.unchecked.append("guidance branches: the model reads no timestep tensor, so "
                                "every call is a step and no two calls are branches of one")
    return report


def _run(compiled: Any, recorder: _Recorder, inputs: Inputs) -> tuple[Any, int | None]:
    """One call: its output, and the most chunks any of its programs ran it as (those
    that ran it are `recorder.ran`)."""
    for program in recorder.pipelined():
        program.last_chunk_count = None
    with torch.no_grad():
        output = compiled(*inputs[0], **inputs[1])
    recorder.ran = [p for p in recorder.pipelined() if p.last_chunk_count]
    return output, max((p.last_chunk_count for p in recorder.ran), default=None)


def _tells_steps(recorder: _Recorder) -> bool:
    """Whether the programs read a timestep (without one, every call is a step and
    branches cannot be told: the backend warns of that)."""
    programs = recorder.pipelined()
    return bool(programs) and all(p.clock.timestep_index is not None or
                                  p.clock.source is not None for p in programs)


def _check_reference(model: torch.nn.Module, compiled: Any, recorder: _Recorder,
                     given: Inputs, config: Config, report: Report, calls: int) -> int:
    """A generation's stale steps against stale semantics run eagerly (`stale_check`),
    where they can be; returns the calls made so far."""
    programs = recorder.ran  # the given input's last call's: in the order they ran
    why = applies(model, programs, given)
    if why is not None:
        report.unchecked.append(f"stale steps against stale semantics run eagerly: {why}")
        return calls
    steps = reference_calls(model, *given, config)
    _record(report, check_reference(lambda inputs: _run(compiled, recorder, inputs),
                                    recorder.backend.reset, reference_for(model, programs),
                                    steps, calls),
            "pipelined stale steps differ from stale semantics run eagerly",
            f"a generation of {len(steps)} steps (the given input, its timestep moved a step "
            "at a time, its token inputs changed every other step): after the warmup steps, "
            "chunk p should attend to the fresh K/V of chunks 0..p and the previous step's "
            "K/V of the rest")
    return calls + len(steps)


def _record(report: Report, checks: list[Check], what: str, why: str) -> None:
    """`checks` added to the report; the first that fails raises, saying `what` differs
    and `why` it should not."""
    for check in checks:
        report.checks.append(check)
        if not check.passes(report.rtol):
            raise NotEquivalent(f"{what}; options {report.options}\n  {check}\n  {why}",
                                check, None)


def _check_branches(model: torch.nn.Module, compiled: Any, recorder: _Recorder,
                    given: Inputs, config: Config, report: Report, calls: int) -> None:
    """Two guidance branches interleaved against each alone (`branches`)."""
    pairs = branch_calls(model, *given, config)
    if not pairs:
        report.unchecked.append("guidance branches: the input has no token data (a float "
                                "tensor of rank >= 3) to change for a second branch")
    _record(report, check_branches(lambda inputs: _run(compiled, recorder, inputs),
                                   recorder.backend.reset, pairs, calls),
            "pipelined guidance branches differ from each branch run alone",
            "the calls alternated two inputs at each step's timestep (the given one, and one "
            "with other token inputs): each should attend to K/V caches of its own, as when "
            "it runs alone")


def _calls(config: Config, recorder: _Recorder) -> Iterator[tuple[str | None, str | None]]:
    """(input, what its output must satisfy or None) of each call in turn; (None, None)
    starts a new generation. Read lazily: the layer count is known after the first call."""
    if config.mode != "stale":
        # a second input, and the first again: caches that keep an earlier call's values
        # show on the calls after it
        yield from (("given", "exact mode"), ("given", "exact mode, caches reused"),
                    ("other", "exact mode, another input"),
                    ("given", "exact mode, the given input after another"))
        return
    # The given input repeated: after a warmup call every stale K/V is exact; without one,
    # layer l's K/V become exact one call after layer l-1's (`_layers`).
    warmup = config.warmup_steps
    yield from [("given", "stale mode, warmup call")] * warmup
    if not warmup:
        yield "given", None
        yield from [("given", None)] * (_layers(recorder) - 1)
    yield "given", "stale mode, repeated input"
    # A new generation that warms up on another input: the given input's K/V replace the
    # other's layer by layer (`_layers` + 1 calls), which a cache that stopped following the calls
    # (exact on the repetitions above) does not.
    yield None, None
    yield from [("other", "stale mode, warmup call on another input")] * warmup
    if not warmup:
        yield "other", None
    yield from [("given", None)] * _layers(recorder)
    yield "given", "stale mode, given input after another's K/V"


def _layers(recorder: _Recorder) -> int:
    """The calls a repeated input takes to bring every K/V up to date, less one: the
    layers with K/V caches of the last call's programs, each a call behind the one before,
    and where graph breaks split the model into programs run one after another, a call
    more for each program after the first (measured: 2 layers in 2 programs, 4 calls)."""
    return sum(len(p.plan.caches) for p in recorder.ran) + max(len(recorder.ran) - 1, 0)


class _Recorder:
    """A tokpipe backend that keeps each graph's program and the arguments of every call."""

    def __init__(self, config: Config):
        self.backend = TokpipeBackend(**config.as_dict())
        self.graphs: list[tuple[LazyProgram, list[tuple]]] = []
        self.ran: list[PipelinedProgram] = []  # the programs that ran the last call

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
        outside = ("  no stage's output differs between this program's chunked and "
                   "unchunked runs, so chunking is not the cause: the difference comes from "
                   "what both runs share (the stage graphs or kernels themselves, which a "
                   "call run as one chunk, in sync mode or warmup, cannot split further), "
                   "from the transport between ranks, or from the parts of the model run "
                   "unpipelined")
        lines.append(outside if drift is None else f"{outside}; {drift}, within the "
                     f"tolerance")
    return "\n".join(lines)
