"""Joint text+image attention on a tiny hand-written model: text tokens ride whole with every
chunk (a segment before or after the chunked tokens), for any stages and chunks."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.fixtures.models import Block
from tests.fixtures.tracing import assert_rel_close, rel_error, trace
from tokpipe_compiler.core.errors import TokpipeError
from tokpipe_compiler.core.meta import INVARIANT_INFO, META_KEY
from tokpipe_compiler.core.stage_graph import BOUNDARY
from tokpipe_compiler.passes.split import prelude_for
from tokpipe_compiler.planning.params import computes_from, prelude_reads


class JointBlock(nn.Module):
    def __init__(self, width: int, heads: int, text_first: bool):
        super().__init__()
        self.heads, self.text_first = heads, text_first
        self.qkv, self.qkv_text = nn.Linear(width, 3 * width), nn.Linear(width, 3 * width)
        self.out, self.out_text = nn.Linear(width, width), nn.Linear(width, width)

    def split_heads(self, h: torch.Tensor) -> torch.Tensor:
        b, n, w = h.shape
        return h.view(b, n, 3, self.heads, w // 3 // self.heads).permute(2, 0, 3, 1, 4)

    def forward(self, x: torch.Tensor, text: torch.Tensor):
        q, k, v = self.split_heads(self.qkv(F.layer_norm(x, x.shape[-1:])))
        qt, kt, vt = self.split_heads(self.qkv_text(text))
        pair = (lambda t, i: [t, i]) if self.text_first else (lambda t, i: [i, t])
        joint = [torch.cat(pair(t, i), dim=2) for t, i in ((qt, q), (kt, k), (vt, v))]
        a = F.scaled_dot_product_attention(*joint).transpose(1, 2).flatten(2)
        t_len, n = text.shape[1], x.shape[1]
        a_text, a_img = (a[:, :t_len], a[:, t_len:]) if self.text_first else (
            a[:, n:], a[:, :n])
        return x + self.out(a_img), text + self.out_text(a_text)


class TinyJoint(nn.Module):
    def __init__(self, depth: int = 2, width: int = 16, heads: int = 2, text_first=True):
        super().__init__()
        self.blocks = nn.ModuleList(JointBlock(width, heads, text_first) for _ in range(depth))

    def forward(self, x: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x, text = block(x, text)
        return x


def inputs(seed: int, length: int = 12):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, length, 16, generator=g), torch.randn(1, 5, 16, generator=g) * 0.5


@pytest.fixture(scope="module", params=[True, False], ids=["text-first", "text-last"])
def joint(request):
    torch.manual_seed(0)
    model = TinyJoint(text_first=request.param).eval()
    return model, trace(model, *inputs(0))


def eager(model, seed):
    with torch.no_grad():
        return model(*inputs(seed))


@pytest.mark.parametrize("stages,chunks", [(1, 2), (2, 3), (3, 4), (4, 12)])
def test_exact_modes_equal_eager(joint, stages, chunks):
    model, traced = joint
    for mode in ("sync", "stale"):
        program = traced.program(mode=mode, stages=stages, chunks=chunks, warmup_steps=3)
        for seed in (1, 2):
            (out,) = program(*traced.args(x=inputs(seed)[0], text=inputs(seed)[1]))
            assert_rel_close(out, eager(model, seed))


@pytest.mark.parametrize("stages,chunks", [(2, 2), (2, 4)])
def test_stale_text_stream(joint, stages, chunks):
    """Repeated input: exact. New input: stale like the image tokens (not exact)."""
    model, traced = joint
    program = traced.program(mode="stale", stages=stages, chunks=chunks, warmup_steps=1)
    for seed in (3, 3):
        (out,) = program(*traced.args(x=inputs(seed)[0], text=inputs(seed)[1]))
    assert_rel_close(out, eager(model, 3))
    (out,) = program(*traced.args(x=inputs(4)[0], text=inputs(4)[1]))
    assert rel_error(out, eager(model, 4)) > 1e-4


def test_an_uneven_split_puts_the_smaller_chunks_first(joint):
    """The first chunk computes the step's text stream: 12 rows in 5 chunks are 2, 2, 2,
    3, 3, not 3, 3, 2, 2, 2 (a video's 3 frames in 2 chunks: 1 then 2). Per call, stale on
    a repeated input equals eager."""
    model, traced = joint
    program = traced.program(mode="stale", stages=2, chunks=5, warmup_steps=1)
    assert [c.units for c in program.plan.chunks] == [2, 2, 2, 3, 3]
    for _ in range(2):
        (out,) = program(*traced.args(x=inputs(1)[0], text=inputs(1)[1]))
    assert_rel_close(out, eager(model, 1))


def test_causal_over_segments_is_refused(joint):
    _, traced = joint
    with pytest.raises(TokpipeError, match="causal"):
        traced.program(mode="causal", stages=1, chunks=2)


class ReturnsText(TinyJoint):
    def forward(self, x: torch.Tensor, text: torch.Tensor):
        for block in self.blocks:
            x, text = block(x, text)
        return x, text


@pytest.mark.parametrize("text_chunks", ["first", "every"])
def test_the_text_stream_returned_is_the_chunk_that_computed_its(text_chunks):
    """In sync, and in stale on a repeated input (stale K/V are then fresh), the text
    stream returned equals eager. With text_chunks="first" it is the first chunk's and the
    later chunks compute none of it (zero rows); with "every" each chunk computes its own
    copy and the last chunk's (it attended to every chunk's K/V of the step) is returned."""
    torch.manual_seed(0)
    model = ReturnsText().eval()
    traced = trace(model, *inputs(0))
    args = traced.args(x=inputs(1)[0], text=inputs(1)[1])
    out = traced.program(mode="sync", stages=2)(*args)
    for got, want in zip(out, eager(model, 1), strict=True):
        assert_rel_close(got, want)
    stale = traced.program(mode="stale", stages=2, chunks=2, warmup_steps=1,
                           text_chunks=text_chunks)
    stale(*args)
    for got, want in zip(stale(*args), eager(model, 1), strict=True):
        assert_rel_close(got, want)
    run, seen = stale._run, []
    stale._run = lambda *a, **k: seen.append(run(*a, **k)) or seen[-1]
    _, text = stale(*traced.args(x=inputs(2)[0], text=inputs(2)[1]))
    (name,) = [s.source for s in stale.plan.graphs.outputs][1:]
    first, last = (seen[0][0, chunk][name] for chunk in (0, 1))
    if text_chunks == "first":
        assert torch.equal(text, first) and last.shape[1] == 0
    else:
        assert torch.equal(text, last) and not torch.allclose(text, first)


class PositionsInPlace(nn.Module):
    """Position ids built by writing into a fresh tensor (the writes have no users)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = torch.zeros(x.shape[1], 16)
        ids[:, 0] = torch.arange(x.shape[1]).float()
        return self.lin(x) + ids


def test_prelude_keeps_writes_into_invariant_values():
    model = PositionsInPlace().eval()
    x = torch.randn(1, 12, 16)
    traced = trace(model, x)
    (out,) = traced.program(mode="sync", stages=1, chunks=1)(*traced.args(x=x))
    with torch.no_grad():
        assert_rel_close(out, model(x))


class MaskFilledInPlace(nn.Module):
    """An additive band mask filled in place by a method (ACE-Step's sliding window:
    `torch.full(...).masked_fill_(band, 0.0)`), which FX does not take for impure."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        i = torch.arange(n)
        mask = torch.full((1, 1, n, n), torch.finfo(x.dtype).min)
        mask.masked_fill_((i[:, None] - i[None, :]).abs() <= 2, 0.0)
        h = self.lin(x).unsqueeze(1)
        return F.scaled_dot_product_attention(h, h, h, attn_mask=mask).squeeze(1)


def test_a_rank_prelude_keeps_method_writes_into_invariant_values():
    traced = trace(MaskFilledInPlace().eval(), torch.randn(1, 12, 16))
    graphs = traced.program(mode="stale", stages=2, chunks=2).plan.graphs
    values = dict(zip(traced.names, traced.args(), strict=True))
    args = [values[name] for name in graphs.input_names]
    whole = dict(zip(graphs.prelude_outputs, graphs.prelude(*args), strict=True))
    for stage in range(2):  # each rank's share of the prelude: the mask as filled
        prelude, kept = prelude_for(graphs, {stage})
        for name, value in zip(kept, prelude(*args), strict=True):
            assert torch.equal(value, whole[name]), name
        # What the memory report counts for the rank: the inputs that part computes from.
        assert prelude_reads(graphs, {stage}) == computes_from(prelude)


class JoinedBefore(nn.Module):
    """Blocks over text and image tokens joined before the graph (OmniGen's blocks' graph
    after a graph break): the token input holds the 5 text tokens first."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width, 2) for _ in range(2))

    def forward(self, joint: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            joint = block(joint, torch.zeros(1, joint.shape[-1]))
        return joint[:, 5:]


def test_text_joined_before_the_graph_is_a_segment_of_the_token_input():
    """The image tokens are chunked and the text rides with every chunk, as when the graph
    joins them itself; sync, and stale on a repeated input, equal eager."""
    torch.manual_seed(0)
    model = JoinedBefore().eval()
    joint = torch.cat(inputs(0)[::-1], dim=1)  # [1, 5 + 12, 16]
    traced = trace(model, joint)
    with torch.no_grad():
        expected = model(joint)
    for mode in ("sync", "stale"):
        program = traced.program(mode=mode, stages=2, chunks=3, warmup_steps=1)
        assert program.plan.units == 12
        program(*traced.args())
        assert_rel_close(program(*traced.args())[0], expected)


class TextSlicedFirst(JoinedBefore):
    """JoinedBefore whose graph first slices the text out, then adds a positional table to
    the image tokens only: the first constant slice the graph takes is the text's."""

    def forward(self, joint: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        text, image = joint[:, :5], joint[:, 5:]
        return super().forward(torch.cat([text, image + table], dim=1))


def test_the_range_the_output_is_made_of_is_chunked():
    """Of the ranges the graph slices from its token input, the image tokens the output is
    made of are chunked, not the 5 text tokens it happens to slice first."""
    torch.manual_seed(0)
    model = TextSlicedFirst().eval()
    joint, table = torch.cat(inputs(0)[::-1], dim=1), torch.randn(12, 16)
    traced = trace(model, joint, table)
    with torch.no_grad():
        expected = model(joint, table)
    for mode in ("sync", "stale"):
        program = traced.program(mode=mode, stages=2, chunks=3, warmup_steps=1)
        assert program.plan.units == 12
        program(*traced.args())
        assert_rel_close(program(*traced.args())[0], expected)


def _linears(gm: torch.fx.GraphModule) -> int:
    return sum(n.op == "call_function" and "linear" in str(n.target) for n in gm.graph.nodes)


def test_chunks_after_the_first_run_without_the_text_stream(joint):
    """In stale mode only a step's first chunk computes the text stream: the later ones'
    graph holds none of it (no linear over text, no value that is only text), and on a
    repeated input the output still equals eager."""
    model, traced = joint
    program = traced.program(mode="stale", stages=1, chunks=3, warmup_steps=1)
    assert [c.segments for c in program.plan.chunks] == [True, False, False]
    stage = program.stage_programs[0]
    rows, whole = stage.graph_for(4, segments=False), stage.graph_for(4)
    assert _linears(rows) == 2 * len(model.blocks)  # each block's image qkv and out
    assert _linears(whole) > _linears(rows)
    assert not [n for n in rows.graph.nodes
                if n.op != "placeholder" and n.meta.get(META_KEY, INVARIANT_INFO).only_segment]
    for _ in range(2):
        (out,) = program(*traced.args(x=inputs(5)[0], text=inputs(5)[1]))
    assert_rel_close(out, eager(model, 5))


def test_the_plan_counts_the_text_rows_the_first_chunk_sends(joint):
    """What a stage sends per chunk, in the plan and the simulator, is what the runtime
    sizes its messages by: the first chunk's boundary values carry the text stream, the
    later chunks' do not; on a slow link that first send costs time."""
    from tokpipe_compiler.costmodel.hardware import DEVICES, LinkModel
    from tokpipe_compiler.costmodel.simulator import simulate, simulate_chunks
    from tokpipe_compiler.runtime.executor import value_spec

    _, traced = joint
    plan = traced.program(mode="stale", stages=2, chunks=3, warmup_steps=1).plan
    sent = {(i.producer, i.name) for g in plan.graphs.stages for i in g.inputs
            if i.kind == BOUNDARY}
    for stage in plan.graphs.stages[:-1]:
        names = [name for producer, name in sent if producer == stage.index]
        for chunk in plan.chunks:
            specs = [value_spec(stage, name, chunk) for name in names]
            runtime = sum(math.prod(s.shape) * s.dtype.itemsize for s in specs)
            assert plan.send_bytes(stage.index, chunk) == runtime
    assert plan.stages[0].send_text_bytes == 5 * 16 * 4  # the text stream, 5 x 16 floats
    # simulate() computes in the plan's dtype: the reference below at the same rates
    slow, h200 = LinkModel("slow", 1e4, 0.0), DEVICES["h200"].for_dtype(torch.float32)
    per_token = plan.tokens / plan.units
    image_only = simulate_chunks(
        [s.cost for s in plan.stages], [s.send_bytes_per_unit / per_token for s in plan.stages],
        plan.tokens, [(plan.chunk_tokens(c), plan.tokens, float(c.segments)) for c in plan.chunks],
        20, 1, h200, slow, 2)
    text_s = slow.seconds(plan.stages[0].send_text_bytes)  # on the first chunk of each step
    assert simulate(plan, h200, slow).pipelined_s > image_only.pipelined_s + 19 * text_s / 2


def test_the_chunk_table_context_holds_the_text(joint):
    """Every chunk attends over the 12 image tokens and the 5 text tokens (whichever chunk
    computes the text): the printed context says both."""
    _, traced = joint
    plan = traced.program(mode="stale", stages=2, chunks=3, warmup_steps=1).plan
    assert plan.text_tokens == 5 and plan.summary()["text_tokens"] == 5
    table = str(plan).split("\nchunk ")[1]
    assert table.count(" 12 + 5 unchunked ") == 3


class ScaledByText(TinyJoint):
    """The image rows scaled by the first text token's attention output: a chunk without
    the text would have nothing to scale by, so every chunk keeps computing the text."""

    def forward(self, x: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        block = self.blocks[0]
        q, k, v = block.split_heads(block.qkv(x))
        qt, kt, vt = block.split_heads(block.qkv_text(text))
        joint = [torch.cat(pair, dim=2) for pair in ((qt, q), (kt, k), (vt, v))]
        a = F.scaled_dot_product_attention(*joint).transpose(1, 2).flatten(2)
        return x + a[:, text.shape[1]:] * a[:, :1]


def test_text_read_by_the_image_rows_stays_in_every_chunk():
    torch.manual_seed(0)
    model = ScaledByText().eval()
    traced = trace(model, *inputs(0))
    program = traced.program(mode="stale", stages=1, chunks=3, warmup_steps=1)
    assert all(c.segments for c in program.plan.chunks)
    for _ in range(2):
        (out,) = program(*traced.args(x=inputs(5)[0], text=inputs(5)[1]))
    assert_rel_close(out, eager(model, 5))
