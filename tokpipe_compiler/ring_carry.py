"""What a ring can carry from one step to the next: an output the stages compute token by
token, in the carried input's dtype, that the stages read back cut per chunk.

An output every chunk computes whole cannot be carried chunk by chunk. Where that is
because sync mode planned an op without a token rule whole (an attention backend tokpipe
does not chunk, such as diffusers' flex attention), `WholeCarry` names the op: the step
runs per call, not as a ring.
"""

from __future__ import annotations

from typing import Any

import torch

from tokpipe_compiler.core.errors import OneUnitGrid, TokpipeError, describe
from tokpipe_compiler.core.fx import example_value
from tokpipe_compiler.core.meta import WHOLE_REASON_KEY
from tokpipe_compiler.core.stage_graph import SLICED, OutputKind, SplitGraphs
from tokpipe_compiler.planning.capture import Captured
from tokpipe_compiler.planning.plan import Plan


class WholeCarry(TokpipeError):
    """A carried output computed whole after an op with no token rule (sync mode): a
    parallelized pipeline runs such a generation per call."""


def check_carry(name: str, traced: Captured, first: str, placeholder: str, spec: Any,
                plan: Plan) -> None:
    """Raises unless output `spec` can feed carried input `name` (graph input
    `placeholder`; `first`: the first carried input) chunk by chunk: a token-wise value of
    the image tokens, in the input's dtype (the stages are compiled for it), that the
    stages read as a token input cut per chunk."""
    if spec.kind != OutputKind.TOKEN:
        raise TokpipeError(f"carried input {name!r} is fed by an output that is not "
                           f"laid out like {first!r}, token by token: carry only "
                           f"tensors shaped like {first!r} and updated token-wise "
                           "(pass step counters and other per-step values in per_step)")
    stage = plan.graphs.stages[spec.producer]
    given = traced.inputs[traced.names.index(placeholder)]
    made = example_value(next((n for n in stage.gm.graph.nodes if n.name == spec.source), None))
    if isinstance(given, torch.Tensor) and isinstance(made, torch.Tensor) and \
            given.dtype != made.dtype:
        raise TokpipeError(f"carried input {name!r} is passed as {given.dtype} but the step "
                           f"returns it as {made.dtype}; pass its first value as "
                           f"{made.dtype} (e.g. torch.zeros_like(x, dtype={made.dtype}))")
    info = stage.output_infos[spec.source]
    if info.segmented or not info.per_unit:
        _refuse_whole(name, plan)
    if not _read_per_chunk(plan.graphs, placeholder):
        raise TokpipeError(
            f"carried input {name!r} is not read as a token input laid out like {first!r} "
            "(it has another shape, or a non-float dtype), so every ring step would read "
            f"its first value; carry only inputs shaped like {first!r}")


def _refuse_whole(name: str, plan: Plan) -> None:
    """The error for carried input `name` fed by an output every chunk computes whole."""
    said = f"carried input {name!r} is fed by an output that every chunk computes whole"
    reasons = (": text tokens joined to the image's (carry only the image tokens), or an "
               "update that mixes tokens (a quantile, norm or mean over the whole latent: "
               "ring mode needs a token-wise update)")
    if plan.units == 1:  # a layout of one unit: the image's cannot be told from text's
        raise OneUnitGrid(f"{said}{reasons} (the token grid is one unit here, where the image "
                          "tokens' layout cannot be told from text's: a ring needs two units "
                          "or more)")
    op = _first_whole_op(plan.graphs)
    if op is not None:
        raise WholeCarry(
            f"{said}: no token rule chunks {describe(op)} ({op.meta[WHOLE_REASON_KEY]}), so "
            "mode='sync' computes it, and all that follows from it, whole, and a ring, "
            "which carries its latents chunk by chunk, cannot run the step: run it per call "
            "(a parallelized pipeline does so by itself). Where the op is an attention "
            "backend (transformer.set_attention_backend(...)), the default one is chunked "
            "in every mode")
    raise TokpipeError(said + reasons)


def _first_whole_op(graphs: SplitGraphs) -> Any:
    """The first op, in the prelude or a stage, that sync mode computes whole for want of
    a token rule (None: none)."""
    for gm in (graphs.prelude, *(stage.gm for stage in graphs.stages)):
        for node in gm.graph.nodes:
            if WHOLE_REASON_KEY in node.meta:
                return node
    return None


def _read_per_chunk(graphs: SplitGraphs, placeholder: str) -> bool:
    """Whether the stages read input `placeholder` as a token input, each chunk's rows of it
    (what a carried chunk replaces), and nothing computes with it whole in the per-call
    prelude or reads it as a table: a ring step would see its first value there."""
    node = next((n for n in graphs.prelude.graph.nodes
                 if n.op == "placeholder" and n.name == placeholder), None)
    if node is not None and any(user.op != "output" for user in node.users):
        return False
    return all(i.kind == SLICED and i.name == placeholder
               for stage in graphs.stages for i in stage.inputs if i.source == placeholder)
