"""How a call's timestep reaches the backend: by a parameter named `sigma` (k-diffusion,
EDM), by one the option `timestep_input` names, as a Python number, or not at all.

Stale mode reads the timestep to tell steps, guidance branches and generations apart: the
first call of a generation is a warmup (exact), and each branch attends to its own K/V.
Tolerance: float32, max |pipelined - eager| <= 1e-5 * max |eager|.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import tokpipe_compiler as tp
from tests.fixtures.models import TinyCausalLM, TinyDiT, dit_inputs
from tests.fixtures.tracing import assert_rel_close, rel_error
from tokpipe_compiler import TokpipeError


class SigmaDiT(TinyDiT):
    def forward(self, latents, sigma, labels):
        return super().forward(latents, sigma, labels)


class NoiseLevelDiT(TinyDiT):
    def forward(self, latents, noise_level, labels):
        return super().forward(latents, noise_level, labels)


class NumberDiT(TinyDiT):
    """Takes the timestep as a Python number, as a hand-written sampler might pass it."""

    def forward(self, latents, timestep: float, labels):
        t = torch.full((latents.shape[0],), timestep, dtype=latents.dtype)
        return super().forward(latents, t, labels)


class Unconditioned(TinyDiT):
    def forward(self, latents, labels):
        return super().forward(latents, torch.zeros(latents.shape[0]), labels)


class DictDiT(TinyDiT):
    """Takes its conditioning as a dict, as research code often does; its `self` named
    otherwise."""

    def forward(me, latents, cond):
        return TinyDiT.forward(me, latents, cond["t"], cond["y"])


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()


def compile_model(cls, **options):
    torch.manual_seed(0)
    model = cls(depth=2, width=32, heads=2, grid=8).eval()
    options = {"stages": 2, "chunks": 4, "mode": "stale", "warmup_steps": 1,
               "compiler": "eager", **options}
    return model, torch.compile(model, backend="tokpipe", dynamic=False, options=options)


def two_generations_with_guidance(model, compiled) -> list[float]:
    """Two generations of two steps, each step a conditional and an unconditional call;
    the error of each call against eager."""
    latents, _, labels = dit_inputs(model, 8)
    null = torch.full_like(labels, 9)
    errors = []
    for _ in range(2):
        for t in (900.0, 600.0):
            for y in (labels, null):
                args = (latents, torch.full((latents.shape[0],), t), y)
                with torch.no_grad():
                    errors.append(rel_error(compiled(*args), model(*args)))
    return errors


@pytest.mark.parametrize(("cls", "options"), [
    (SigmaDiT, {}), (NoiseLevelDiT, {"timestep_input": "noise_level"})])
def test_a_named_timestep_tells_generations_and_branches(cls, options):
    """Each generation's first step (both branches) is a warmup, exact; a second
    generation does not attend to the first's K/V, nor one branch to the other's. Its
    later steps are stale: they differ from eager."""
    model, compiled = compile_model(cls, **options)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the timestep is found: nothing to warn about
        errors = two_generations_with_guidance(model, compiled)
    for first_step in (0, 1, 4, 5):
        assert errors[first_step] <= 1e-5
    assert min(errors[2], errors[3], errors[6], errors[7]) > 1e-4


def test_without_the_option_an_unknown_timestep_name_warns():
    model, compiled = compile_model(NoiseLevelDiT)
    with pytest.warns(UserWarning, match=r"found no timestep among the model's inputs.*"
                                         r"'timestep_input'") as record:
        errors = two_generations_with_guidance(model, compiled)
    assert len([w for w in record if "found no timestep" in str(w.message)]) == 1
    assert errors[4] > 1e-4  # the second generation's first step read the first's K/V


def test_sync_mode_does_not_warn_about_a_missing_timestep():
    model, compiled = compile_model(Unconditioned, mode="sync")
    latents, _, labels = dit_inputs(model, 8)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("error")
        compiled(latents, labels)


def test_a_misspelt_timestep_input_names_the_parameters():
    model, compiled = compile_model(SigmaDiT, timestep_input="sigmaa")
    latents, t, labels = dit_inputs(model, 8)
    with pytest.raises(TokpipeError, match=r"timestep_input='sigmaa'.*'labels'.*'sigma'"):
        compiled(latents, t, labels)


def test_explain_names_a_misspelt_timestep_input_as_the_call_does():
    torch.manual_seed(0)
    model = SigmaDiT(depth=1, width=16, heads=2, grid=8).eval()
    with pytest.raises(TokpipeError, match=r"timestep_input='sigmaa'.*'labels'.*'sigma'"):
        tp.explain(model, dit_inputs(model, 8), stages=2, chunks=2, timestep_input="sigmaa")
    assert tp.explain(model, dit_inputs(model, 8), stages=2, chunks=2,
                      timestep_input="sigma").stages


@pytest.mark.parametrize("options", [{}, {"timestep_input": "t"}])
def test_a_timestep_in_a_dict_is_found_or_named_by_its_entry(options):
    """Found by its entry's name (`cond["t"]`), or named so: each generation's first step
    is a warmup for both branches, and the later steps are stale."""
    model, compiled = compile_model(DictDiT, **options)
    latents, _, labels = dit_inputs(model, 8)
    errors = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for t in (900.0, 600.0):
            for y in (labels, torch.full_like(labels, 9)):
                cond = {"t": torch.full((1,), t), "y": y}
                with torch.no_grad():
                    errors.append(rel_error(compiled(latents, cond), model(latents, cond)))
    assert max(errors[:2]) <= 1e-5 and min(errors[2:]) > 1e-4


def test_a_timestep_input_naming_a_dict_names_its_entries():
    model, compiled = compile_model(DictDiT, timestep_input="cond")
    latents, t, labels = dit_inputs(model, 8)
    with pytest.raises(TokpipeError, match=r"timestep_input='cond' names a parameter the "
                                           r"model reads entries of .*\['t', 'y'\].*"
                                           r"timestep_input='t'"):
        compiled(latents, {"t": t, "y": labels})
    torch._dynamo.reset()
    model, compiled = compile_model(DictDiT, timestep_input="time")
    with pytest.raises(TokpipeError, match=r"its parameters are \['cond', 'latents'\]$"):
        compiled(latents, {"t": t, "y": labels})


def test_a_timestep_input_naming_a_dict_suggests_its_timestep_entry():
    """The entry read first was suggested (the class labels, 'y')."""
    from tokpipe_compiler.planning.timestep_checks import check_timestep_input

    inputs = [("L['cond']['y']", "y"), ("L['cond']['mask']", "mask"), ("L['cond']['t']", "t")]
    with pytest.raises(TokpipeError, match=r"timestep_input='t' say$"):
        check_timestep_input("cond", {"x", "cond"}, inputs)


@pytest.mark.parametrize("choice", [-1, 1.5, True])
def test_a_timestep_input_that_is_neither_a_name_nor_a_position_is_refused(choice):
    """A position (an int >= 0) names the input of a forward of (*args, **kwargs)."""
    with pytest.raises(ValueError, match="must be the forward's parameter name, a position"):
        compile_model(SigmaDiT, timestep_input=choice)[1](*dit_inputs(TinyDiT(grid=8), 8))


def test_a_position_for_a_forward_of_named_parameters_names_them():
    """A position names an input only where the forward takes *args: one given to a forward
    of named parameters fell back to the default names without a word."""
    model, compiled = compile_model(SigmaDiT, timestep_input=9)
    latents, t, labels = dit_inputs(model, 8)
    with pytest.raises(TokpipeError, match=r"timestep_input=9 names a position.*\['labels', "
                                           r"'latents', 'sigma'\].*timestep_input='sigma'"):
        compiled(latents, t, labels)


def test_a_python_number_timestep_warns_once_and_stays_exact():
    """Each value is a new graph and a new generation: every step a warmup, equal to eager,
    and a warning that says to pass a tensor."""
    model, compiled = compile_model(NumberDiT)
    latents, _, labels = dit_inputs(model, 8)
    with pytest.warns(UserWarning, match=r"'timestep' is a Python number \(900.0\).*"
                                         r"timestep=torch.tensor\(900.0\)") as record:
        for t in (900.0, 600.0, 300.0):
            with torch.no_grad():
                assert_rel_close(compiled(latents, t, labels), model(latents, t, labels))
    assert len([w for w in record if "Python number" in str(w.message)]) == 1


def test_many_calls_at_one_timestep_warn_of_their_caches():
    """Guidance takes 2 branches, skip-layer guidance 3; the 5th call at one timestep with
    other inputs warns that each branch holds caches until the generation ends."""
    model, compiled = compile_model(TinyDiT)
    latents, t, labels = dit_inputs(model, 8)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("error")
        for y in range(4):
            compiled(latents, t, torch.full_like(labels, y))
    with pytest.warns(UserWarning, match=r"5 calls in a row at one timestep.*MiB each.*"
                                         r"tp.reset\(compiled\)"), torch.no_grad():
        compiled(latents, t, torch.full_like(labels, 4))


def test_the_missing_timestep_warning_says_when_input_names_are_unknown():
    from tokpipe_compiler.planning.timestep_checks import missing_timestep

    assert "among the model's inputs ['x', 'labels']" in missing_timestep(["x", "labels"], None)
    assert "carry no parameter names" in missing_timestep([], None)


def test_stale_causal_attention_needs_no_timestep_to_stay_exact():
    """With is_causal attention a stale chunk reads only keys this call wrote, so a call
    with no timestep cannot read another call's K/V: each equals eager, and the warning that
    a second input attends to the first's would be wrong."""
    torch.manual_seed(0)
    model = TinyCausalLM(depth=2, width=32, heads=2).eval()
    compiled = torch.compile(model, backend="tokpipe", dynamic=False, options={
        "stages": 2, "chunks": 4, "mode": "stale", "compiler": "eager"})
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("error")
        for seed in (1, 2, 3):
            x = torch.randn(2, 32, 32, generator=torch.Generator().manual_seed(seed))
            assert_rel_close(compiled(x), model(x), 1e-5)
    assert len(tp.programs(compiled)) == 1
