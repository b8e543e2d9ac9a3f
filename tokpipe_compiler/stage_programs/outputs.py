"""A program's token outputs, joined from their chunks' pieces with the layout the traced
graph gives them (and without gradients: an inference backend's)."""

from __future__ import annotations

import torch

from tokpipe_compiler.core.errors import TokpipeError
from tokpipe_compiler.core.fx import example_value
from tokpipe_compiler.core.stage_graph import OutputKind
from tokpipe_compiler.core.warn import warn
from tokpipe_compiler.planning.plan import Plan
from tokpipe_compiler.runtime.chunking import Chunk, assemble


def assemble_output(plan: Plan, spec, pieces: list[torch.Tensor],
                    chunks: list[Chunk]) -> torch.Tensor:
    """A token output from its chunks' pieces, with the layout its stage gives it."""
    info = plan.graphs.stages[spec.producer].output_infos[spec.source]
    return assemble(pieces, spec.axis, info.outer, info.lead, info.trail,
                    [c.segments for c in chunks])


def traced_strides(plan: Plan) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """Each token output's shape and strides as the traced graph gives it. Joined from
    chunks, an output is contiguous; where the model's is not (a transposed patch
    embedding), the graph after a graph break, which Dynamo guards on its inputs' strides,
    would be traced again at the first chunked step."""
    found = {}
    for spec in plan.graphs.outputs:
        if spec.kind != OutputKind.TOKEN:
            continue
        stage = plan.graphs.stages[spec.producer].gm
        value = example_value(next((n for n in stage.graph.nodes if n.name == spec.source),
                                   None))
        if isinstance(value, torch.Tensor):
            found[spec.source] = (tuple(value.shape), tuple(value.stride()))
    return found


def restrided(tensor: torch.Tensor, traced: tuple | None) -> torch.Tensor:
    """`tensor` with the traced strides (`traced_strides`), copied only where they differ."""
    if traced is None or tuple(tensor.shape) != traced[0] or tensor.stride() == traced[1]:
        return tensor
    return torch.empty_strided(tensor.shape, traced[1], dtype=tensor.dtype,
                               device=tensor.device).copy_(tensor)


def warn_no_gradients(args: tuple, said: set[str]) -> None:
    """Outputs carry no gradients: say so once (per `said`) where a caller may expect them
    (grad enabled and an input, a parameter say, requiring grad), not at a later backward()
    far from the cause."""
    if "grad mode" in said or _requiring_grad(args) is None:
        return
    said.add("grad mode")
    warn("tokpipe: called with grad enabled and inputs (parameters, say) that require grad, "
         "but this is an inference backend: its outputs carry no gradients (a backward() "
         "through them raises). Call it under torch.no_grad() or torch.inference_mode() "
         "(diffusers pipelines do), or model.requires_grad_(False)")


def refusing_backward(outputs: tuple, args: tuple) -> tuple:
    """`outputs`, where an input requires grad, as tensors whose backward() raises: a model
    split at graph breaks runs its other graphs with autograd, so a backward() that ended
    at outputs without gradients would fill in the gradients of those graphs' weights and
    leave the pipelined ones' at None, silently."""
    anchor = _requiring_grad(args)
    wrapped = [i for i, o in enumerate(outputs) if isinstance(o, torch.Tensor)
               and o.is_floating_point() and not o.requires_grad]
    if anchor is None or not wrapped:
        return outputs
    refusing = _NoBackward.apply(anchor, *(outputs[i] for i in wrapped))
    found = list(outputs)
    for i, tensor in zip(wrapped, refusing, strict=True):
        found[i] = tensor
    return tuple(found)


def _requiring_grad(args: tuple) -> torch.Tensor | None:
    return next((a for a in args if isinstance(a, torch.Tensor) and a.requires_grad), None)


class _NoBackward(torch.autograd.Function):
    """The identity on a pipeline's outputs; backward raises."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, *outputs: torch.Tensor) -> tuple:
        return tuple(o.detach() for o in outputs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        raise TokpipeError(
            "backward() reached the outputs of a tokpipe pipeline, which carry no gradients "
            "(an inference backend); the gradients of the model's weights would be wrong. "
            "Train or fine-tune the model without the tokpipe backend")
