"""A block compiled on its own while its model runs eagerly (diffusers' regional
compilation, `compile_repeated_blocks`, or `block.compile()` in a loop) would get a
pipeline per block that counts each call as a denoising step: it is refused with a
TokpipeError that says to compile the model (with fallback=True: run as traced, warned).
A wrapper module that calls the one model compiled inside it pipelines that model."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import tokpipe_compiler as tp
from tests.fixtures.models import Block, TinyDiT, dit_inputs
from tests.fixtures.pipelines import generate, wan
from tests.fixtures.tracing import assert_rel_close

OPTIONS = {"stages": 2, "chunks": 2, "compiler": "eager"}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Dynamo's code for Block.forward, traced (and refused) in one test, would serve the
    blocks of the next: each test traces its own."""
    torch.compiler.reset()


class Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block(16, 2) for _ in range(3))
        self.cond = nn.Parameter(torch.randn(1, 16) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, self.cond)
        return x


class BlockNamedS(Block):
    def forward(s, x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        return super().forward(x, cond)


class SelfNamedS(Blocks):
    """A model and blocks whose forwards call their instance `s`, not `self`."""

    def __init__(s):
        super().__init__()
        s.blocks = nn.ModuleList(BlockNamedS(16, 2) for _ in range(3))

    def forward(s, x: torch.Tensor) -> torch.Tensor:
        for block in s.blocks:
            x = block(x, s.cond)
        return x


@pytest.mark.parametrize(("model_class", "found"), [
    (Blocks, "one of the 3 Block blocks of Blocks"),
    (SelfNamedS, "one of the 3 BlockNamedS blocks of SelfNamedS"),  # forward(s, ...)
])
@pytest.mark.parametrize("assigned", [False, True])
def test_blocks_compiled_one_by_one_are_refused(model_class, found, assigned):
    """`block.compile()`, or the compiled wrapper put in the block's place."""
    torch.manual_seed(0)
    model = model_class().eval()
    for i, block in enumerate(model.blocks):
        if assigned:
            model.blocks[i] = torch.compile(block, backend="tokpipe", dynamic=False,
                                            options=OPTIONS)
        else:
            block.compile(backend="tokpipe", dynamic=False, options=OPTIONS)
    with pytest.raises(tp.TokpipeError, match=f"{found}, compiled on its own.*Compile the "
                                              "model instead"), torch.no_grad():
        model(torch.randn(1, 16, 16))


class BreakInTheLoop(Blocks):
    """A graph break between the blocks, inside the loop over them: Dynamo skips the
    model's forward and traces each block on its own."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, self.cond)
            if self.how == "print":
                print("block done")
            else:
                x = _not_traced(x)
        return x


@torch.compiler.disable
def _not_traced(x: torch.Tensor) -> torch.Tensor:
    return x * 1.0


@pytest.mark.parametrize("how", ["print", "disabled call"])
def test_a_model_whose_loop_over_blocks_breaks_the_graph_is_refused(how):
    """Not a pipeline per block, which would take a step's second guidance branch for the
    next step (attending to the first branch's K/V); with fallback=True the blocks run as
    traced, as eager."""
    torch.manual_seed(0)
    model = BreakInTheLoop(how).eval()
    x = torch.randn(1, 16, 16)
    with torch.no_grad():
        expected = model(x)
    compiled = torch.compile(model, backend="tokpipe", dynamic=False, options=OPTIONS)
    with pytest.raises(tp.TokpipeError, match=r"one of the 3 Block blocks of BreakInTheLoop, "
                       r"traced on its own: .*graph break inside its loop over the blocks"), \
            torch.no_grad():
        compiled(x)
    torch.compiler.reset()
    compiled = torch.compile(model, backend="tokpipe", dynamic=False,
                             options={**OPTIONS, "fallback": True})
    with pytest.warns(UserWarning, match="running this graph unpipelined"), torch.no_grad():
        assert torch.equal(compiled(x), expected)


def test_blocks_traced_alone_run_in_sync_mode_saying_what_it_costs():
    """Where steps need not be told apart, each block runs as a pipeline of its own, exact,
    with a warning that says so (a diffusers model whose blocks break the graph)."""
    torch.manual_seed(0)
    model = BreakInTheLoop("disabled call").eval()
    x = torch.randn(1, 16, 16)
    with torch.no_grad():
        expected = model(x)
    compiled = torch.compile(model, backend="tokpipe", dynamic=False,
                             options={**OPTIONS, "mode": "sync"})
    with pytest.warns(UserWarning, match="each block runs as a pipeline of its own"), \
            torch.no_grad():
        assert_rel_close(compiled(x), expected)
    assert len(tp.programs(compiled)) == 3


def test_blocks_traced_alone_again_say_so_again():
    """Dynamo keeps skipping the model's forward when it traces the blocks again (a new
    input shape here; a diffusers cache hook turned off, in use): the new pipelines per
    block are said again, once for all the blocks."""
    torch.manual_seed(0)
    model = BreakInTheLoop("disabled call").eval()
    compiled = torch.compile(model, backend="tokpipe", dynamic=False,
                             options={**OPTIONS, "mode": "sync"})
    said = []
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        for tokens in (16, 16, 24):
            compiled(torch.randn(1, tokens, 16))
            said.append(sum("pipeline of its own" in str(w.message) for w in caught))
    assert said == [1, 1, 2]


def test_diffusers_regional_compilation_is_refused_and_runs_as_traced_with_fallback():
    expected = generate(*wan(), steps=2)
    pipe, kwargs = wan()
    pipe.transformer.compile_repeated_blocks(backend="tokpipe", dynamic=False, options=OPTIONS)
    with pytest.raises(tp.TokpipeError, match="WanTransformerBlock block of "
                                              "WanTransformer3DModel"):
        generate(pipe, kwargs, steps=2)
    torch.compiler.reset()
    pipe, kwargs = wan()
    pipe.transformer.compile_repeated_blocks(backend="tokpipe", dynamic=False,
                                             options={**OPTIONS, "fallback": True})
    with pytest.warns(UserWarning, match="running this graph unpipelined"):
        assert torch.equal(generate(pipe, kwargs, steps=2), expected)


class Wrapper(nn.Module):
    """Calls the one model it holds, compiled inside it."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return self.model(*args)


def test_a_wrapper_around_one_compiled_model_pipelines_it():
    torch.manual_seed(0)
    inner = TinyDiT(depth=2, width=32, heads=2, grid=8).eval()
    args = dit_inputs(inner, 8)
    with torch.no_grad():
        expected = inner(*args)
    inner.compile(backend="tokpipe", dynamic=False, options={**OPTIONS, "mode": "sync"})
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # two stages of a tiny model are unbalanced
        out = Wrapper(inner)(*args)
    assert tp.programs(inner), "the model ran pipelined"
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


class Experts(nn.Module):
    """Two models of one class held as attributes, one called per input (as two experts)."""

    def __init__(self):
        super().__init__()
        self.first = TinyDiT(depth=2, width=32, heads=2, grid=8).eval()
        self.second = TinyDiT(depth=2, width=32, heads=2, grid=8).eval()

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return self.first(*args)


def test_one_of_two_models_held_as_attributes_pipelines():
    torch.manual_seed(0)
    experts = Experts().eval()
    args = dit_inputs(experts.first, 8)
    with torch.no_grad():
        expected = experts(*args)
    experts.first.compile(backend="tokpipe", dynamic=False, options={**OPTIONS, "mode": "sync"})
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        out = experts(*args)
    assert tp.programs(experts.first)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


class Ensemble(nn.Module):
    """Two models of one class in a ModuleList, the first called: a stack, but of models."""

    def __init__(self):
        super().__init__()
        self.members = nn.ModuleList(TinyDiT(depth=2, width=32, heads=2, grid=8)
                                     for _ in range(2))

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return self.members[0](*args)


def test_a_model_in_a_list_of_models_pipelines():
    torch.manual_seed(0)
    ensemble = Ensemble().eval()
    first = ensemble.members[0]
    args = dit_inputs(first, 8)
    with torch.no_grad():
        expected = ensemble(*args)
    first.compile(backend="tokpipe", dynamic=False, options={**OPTIONS, "mode": "sync"})
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        out = ensemble(*args)
    assert tp.programs(first)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def test_blocks_compiled_by_another_backend_never_run_on_the_probes_fake_tensors():
    """The pipeline's probe runs the transformer on fake tensors, which hold no data: blocks
    that Inductor compiled (compile_repeated_blocks) ran their kernels on them and the
    process died (SIGSEGV). The probe runs compiled code eagerly; the ring runs on."""
    from torch._subclasses.fake_tensor import FakeTensor

    seen: list[bool] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        def run(*args: torch.Tensor) -> object:
            seen.append(any(isinstance(a, FakeTensor) for a in args))
            return gm(*args)
        return run

    expected = generate(*wan(), steps=2)
    pipe, kwargs = wan()
    pipe.transformer.compile_repeated_blocks(backend=backend, dynamic=False)
    tp.parallelize(pipe, **OPTIONS, mode="sync")
    assert_rel_close(generate(pipe, kwargs, steps=2), expected)
    assert not any(seen), seen  # (the pipelined trace goes through the blocks as written)
