"""Rows computed and then overwritten whole are made constants before annotate
(passes/dead_rows.py): Z-Image's padding, the last token repeated and then replaced by a
learnt pad token through a constant mask, no longer stops a stale pipeline."""

from __future__ import annotations

import operator
import warnings

import pytest
import torch
from torch import nn

import tokpipe_compiler as tp
from tests.fixtures.models import PadsTokens, dit_inputs
from tests.fixtures.more_pipelines import zimage_padded
from tests.fixtures.tracing import rel_error, trace
from tokpipe_compiler.passes.dead_rows import constant_dead_rows

OPTIONS = {"stages": 2, "chunks": 4, "warmup_steps": 1, "compiler": "eager"}
TIMESTEPS = (900, 800, 700)


def _outputs(model: nn.Module, mode: str) -> list[torch.Tensor]:
    latents, _, labels = dit_inputs(model, 8)
    compiled = torch.compile(model, backend="tokpipe", dynamic=False,
                             options={**OPTIONS, "mode": mode})
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        outputs = [compiled(latents, torch.tensor([t]), labels) for t in TIMESTEPS]
    assert tp.programs(compiled)  # pipelined, not run as traced
    torch.compiler.reset()
    return outputs


def test_padding_with_the_last_token_pipelines_as_padding_with_zeros():
    """Stale raised UnchunkableOps on `x[:, -1:]` (it cuts through the chunks). Now it
    computes what the same model padded with zeros computes, call after call (the padded
    rows' values never reach the output), and sync computes what eager computes."""
    torch.manual_seed(0)
    last = PadsTokens(depth=2, grid=8).eval()
    zeros = PadsTokens(depth=2, grid=8, pad_with="zeros").eval()
    zeros.load_state_dict(last.state_dict())
    for got, want in zip(_outputs(last, "stale"), _outputs(zeros, "stale"), strict=True):
        assert rel_error(got, want) <= 1e-6
    latents, _, labels = dit_inputs(last, 8)
    with torch.no_grad():
        eager = last(latents, torch.tensor([TIMESTEPS[-1]]), labels)
    assert rel_error(_outputs(last, "sync")[-1], eager) <= 1e-5


class Pads(nn.Module):
    """Rows padded with the last one, embedded, then overwritten through a mask; the
    variants keep the padded rows alive in one way each."""

    def __init__(self, variant: str = "overwritten"):
        super().__init__()
        self.variant = variant
        self.inner = nn.Linear(4, 4)
        self.pad = nn.Parameter(torch.randn(4))

    def forward(self, x: torch.Tensor, keep: torch.Tensor):
        padded = torch.cat([x, x[-1:].repeat(3, 1)])
        h = self.inner(padded)
        if self.variant == "mixed":
            h = h + h.mean(dim=0)  # every row reads the padded ones
        mask = torch.cat([torch.zeros(6, dtype=torch.bool),
                          torch.ones(3 if self.variant != "one_kept" else 2, dtype=torch.bool),
                          torch.zeros(1 if self.variant == "one_kept" else 0, dtype=torch.bool)])
        if self.variant == "input_mask":
            mask = keep
        out = torch.where(mask[:, None], self.pad, h)
        return (out, padded) if self.variant == "returned" else out


def _last_row_read(gm: torch.fx.GraphModule) -> bool:
    return any(n.target is operator.getitem and n.args[1] == slice(-1, None)
               for n in gm.graph.nodes)


@pytest.mark.parametrize(("variant", "rewritten"), [
    ("overwritten", True),
    ("returned", False),      # the padded rows are an output
    ("mixed", False),         # a mean over the rows reads them before the mask
    ("one_kept", False),      # the mask leaves the last padded row
    ("input_mask", False),    # the mask is an input: its values are not known
])
def test_a_slice_is_made_zeros_only_where_none_of_its_values_reach_the_output(variant,
                                                                              rewritten):
    torch.manual_seed(0)
    model = Pads(variant)
    x, keep = torch.randn(6, 4), torch.arange(9) >= 6
    traced = trace(model, x, keep)
    gm = traced.gm
    expected = gm(*traced.args())
    assert bool(constant_dead_rows(gm)) == rewritten
    assert _last_row_read(gm) != rewritten
    for got, want in zip(gm(*traced.args()), expected, strict=True):
        assert torch.equal(got, want)


def _zeros_padding(pad_with_ids):
    """Z-Image's padding with zeros rows instead of the last token repeated."""

    def pad(self, feat, *args, **kwargs):
        padded, *rest = pad_with_ids(self, feat, *args, **kwargs)
        zeros = torch.zeros(len(padded) - len(feat), feat.shape[1], dtype=feat.dtype)
        return (torch.cat([feat, zeros]), *rest)

    return pad


def test_z_image_at_a_size_it_pads_runs_as_a_ring_in_stale(monkeypatch):
    """At 128x112 px (an SDXL-bucket-like size: image tokens not a multiple of 32) stale
    raised UnchunkableOps on the padding and the pad token's mask over the guided
    branches. Now it runs as a ring: sync as serial, stale as the same ring computes with
    the padding's values made zeros (which the pad token overwrites)."""
    from diffusers import ZImageTransformer2DModel

    from tests.fixtures.pipelines import generate, parallelized

    serial = generate(*zimage_padded(), steps=3)
    rings = {}
    for mode in ("sync", "stale"):
        pipe, kwargs = parallelized(zimage_padded, mode=mode)
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="tokpipe: .* runs per call")
            rings[mode] = generate(pipe, kwargs, steps=3)
    assert rel_error(rings["sync"], serial) <= 1e-5
    monkeypatch.setattr(ZImageTransformer2DModel, "_pad_with_ids",
                        _zeros_padding(ZImageTransformer2DModel._pad_with_ids))
    pipe, kwargs = parallelized(zimage_padded, mode="stale")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        zeros = generate(pipe, kwargs, steps=3)
    assert rel_error(rings["stale"], zeros) <= 1e-6
