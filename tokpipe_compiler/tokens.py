"""What the annotate pass records on every node: how a value depends on the tokens."""

from __future__ import annotations

from dataclasses import dataclass

TOKEN = "token"
INVARIANT = "invariant"
ATTENTION = "attention"
UNSUPPORTED = "unsupported"

META_KEY = "tokpipe"


@dataclass(frozen=True)
class TokenInfo:
    """How one FX value depends on the token sequence.

    kind: TOKEN (rows of `axis` follow the token grid), INVARIANT (no token dependence:
    timestep and text conditioning, parameters), ATTENTION (an attention node that mixes
    tokens only through K/V; its output is token-carrying along `axis`) or UNSUPPORTED.
    axis: the token axis of the value (TOKEN and ATTENTION).
    per_unit: elements along `axis` per grid unit. A unit is one row of the token grid
    (one patch row of an image latent), so a chunk of units [u0, u1) is the slice
    [u0 * per_unit, u1 * per_unit) of `axis`.
    reason: for UNSUPPORTED, why.
    """

    kind: str
    axis: int | None = None
    per_unit: int | None = None
    reason: str | None = None

    @property
    def carries_tokens(self) -> bool:
        return self.kind in (TOKEN, ATTENTION)


INVARIANT_INFO = TokenInfo(INVARIANT)


def token(axis: int, per_unit: int) -> TokenInfo:
    return TokenInfo(TOKEN, axis, per_unit)
