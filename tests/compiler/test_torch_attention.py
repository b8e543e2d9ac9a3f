"""PyTorch's fused attention modules, which Dynamo keeps as one op each
(nn.MultiheadAttention: F.multi_head_attention_forward; nn.TransformerEncoderLayer's fast
path), are written out with scaled_dot_product_attention (`passes/torch_attention.py`), so
stale mode chunks them with K/V caches, with their masks and key padding masks.

Tolerance: float32, max |pipelined - eager| <= 1e-5 * max |eager|.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.fixtures.tracing import assert_rel_close, quiet_program, second_call, trace


class MultiheadBlocks(nn.Module):
    """Two residual blocks of nn.MultiheadAttention: self-attention (`text`: then
    cross-attention to it, keys of another width), an attention mask over the tokens,
    (`padding`) a key padding mask passed with the tokens."""

    def __init__(self, batch_first: bool = True, text: bool = False, mask: str = "none",
                 padding: bool = False):
        super().__init__()
        self.batch_first, self.mask, self.text, self.padding = batch_first, mask, text, padding
        self.attn = nn.ModuleList(
            nn.MultiheadAttention(32, 4, batch_first=batch_first,
                                  kdim=12 if text else None, vdim=12 if text else None)
            for _ in range(2))
        self.mlp = nn.ModuleList(nn.Linear(32, 32) for _ in range(2))

    def forward(self, x: torch.Tensor, extra: torch.Tensor | None = None) -> torch.Tensor:
        """`extra`: the text (`text`) or the key padding mask (`padding`)."""
        text, padding = (extra, None) if self.text else (None, extra)
        if not self.batch_first:
            x = x.transpose(0, 1)
        tokens = x.shape[1 if self.batch_first else 0]
        mask = _mask(self.mask, tokens)
        for attn, mlp in zip(self.attn, self.mlp, strict=True):
            kv = x if text is None else (text if self.batch_first else text.transpose(0, 1))
            x = x + attn(x, kv, kv, need_weights=False, attn_mask=mask,
                         key_padding_mask=padding, is_causal=self.mask == "causal")[0]
            x = x + mlp(x)
        return x if self.batch_first else x.transpose(0, 1)


def _mask(kind: str, n: int) -> torch.Tensor | None:
    if kind == "none":
        return None
    if kind == "causal":
        return nn.Transformer.generate_square_subsequent_mask(n)
    band = (torch.arange(n)[:, None] - torch.arange(n)[None, :]).abs() > n // 2
    return band if kind == "bool" else band.float() * -3.0


def _padding(kind: str) -> torch.Tensor:
    """Key padding of [N, S]: the second sequence's last 3 tokens, True (or -1e9) hides.
    Of the attention mask's kind: PyTorch deprecates mixing them (and its warning is a
    graph break)."""
    hidden = torch.zeros(2, 16, dtype=torch.bool)
    hidden[1, 13:] = True
    return hidden if kind == "bool" else torch.zeros(2, 16).masked_fill(hidden, -1e9)


@pytest.mark.parametrize(("options", "mode", "padding"), [
    ({}, "stale", None), ({"batch_first": False}, "stale", None), ({"text": True}, "stale", None),
    ({"mask": "float"}, "sync", None), ({"mask": "bool"}, "sync", None),
    ({"mask": "causal"}, "causal", None), ({}, "stale", "bool"), ({}, "stale", "float"),
    ({"batch_first": False}, "sync", "bool"), ({"mask": "bool"}, "sync", "bool"),
    ({"mask": "float"}, "sync", "float"), ({"mask": "causal"}, "causal", "float"),
], ids=["self", "sequence-first", "cross", "float-mask", "bool-mask", "causal",
        "padding", "float-padding", "sequence-first-padding", "bool-mask-padding",
        "float-mask-padding", "causal-padding"])
def test_multihead_attention_is_written_out_and_pipelined(options, mode, padding):
    """nn.MultiheadAttention's one op becomes projections, heads and sdpa: stale chunks
    self-attention with K/V caches (the second call sees the first's K/V of the same input:
    eager's value), cross-attention to text runs token-wise, masks, key padding masks and
    the causal hint carry over."""
    torch.manual_seed(0)
    model = MultiheadBlocks(**options, padding=padding is not None).eval()
    inputs = [torch.randn(2, 16, 32)] + ([torch.randn(2, 5, 12)] if options.get("text") else [])
    inputs += [] if padding is None else [_padding(padding)]
    traced = trace(model, *inputs)
    program = quiet_program(traced, mode=mode, chunks=4, warmup_steps=1)
    assert len(program.plan.caches) == (0 if options.get("text") else 2)
    with torch.no_grad():
        expected = model(*inputs)
    assert_rel_close(second_call(program, traced), expected)


def test_errors_about_written_out_attention_name_the_users_line():
    traced = trace(MultiheadBlocks().eval(), torch.randn(2, 16, 32))
    with pytest.raises(Exception, match=r"needs causal attention.*x = x \+ attn\(x, kv, kv"):
        quiet_program(traced, mode="causal", chunks=4)


class ReadsWeights(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(32, 4, batch_first=True)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.attn(x, x, x, need_weights=True)


def test_multihead_attention_whose_weights_are_read_is_left_whole():
    """The attention weights mix every token: the call stays one op, which stale refuses
    by name."""
    traced = trace(ReadsWeights().eval(), torch.randn(2, 16, 32))
    with pytest.raises(Exception, match="multi_head_attention_forward"):
        traced.program(mode="stale", stages=2, chunks=2)


class Encoder(nn.Module):
    def __init__(self, norm_first: bool, activation: str):
        super().__init__()
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.1, activation=activation,
                                           batch_first=True, norm_first=norm_first)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder(x)


@pytest.mark.parametrize(("norm_first", "activation"), [(False, "relu"), (True, "gelu")])
def test_transformer_encoder_layers_are_written_out_and_pipelined(norm_first, activation):
    """nn.TransformerEncoderLayer in evaluation without gradients runs one fused op per
    layer (norms, attention, MLP); written out, stale chunks each layer's self-attention
    with K/V caches and equals eager on a repeated input."""
    torch.manual_seed(0)
    model = Encoder(norm_first, activation).eval()
    x = torch.randn(2, 16, 32)
    traced = trace(model, x)
    program = quiet_program(traced, mode="stale", chunks=4, warmup_steps=1)
    assert len(program.plan.caches) == 2
    with torch.no_grad():
        expected = model(x)
    assert_rel_close(second_call(program, traced), expected)
