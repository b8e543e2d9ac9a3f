"""What `assert_equivalent` compares and reports: one `Check` per compared call, the
`Report` of them all, and `NotEquivalent`, raised on the first that fails."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from tokpipe_compiler.testing.locate import Where


@dataclass(frozen=True)
class Check:
    """One compared call: its largest difference from the reference (eager, or the same
    program's run of one guidance branch alone)."""

    name: str
    call: int  # 1-based
    error: float  # max |pipelined - reference| over the output
    scale: float  # max |reference|
    output: int  # which tensor of the flattened output holds the largest difference
    index: tuple[int, ...]  # where in it
    expected: float
    actual: float
    chunks: int | None = None  # the chunks the call ran as (1: the whole sequence)

    def passes(self, rtol: float) -> bool:
        return self.error <= rtol * self.scale

    def __str__(self) -> str:
        ran = "" if self.chunks is None else \
            " [whole sequence]" if self.chunks == 1 else f" [{self.chunks} chunks]"
        return (f"{self.name} (call {self.call}){ran}: max |pipelined - reference| = "
                f"{self.error:.3e} at output[{self.output}][{', '.join(map(str, self.index))}]"
                f" (reference {self.expected:.6g}, pipelined {self.actual:.6g}); max "
                f"|reference| {self.scale:.3e}")


@dataclass
class Report:
    """What assert_equivalent compared; `str(report)` lists every check."""

    options: dict[str, Any]
    rtol: float
    checks: list[Check] = field(default_factory=list)
    unchecked: list[str] = field(default_factory=list)  # what was not checked, and why

    @property
    def max_relative_error(self) -> float:
        return max((c.error / c.scale if c.scale else c.error for c in self.checks), default=0.0)

    @property
    def chunked(self) -> bool:
        """Whether any compared call ran in more than one chunk."""
        return any((c.chunks or 1) > 1 for c in self.checks)

    def __str__(self) -> str:
        head = f"tokpipe equivalence {self.options}, rtol {self.rtol:g}:"
        return "\n".join([head, *(f"  {c}" for c in self.checks),
                          *(f"  not checked: {u}" for u in self.unchecked)])


class NotEquivalent(AssertionError):
    """The pipelined output differs from its reference beyond the tolerance."""

    def __init__(self, message: str, check: Check, where: Where | None):
        super().__init__(message)
        self.check = check
        self.where = where


def output_tensors(output: Any) -> list[torch.Tensor]:
    """The tensors in a model's output, in order: torch's pytree leaves, and the fields of
    the dataclasses it does not know (a plain `@dataclass` output, not registered)."""
    found: list[torch.Tensor] = []
    for leaf in tree_leaves(output):
        if dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            found += output_tensors([getattr(leaf, f.name) for f in dataclasses.fields(leaf)])
        elif isinstance(leaf, torch.Tensor):
            found.append(leaf)
    return found


def compare(name: str, call: int, expected: Any, actual: Any,
            chunks: int | None = None) -> Check:
    """The Check of `actual` against `expected`: its worst tensor, relative to its scale."""
    pairs = list(zip(output_tensors(expected), output_tensors(actual), strict=True))
    worst: Check | None = None
    for i, (e, a) in enumerate(pairs):
        diff = (a.float() - e.float()).abs()
        flat = int(diff.argmax()) if diff.numel() else 0
        index = tuple(int(k) for k in torch.unravel_index(torch.tensor(flat), diff.shape))
        scale = e.float().abs().max().item() if e.numel() else 0.0
        check = Check(name, call, diff.max().item() if diff.numel() else 0.0, scale, i, index,
                      e.flatten()[flat].item() if e.numel() else 0.0,
                      a.flatten()[flat].item() if a.numel() else 0.0, chunks)
        if worst is None or _relative(check) > _relative(worst):
            worst = check
    if worst is None:
        raise ValueError("the model's output holds no tensor to compare")
    return worst


def _relative(check: Check) -> float:
    return check.error / check.scale if check.scale else check.error
