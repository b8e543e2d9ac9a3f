"""Options of the tokpipe backend, validated once, up front."""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from tokpipe_compiler.runtime.transport import MAX_TIMEOUT

MODES = ("stale", "causal", "sync")
COMPILERS = ("inductor", "max-autotune", "eager")
# torch.compile's `mode`, which it hands to every backend, as tokpipe options.
TORCH_MODES: dict[str, dict[str, Any]] = {
    "default": {},
    "reduce-overhead": {"cuda_graphs": True},
    "max-autotune": {"compiler": "max-autotune", "cuda_graphs": True},
    "max-autotune-no-cudagraphs": {"compiler": "max-autotune"},
}
TEXT_CHUNKS = ("first", "every")
ATTENTION_KERNELS = ("sdpa", "triton")


@dataclass(frozen=True)
class Config:
    """What the user asked for. Every field is checked in `__post_init__`.

    stages: pipeline stages (one per rank when torch.distributed is initialised).
    chunks: token chunks per step: a count (equal chunks), "auto" (the cost model chooses:
        a count for stale mode, TeraPipe's uneven lengths for causal mode), or a sequence of
        token lengths, one per chunk, in whole rows of the token grid.
    mode: "stale" (PipeFusion), "causal" (TeraPipe, exact) or "sync" (exact reference).
    warmup_steps: calls after a reset that run synchronously and fill the K/V caches.
    compiler: "inductor" compiles each stage with compile_fx; "max-autotune" the same with
        Inductor's max-autotune options (matmul and Triton configurations benchmarked at
        compile time: slower compiles); "eager" runs stage graphs as is.
    token_input: name or position of the input that carries the tokens (None: auto-detect).
    timestep_input: the forward's parameter that carries the timestep, which tells steps,
        guidance branches and generations apart (None: the first of TIMESTEP_NAMES); or
        its position in the call, where the forward takes (*args, **kwargs).
    fallback: on a graph the pass cannot pipeline, run it unpipelined with a warning.
    timeout: seconds a rank waits for another before it raises, naming what it waited for.
    cuda_graphs: replay each chunk of a stage from a CUDA graph (GPU runs), so a chunk's
        kernel launches cost one replay; stages that cannot be captured warn and run as is.
    text_chunks: which chunks of a stale step compute the text tokens of joint attention:
        "first" (the later chunks attend to the text's K/V as the first chunk left them, so
        the text is computed once a step) or "every" (each chunk computes its own copy).
    attention: how a chunk writes its K/V cache and attends over it: "sdpa" (a cache copy,
        then the library's attention: cuDNN or flash on a GPU) or "triton" (both in one
        fused Triton kernel; CUDA only, layers without masks or text segments, the others
        warn and use SDPA). On an H200 the library's kernels were faster.
    """

    stages: int = 2
    chunks: int | str | tuple[int, ...] = 4
    mode: str = "stale"
    warmup_steps: int = 1
    compiler: str = "inductor"
    token_input: str | int | None = None
    timestep_input: str | int | None = None
    fallback: bool = False
    timeout: float = 300.0
    cuda_graphs: bool = False
    text_chunks: str = "first"
    attention: str = "sdpa"

    def __post_init__(self) -> None:
        _check_int("stages", self.stages, 1)
        if isinstance(self.chunks, (list, tuple)):
            object.__setattr__(self, "chunks", _token_lengths(self.chunks))
        elif self.chunks != "auto":
            _check_int("chunks", self.chunks, 1, extra=' or "auto" or a list of token lengths')
        _check_choice("mode", self.mode, MODES)
        _check_int("warmup_steps", self.warmup_steps, 0)
        _check_choice("compiler", self.compiler, COMPILERS)
        _check_choice("text_chunks", self.text_chunks, TEXT_CHUNKS)
        _check_choice("attention", self.attention, ATTENTION_KERNELS)
        if self.token_input is not None and not isinstance(self.token_input, (str, int)):
            raise ValueError(
                f"option 'token_input' must be an input name, a position or None, "
                f"got {self.token_input!r}"
            )
        stamp = self.timestep_input
        if stamp is not None and not isinstance(stamp, str) and \
                not (isinstance(stamp, int) and not isinstance(stamp, bool) and stamp >= 0):
            raise ValueError(f"option 'timestep_input' must be the forward's parameter name, "
                             f"a position in the call or None, got {stamp!r}")
        _check_timeout(self.timeout)
        for name in ("fallback", "cuda_graphs"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"option '{name}' must be True or False, "
                                 f"got {getattr(self, name)!r}")

    @classmethod
    def from_options(cls, options: dict[str, Any] | None, torch_mode: str | None = None
                     ) -> Config:
        """Build from a torch.compile `options` dict, naming any unknown key; torch.compile's
        `mode` (`torch_mode`) sets the options it stands for (TORCH_MODES) on top."""
        options = dict(options or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(
                f"unknown tokpipe option(s) {unknown}; allowed options are {sorted(known)}"
            )
        return cls(**options).with_torch_mode(torch_mode)

    def with_torch_mode(self, torch_mode: str | None) -> Config:
        """This config with the options torch.compile's `mode` stands for."""
        if torch_mode is None:
            return self
        if torch_mode not in TORCH_MODES:
            raise ValueError(f"torch.compile mode {torch_mode!r} has no meaning for tokpipe; "
                             f"use one of {list(TORCH_MODES)} or tokpipe's own options")
        return replace(self, **TORCH_MODES[torch_mode])

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


# torch.distributed keeps timeouts as a timedelta in milliseconds; a week (MAX_TIMEOUT) is
# far past any real wait and well inside what every backend converts without overflow.


def _check_timeout(value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not 0 < value <= MAX_TIMEOUT:  # also rejects nan
        raise ValueError(f"option 'timeout' must be a finite number of seconds, > 0 and "
                         f"<= {MAX_TIMEOUT:.0f} (a week), got {value!r}")


def _check_int(name: str, value: Any, minimum: int, extra: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"option '{name}' must be an int >= {minimum}{extra}, got {value!r}")


def parse_chunks(text: str) -> int | str | tuple[int, ...]:
    """The `chunks` option from a command line: "auto", a count, or comma-separated token
    lengths ("1728,960,768,640")."""
    if text == "auto":
        return text
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--chunks must be auto, a count or comma-separated token lengths, got {text!r}"
        ) from None
    return values[0] if len(values) == 1 and "," not in text else values


def _token_lengths(value: list | tuple) -> tuple[int, ...]:
    if not value or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in value):
        raise ValueError(
            f"option 'chunks' as a sequence must hold token lengths (ints >= 1), got {value!r}"
        )
    return tuple(value)


def _check_choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"option '{name}' must be one of {list(allowed)}, got {value!r}")
