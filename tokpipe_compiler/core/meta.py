"""The contract between passes: the `node.meta` keys they write and read, and the kinds
they record.

| key                   | written by                         | read by                          |
|-----------------------|------------------------------------|----------------------------------|
| SOURCE_KEY            | backend (`core.fx.record_sources`) | annotate (token input), fx       |
| POSITION_KEY          | backend, capture (`traced_frame`)  | fx (`argument_of`, `position_of`)|
|                       |                                    | static (copied to a static graph)|
| META_KEY (TokenInfo)  | annotate (chunk_attention: its op) | every later pass, cost model     |
| SLICES_KEY            | annotate's rules (transient)       | annotate; popped before it ends  |
| STAGE_KEY             | partition (via the driver)         | split                            |
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

SOURCE_KEY = "tokpipe_source"  # where Dynamo got a placeholder: "L['latents']"
# (parameter name, place in the call) of an argument passed by position through *args
POSITION_KEY = "tokpipe_position"
META_KEY = "tokpipe"  # TokenInfo of the node's value
SLICES_KEY = "tokpipe_slices"  # operands to cut to the chunk, recorded by a rule
# On a node sync mode computes whole for want of a token rule: the rule's reason (a ring
# that cannot carry a whole output names the op, `ring_carry.py`).
WHOLE_REASON_KEY = "tokpipe_whole_reason"
STAGE_KEY = "tokpipe_stage"  # pipeline stage of a token-carrying node


class Kind(str, enum.Enum):
    """How a value depends on the token sequence (see TokenInfo)."""

    TOKEN = "token"
    INVARIANT = "invariant"
    ATTENTION = "attention"
    UNSUPPORTED = "unsupported"
    TOKEN_SUM = "token_sum"


TOKEN, INVARIANT, ATTENTION, UNSUPPORTED, TOKEN_SUM = Kind


@dataclass(frozen=True)
class TokenInfo:
    """How one FX value depends on the token sequence.

    kind: TOKEN (rows of `axis` follow the token grid), INVARIANT (no token dependence:
    timestep and text conditioning, parameters), ATTENTION (an attention node that mixes
    tokens only through K/V; its output is token-carrying along `axis`), TOKEN_SUM (a sum
    over the token axis that mixes tokens only through a cache of per-unit partial sums;
    its output changes with the chunk: per_unit 0 when the token axis is summed away) or
    UNSUPPORTED.
    axis: the token axis of the value (TOKEN and ATTENTION).
    per_unit: elements along `axis` per grid unit. A unit is one row of the token grid
    (one patch row of an image latent), so a chunk of units [u0, u1) is the slice
    [u0 * per_unit, u1 * per_unit) of `axis`.
    reason: for UNSUPPORTED, why.
    lead, trail: elements along `axis` before and after the chunked range that every chunk
    carries whole: the text tokens of joint text+image attention. A value that is only such
    a segment (the text stream after joint attention) has per_unit 0: it changes with the
    chunk but its size does not.
    outer: blocks the token layout repeats in along `axis`, outermost: a batch (or the
    guidance branches) merged with the frames, `[B * F, ...]`, has outer B. Block b holds
    elements [b * n, (b + 1) * n) of the axis, n = lead + units * per_unit + trail, and a
    chunk is its range in every block.
    """

    kind: Kind
    axis: int | None = None
    per_unit: int | None = None
    reason: str | None = None
    lead: int = 0
    trail: int = 0
    outer: int = 1

    @property
    def carries_tokens(self) -> bool:
        return self.kind in (TOKEN, ATTENTION, TOKEN_SUM)

    @property
    def segmented(self) -> bool:
        return bool(self.lead or self.trail)

    @property
    def only_segment(self) -> bool:
        """A token value none of whose rows are the chunk's own: the text stream, which a
        chunk that leaves the text to the step's first chunk does not compute."""
        return self.carries_tokens and self.segmented and not self.per_unit

    def extent(self, units: int, segments: bool = True) -> int:
        """Size of the token axis on a chunk of `units` grid units, with or without the
        segments (a chunk that leaves the text to the step's first chunk has none)."""
        return self.outer * self.block(units, segments)

    def block(self, units: int, segments: bool = True) -> int:
        """Elements of one outer block on a chunk of `units` grid units."""
        rows = units * self.per_unit
        return self.lead + rows + self.trail if segments else rows

    def moved(self, axis: int, kind: Kind = TOKEN) -> TokenInfo:
        """The same token layout on another axis."""
        return replace(self, kind=kind, axis=axis)


INVARIANT_INFO = TokenInfo(INVARIANT)


def token(axis: int, per_unit: int) -> TokenInfo:
    return TokenInfo(TOKEN, axis, per_unit)
