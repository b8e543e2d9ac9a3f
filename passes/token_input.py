"""Which graph input carries the tokens, and its candidate token axes (annotate's seed)."""

from __future__ import annotations

import torch
import torch.fx

from tokpipe_compiler.core.errors import NoTokenInput, TokpipeError
from tokpipe_compiler.core.fx import example_value, is_user_input, node_shape, source_name


def find_token_input(gm: torch.fx.GraphModule, choice: str | int | None) -> torch.fx.Node:
    """The placeholder carrying the tokens: named, by position among user inputs, or the
    largest floating user input of rank >= 3."""
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder" and is_user_input(n)]
    if isinstance(choice, str):
        for node in inputs:
            if choice in (node.name, node.target) or node.name == f"l_{choice}_" \
                    or source_name(node) == f"L['{choice}']":
                return node
        raise NoTokenInput(
            f"token_input={choice!r} matches no input of the graph; inputs are "
            f"{[n.name for n in inputs]}"
        )
    if isinstance(choice, int):
        if not 0 <= choice < len(inputs):
            raise TokpipeError(f"token_input={choice} is out of range: {len(inputs)} inputs")
        return inputs[choice]
    candidates = [n for n in inputs if _is_float(n) and len(node_shape(n)) >= 3]
    if not candidates:
        raise NoTokenInput(
            "no input looks like a token sequence (a float tensor of rank >= 3); pass "
            "options={'token_input': NAME} to name it"
        )
    return max(candidates, key=lambda n: node_shape(n).numel())


def seed_axes(node: torch.fx.Node) -> list[int]:
    """Candidate token axes, in order: rows of an image latent [B, C, H, W]; the sequence of
    tokens [B, L, D] (or [B, C, L]) or ids [B, L]; frames of a video [B, C, F, H, W] (or
    [B, F, C, H, W])."""
    ndim = len(node_shape(node))
    return {2: [1], 3: [1, 2], 4: [2], 5: [2, 1]}.get(ndim, [1])


def _is_float(node: torch.fx.Node) -> bool:
    value = example_value(node)
    return isinstance(value, torch.Tensor) and value.is_floating_point()
