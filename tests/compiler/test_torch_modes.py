"""torch.compile's `mode`, which it hands to every backend, sets the tokpipe options it
stands for: "reduce-overhead" the runtime's CUDA graphs, "max-autotune-no-cudagraphs"
stages compiled with Inductor's max-autotune options, "max-autotune" both; any other
mode is refused by name (it was ignored). Tolerance: 1e-5 relative to eager (float32)."""

from __future__ import annotations

import warnings

import pytest
import torch

import tokpipe_compiler as tp
from tests.fixtures.models import TinyDiT, dit_inputs
from tests.fixtures.tracing import assert_rel_close
from tokpipe_compiler.config import Config


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()


def model_and_inputs() -> tuple[torch.nn.Module, tuple]:
    torch.manual_seed(0)
    model = TinyDiT(depth=2, width=32, heads=2, grid=8).eval()
    return model, dit_inputs(model, 8)


def run(compiled, args) -> torch.Tensor:
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no CUDA here: the graphs' stages warn, run as is
        return compiled(*args)


@pytest.mark.parametrize(("mode", "compiler", "cuda_graphs"), [
    ("default", "inductor", False),
    ("reduce-overhead", "inductor", True),
    ("max-autotune-no-cudagraphs", "max-autotune", False),
    ("max-autotune", "max-autotune", True),
])
def test_each_mode_sets_its_options(mode, compiler, cuda_graphs):
    config = Config.from_options({"chunks": 2}, mode)
    assert (config.compiler, config.cuda_graphs, config.chunks) == (compiler, cuda_graphs, 2)


def test_stages_compiled_with_max_autotune_equal_eager():
    model, args = model_and_inputs()
    with torch.no_grad():
        expected = model(*args)
    compiled = torch.compile(model, backend="tokpipe", dynamic=False,
                             mode="max-autotune-no-cudagraphs")
    assert_rel_close(run(compiled, args), expected, 1e-5)
    (program,) = tp.programs(compiled)
    assert program.plan.config.compiler == "max-autotune"


def test_a_mode_with_a_backend_object_keeps_the_objects_options():
    model, args = model_and_inputs()
    other, _ = model_and_inputs()
    by_name = torch.compile(other, backend="tokpipe", dynamic=False, mode="reduce-overhead")
    by_object = torch.compile(model, backend=tp.backend(compiler="eager", chunks=2),
                              dynamic=False, mode="reduce-overhead")
    run(by_name, args)
    run(by_object, args)
    (program,) = tp.programs(by_object)  # its own, not the string backend's of that mode
    config = program.plan.config
    assert (config.compiler, config.chunks, config.cuda_graphs) == ("eager", 2, True)


def test_an_unknown_mode_is_named():
    model, args = model_and_inputs()
    compiled = torch.compile(model, backend="tokpipe", dynamic=False, mode="fastest")
    with pytest.raises(ValueError, match=r"torch.compile mode 'fastest' has no meaning for "
                                         r"tokpipe; use one of"):
        run(compiled, args)


@pytest.mark.parametrize(("compiler", "autotuned"), [("inductor", False),
                                                     ("max-autotune", True)])
def test_the_max_autotune_compiler_compiles_with_inductors_autotuning(
        monkeypatch: pytest.MonkeyPatch, compiler, autotuned):
    from torch._inductor import compile_fx, config

    from tokpipe_compiler.stage_programs.compile import compile_stage

    seen = []

    def record(gm, example_inputs):
        seen.append((config.max_autotune, config.coordinate_descent_tuning))
        return gm

    monkeypatch.setattr(compile_fx, "compile_fx", record)
    gm = torch.fx.symbolic_trace(torch.nn.Linear(4, 4))
    compile_stage(gm, [torch.randn(2, 4)], compiler)
    assert seen == [(autotuned, autotuned)]
