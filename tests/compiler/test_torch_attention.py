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

import tokpipe_compiler as tp
from tests.fixtures.tracing import assert_rel_close, quiet_program, second_call, trace
from tokpipe_compiler import TokpipeError
from tokpipe_compiler.passes import torch_attention
from tokpipe_compiler.passes.torch_attention import ENCODER_LAYERS, write_out_torch_attention
from tokpipe_compiler.testing import assert_equivalent


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
    """nn.TransformerEncoder of 2 layers; `causal`: with the causal mask and is_causal=True
    (which skips torch's mask detection, a graph break); `padding`: a key padding mask."""

    def __init__(self, norm_first: bool = False, activation: str = "relu",
                 causal: bool = False):
        super().__init__()
        self.causal = causal
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.1, activation=activation,
                                           batch_first=True, norm_first=norm_first)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

    def forward(self, x: torch.Tensor, padding: torch.Tensor | None = None) -> torch.Tensor:
        if not self.causal:
            return self.encoder(x, src_key_padding_mask=padding)
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        return self.encoder(x, mask=mask, is_causal=True, src_key_padding_mask=padding)


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


class FusedLayer(nn.Module):
    """torch's fused encoder-layer op called with a given mask and mask_type."""

    def __init__(self, mask: torch.Tensor, mask_type: int):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True,
                                                norm_first=True)
        self.register_buffer("mask", mask)
        self.mask_type = mask_type

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        layer, attn = self.layer, self.layer.self_attn
        return torch._transformer_encoder_layer_fwd(
            x, 32, 4, attn.in_proj_weight, attn.in_proj_bias, attn.out_proj.weight,
            attn.out_proj.bias, False, True, layer.norm1.eps, layer.norm1.weight,
            layer.norm1.bias, layer.norm2.weight, layer.norm2.bias, layer.linear1.weight,
            layer.linear1.bias, layer.linear2.weight, layer.linear2.bias, self.mask,
            self.mask_type)


def _fused_masks() -> dict[str, tuple[torch.Tensor, int]]:
    """Each mask_type (0: [L, L], 1: [N, L], 2: [N, H, L, L]) boolean (True hides) and float:
    -inf hides, and a finite nonzero value too (the op reads any mask as boolean); a mask of
    the scores' shape, which the op takes whatever the mask_type; an integer mask."""
    band = (torch.arange(16)[:, None] - torch.arange(16)[None, :]).abs() > 5
    padding = torch.zeros(2, 16, dtype=torch.bool)
    padding[1, 11:] = True
    merged = band.expand(2, 4, 16, 16) | padding[:, None, None, :]
    masks = {}
    for mask_type, hidden in enumerate((band, padding, merged)):
        masks[f"bool-{mask_type}"] = (hidden, mask_type)
        masks[f"float-{mask_type}"] = (torch.zeros(hidden.shape).masked_fill(hidden, -1e4),
                                       mask_type)
    masks["float-inf-2"] = (torch.zeros(2, 4, 16, 16).masked_fill(merged, float("-inf")), 2)
    masks["scores-shape-0"] = (merged, 0)
    masks["scores-shape-1"] = (merged.float(), 1)
    masks["uint8-0"] = (band.to(torch.uint8), 0)
    return masks


@pytest.mark.parametrize("name", list(_fused_masks()))
def test_fused_encoder_layer_masks_are_written_out_exactly(name):
    """Each mask the fused op takes becomes sdpa's attn_mask with the op's answer."""
    torch.manual_seed(0)
    model = FusedLayer(*_fused_masks()[name]).eval()
    x = torch.randn(2, 16, 32)
    traced = trace(model, x)
    assert write_out_torch_attention(traced.gm) == 1
    with torch.no_grad():
        assert_rel_close(traced.gm(*traced.args())[0], model(x))


def test_a_refused_fused_encoder_layer_names_the_way_around(monkeypatch):
    """A fused layer left whole (here: every one) is refused by name, with how to run
    torch's layer through the op that tokpipe writes out."""
    monkeypatch.setattr(torch_attention, "_encoder_writable", lambda args: False)
    traced = trace(Encoder().eval(), torch.randn(2, 16, 32))
    with pytest.raises(TokpipeError, match=r"(?s)_transformer_encoder_layer_fwd.*"
                       r"set_fastpath_enabled\(False\).*F.multi_head_attention_forward"):
        traced.program(mode="stale", stages=2, chunks=4)


def _key_padding() -> torch.Tensor:
    """The second sequence's last 3 tokens hidden."""
    padding = torch.zeros(2, 16, dtype=torch.bool)
    padding[1, 13:] = True
    return padding


@pytest.mark.filterwarnings("ignore:tokpipe. mode='stale' found no timestep")
@pytest.mark.parametrize(("causal", "padding", "mode"), [
    (True, False, "causal"), (True, True, "causal"), (False, True, "stale"),
    (False, True, "sync")], ids=["causal", "causal-padding", "padding-stale", "padding-sync"])
def test_masked_transformer_encoder_is_pipelined(causal, padding, mode):
    """The fast path with a mask: the causal mask (merged with the key padding mask) in
    causal mode, a key padding mask in stale and sync."""
    torch.manual_seed(0)
    model = Encoder(norm_first=True, causal=causal).eval()
    args = (torch.randn(2, 16, 32),) + ((_key_padding(),) if padding else ())
    if causal and padding:  # of the causal mask's type: torch warns on mixing (a graph break)
        args = (args[0], torch.zeros(2, 16).masked_fill(args[1], float("-inf")))
    assert_equivalent(model, args, stages=2, chunks=4, mode=mode, warmup_steps=1)


@pytest.mark.filterwarnings("ignore:tokpipe. 2 stages cannot be balanced")
def test_plan_names_the_written_out_encoder_layers():
    """The nodes written out from each fused layer keep its module path."""
    model = Encoder().eval()
    plan = tp.explain(model, (torch.randn(2, 16, 32),), stages=2, chunks=4, compiler="eager")
    assert [s.layers for s in plan.stages] == [["encoder.layers.0"], ["encoder.layers.1"]]
    assert all(n.target not in ENCODER_LAYERS for s in plan.stages for n in s.graph.gm.graph.nodes)
