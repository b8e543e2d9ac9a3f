"""One way to run a compiler pass: named, its graph dumped when logging asks, its promise
checked.

    result = run_pass(ANNOTATE, annotate, gm, config.token_input)

A pass's promise is what it leaves in `node.meta` for the passes after it (the contract in
`core/meta.py`). A broken promise is a bug in the compiler, never the user's model, so it
raises CompilerBug naming the pass and the node.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.fx

from tokpipe_compiler.core.errors import CompilerBug
from tokpipe_compiler.core.logs import dump_graph
from tokpipe_compiler.core.meta import (
    ATTENTION,
    META_KEY,
    SLICES_KEY,
    STAGE_KEY,
    TOKEN_SUM,
    UNSUPPORTED,
    TokenInfo,
)

R = TypeVar("R")


@dataclass(frozen=True)
class PassSpec:
    """A pass as the driver lists it: its name, the meta keys it reads and writes, and the
    check of what it promises the passes after it."""

    name: str
    reads: tuple[str, ...]
    writes: tuple[str, ...]
    promise: Callable[[torch.fx.GraphModule], None]
    # The graphs to dump after it, by name: the graph it rewrote, unless it makes new ones.
    made: Callable[[Any, torch.fx.GraphModule], list[tuple[str, torch.fx.GraphModule]]] = (
        lambda result, gm: [("", gm)])


def run_pass(spec: PassSpec, fn: Callable[..., R], gm: torch.fx.GraphModule, *args: Any) -> R:
    """`fn(gm, *args)`, then the pass's promise checked on `gm` and what it made dumped."""
    result = fn(gm, *args)
    gm.graph.lint()
    spec.promise(gm)
    for name, graph in spec.made(result, gm):
        dump_graph(f"{spec.name}/{name}" if name else spec.name, graph)
    return result


def _computed(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op != "output"]


def annotated(gm: torch.fx.GraphModule) -> None:
    """Every value has a supported TokenInfo; no rule left operands to slice behind."""
    for node in _computed(gm):
        info = node.meta.get(META_KEY)
        if not isinstance(info, TokenInfo) or info.kind == UNSUPPORTED:
            raise CompilerBug("annotate", node, f"has no supported TokenInfo ({info!r})")
        if SLICES_KEY in node.meta:
            raise CompilerBug("annotate", node, "still holds operands to slice")


def staged(gm: torch.fx.GraphModule) -> None:
    """Stages rise along graph order: each stage is one contiguous run of nodes."""
    last = 0
    for node in _computed(gm):
        stage = node.meta.get(STAGE_KEY)
        if stage is None:
            continue
        if stage < last:
            raise CompilerBug("partition", node, f"is on stage {stage} after stage {last}")
        last = stage


def attention_chunked(gm: torch.fx.GraphModule) -> None:
    """No token-mixing attention is left but the kv_attention calls."""
    for node in _computed(gm):
        if node.meta[META_KEY].kind == ATTENTION and \
                node.target is not torch.ops.tokpipe.kv_attention.default:
            raise CompilerBug("chunk_attention", node, "is attention left unchunked")


def sums_chunked(gm: torch.fx.GraphModule) -> None:
    """No sum over tokens is left but the partial-sum ops (none at all in sync mode)."""
    ops = {torch.ops.tokpipe.token_sum.default, torch.ops.tokpipe.token_matmul.default,
           torch.ops.tokpipe.token_group_norm.default, torch.ops.tokpipe.halo_conv.default}
    for node in _computed(gm):
        if node.meta[META_KEY].kind == TOKEN_SUM and node.target not in ops:
            raise CompilerBug("chunk_sums", node, "is a sum over tokens left unchunked")


def nothing(gm: torch.fx.GraphModule) -> None:
    """A pass that only reads the graph promises nothing about it."""
