"""In-place writes of token values that a chunked graph cannot keep: into a graph input
(a buffer, parameter or argument that outlives the call) or into a tensor computed without
tokens, whose readers would take it for the same in every chunk."""

from __future__ import annotations

import operator

import torch
import torch.fx

from tokpipe_compiler.core.meta import INVARIANT, TokenInfo
from tokpipe_compiler.passes.rules import IN_PLACE
from tokpipe_compiler.passes.split import written_base


def written_reason(written: torch.fx.Node) -> str:
    """Why a write of token values into `written` (see tokens_written_into) is refused."""
    name = written.name
    if written.op == "placeholder":
        return (f"it writes a value computed from the tokens in place into '{name}', a graph "
                "input (a buffer, parameter or argument) that outlives the call: pipelined, "
                "each chunk would write its own part, and only on its stage's rank; update it "
                "outside the compiled model")
    return (f"it writes a value computed from the tokens in place into '{name}', a tensor "
            "computed without them, which its readers would take for the same in every "
            f"chunk; write it out of place ({name} = {name} + ...)")


def tokens_written_into(node: torch.fx.Node,
                         infos: dict[torch.fx.Node, TokenInfo]) -> torch.fx.Node | None:
    """The tensor without tokens that `node` writes a value read from the tokens into, in
    place: an input (or a view of it), or a value computed without tokens (its readers
    would read it as invariant). None for a write of invariant values, which runs once per
    call in the prelude. An item assignment into a computed value has its own rule
    (`x[:, :n] = h` fills a buffer of the tokens' length)."""
    base = written_base(node)
    if base is None or (node in infos and infos[node].kind == INVARIANT):
        return None
    if base.op == "placeholder":
        return base
    if node.target is operator.setitem or base not in infos:
        return None
    return base if not infos[base].carries_tokens else None


def writes_into_invariant(node: torch.fx.Node, infos: dict[torch.fx.Node, TokenInfo]) -> bool:
    """An in-place write into a tensor without tokens."""
    if node.target not in IN_PLACE or not isinstance(node.args[0], torch.fx.Node):
        return False
    target = infos.get(node.args[0])
    return target is None or not target.carries_tokens
