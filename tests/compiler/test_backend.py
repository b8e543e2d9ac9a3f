"""The backend as users meet it: torch.compile, options, errors, fallbacks, reset."""

from __future__ import annotations

import importlib.metadata
import re
import warnings

import pytest
import torch

import tokpipe_compiler as tp
from tests.fixtures.models import (
    ConvAcrossRows,
    LearnedQueries,
    MaxOverTokens,
    MergesRows,
    SortOverTokens,
    TinyDiT,
    TokensIntoBuffer,
    dit_inputs,
)
from tests.fixtures.tracing import assert_rel_close


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()


def compile_dit(**options):
    torch.manual_seed(0)
    model = TinyDiT(depth=2, width=32, heads=2, grid=8).eval()
    options.setdefault("compiler", "eager")
    compiled = torch.compile(model, backend="tokpipe", options=options, dynamic=False)
    return model, compiled


def test_entry_point_registers_the_backend():
    names = [ep.name for ep in importlib.metadata.entry_points(group="torch_dynamo_backends")]
    assert "tokpipe" in names
    assert "tokpipe" in torch._dynamo.list_backends()


@pytest.mark.parametrize(("options", "name"), [
    ({"stages": 0}, "stages"), ({"chunks": "many"}, "chunks"), ({"mode": "fast"}, "mode"),
    ({"warmup_steps": -1}, "warmup_steps"), ({"compiler": "tvm"}, "compiler"),
    ({"fallback": "yes"}, "fallback"), ({"chunk": 4}, "chunk"), ({"chunks": [8, 0]}, "chunks"),
    ({"chunks": []}, "chunks"), ({"chunks": [8.0]}, "chunks"),
])
def test_bad_options_name_the_option(options, name):
    with pytest.raises(ValueError, match=re.escape(name)):
        tp.backend(**options)
    model, compiled = compile_dit(**options)
    with pytest.raises(ValueError, match=re.escape(name)):
        compiled(*dit_inputs(model, 8))


def test_string_backend_and_backend_object_agree_with_eager():
    model, compiled = compile_dit(stages=2, chunks=2, mode="stale", warmup_steps=1)
    backend = tp.backend(stages=2, chunks=2, mode="stale", warmup_steps=1, compiler="eager")
    compiled_obj = torch.compile(model, backend=backend, dynamic=False)
    inputs = dit_inputs(model, 8)
    with torch.no_grad():
        expected = model(*inputs)
        for fn in (compiled, compiled_obj):
            assert_rel_close(fn(*inputs), expected)
            assert_rel_close(fn(*inputs), expected)


def test_reset_starts_a_new_generation():
    model, compiled = compile_dit(stages=2, chunks=4, mode="stale", warmup_steps=1)
    a, b = dit_inputs(model, 8, seed=1), dit_inputs(model, 8, seed=2)
    b = (b[0], a[1] - 1, b[2])  # the next denoising step: its timestep is lower
    with torch.no_grad():
        compiled(*a)
        stale = compiled(*b)
        tp.reset(compiled)
        fresh = compiled(*b)
        expected = model(*b)
    assert (stale - expected).abs().max() > 1e-4  # after warmup: stale K/V of input a
    assert_rel_close(fresh, expected)  # after reset: warmup again, exact


def test_reset_rejects_what_is_not_a_tokpipe_model():
    with pytest.raises(tp.TokpipeError, match="no tokpipe program"):
        tp.reset(torch.nn.Linear(2, 2))


def test_new_input_shape_starts_a_new_generation():
    model, compiled = compile_dit(stages=2, chunks=2, mode="stale", warmup_steps=1)
    small, large = dit_inputs(model, 8, seed=1), dit_inputs(model, 8, seed=2, batch=2)
    with torch.no_grad():
        compiled(*small)
        compiled(*large)  # another shape: a new generation, warmup, exact
        again = dit_inputs(model, 8, seed=3)
        out = compiled(*again)  # back to the first shape: its caches are an old generation
        assert_rel_close(out, model(*again))


def test_unsupported_op_names_op_shape_and_source_line():
    model = MaxOverTokens().eval()
    compiled = torch.compile(model, backend="tokpipe", options={"compiler": "eager"},
                             dynamic=False)
    with pytest.raises(tp.TokpipeError) as err:
        compiled(torch.randn(1, 8, 16))
    text = str(err.value)
    assert "amax" in text and "(1, 8, 16)" in text
    assert "models.py" in text and "h.amax(dim=1, keepdim=True)" in text
    assert "fallback" in text  # says what the user can do


@pytest.mark.parametrize(("model", "shape", "words"), [
    (ConvAcrossRows(), (1, 4, 8, 8), "reaches across chunk rows"),
    (SortOverTokens(), (1, 8, 16), "sort"),
    (LearnedQueries(), (1, 8, 16), r"cross-attention from queries without the tokens \(another "
                                   r"stream: an audio track, learned queries\)"),
])
def test_other_token_mixers_are_rejected(model, shape, words):
    compiled = torch.compile(model.eval(), backend="tokpipe", options={"compiler": "eager"},
                             dynamic=False)
    with pytest.raises(tp.TokpipeError, match=words):
        compiled(torch.randn(shape))


@pytest.mark.parametrize("mode", ["sync", "stale"])
def test_tokens_written_into_a_tensor_without_tokens_are_rejected(mode):
    """Sync mode runs a token-mixing value whole, but not one written in place into a
    tensor made without tokens: that tensor's readers would be taken for token-free. (A
    buffer nothing reads between its writes is rewritten as a concatenation instead:
    tests/compiler/test_buffer_fills.py.)"""
    compiled = torch.compile(TokensIntoBuffer(peek=True).eval(), backend="tokpipe",
                             dynamic=False,
                             options={"compiler": "eager", "mode": mode})
    with pytest.raises(tp.TokpipeError, match="setitem") as err:
        compiled(torch.randn(1, 8, 16))
    assert "joint[:, 3:] = h" in str(err.value)


def test_fallback_runs_unpipelined_and_warns():
    """The warning says what mixes tokens, without the advice to pass fallback=True."""
    model = MaxOverTokens().eval()
    compiled = torch.compile(model, backend="tokpipe",
                             options={"compiler": "eager", "fallback": True}, dynamic=False)
    x = torch.randn(1, 8, 16)
    with pytest.warns(UserWarning, match=r"(?s)unpipelined.*amax") as record, torch.no_grad():
        out = compiled(x)
        assert torch.equal(out, model(x))
    assert not any("'fallback': True" in str(w.message) for w in record)


class SortInEveryBlock(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(3):
            x = x + torch.sort(x, dim=1).values
        return x


def test_an_unsupported_op_repeated_by_the_blocks_is_named_once():
    compiled = torch.compile(SortInEveryBlock().eval(), backend="tokpipe",
                             options={"compiler": "eager"}, dynamic=False)
    with pytest.raises(tp.TokpipeError) as err:
        compiled(torch.randn(1, 8, 16))
    assert str(err.value).count("torch.sort(x, dim=1)") == 1
    assert "(3 times)" in str(err.value)


def test_more_chunks_than_rows_run_one_a_row_with_a_warning():
    """It was an error: a server with a fixed chunk count refused the smaller requests (a
    short video, a low image), which run as many chunks as they have units."""
    model, compiled = compile_dit(stages=2, chunks=5, mode="stale")  # 8x8 latent: 4 rows
    inputs = dit_inputs(model, 8)
    with pytest.warns(UserWarning, match='chunks=5 is more than the 4 units .* it runs 4 '
                                         r'chunk\(s\). chunks="auto" chooses'), torch.no_grad():
        out = compiled(*inputs)  # the warmup step, whole
    assert len(tp.programs(compiled)[0].plan.chunks) == 4
    with torch.no_grad():
        eager = model(*inputs)
    assert (out - eager).abs().max().item() <= 1e-5 * eager.abs().max().item()


def test_more_chunks_than_merged_rows_names_the_unit():
    """A model that merges patch rows pairs is chunked by pairs: the warning says so, in
    tokens, where counting patch rows would give twice as many."""
    torch.manual_seed(0)
    model = MergesRows().eval()
    compiled = torch.compile(model, backend="tokpipe", dynamic=False,
                             options={"stages": 2, "chunks": 8, "compiler": "eager"})
    with pytest.warns(UserWarning, match=r"the 4 units .*\(64 tokens, 16 a unit"):
        compiled(*dit_inputs(model, 16))


def test_more_stages_than_cut_points_is_an_error():
    model, compiled = compile_dit(stages=500, chunks=2)
    with pytest.raises(tp.TokpipeError, match="use fewer stages"):
        compiled(*dit_inputs(model, 8))


class BrokenDiT(TinyDiT):
    """A graph break between blocks: Dynamo hands the backend several graphs."""

    def forward(self, latents, timestep, labels):
        b, c, h, w = latents.shape
        x = self.embed(latents).flatten(2).transpose(1, 2) + self.pos
        cond = self.t_mlp(torch.cat([timestep.float()[:, None]] * 16, dim=-1)) + self.label(labels)
        x = self.blocks[0](x, cond)
        torch._dynamo.graph_break()
        x = self.blocks[1](x, cond)
        p = self.patch
        x = self.out(x).reshape(b, h // p, w // p, p, p, c)
        return torch.einsum("nhwpqc->nchpwq", x).reshape(b, c, h, w)


@pytest.mark.parametrize("mode", ["sync", "stale"])
def test_graph_breaks_each_pipelined(mode):
    torch.manual_seed(0)
    model = BrokenDiT(depth=2, width=32, heads=2, grid=8).eval()
    compiled = torch.compile(model, backend="tokpipe", dynamic=False, options={
        "compiler": "eager", "stages": 2, "chunks": 2, "mode": mode, "warmup_steps": 1})
    inputs = dit_inputs(model, 8)
    with torch.no_grad():
        expected = model(*inputs)
        for _ in range(2):
            assert_rel_close(compiled(*inputs), expected)


class NoTokens(torch.nn.Module):
    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return torch.sin(t) * 2


def test_graph_without_token_input_runs_unpipelined_with_warning():
    compiled = torch.compile(NoTokens(), backend="tokpipe", options={"compiler": "eager"},
                             dynamic=False)
    t = torch.randn(3)
    with pytest.warns(UserWarning, match="unpipelined"):
        assert torch.equal(compiled(t), torch.sin(t) * 2)


def test_dynamic_shapes_are_made_static_per_shape():
    """Without dynamic=False Dynamo retraces a new batch size symbolically; each concrete
    shape still gets a pipelined, exact program."""
    torch.manual_seed(0)
    model = TinyDiT(depth=2, width=32, heads=2, grid=8).eval()
    compiled = torch.compile(model, backend="tokpipe", options={
        "compiler": "eager", "stages": 2, "chunks": 2, "mode": "sync"})
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch in (1, 2, 3):
            inputs = dit_inputs(model, 8, seed=batch, batch=batch)
            assert_rel_close(compiled(*inputs), model(*inputs))
    # said once, when the second shape made the graph symbolic
    said = [w for w in caught if "Dynamo made a graph symbolic" in str(w.message)]
    assert len(said) == 1 and "dynamic=False" in str(said[0].message)


class ScaledDiT(TinyDiT):
    """A DiT whose output goes through F.layer_norm with a Python float attribute as its
    eps and is scaled by it: `dynamic=True` passes the float as a tensor input."""

    scale = 0.5

    def forward(self, *args):
        out = super().forward(*args)
        return torch.nn.functional.layer_norm(out, out.shape[-1:], eps=self.scale) * self.scale


def test_dynamic_true_floats_are_folded_per_value():
    """dynamic=True makes the model's floats symbolic inputs: each static graph takes their
    values as constants, and a changed value gets a graph of its own."""
    torch.manual_seed(0)
    model = ScaledDiT(depth=2, width=32, heads=2, grid=8).eval()
    compiled = torch.compile(model, backend="tokpipe", dynamic=True, options={
        "compiler": "eager", "stages": 2, "chunks": 2, "mode": "sync"})
    with torch.no_grad():
        for batch, scale in ((1, 0.5), (2, 0.5), (2, 2.0)):
            model.scale = scale
            inputs = dit_inputs(model, 8, seed=batch, batch=batch)
            assert_rel_close(compiled(*inputs), model(*inputs))
    assert len(tp.programs(compiled)) == 3


@pytest.mark.parametrize("dynamic", [False, None])
def test_a_new_input_shape_frees_the_last_shapes_caches(dynamic):
    """Each shape has its own program; only the one in use holds K/V, and a shape used
    again starts a new generation. Under dynamic=None the second shape's graph is
    symbolic, its token input another placeholder name: the first shape's program held
    its caches and went on with its generation."""
    torch.manual_seed(0)
    model = TinyDiT(depth=2, width=32, heads=2, grid=8).eval()
    compiled = torch.compile(model, backend="tokpipe", dynamic=dynamic, options={
        "compiler": "eager", "stages": 2, "chunks": 2, "mode": "stale", "warmup_steps": 1})
    small = dit_inputs(model, 8, seed=0, batch=1)
    large = dit_inputs(model, 8, seed=1, batch=2)
    with torch.no_grad():
        compiled(*small)
        compiled(*small)
        first = tp.programs(compiled)[0]
        assert first.branches
        compiled(*large)
        assert not first.branches
        assert_rel_close(compiled(*small), model(*small))  # the warmup step again: exact


def test_grad_mode_with_parameters_requiring_grad_warns_once():
    """The outputs carry no gradients: a caller in grad mode hears it at the call, once,
    not from a later backward(); under no_grad, as pipelines call, nothing is said."""
    model, compiled = compile_dit(stages=2, chunks=2)
    args = dit_inputs(model, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            compiled(*args)
        assert not [w for w in caught if "grad" in str(w.message)]
        compiled(*args)
        compiled(*args)
    said = [str(w.message) for w in caught if "grad enabled" in str(w.message)]
    assert len(said) == 1 and "torch.no_grad()" in said[0]


def test_dynamos_recompile_limit_is_said_as_a_warning():
    """Past the limit Dynamo runs the model eagerly, unpipelined, with a log record only."""
    model, compiled = compile_dit(stages=2, chunks=2)
    with torch._dynamo.config.patch(recompile_limit=2), torch.no_grad(), \
            warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch in (1, 2, 3):
            compiled(*dit_inputs(model, 8, batch=batch))
    said = [str(w.message) for w in caught if "recompile_limit (2)" in str(w.message)]
    assert len(said) == 1 and "eagerly, unpipelined" in said[0]
    assert "models.py" in said[0] and "isolate_recompiles=True" in said[0]
