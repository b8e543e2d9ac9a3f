"""What every token rule module shares: the rule signature, the context a rule reads, a
registration decorator bound to the module's own table, and small helpers.

A rule sees a node with at least one token-carrying input and returns the node's TokenInfo
(UNSUPPORTED, with a reason, for an op that mixes tokens). Each rule module keeps its own
table; `rules.py` merges them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from fractions import Fraction
from typing import Any

import torch.fx

from tokpipe_compiler.core.args import arg
from tokpipe_compiler.core.fx import example_value, node_shape
from tokpipe_compiler.core.meta import SLICES_KEY, TOKEN_SUM, UNSUPPORTED, TokenInfo
from tokpipe_compiler.passes import segments

Rule = Callable[[torch.fx.Node, "RuleContext"], TokenInfo]
Register = Callable[..., Callable[[Rule], Rule]]


class RuleContext:
    """What a rule may ask: the TokenInfo of any earlier node. What it may require: `bands`
    that every chunk holds whole (see keep_bands)."""

    def __init__(self, infos: dict[torch.fx.Node, TokenInfo]):
        self.infos = infos
        self.bands: set[Fraction] = set()

    def keep_bands(self, per_unit: Fraction) -> None:
        """Chunks hold whole bands of the op's input rows, `per_unit` bands per grid unit (a
        Fraction, as a TokenInfo's): annotate makes the unit a multiple of its denominator.
        For an op whose output's TokenInfo does not show the band: F.unfold lays each band
        of 2 latent rows out as the next 8 tokens, and per_unit 4 alone would allow a chunk
        of 1 latent row."""
        self.bands.add(Fraction(per_unit))

    def info(self, arg: Any) -> TokenInfo | None:
        return self.infos.get(arg) if isinstance(arg, torch.fx.Node) else None

    def token_args(self, node: torch.fx.Node) -> list[torch.fx.Node]:
        return [a for a in node.all_input_nodes if self.infos[a].carries_tokens]


def mixes_tokens(rule: Rule) -> Rule:
    """Marks a rule whose op may mix tokens itself (attention through a K/V cache, a sum or
    a convolution through a cache of partial sums or rows): an ATTENTION or TOKEN_SUM info
    it makes anew is its op's own, even where it equals its input's (one such op fed
    straight by another). Such an info from any other rule, or handed on from an input,
    is the input's layout only (`annotate` makes it TOKEN)."""
    rule.mixes_tokens = True  # type: ignore[attr-defined]
    return rule


def registrar(table: dict[Any, Rule]) -> Register:
    """A `@register(*op_keys)` decorator that writes into `table`. Two different rules for
    one key in a table is an error (the same rule under aliases of one op is not)."""

    def register(*keys: Any) -> Callable[[Rule], Rule]:
        def wrap(rule: Rule) -> Rule:
            for key in keys:
                if table.get(key, rule) is not rule:
                    raise ValueError(f"op {key!r} has two rules: {table[key].__name__} and "
                                     f"{rule.__name__}")
                table[key] = rule
            return rule

        return wrap

    return register


def unsupported(reason: str) -> TokenInfo:
    return TokenInfo(UNSUPPORTED, reason=reason)


def summed(node: torch.fx.Node, info: TokenInfo, what: str) -> TokenInfo:
    """A sum over the token axis of `info` that chunk_sums pipelines with a partial-sum
    cache: the result holds no chunked range, so every chunk has all of it (per_unit 0)."""
    why = sum_refusal(info)
    if why:
        return unsupported(f"{what} over the token axis mixes tokens; it can be pipelined "
                           f"with partial sums, but not here: {why}")
    value = example_value(node)
    if not isinstance(value, torch.Tensor) or not value.dim():
        return unsupported(f"{what} over the token axis down to a scalar mixes tokens")
    return replace(segments.whole(value), kind=TOKEN_SUM)


def sum_refusal(info: TokenInfo) -> str:
    """Why a sum over this token layout cannot keep per-unit partial sums, or ''."""
    if info.segmented or not info.per_unit:
        return "the token axis holds whole text segments"
    if info.outer > 1:
        return ("the token axis repeats in outer blocks (another axis, the batch rows or "
                "the frames, merged into it)")
    return ""


def first_token(node: torch.fx.Node, ctx: RuleContext) -> tuple[torch.fx.Node, TokenInfo]:
    """The node's first token-carrying input and its TokenInfo."""
    arg = ctx.token_args(node)[0]
    return arg, ctx.infos[arg]


def slice_operand(node: torch.fx.Node, operand: torch.fx.Node, axis: int, info: TokenInfo) -> str:
    """Record that an invariant operand is a per-token table (a positional embedding, say)
    that must be cut to the chunk before `node` uses it; returns why it cannot be, or ''.
    `axis`: the operand's axis that lines up with the token axis of `info`, `node`'s own."""
    if not info.per_unit:
        return ""  # a segment-only value: every chunk uses the table whole
    table, full = node_shape(operand)[axis], node_shape(node)[info.axis]
    if table != full:
        return (f"a per-token table of {table} rows meets a token axis of {full} rows (a "
                "table longer than the sequence must be cut to it before the model uses it)")
    node.meta.setdefault(SLICES_KEY, []).append((operand, axis, info.moved(axis)))
    return ""


def scaled_per_unit(info: TokenInfo, scale: int) -> TokenInfo:
    """The same info with per_unit multiplied by the grid scale (Fraction -> int)."""
    if not info.carries_tokens:
        return info
    return replace(info, per_unit=int(Fraction(info.per_unit) * scale))


def source(node: torch.fx.Node) -> Any:
    """What the op is applied to: a method's tensor, a function's first argument."""
    return arg(node, 0, "input")
