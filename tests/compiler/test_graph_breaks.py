"""Models Dynamo traces as several graphs (graph breaks): the graph with attention over the
tokens is pipelined, the others run as traced with a warning, and the whole matches eager."""

from __future__ import annotations

import warnings

import pytest
import torch

import tokpipe_compiler as tp
from tests.fixtures.models import MeanOverTokens, SplitDiT, TinyDiT, dit_inputs
from tests.fixtures.tracing import assert_rel_close
from tests.fixtures.zoo import ZOO, build
from tokpipe_compiler.runtime.caches import CacheSpec


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch.compiler.reset()


def run(model: torch.nn.Module, args: tuple = (), kwargs: dict | None = None, calls: int = 1,
        **options) -> tuple[torch.Tensor, object, list[str]]:
    """(output of the last call, the compiled model, tokpipe's warnings)."""
    options = {"compiler": "eager", "stages": 2, "chunks": 2, **options}
    compiled = torch.compile(model, backend="tokpipe", dynamic=False, options=options)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        for _ in range(calls):
            out = compiled(*args, **(kwargs or {}))
    return out, compiled, [str(w.message) for w in caught if "tokpipe" in str(w.message)]


def unpipelined(messages: list[str]) -> list[str]:
    return [m for m in messages if "running this graph unpipelined" in m]


@pytest.mark.parametrize("mode", ["sync", "stale"])
def test_the_block_graph_is_pipelined_and_the_small_graphs_run_as_traced(mode):
    torch.manual_seed(0)
    model = SplitDiT(depth=2, width=32, heads=2, grid=8).eval()
    inputs = dit_inputs(model, 8)
    out, compiled, messages = run(model, inputs, calls=2, mode=mode)
    with torch.no_grad():
        assert_rel_close(out, model(*inputs))  # stale: a repeated input is exact
    conditioning, embedding = unpipelined(messages)
    assert "graph breaks" in conditioning and "no input that looks like a token" in conditioning
    assert "holds no attention over its token input 'l_latents_'" in embedding
    assert "ends at a graph break" in embedding
    (program,) = tp.programs(compiled)  # the blocks' graph, pipelined
    assert sum(isinstance(c, CacheSpec) for c in program.plan.caches) == 2  # one per block
    assert len(program.plan.graphs.stages) == 2
    assert len(program.plan.chunks) == (1 if mode == "sync" else 2)
    assert program.calls == 2



def test_after_the_first_call_one_line_says_how_much_is_pipelined():
    """Compiled directly: the model's second call gives the line (its first planned every
    graph); no line after later calls."""
    torch.manual_seed(0)
    model = SplitDiT(depth=2, width=32, heads=2, grid=8).eval()
    _, _, messages = run(model, dit_inputs(model, 8), calls=3)
    lines = [m for m in messages if "graphs (Dynamo split it" in m]
    assert len(lines) == 1, messages
    assert "traced from forward (models.py:" in lines[0]
    assert "ran as 3 graphs" in lines[0] and "1 pipelined, holding" in lines[0], lines[0]
    assert "2 run as traced" in lines[0], lines[0]
    assert messages.index(lines[0]) == len(messages) - 1  # after the planning's warnings


class MaxInBlocks(SplitDiT):
    """The blocks' graph starts with a max over the tokens: no chunking for it."""

    def before_blocks(self, x):
        return x - x.amax(dim=1, keepdim=True)


class MaxAfterBlocks(SplitDiT):
    """The blocks' graph ends with a max over the image's rows, which no block reads."""

    def unpatchify(self, x, shape):
        out = super().unpatchify(x, shape)
        return out - out.amax(dim=2, keepdim=True)


def test_a_block_graph_that_cannot_be_chunked_raises():
    torch.manual_seed(0)
    model = MaxInBlocks(depth=2, width=32, heads=2, grid=8).eval()
    with pytest.raises(tp.TokpipeError, match="amax") as err:
        run(model, dit_inputs(model, 8), mode="stale")
    assert "fallback" in str(err.value)


def test_a_max_after_the_blocks_runs_after_the_pipeline():
    """planning/graph_tail.py: the max runs on the whole output; the blocks are pipelined."""
    torch.manual_seed(0)
    model = MaxAfterBlocks(depth=2, width=32, heads=2, grid=8).eval()
    args = dit_inputs(model, 8)
    out, compiled, _ = run(model, args, mode="stale")
    with torch.no_grad():
        assert_rel_close(out, model(*args))  # the first call is the warmup step: exact
    assert [len(p.plan.caches) for p in tp.programs(compiled)] == [2]


class SortBeforeBlocks(SplitDiT):
    """The blocks' graph starts by sorting the tokens: its attention then reads values
    that cannot be chunked (and carry no chunk's tokens)."""

    def before_blocks(self, x):
        return x.sort(dim=1).values


def test_attention_behind_an_op_that_cannot_be_chunked_raises():
    """The graph still holds attention over its token input: it raises as a whole model
    would, and does not run as traced with a warning."""
    torch.manual_seed(0)
    model = SortBeforeBlocks(depth=2, width=32, heads=2, grid=8).eval()
    with pytest.raises(tp.TokpipeError, match="sort"):
        run(model, dit_inputs(model, 8), mode="stale")


class MaxInEmbedding(SplitDiT):
    """The patch embedding's graph (no attention) takes a max over the tokens."""

    def tokens(self, latents):
        return super().tokens(latents - latents.amax(dim=2, keepdim=True))


def test_a_small_graph_that_cannot_be_chunked_runs_as_traced():
    torch.manual_seed(0)
    model = MaxInEmbedding(depth=2, width=32, heads=2, grid=8).eval()
    inputs = dit_inputs(model, 8)
    out, compiled, messages = run(model, inputs, calls=2, mode="stale")
    with torch.no_grad():
        assert_rel_close(out, model(*inputs))
    assert len(unpipelined(messages)) == 2
    assert len(tp.programs(compiled)) == 1


def test_one_graph_without_attention_is_still_pipelined():
    """No graph breaks: a model without attention is pipelined as before (its mean over
    tokens from partial sums), without a warning."""
    model = MeanOverTokens().eval()
    x = torch.randn(1, 8, 16)
    out, compiled, messages = run(model, (x,), mode="sync")
    with torch.no_grad():
        assert_rel_close(out, model(x))
    assert not unpipelined(messages)
    assert len(tp.programs(compiled)) == 1


def test_explain_plans_the_block_graph():
    torch.manual_seed(0)
    model = SplitDiT(depth=2, width=32, heads=2, grid=8).eval()
    plan = tp.explain(model, dit_inputs(model, 8), compiler="eager", chunks=2)
    assert plan.token_input == "l_x_"
    assert sum(isinstance(c, CacheSpec) for c in plan.caches) == 2


@pytest.mark.parametrize(("name", "pipelined", "caches"), [
    ("OmniGenTransformer2DModel", 1, True),  # blocks after its rope's data-dependent branch
    # Nothing to pipeline: its blocks' attention runs outside any graph (a per-item loop
    # over nonzero masks), and its one graph with attention pools the text.
    ("MochiTransformer3DModel", 0, False),
])
def test_diffusers_models_with_graph_breaks_match_eager_in_sync(name, pipelined, caches):
    model = build(name)
    inputs = ZOO[name].inputs(1)
    out, compiled, messages = run(model, kwargs=inputs, mode="sync", chunks=ZOO[name].chunks)
    with torch.no_grad():
        assert_rel_close(out.sample, model(**inputs).sample)
    programs = tp.programs(compiled)
    assert len(programs) == pipelined
    assert all(any(isinstance(c, CacheSpec) for c in p.plan.caches) == caches
               for p in programs)
    assert unpipelined(messages)


@pytest.mark.parametrize("name", [
    "OmniGenTransformer2DModel",  # text and time tokens joined before the blocks' graph
    "HunyuanVideoFramepackTransformer3DModel",  # blocks' graphs return the text stream
    "Lumina2Transformer2DModel",  # its joint sequence written item by item into zeros
    "HunyuanVideo15Transformer3DModel",  # its first graph returns text in the text's shape
])
def test_diffusers_models_with_graph_breaks_pipeline_stale(name):
    """Stale on a repeated input (stale K/V are then fresh) equals eager."""
    model = build(name)
    inputs = ZOO[name].inputs(1)
    out, compiled, _ = run(model, kwargs=inputs, calls=2, mode="stale", warmup_steps=1,
                           chunks=ZOO[name].chunks)
    with torch.no_grad():
        assert_rel_close(out.sample, model(**inputs).sample)
    assert tp.programs(compiled)


def test_the_block_graph_follows_generations_and_guidance_branches():
    """The blocks' graph reads no timestep: it follows the conditioning graph's, so a call
    sequence (two guidance branches per step, a second generation) gives what the same
    model without graph breaks gives, call for call, in stale mode."""
    torch.manual_seed(0)
    split = SplitDiT(depth=2, width=32, heads=2, grid=8).eval()
    whole = TinyDiT(depth=2, width=32, heads=2, grid=8).eval()
    whole.load_state_dict(split.state_dict())
    options = {"compiler": "eager", "stages": 2, "chunks": 2, "mode": "stale",
               "warmup_steps": 1}
    compiled = [torch.compile(m, backend="tokpipe", dynamic=False, options=dict(options))
                for m in (split, whole)]
    calls = [(dit_inputs(split, 8, seed=gen)[0] + 0.1 * step, torch.tensor([t]),
              torch.tensor([label]))
             for gen in (0, 1) for step, t in enumerate((900, 800, 700))
             for label in (3, 0)]  # guidance: the conditional branch, then the other
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        for args in calls:
            got, expected = (c(*args) for c in compiled)
            assert_rel_close(got, expected)
    (program,) = tp.programs(compiled[0])
    assert sorted(program.branches) == [0, 1]


@pytest.mark.parametrize("model_class", [TinyDiT, SplitDiT])
def test_backward_through_the_pipeline_raises(model_class):
    """Called in grad mode, a model split at graph breaks runs its other graphs with
    autograd: a backward() would give their weights gradients and the pipelined blocks'
    None. It raises instead, as it does for a model in one graph."""
    torch.manual_seed(0)
    model = model_class(depth=2, width=32, heads=2, grid=8).eval()
    args = dit_inputs(model, 8)
    compiled = torch.compile(model, backend="tokpipe", dynamic=False,
                             options={"compiler": "eager", "stages": 2, "chunks": 2})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = compiled(*args)
    with torch.no_grad():
        assert_rel_close(out, model(*args))
    with pytest.raises(tp.TokpipeError, match="carry no gradients"):
        out.sum().backward()
