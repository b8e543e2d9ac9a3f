"""Stale mode's semantics computed on the eager model, independently of the compiler.

The README's table says what chunk p of a stale step attends to: the fresh K/V of chunks
0..p and the previous step's K/V of chunks p+1.. (with no previous step, at a generation's
first step without warmup: chunks 0..p only). Every other op of a plain DiT acts token by
token, so one eager pass per step computes every chunk's answer at once: each attention
call over the chunked tokens computes this step's K/V of every token (the fresh ones,
since the tokens' own activations are already the stale-mode ones, layer by layer) and
gives each chunk's queries those of the chunks up to its own and the previous step's of
the rest. The first `warmup` steps attend to the whole fresh sequence.

This holds where every attention over the chunked tokens is
`F.scaled_dot_product_attention` with queries and keys of those tokens alone, in grid
order (a chunk's tokens contiguous); `applies` says why not elsewhere (joint attention's
text, sums over tokens, attention written out, graph breaks).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from tokpipe_compiler.config import Config
from tokpipe_compiler.programs.pipelined import PipelinedProgram
from tokpipe_compiler.runtime.caches import CacheSpec
from tokpipe_compiler.testing.checks import Check, compare
from tokpipe_compiler.testing.inputs import Inputs, changed_input

# A compiled call: inputs -> (output, the chunks it ran as)
Run = Callable[[Inputs], tuple[Any, int | None]]
STALE_STEPS = 3  # steps compared after the warmup ones

_SDPA = inspect.signature(lambda query, key, value, attn_mask=None, dropout_p=0.0,
                          is_causal=False, scale=None, enable_gqa=False: None)


def _bind(args: tuple, kwargs: dict) -> inspect.BoundArguments:
    """An attention call's arguments by name, defaults included."""
    call = _SDPA.bind(*args, **kwargs)
    call.apply_defaults()
    return call


class StaleReference:
    """A stale-mode run of `model`: call it once per denoising step of one guidance branch;
    `new_generation` drops the K/V of the last."""

    def __init__(self, model: torch.nn.Module, tokens: int, bounds: Sequence[tuple[int, int]],
                 warmup: int):
        self.model, self.tokens, self.bounds, self.warmup = model, tokens, list(bounds), warmup
        self.new_generation()

    def new_generation(self) -> None:
        self.steps = 0
        self.caches: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with _StaleAttention(self), torch.no_grad():
            output = self.model(*args, **kwargs)
        self.steps += 1
        return output

    def attend(self, layer: int, call: inspect.BoundArguments) -> torch.Tensor:
        """Layer `layer`'s attention at this step: per chunk, its keys as stale mode has them."""
        q, k, v = (call.arguments[n] for n in ("query", "key", "value"))
        stale = self.caches.get(layer)
        self.caches[layer] = (k, v)
        if self.steps < self.warmup:
            return F.scaled_dot_product_attention(**call.arguments)
        mask = call.arguments["attn_mask"]
        outputs = []
        for start, stop in self.bounds:
            keys, values = k[..., :stop, :], v[..., :stop, :]
            if stale is not None:
                keys = torch.cat([keys, stale[0][..., stop:, :]], dim=-2)
                values = torch.cat([values, stale[1][..., stop:, :]], dim=-2)
            outputs.append(F.scaled_dot_product_attention(
                **{**call.arguments, "query": q[..., start:stop, :], "key": keys,
                   "value": values, "attn_mask": _rows(mask, start, stop, keys.shape[-2])}))
        return torch.cat(outputs, dim=-2)

    def is_chunked(self, call: inspect.BoundArguments) -> bool:
        """Whether the attention's queries and keys are the chunked tokens."""
        q, k = call.arguments["query"], call.arguments["key"]
        return q.dim() >= 2 and q.shape[-2] == k.shape[-2] == self.tokens


class _StaleAttention(TorchFunctionMode):
    """Routes the model's attention calls over the chunked tokens to `reference.attend`, in
    call order (the i-th such call of a step is layer i)."""

    def __init__(self, reference: StaleReference):
        super().__init__()
        self.reference, self.layer = reference, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        call = _bind(args, kwargs)
        if not self.reference.is_chunked(call):
            return func(*args, **kwargs)
        self.layer += 1
        return self.reference.attend(self.layer - 1, call)


def _rows(mask: torch.Tensor | None, start: int, stop: int, keys: int) -> torch.Tensor | None:
    """A mask's rows of the queries [start, stop) and its first `keys` columns."""
    if mask is None:
        return None
    rows = mask if mask.dim() < 2 or mask.shape[-2] == 1 else mask[..., start:stop, :]
    return rows if rows.dim() < 1 or rows.shape[-1] == 1 else rows[..., :keys]


def applies(model: torch.nn.Module, programs: Sequence[PipelinedProgram], inputs: tuple
            ) -> str | None:
    """Why StaleReference cannot stand for these programs of `model` (None where it can)."""
    if any(not isinstance(c, CacheSpec) for p in programs for c in p.plan.caches):
        return "the model sums over tokens (stale partial sums)"
    if any(p.plan.text_tokens for p in programs):
        return "the model's attention joins tokens other than the chunked ones (joint text)"
    attending = [p for p in programs if p.plan.caches]
    if not attending:
        return "no attention over the chunked tokens (no K/V caches): nothing is stale"
    if len({(p.plan.tokens, tuple(_bounds(p))) for p in attending}) != 1:
        return (f"the model's {len(programs)} pipelined programs (graph breaks) chunk "
                "their tokens differently")
    found = _Count(attending[0].plan.tokens)
    with found, torch.no_grad():
        model(*inputs[0], **inputs[1])
    caches = sum(len(p.plan.caches) for p in attending)
    if found.causal:
        return "the model's attention is causal"
    if found.chunked != caches:
        return (f"{found.chunked} scaled_dot_product_attention call(s) with queries and keys "
                f"of the {attending[0].plan.tokens} chunked tokens, against {caches} K/V "
                "cache(s) in the plan (attention written out, or over another layout of "
                "the tokens)")
    return None


def reference_for(model: torch.nn.Module, programs: Sequence[PipelinedProgram]
                  ) -> StaleReference:
    """The StaleReference of `programs`' chunks and warmup (those `applies` accepted)."""
    program = next(p for p in programs if p.plan.caches)
    return StaleReference(model, program.plan.tokens, _bounds(program),
                          program.plan.config.warmup_steps)


def _bounds(program: PipelinedProgram) -> list[tuple[int, int]]:
    """The token ranges of `program`'s chunks."""
    plan = program.plan
    per_unit = plan.tokens // plan.units
    return [(c.start * per_unit, c.stop * per_unit) for c in plan.chunks]


class _Count(TorchFunctionMode):
    """Counts one forward's attention calls over `tokens` tokens."""

    def __init__(self, tokens: int):
        super().__init__()
        self.tokens, self.chunked, self.causal = tokens, 0, False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            call = _bind(args, kwargs)
            q, k = call.arguments["query"], call.arguments["key"]
            if q.dim() >= 2 and q.shape[-2] == k.shape[-2] == self.tokens:
                self.chunked += 1
                self.causal |= bool(call.arguments["is_causal"])
        return func(*args, **kwargs)


def reference_calls(model: torch.nn.Module, args: tuple, kwargs: dict, config: Config
                    ) -> list[Inputs]:
    """A generation's steps (its warmup ones and `STALE_STEPS` more): the given input with
    its timestep moved a step at a time and its token inputs changed every other step, so
    each step's K/V differ from the last's."""
    steps = config.warmup_steps + STALE_STEPS
    return [changed_input(model, args, kwargs, config.timestep_input, k, k % 2 == 1,
                          steps - 1) for k in range(steps)]


def check_reference(run: Run, new_generation: Callable[[], None], reference: StaleReference,
                    calls: list[Inputs], first_call: int) -> list[Check]:
    """Each step of a new generation of `calls` against StaleReference's run of them.
    `first_call`: the number of calls made before (for the checks' call numbers)."""
    new_generation()
    reference.new_generation()
    checks = []
    for step, inputs in enumerate(calls):
        actual, chunks = run(inputs)
        expected = reference(*inputs[0], **inputs[1])
        checks.append(compare(f"stale mode, step {step} of a generation against stale "
                              "semantics run eagerly", first_call + step + 1, expected,
                              actual, chunks))
    return checks
