"""Causal mode with attention masks: a chunk attends to the chunks up to its own, which is
the model's answer only where the model's mask hides the later keys (a causal mask). A
padding or bidirectional mask raises instead of giving another answer.

Tolerance: float32, max |pipelined - eager| <= 1e-5 * max |eager|.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.fixtures.tracing import assert_rel_close
from tokpipe_compiler import TokpipeError

TOKENS = 64
# One attention cannot be split evenly over two stages; that is not what is tested here.
pytestmark = pytest.mark.filterwarnings("ignore:tokpipe. 2 stages cannot be balanced")


class MaskedBlock(nn.Module):
    """One attention over the tokens, with the mask the caller passes (no is_causal)."""

    def __init__(self, width: int = 32, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.embed, self.qkv = nn.Linear(8, width), nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, 8)

    def forward(self, x: torch.Tensor, timestep: torch.Tensor, mask: torch.Tensor):
        h = self.embed(x) + timestep[:, None, None] / 1000
        b, n, d = h.shape
        q, k, v = self.qkv(h).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        return self.out(F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
                        .transpose(1, 2).reshape(b, n, d))


def causal_bool() -> torch.Tensor:
    return torch.ones(TOKENS, TOKENS, dtype=torch.bool).tril()


def padding_bool() -> torch.Tensor:
    keep = torch.ones(2, TOKENS, dtype=torch.bool)
    keep[1, 56:] = False
    return keep[:, None, None, :]


def additive(allowed: torch.Tensor, hidden: float) -> torch.Tensor:
    return torch.zeros(allowed.shape).masked_fill(~allowed, hidden)


MASKS = {
    "causal bool": causal_bool,
    "causal -inf": lambda: additive(causal_bool(), float("-inf")),
    "causal finfo.min": lambda: additive(causal_bool(), torch.finfo(torch.float32).min),
    "causal and padding": lambda: causal_bool() & padding_bool(),
}
SHOWING = {
    "padding bool": padding_bool,
    "padding -10000": lambda: additive(padding_bool(), -10000.0),
    "zeros": lambda: torch.zeros(TOKENS, TOKENS),
}


def run(mask: torch.Tensor, mode: str = "causal") -> tuple[torch.Tensor, torch.Tensor]:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = MaskedBlock().eval()
    x, t = torch.randn(2, TOKENS, 8), torch.tensor([500.0, 500.0])
    compiled = torch.compile(model, backend="tokpipe", dynamic=False, options={
        "stages": 2, "chunks": 4, "mode": mode, "compiler": "eager"})
    with torch.no_grad():
        return compiled(x, t, mask), model(x, t, mask)


@pytest.mark.parametrize("name", MASKS)
def test_causal_mode_runs_a_mask_that_hides_the_later_keys(name):
    out, expected = run(MASKS[name]())
    assert_rel_close(out, expected)


@pytest.mark.parametrize("name", SHOWING)
def test_causal_mode_refuses_a_mask_that_shows_later_chunks(name):
    with pytest.raises(TokpipeError, match=r"mode='causal'.*later chunks.*mode='stale'"):
        run(SHOWING[name]())


@pytest.mark.parametrize("mode", ["sync", "stale"])
def test_other_modes_run_a_padding_mask(mode):
    """Stale's first call is a warmup (whole sequence): it equals eager."""
    out, expected = run(padding_bool(), mode)
    assert_rel_close(out, expected)


def test_left_padding_rows_left_unmasked_are_named():
    """transformers' SDPA path unmasks the rows of left-padding queries that a causal mask
    with padding hides completely (else SDPA gives NaN): those rows see every key, later
    chunks' too, and the error says so."""
    allowed = causal_bool().clone().expand(2, 1, TOKENS, TOKENS).clone()
    allowed[1, :, :, :8] = False  # 8 tokens of left padding in the second sequence
    allowed[1, :, :8, :] = True  # their rows unmasked
    with pytest.raises(TokpipeError, match=r"rows see every key.*left padding"):
        run(allowed)
    with pytest.raises(TokpipeError) as plain:
        run(padding_bool())
    assert "every key" not in str(plain.value)
