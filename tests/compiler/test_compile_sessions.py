"""The sessions of string-backend compiles: freed with what Dynamo drops, and keeping the
options their compile was first traced with."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import tokpipe_compiler as tp
from tests.fixtures.models import TinyDiT, dit_inputs
from tests.fixtures.tracing import assert_rel_close


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()


def _model() -> TinyDiT:
    torch.manual_seed(0)
    return TinyDiT(depth=2, width=32, heads=2, grid=8).eval()


def test_programs_of_a_dropped_compile_are_freed_while_the_model_lives():
    """A server that compiles its model anew (a reset, a compiled wrapper dropped) kept every
    earlier compile's programs and K/V caches for as long as the model lived."""
    model = _model()
    inputs = dit_inputs(model, 8)
    dropped: list[weakref.ref] = []
    for _ in range(2):
        compiled = torch.compile(model, backend="tokpipe", dynamic=False,
                                 options={"stages": 2, "chunks": 2, "compiler": "eager"})
        with torch.no_grad():
            compiled(*inputs)
        (program,) = tp.programs(compiled)
        dropped.append(weakref.ref(program))
        del compiled, program
        torch._dynamo.reset()
        gc.collect()
    assert [ref() for ref in dropped] == [None, None]
    compiled = torch.compile(model, backend="tokpipe", dynamic=False,
                             options={"stages": 2, "chunks": 2, "compiler": "eager"})
    with torch.no_grad():
        compiled(*inputs)
    assert len(tp.programs(compiled)) == 1  # not the dropped compiles' too


def test_options_changed_after_a_compile_keep_its_first_options():
    """torch hands the backend the options dict itself: one changed for the next compile
    changed this compile's later graphs (a sync model ran stale at a new batch size)."""
    model = _model()
    options = {"stages": 2, "chunks": 2, "mode": "sync", "compiler": "eager"}
    compiled = torch.compile(model, backend="tokpipe", dynamic=False, options=options)
    with torch.no_grad():
        compiled(*dit_inputs(model, 8))
    options["mode"] = "stale"
    larger = dit_inputs(model, 8, seed=2, batch=2)
    with pytest.warns(UserWarning, match="options dict given to torch.compile changed"), \
            torch.no_grad():
        compiled(*larger)  # a new graph of the same compile
        out = compiled(*larger)
        assert_rel_close(out, model(*larger))
    assert {p.plan.config.mode for p in tp.programs(compiled)} == {"sync"}


def test_a_dict_changed_for_a_model_of_the_same_class_warns():
    """Dynamo serves a second compile given the same (changed) dict from the first's graphs,
    for a model of the same class, without calling the backend: its model ran with the
    first compile's options, without a word."""
    options = {"stages": 2, "chunks": 2, "mode": "sync", "compiler": "eager"}
    first, second = _model(), _model()
    with torch.no_grad():
        torch.compile(first, backend="tokpipe", dynamic=False, options=options)(
            *dit_inputs(first, 8))
        options["chunks"] = 4
        compiled = torch.compile(second, backend="tokpipe", dynamic=False, options=options)
        with pytest.warns(UserWarning, match="options dict given to torch.compile changed"):
            out = compiled(*dit_inputs(second, 8))
    assert_rel_close(out, second(*dit_inputs(second, 8)))
    assert {p.plan.config.chunks for p in tp.programs(compiled)} == {2}  # as the warning says
