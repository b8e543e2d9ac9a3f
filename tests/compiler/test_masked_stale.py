"""Masks and whole segments around the chunked tokens, per mode.

Stale mode without warmup: a first step's chunk sees only the chunks up to its own, and a
model's mask (an additive bias, a text padding mask of joint attention) is cut to those
keys: the mode's approximation, not causal mode's refusal. Causal attention with a segment
in front of the chunked tokens (a start token) runs in every mode; one behind them runs in
sync and stale, and causal mode refuses it.

Tolerance: float32, max |pipelined - eager| <= 1e-5 * max |eager|.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from tests.fixtures.tracing import assert_rel_close
from tokpipe_compiler import TokpipeError
from tokpipe_compiler.testing import assert_equivalent, latents_like, options
from tokpipe_compiler.testing.strategies import model_facts

TOKENS, TEXT, WIDTH, HEADS, CHUNKS = 32, 5, 32, 4, 4
# A tiny model cannot be split evenly over two stages; that is not what is tested here.
pytestmark = pytest.mark.filterwarnings("ignore:tokpipe. 2 stages cannot be balanced")


class Attention(nn.Module):
    """Self-attention over [B, L, WIDTH] through `self.attend` (SDPA; a test swaps it)."""

    def __init__(self, causal: bool = False):
        super().__init__()
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.causal, self.attend = causal, F.scaled_dot_product_attention

    def forward(self, h: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        b, n, _ = h.shape
        q, k, v = self.qkv(h).view(b, n, 3, HEADS, -1).permute(2, 0, 3, 1, 4)
        a = self.attend(q, k, v, attn_mask=mask, is_causal=self.causal)
        return h + self.proj(a.transpose(1, 2).reshape(b, n, -1))


class BiasModel(nn.Module):
    """An additive distance bias [1, H, N, N] on every attention (ALiBi style)."""

    def __init__(self, depth: int = 2):
        super().__init__()
        self.embed, self.out = nn.Linear(8, WIDTH), nn.Linear(WIDTH, 8)
        self.blocks = nn.ModuleList(Attention() for _ in range(depth))
        dist = (torch.arange(TOKENS)[:, None] - torch.arange(TOKENS)[None]).abs().float()
        slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
        self.register_buffer("bias", -slopes[:, None, None] * dist, persistent=False)

    def forward(self, x: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) + timestep[:, None, None] / 1000
        for block in self.blocks:
            h = block(h, self.bias[None])
        return self.out(h)


class JointModel(nn.Module):
    """SD3-style joint attention over [text, image] with a boolean key mask hiding padded
    text tokens."""

    def __init__(self, depth: int = 2):
        super().__init__()
        self.embed, self.text, self.out = (nn.Linear(8, WIDTH), nn.Linear(16, WIDTH),
                                           nn.Linear(WIDTH, 8))
        self.blocks = nn.ModuleList(Attention() for _ in range(depth))

    def forward(self, x: torch.Tensor, timestep: torch.Tensor, text: torch.Tensor,
                text_mask: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) + timestep[:, None, None] / 1000
        h = torch.cat([self.text(text), h], 1)
        image_keys = torch.ones(x.shape[:2], dtype=torch.bool, device=x.device)
        mask = torch.cat([text_mask, image_keys], 1)[:, None, None, :]
        for block in self.blocks:
            h = block(h, mask)
        return self.out(h[:, text.shape[1]:])


def bias_args(seed: int = 0) -> tuple:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, TOKENS, 8, generator=g), torch.tensor([500.0])


def joint_args(seed: int = 0) -> tuple:
    g = torch.Generator().manual_seed(seed)
    keep = torch.ones(1, TEXT, dtype=torch.bool)
    keep[:, 3:] = False  # two padded text tokens
    return (torch.randn(1, TOKENS, 8, generator=g), torch.tensor([500.0]),
            torch.randn(1, TEXT, 16, generator=g), keep)


MASKED = {"additive bias": (BiasModel, bias_args, 0),
          "joint with padding": (JointModel, joint_args, TEXT)}


def cut_to_visible(lead: int, q, k, v, attn_mask=None, is_causal=False):
    """Stale's first step without warmup, one attention: each chunk's rows attend to the
    lead segment and the chunks up to their own, the mask cut to those keys; the lead's rows
    are the first chunk's (the chunk that computes them)."""
    size = (q.shape[-2] - lead) // CHUNKS
    mask = attn_mask.expand(*attn_mask.shape[:-2], q.shape[-2], k.shape[-2])
    parts = []
    for p in range(CHUNKS):
        rows = slice(lead + p * size, lead + (p + 1) * size)
        if p == 0:
            rows = slice(0, rows.stop)
        keys = slice(0, lead + (p + 1) * size)
        parts.append(F.scaled_dot_product_attention(
            q[..., rows, :], k[..., keys, :], v[..., keys, :], attn_mask=mask[..., rows, keys]))
    return torch.cat(parts, -2)


def compiled(model: nn.Module, **options):
    torch._dynamo.reset()
    return torch.compile(model, backend="tokpipe", dynamic=False, options={
        "stages": 2, "chunks": CHUNKS, "compiler": "eager", **options})


@pytest.mark.parametrize("name", MASKED)
def test_stale_without_warmup_cuts_the_mask_to_the_visible_keys(name):
    """The first call is the approximation (no refusal naming causal mode); stale mode is
    exact once the caches hold the input's K/V (assert_equivalent repeats it per layer)."""
    build, args, lead = MASKED[name]
    torch.manual_seed(0)
    model = build(depth=1).eval()
    with torch.no_grad():
        first = compiled(model, mode="stale", warmup_steps=0)(*args())
        model.blocks[0].attend = lambda *a, **k: cut_to_visible(lead, *a, **k)
        approximation = model(*args())
    assert_rel_close(first, approximation)
    torch.manual_seed(0)
    assert_equivalent(build().eval(), args(), stages=2, chunks=CHUNKS, mode="stale",
                      warmup_steps=0)


class StartTokenModel(nn.Module):
    """Causal attention with a learned token concatenated before (a start token) or after
    the chunked tokens."""

    def __init__(self, where: str = "before", depth: int = 2):
        super().__init__()
        self.where = where
        self.embed, self.out = nn.Linear(8, WIDTH), nn.Linear(WIDTH, 8)
        self.token = nn.Parameter(torch.randn(1, 2, WIDTH))
        self.blocks = nn.ModuleList(Attention(causal=True) for _ in range(depth))

    def forward(self, x: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) + timestep[:, None, None] / 1000
        token = self.token.expand(x.shape[0], -1, -1)
        h = torch.cat([token, h] if self.where == "before" else [h, token], 1)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


@pytest.mark.parametrize("mode", ["sync", "stale", "causal"])
def test_causal_attention_with_a_start_token_in_front(mode):
    torch.manual_seed(0)
    assert_equivalent(StartTokenModel().eval(), bias_args(), stages=2, chunks=CHUNKS,
                      mode=mode, warmup_steps=0)


@pytest.mark.parametrize("mode", ["sync", "stale"])
def test_causal_attention_with_tokens_behind_in_whole_sequence_modes(mode):
    torch.manual_seed(0)
    assert_equivalent(StartTokenModel("after").eval(), bias_args(), stages=2, chunks=CHUNKS,
                      mode=mode)


def test_causal_mode_refuses_causal_attention_with_tokens_behind():
    torch.manual_seed(0)
    model = StartTokenModel("after").eval()
    with pytest.raises(TokpipeError, match=r"mode='causal'.*2 tokens after the chunked ones.*"
                                           r"before the chunked ones.*mode='stale' or 'sync'"):
        compiled(model, mode="causal")(*bias_args())


class StartKeysOnly(StartTokenModel):
    """Causal attention whose keys hold a start token its queries lack."""

    def forward(self, x: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) + timestep[:, None, None] / 1000
        b, n, _ = h.shape
        q = h.view(b, n, HEADS, -1).transpose(1, 2)
        kv = torch.cat([self.token.expand(b, -1, -1), h], 1).view(b, n + 2, HEADS, -1)
        kv = kv.transpose(1, 2)
        a = F.scaled_dot_product_attention(q, kv, kv, is_causal=True)
        return self.out(a.transpose(1, 2).reshape(b, n, -1))


def test_causal_queries_without_the_keys_start_token_are_refused():
    torch.manual_seed(0)
    with pytest.raises(TokpipeError, match=r"keys that hold 2 tokens outside the chunked ones and "
                                           r"queries that hold 0"):
        compiled(StartKeysOnly().eval(), mode="sync")(*bias_args())


@pytest.mark.parametrize("build,args,causal", [
    (BiasModel, bias_args, False), (JointModel, joint_args, False),
    (StartTokenModel, bias_args, True), (lambda: StartTokenModel("after"), bias_args, False)])
def test_options_draw_causal_mode_only_where_it_runs(build, args, causal):
    """A mask that shows later keys is refused at the call, not at planning: the
    strategy runs causal mode once to know."""
    model = build().eval()
    assert ("causal" in model_facts(model, args()).modes) == causal


JOINT = JointModel().eval()


@settings(max_examples=8, deadline=None)
@given(data=st.data())
def test_the_readme_property_test_on_joint_attention_with_padding(data):
    x, *rest = joint_args()
    opts = data.draw(options(JOINT, (x, *rest), max_stages=2, max_chunks=8))
    assert_equivalent(JOINT, (data.draw(latents_like(x)), *rest), **opts)
