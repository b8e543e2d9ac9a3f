"""assert_equivalent's check of stale steps against `stale_reference`: where the reference
stands for a model's programs, and a generation run by both.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from tokpipe_compiler.config import Config
from tokpipe_compiler.runtime.caches import CacheSpec
from tokpipe_compiler.stage_programs.pipelined import PipelinedProgram
from tokpipe_compiler.testing.checks import Check, compare
from tokpipe_compiler.testing.inputs import Inputs, changed_input
from tokpipe_compiler.testing.stale_reference import AttentionCount, Layout, StaleReference

# A compiled call: inputs -> (output, the chunks it ran as)
Run = Callable[[Inputs], tuple[Any, int | None]]
STALE_STEPS = 3  # steps compared after the warmup ones


def applies(model: torch.nn.Module, programs: Sequence[PipelinedProgram], inputs: Inputs
            ) -> str | None:
    """Why StaleReference cannot stand for `programs` (those that ran one call of
    `model`, in order) on `inputs`; None where it can."""
    others = [c for p in programs for c in p.plan.caches if not isinstance(c, CacheSpec)]
    if any(getattr(c, "rows", False) for c in others):
        return "the model convolves across rows (stale rows at the chunks' edges)"
    if others:
        return "the model sums over tokens (stale partial sums)"
    attending = [p for p in programs if p.plan.caches]
    if not attending:
        return "no attention over the chunked tokens (no K/V caches): nothing is stale"
    if len({(p.plan.tokens, tuple(_bounds(p))) for p in attending}) != 1:
        return (f"the model's {len(programs)} pipelined programs (graph breaks) chunk "
                "their tokens differently")
    if any(p.plan.text_tokens for p in attending) and \
            attending[0].plan.config.text_chunks != "first":
        return "text_chunks='every': each chunk computes a copy of the joined tokens"
    layouts = _layouts(attending)
    if any(layout.length != c.k_shape[-2] for layout, c in
           zip(layouts, (c for p in attending for c in p.plan.caches), strict=True)):
        return "a K/V cache holds another layout of the tokens"
    found = AttentionCount(layouts)
    with found, torch.no_grad():
        model(*inputs[0], **inputs[1])
    if found.causal:
        return "the model's attention is causal"
    if found.found != len(layouts) or found.matched != len(layouts):
        return (f"{found.found} scaled_dot_product_attention call(s) whose queries and keys "
                f"have the chunked sequence's length, against {len(layouts)} K/V cache(s) in "
                "the plan (attention written out, over another layout of the tokens, or a "
                "cross-attention whose text is as long)")
    return None


def reference_for(model: torch.nn.Module, programs: Sequence[PipelinedProgram]
                  ) -> StaleReference:
    """The StaleReference of `programs`' attention, chunks and warmup (where `applies`)."""
    attending = [p for p in programs if p.plan.caches]
    return StaleReference(model, _layouts(attending), _bounds(attending[0]),
                          attending[0].plan.config.warmup_steps)


def _layouts(attending: Sequence[PipelinedProgram]) -> list[Layout]:
    return [Layout(c.lead, p.plan.tokens, c.trail) for p in attending for c in p.plan.caches]


def _bounds(program: PipelinedProgram) -> list[tuple[int, int]]:
    """The chunked-token ranges of `program`'s chunks."""
    plan = program.plan
    per_unit = plan.tokens // plan.units
    return [(c.start * per_unit, c.stop * per_unit) for c in plan.chunks]


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
