"""Stale mode's semantics computed on the eager model, independently of the compiler.

The README's table says what chunk p of a stale step attends to: the fresh K/V of chunks
0..p and the previous step's K/V of chunks p+1.. (with no previous step, at a generation's
first step without warmup: chunks 0..p only). Tokens joined to the chunked ones (joint
attention's text, a start token: `Layout.lead`, `Layout.trail`) are computed by a step's
first chunk (`text_chunks="first"`), with its keys, and every chunk attends to their fresh
K/V. Every other op acts token by token, so one eager pass per step computes every chunk's
answer at once: each attention call over the chunked tokens computes this step's K/V of
every token (the fresh ones, since the tokens' own activations are already the stale-mode
ones, layer by layer) and gives each chunk's queries the keys stale mode gives it. The
first `warmup` steps attend to the whole fresh sequence.

This holds where every attention over the chunked tokens is
`F.scaled_dot_product_attention` with queries and keys of the whole sequence, in grid
order (a chunk's tokens contiguous); `stale_check.applies` says why not elsewhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from tokpipe_compiler.core.args import SDPA

Call = dict[str, Any]  # an attention call's arguments by name, those given


@dataclass(frozen=True)
class Layout:
    """One attention's sequence: `lead` tokens, the chunked `tokens`, `trail` tokens."""

    lead: int
    tokens: int
    trail: int

    @property
    def length(self) -> int:
        return self.lead + self.tokens + self.trail

    def chunked(self, start: int, stop: int) -> torch.Tensor:
        """The positions of chunked tokens [start, stop)."""
        return torch.arange(self.lead + start, self.lead + stop)

    def segments(self) -> torch.Tensor:
        """The positions of the tokens joined to the chunked ones."""
        return torch.cat([torch.arange(self.lead),
                          torch.arange(self.lead + self.tokens, self.length)])

    def holds(self, call: Call) -> bool:
        """Whether an attention call's queries and keys are this sequence."""
        q, k = call["query"], call["key"]
        return q.dim() >= 2 and q.shape[-2] == k.shape[-2] == self.length


def bind(args: tuple, kwargs: dict) -> Call:
    """An attention call's arguments by name (`core.args.SDPA`'s order)."""
    return {**dict(zip(SDPA, args, strict=False)), **kwargs}


class StaleReference:
    """A stale-mode run of `model`: call it once per denoising step of one guidance branch;
    `new_generation` drops the K/V of the last. layouts: the sequence of each attention
    over the chunked tokens, in call order; bounds: the chunks, in chunked tokens."""

    def __init__(self, model: torch.nn.Module, layouts: Sequence[Layout],
                 bounds: Sequence[tuple[int, int]], warmup: int):
        self.model, self.layouts, self.bounds = model, list(layouts), list(bounds)
        self.warmup = warmup
        self.new_generation()

    def new_generation(self) -> None:
        self.steps = 0
        self.caches: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with _StaleAttention(self), torch.no_grad():
            output = self.model(*args, **kwargs)
        self.steps += 1
        return output

    def attend(self, layer: int, call: Call) -> torch.Tensor:
        """Layer `layer`'s attention at this step: per chunk, its keys as stale mode has them."""
        q, k, v = (call[n] for n in ("query", "key", "value"))
        stale = self.caches.get(layer)
        self.caches[layer] = (k, v)
        if self.steps < self.warmup:
            return F.scaled_dot_product_attention(**call)
        layout = self.layouts[layer]
        out = q.new_empty((*q.shape[:-1], v.shape[-1]))
        for p, (start, stop) in enumerate(self.bounds):
            rows = layout.chunked(start, stop)
            if p == 0:  # the first chunk computes the joined tokens
                rows = torch.cat([layout.segments(), rows])
            rows = rows.to(q.device)
            keys, values, columns = self._keys(layout, k, v, stale, stop)
            out.index_copy_(-2, rows, F.scaled_dot_product_attention(
                **{**call, "query": q.index_select(-2, rows), "key": keys, "value": values,
                   "attn_mask": _mask(call.get("attn_mask"), rows, columns)}))
        return out

    @staticmethod
    def _keys(layout: Layout, k: torch.Tensor, v: torch.Tensor,
              stale: tuple[torch.Tensor, torch.Tensor] | None, stop: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The keys and values a chunk ending at `stop` attends to, and their positions
        (None: all): fresh up to its end, the previous step's after it."""
        if stale is None:  # no previous step: the keys written so far
            seen = torch.cat([layout.segments(), layout.chunked(0, stop)]).to(k.device)
            return k.index_select(-2, seen), v.index_select(-2, seen), seen
        later = layout.chunked(stop, layout.tokens).to(k.device)
        keys, values = k.clone(), v.clone()
        keys.index_copy_(-2, later, stale[0].index_select(-2, later))
        values.index_copy_(-2, later, stale[1].index_select(-2, later))
        return keys, values, None


def _mask(mask: torch.Tensor | None, rows: torch.Tensor, columns: torch.Tensor | None
          ) -> torch.Tensor | None:
    """A mask's entries of the queries `rows` and the keys `columns` (None: all); a
    dimension it broadcasts stays as it is."""
    if mask is None or mask.dim() < 2:
        return mask
    if mask.shape[-2] > 1:
        mask = mask.index_select(-2, rows.to(mask.device))
    if columns is not None and mask.shape[-1] > 1:
        mask = mask.index_select(-1, columns.to(mask.device))
    return mask


class _StaleAttention(TorchFunctionMode):
    """Routes the model's attention calls over the chunked tokens to `reference.attend`, in
    call order (the i-th such call of a step is layer i)."""

    def __init__(self, reference: StaleReference):
        super().__init__()
        self.reference, self.layer = reference, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        call = bind(args, kwargs)
        layouts = self.reference.layouts
        if self.layer >= len(layouts) or not layouts[self.layer].holds(call):
            return func(*args, **kwargs)
        self.layer += 1
        return self.reference.attend(self.layer - 1, call)


class AttentionCount(TorchFunctionMode):
    """Counts one forward's attention calls whose queries and keys have the length of any
    of `layouts` (`found`), those that match `layouts` in call order (`matched`), and
    whether any is causal."""

    def __init__(self, layouts: Sequence[Layout]):
        super().__init__()
        self.layouts, self.found, self.matched, self.causal = list(layouts), 0, 0, False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            call = bind(args, kwargs)
            if any(layout.holds(call) for layout in self.layouts):
                self.found += 1
                self.causal |= bool(call.get("is_causal", False))
            if self.matched < len(self.layouts) and self.layouts[self.matched].holds(call):
                self.matched += 1
        return func(*args, **kwargs)
