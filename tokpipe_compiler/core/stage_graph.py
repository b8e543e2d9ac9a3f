"""The stage graphs the compiler hands the runtime: one GraphModule per stage, what each of
its inputs is and where its outputs go.

Every value a stage reads from outside comes in as a placeholder of one of three kinds:
  boundary  a token value computed by an earlier stage for the same chunk (sent to it)
  sliced    a full per-call tensor cut to the chunk by the runtime (the token input,
            positional tables, mask rows)
  call      a per-call value (parameters, timestep and text conditioning, K/V caches,
            the chunk descriptor)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

from tokpipe_compiler.core.meta import TokenInfo


class InputKind(str, enum.Enum):
    """Where a stage input comes from (see the module docstring)."""

    BOUNDARY = "boundary"
    SLICED = "sliced"
    CALL = "call"


class OutputKind(str, enum.Enum):
    """What one element of the graph's output tuple is."""

    TOKEN = "token"  # assembled from the chunks of the stage that computes it
    CALL = "call"  # a per-call value (from the prelude or the inputs)
    CONST = "const"  # a constant Dynamo left in the output


BOUNDARY, SLICED, CALL = InputKind


@dataclass(frozen=True)
class StageInput:
    name: str  # placeholder name inside the stage graph
    kind: InputKind
    source: str  # the value it is read from (a per-call value for SLICED)
    axis: int | None = None
    per_unit: int | None = None
    producer: int | None = None  # stage that computes a BOUNDARY value


@dataclass(frozen=True)
class OutputSpec:
    """One element of the graph's output tuple."""

    kind: OutputKind
    source: Any  # value name, or the constant itself
    axis: int | None = None
    per_unit: int | None = None
    producer: int | None = None


@dataclass
class StageGraph:
    index: int
    gm: torch.fx.GraphModule  # at full sequence length; specialised per chunk length later
    inputs: list[StageInput]
    outputs: list[str]
    # How each output depends on the tokens: its axis, per_unit and whole text segments.
    output_infos: dict[str, TokenInfo] = field(default_factory=dict)


@dataclass
class SplitGraphs:
    prelude: torch.fx.GraphModule
    prelude_outputs: list[str]
    input_names: list[str]  # placeholders of the original graph, in call order
    stages: list[StageGraph]
    outputs: list[OutputSpec]
