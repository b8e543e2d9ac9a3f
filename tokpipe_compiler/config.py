"""Options of the tokpipe backend, validated once, up front."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

MODES = ("stale", "causal", "sync")
COMPILERS = ("inductor", "eager")


@dataclass(frozen=True)
class Config:
    """What the user asked for. Every field is checked in `__post_init__`.

    stages: pipeline stages (one per rank when torch.distributed is initialised).
    chunks: token chunks per step (int), or "auto" to let the cost model choose.
    mode: "stale" (PipeFusion), "causal" (TeraPipe, exact) or "sync" (exact reference).
    warmup_steps: calls after a reset that run synchronously and fill the K/V caches.
    compiler: "inductor" compiles each stage with compile_fx; "eager" runs stage graphs as is.
    token_input: name or position of the input that carries the tokens (None: auto-detect).
    fallback: on a graph the pass cannot pipeline, run it unpipelined with a warning.
    timeout: seconds a rank waits for another before it raises, naming what it waited for.
    """

    stages: int = 2
    chunks: int | str = 4
    mode: str = "stale"
    warmup_steps: int = 1
    compiler: str = "inductor"
    token_input: str | int | None = None
    fallback: bool = False
    timeout: float = 300.0

    def __post_init__(self) -> None:
        _check_int("stages", self.stages, 1)
        if self.chunks != "auto":
            _check_int("chunks", self.chunks, 1, extra=' or "auto"')
        _check_choice("mode", self.mode, MODES)
        _check_int("warmup_steps", self.warmup_steps, 0)
        _check_choice("compiler", self.compiler, COMPILERS)
        if self.token_input is not None and not isinstance(self.token_input, (str, int)):
            raise ValueError(
                f"option 'token_input' must be an input name, a position or None, "
                f"got {self.token_input!r}"
            )
        if isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float)) \
                or self.timeout <= 0:
            raise ValueError(
                f"option 'timeout' must be a number of seconds > 0, got {self.timeout!r}"
            )
        if not isinstance(self.fallback, bool):
            raise ValueError(f"option 'fallback' must be True or False, got {self.fallback!r}")

    @classmethod
    def from_options(cls, options: dict[str, Any] | None) -> Config:
        """Build from a torch.compile `options` dict, naming any unknown key."""
        options = dict(options or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(
                f"unknown tokpipe option(s) {unknown}; allowed options are {sorted(known)}"
            )
        return cls(**options)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _check_int(name: str, value: Any, minimum: int, extra: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"option '{name}' must be an int >= {minimum}{extra}, got {value!r}")


def _check_choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"option '{name}' must be one of {list(allowed)}, got {value!r}")
