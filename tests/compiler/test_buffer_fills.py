"""Buffers filled by slice writes (Lumina2's joint text+image sequence, one batch item at a
time) are rewritten as concatenations before annotate (`passes/buffer_fills.py`), and
pipeline like the `torch.cat` joint sequences of SD3 and Flux.

Tolerance: float32, max |pipelined - eager| <= 1e-5 * max |eager|.
"""

from __future__ import annotations

import operator
import warnings

import pytest
import torch
from torch import nn

from tests.fixtures.models import Block
from tests.fixtures.tracing import assert_rel_close, trace
from tokpipe_compiler.core.errors import TokpipeError
from tokpipe_compiler.passes.buffer_fills import concatenate_buffer_fills


class JointBuffer(nn.Module):
    """Lumina2's layout: image tokens refined by their own attention, then written after
    each item's text into a zeros buffer as long as the longest text plus the image, one
    batch item at a time; joint attention; the image tokens read back per item. The text
    lengths are Python numbers, as Lumina2's are after its `.tolist()`."""

    def __init__(self, text_lengths: tuple[int, ...], width: int = 16, copy: bool = False):
        super().__init__()
        self.text_lengths, self.copy = text_lengths, copy
        self.text = nn.Linear(12, width)
        self.embed = nn.Linear(4, width)
        self.refiner, self.joint = Block(width, 2), Block(width, 2)

    def forward(self, x: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        cond = torch.zeros(1, self.embed.out_features)
        h = self.refiner(self.embed(x), cond)
        t = self.text(text)
        b, n, c = h.shape
        joint = h.new_zeros(b, max(self.text_lengths) + n, c)
        for i, length in enumerate(self.text_lengths):
            if self.copy:  # the same writes as copies into views
                joint[i, :length].copy_(t[i, :length])
                joint[i, length:length + n].copy_(h[i])
            else:
                joint[i, :length] = t[i, :length]
                joint[i, length:length + n] = h[i]
        out = self.joint(joint, cond)
        return torch.stack([out[i, length:length + n]
                            for i, length in enumerate(self.text_lengths)])


def run_mode(model: nn.Module, mode: str, *inputs: torch.Tensor) -> torch.Tensor:
    traced = trace(model, *inputs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # two stages of a tiny model are unbalanced
        program = traced.program(mode=mode, stages=2, chunks=4, warmup_steps=1)
    program(*traced.args())
    return program(*traced.args())[0]  # stale: the second call, K/V from the first


@pytest.mark.parametrize("copy", [False, True])
@pytest.mark.parametrize("mode", ["sync", "stale"])
def test_a_joint_sequence_written_item_by_item_equals_eager(mode, copy):
    """Guidance's batch of two, each item's text 5 tokens long: the joint sequence is a
    text segment before the image tokens, as with torch.cat; written with `x[i] = v` or
    with `x[i].copy_(v)`."""
    torch.manual_seed(0)
    model = JointBuffer((5, 5), copy=copy).eval()
    x, text = torch.randn(2, 16, 4), torch.randn(2, 5, 12)
    with torch.no_grad():
        expected = model(x, text)
    assert_rel_close(run_mode(model, mode, x, text), expected)


def test_texts_of_different_lengths_run_whole_in_sync_and_are_refused_chunked():
    """Items 5 and 3 text tokens long put their image tokens at different offsets (and
    leave two rows of zeros after the shorter): sync runs that whole and equals eager;
    stale cannot give both items one chunk layout and says where. In sync the buffer,
    made by `h.new_zeros` from attended tokens, is computed before the stages without
    computing `h`."""
    torch.manual_seed(0)
    model = JointBuffer((5, 3)).eval()
    x, text = torch.randn(2, 16, 4), torch.randn(2, 5, 12)
    with torch.no_grad():
        expected = model(x, text)
    assert_rel_close(run_mode(model, "sync", x, text), expected)
    with pytest.raises(TokpipeError, match="different layouts") as err:
        run_mode(model, "stale", x, text)
    assert "joint[i, length:length + n] = h[i]" in str(err.value)


class Fills(nn.Module):
    """Writes of a cast tensor, a scalar and a broadcast row into a float64 buffer of 7s,
    leaving rows unwritten."""

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        buf = torch.full((3, 4, 5), 7.0, dtype=torch.float64)
        buf[0, 1:3] = x
        buf[1:3, :, 2:] = 1.5
        buf[1:3, :, :2] = z
        return buf * 2


def test_a_fill_becomes_a_concatenation_with_the_same_values():
    x, z = torch.randn(2, 5), torch.randn(1, 2)
    traced = trace(Fills(), x, z)
    concatenate_buffer_fills(traced.gm)
    targets = [n.target for n in traced.gm.graph.nodes]
    assert operator.setitem not in targets and torch.cat in targets
    out = traced.gm(*traced.args())[0]
    assert out.dtype == torch.float64 and torch.equal(out, Fills()(x, z))


class Peek(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        buf = torch.zeros(4, 3)
        buf[:2] = a
        seen = buf.sum()  # the half-filled buffer is observed
        buf[2:] = b
        return buf + seen


class Overlap(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        buf = torch.zeros(4, 3)
        buf[:2] = a
        buf[1:3] = b  # overwrites a's second row
        return buf * 1


class Strided(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        buf = torch.zeros(4, 3)
        buf[::2] = a
        buf[1::2] = b
        return buf * 1


@pytest.mark.parametrize("model", [Peek(), Overlap(), Strided()],
                         ids=["read-between-writes", "overlapping", "strided"])
def test_fills_a_concatenation_cannot_express_stay_in_place(model):
    a, b = torch.randn(2, 3), torch.randn(2, 3)
    traced = trace(model, a, b)
    concatenate_buffer_fills(traced.gm)
    assert operator.setitem in [n.target for n in traced.gm.graph.nodes]
    assert torch.equal(traced.gm(*traced.args())[0], model(a, b))


class TableThroughAView(nn.Module):
    """CogVideoX at a resolution other than its configured one: a positional table made in
    the forward and written into a zeros buffer after the text rows through `.data`
    (`joint.data[:, T:].copy_(pos)`), or through a plain view, then added to the tokens."""

    def __init__(self, through_data: bool, width: int = 16, text: int = 3):
        super().__init__()
        self.through_data, self.text_rows = through_data, text
        self.embed, self.block = nn.Linear(4, width), Block(width, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        rows = torch.arange(h.shape[1] - self.text_rows, dtype=h.dtype)
        pos = torch.sin(rows[:, None] / (1 + torch.arange(h.shape[2], dtype=h.dtype)))
        table = pos.new_zeros(1, h.shape[1], h.shape[2])
        target = table.data if self.through_data else table
        target[:, self.text_rows:].copy_(pos)
        return self.block(h + table, torch.zeros(1, h.shape[2]))


@pytest.mark.parametrize("through_data", [True, False])
@pytest.mark.parametrize("mode", ["sync", "stale"])
def test_a_table_written_through_a_view_keeps_its_write(mode, through_data):
    """The write has no users: the per-call prelude must keep it (it once dropped writes
    through a view, adding zeros), and a `.copy_` into a slice is a fill like `x[i] = v`."""
    torch.manual_seed(0)
    model = TableThroughAView(through_data).eval()
    x = torch.randn(1, 19, 4)
    with torch.no_grad():
        assert_rel_close(run_mode(model, mode, x), model(x))
