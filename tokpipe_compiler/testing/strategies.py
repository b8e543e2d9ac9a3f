"""Hypothesis strategies for pipelining tests: options valid for a model, and inputs.

    @given(data=st.data())
    def test_any_pipeline(data):
        opts = data.draw(options(model, args))              # stages, chunks, mode, warmup
        latents = data.draw(latents_like(args[0]))
        assert_equivalent(model, (latents, *args[1:]), **opts)
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from hypothesis import strategies as st

from tokpipe_compiler.config import MODES, Config
from tokpipe_compiler.core.errors import NoTokenInput, TokpipeError
from tokpipe_compiler.costmodel.planning_costs import send_cost
from tokpipe_compiler.passes.annotate import annotate
from tokpipe_compiler.planning.capture import Captured, capture
from tokpipe_compiler.planning.driver import (
    assign_stages,
    build_plan,
    copy_graph_module,
    idle_stages,
    sequence_tokens,
    token_batch,
)
from tokpipe_compiler.stage_programs.pipelined import PipelinedProgram


@dataclass(frozen=True)
class ModelFacts:
    """What bounds the options of one model at one input shape."""

    units: int  # rows of the token grid: at most this many chunks
    modes: tuple[str, ...]
    graph: torch.fx.GraphModule = field(repr=False)  # annotated: what the partition cuts
    token_input: torch.fx.Node = field(repr=False)
    tokens: int = 0  # of the sequence, as the plan counts them
    _plans_at: dict[int, bool] = field(default_factory=dict, repr=False, compare=False)

    def max_stages(self, up_to: int) -> int:
        """The most stages, at most `up_to`, such that every count up to it plans: each stage
        has some work to compute (a partition of the whole sequence, as one chunk weighs
        it; the driver warns of a stage without a FLOP) and the graph has places to cut."""
        best = 1
        for stages in range(2, up_to + 1):
            if not self._plans(stages):
                break
            best = stages
        return best

    def _plans(self, stages: int) -> bool:
        if stages not in self._plans_at:
            try:
                with warnings.catch_warnings():  # the warnings of this trial cut
                    warnings.simplefilter("ignore")
                    cut = assign_stages(self.graph, stages, self.tokens, self.tokens,
                                        send_cost(self.token_input))
                self._plans_at[stages] = not idle_stages(cut)
            except TokpipeError:
                self._plans_at[stages] = False
        return self._plans_at[stages]


def model_facts(model: torch.nn.Module, args: tuple, kwargs: dict | None = None) -> ModelFacts:
    """Traced once per model and input shapes (cached while the model lives)."""
    key = tuple(_shape(a) for a in args) + tuple(
        (k, _shape(v)) for k, v in sorted((kwargs or {}).items()))
    per_model = _FACTS.setdefault(model, {})
    if key not in per_model:
        per_model[key] = _measure(model, args, kwargs)
    return per_model[key]


_FACTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _shape(value: object) -> object:
    return tuple(value.shape) if isinstance(value, torch.Tensor) else repr(value)


def _measure(model: torch.nn.Module, args: tuple, kwargs: dict | None) -> ModelFacts:
    for captured in _captured(model, args, kwargs):
        annotated = copy_graph_module(captured.gm)
        try:
            annotation = annotate(annotated, None)
        except NoTokenInput:
            continue
        tokens = sequence_tokens(annotated, annotation.units, token_batch(annotated, annotation))
        modes = tuple(mode for mode in MODES
                      if mode != "causal" or _runs_causal(captured, annotation.units))
        return ModelFacts(annotation.units, modes, annotated, annotation.token_input, tokens)
    raise TokpipeError("no traced graph of this model has a token input to pipeline")


def _captured(model: torch.nn.Module, args: tuple, kwargs: dict | None) -> list[Captured]:
    """capture's graphs; where tracing fails because the model itself fails at these inputs
    (a drawn shape it does not take), that error, said as such."""
    try:
        return capture(model, args, kwargs, fresh=True)
    except TokpipeError:
        raise
    except Exception as err:
        try:
            with torch.no_grad():
                model(*args, **(kwargs or {}))
        except Exception as eager:
            shapes = [_shape(a) for a in [*args, *(kwargs or {}).values()]]
            raise TokpipeError(
                f"the model itself raises at these inputs (shapes {shapes}), run eagerly: "
                f"{type(eager).__name__}: {eager}; draw inputs it takes (latents_like's "
                "`sizes` draws each axis on its own; a tuple of axes as the key draws one "
                "size for all of them, as a square grid needs)") from eager
        raise err


def _runs_causal(captured: Captured, units: int) -> bool:
    """Whether causal mode plans the graph and runs it on the traced inputs: a mask that
    shows a chunk keys of later chunks (padding, not causal) is refused at the call only."""
    config = Config(stages=1, chunks=min(2, units), mode="causal", compiler="eager")
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            PipelinedProgram(build_plan(captured.gm, config))(*captured.inputs)
    except TokpipeError:
        return False
    return True


def options(model: torch.nn.Module, args: tuple, kwargs: dict | None = None, *,
            max_stages: int = 4, max_chunks: int = 8,
            modes: Sequence[str] | None = None) -> st.SearchStrategy[dict]:
    """Backend options valid for `model(*args, **kwargs)`: stages the graph can be cut
    into with work for each, chunks no more than its token rows, modes it supports (causal
    only where it runs on the given inputs: attention causal, or masked to hide later
    keys), warmup_steps 0 or 1. Drawn to pipeline: two stages and two chunks at least
    where the model allows them (one chunk is the whole sequence, which sync mode runs
    anyway), and the chunked modes first, which is where hypothesis shrinks to."""
    facts = model_facts(model, args, kwargs)
    allowed = [m for m in (modes or MODES) if m in facts.modes]
    if not allowed:
        raise ValueError(f"none of modes {list(modes or MODES)} suits this model "
                         f"(it supports {list(facts.modes)})")
    most_stages = facts.max_stages(max_stages)
    most_chunks = max(1, min(max_chunks, facts.units))
    return st.fixed_dictionaries({
        "stages": st.integers(min(2, most_stages), most_stages),
        "chunks": st.integers(min(2, most_chunks), most_chunks),
        "mode": st.sampled_from(sorted(allowed, key=lambda m: m == "sync")),
        "warmup_steps": st.integers(0, 1),
    })


def latents_like(like: torch.Tensor, *,
                 sizes: Mapping[int | tuple[int, ...], Sequence[int]] | None = None
                 ) -> st.SearchStrategy:
    """Tensors of `like`'s dtype and device, normal noise at a drawn seed and scale.

    sizes: axis -> allowed sizes, for models that take several shapes (say, latent sides
    that are multiples of the patch); a tuple of axes draws one size for all of them (a
    square grid: `{(2, 3): [16, 24]}`); by default the shape of `like`. Options drawn for
    `like` may hold more chunks than a smaller drawn grid has rows: draw the latents first,
    then `options(model, (latents, ...))` for them.
    """
    if not like.is_floating_point():
        raise ValueError(f"latents_like needs a floating tensor, got {like.dtype}; draw "
                         "labels or timesteps with hypothesis.strategies.integers")
    groups = _size_choices(like, sizes or {})

    @st.composite
    def draw_latents(draw) -> torch.Tensor:
        shape = list(like.shape)
        for axes, allowed in groups:
            size = draw(st.sampled_from(allowed))
            for axis in axes:
                shape[axis] = size
        seed = draw(st.integers(0, 2**31 - 1))
        noise = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
        scale = draw(st.sampled_from([1.0, 0.1, 10.0]))
        return (noise * scale).to(dtype=like.dtype, device=like.device)

    return draw_latents()


def _size_choices(like: torch.Tensor, sizes: Mapping[Any, Sequence[int]]
                  ) -> list[tuple[tuple[int, ...], list[int]]]:
    """`sizes` checked: integer axes of `like` (negative from the end) or tuples of them,
    each to a non-empty list of positive sizes; as (axes, sizes) pairs."""
    example = f"sizes={{{like.dim() - 2}: [16, 24], {like.dim() - 1}: [16, 24]}}"
    groups = []
    for key, choices in sizes.items():
        for axis in key if isinstance(key, tuple) and key else (key,):
            if isinstance(axis, bool) or not isinstance(axis, int) or \
                    not -like.dim() <= axis < like.dim():
                raise ValueError(f"latents_like sizes: key {key!r} is not an axis of the "
                                 f"{like.dim()}-d latents {tuple(like.shape)}: keys are "
                                 "integer axes (negative from the end) or tuples of them, "
                                 f"e.g. {example}")
        allowed = list(choices)
        if not allowed or not all(isinstance(n, int) and n > 0 for n in allowed):
            raise ValueError(f"latents_like sizes: axis {key} needs a non-empty list of "
                             f"positive integer sizes, got {choices!r}, e.g. {example}")
        axes = tuple(a % like.dim() for a in (key if isinstance(key, tuple) else (key,)))
        groups.append((axes, allowed))
    return groups
