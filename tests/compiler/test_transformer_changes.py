"""A parallelized pipeline follows changes to its transformer between generations: a ring,
traced with the transformer's weights and modules as they were, is traced anew when they
change (a weight assigned anew, attention processors swapped, a LoRA added or rescaled),
with a warning, and computes what the changed pipeline computes serially (sync mode,
within 1e-5 relative, float32). Nothing changed: nothing is traced again."""

from __future__ import annotations

import copy
import gc
import warnings
import weakref

import pytest
import torch

import tokpipe_compiler as tp
from tests.fixtures import pipelines
from tests.fixtures.changes import CHANGES, add_lora, damp_processors
from tests.fixtures.conditioned import CONDITIONED
from tests.fixtures.perturbed import PERTURBED
from tests.fixtures.pipelines import generate

OPTIONS = {"stages": 2, "chunks": 2, "mode": "sync", "compiler": "eager"}
TRACED_ANEW = "changed since its rings were traced"


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _pair(family: str) -> tuple:
    """A parallelized pipeline, the same pipeline serial, and the call's arguments."""
    pipe, kwargs = pipelines.FAMILIES[family]()
    serial = copy.deepcopy(pipe)
    tp.pipelines.parallelize(pipe, **OPTIONS)
    return pipe, serial, kwargs


@pytest.mark.parametrize("family, change, before", [
    ("pixart_alpha", "assign_weight", None),
    ("pixart_alpha", "swap_processors", None),
    ("flux", "add_lora", None),
    ("flux", "scale_lora", add_lora),  # a LoRA added before the first generation
    ("pixart_alpha", "set_processor_scale", damp_processors),
])
def test_a_changed_transformer_is_traced_anew(family, change, before):
    if "lora" in change:
        pytest.importorskip("peft")
    pipe, serial, kwargs = _pair(family)
    for p in ([pipe, serial] if before else []):
        before(p.transformer)
    first = generate(serial, kwargs, steps=3)
    assert _relative(generate(pipe, kwargs, steps=3), first) <= 1e-5
    traced = [weakref.ref(r) for r in pipe._tokpipe_ring.denoisers["transformer"].rings.values()]
    for p in (pipe, serial):
        CHANGES[change](p.transformer)
    changed = generate(serial, kwargs, steps=3)
    assert _relative(changed, first) > 1e-3  # the change changes the generation
    with pytest.warns(UserWarning, match=TRACED_ANEW):
        ring = generate(pipe, kwargs, steps=3)
    assert _relative(ring, changed) <= 1e-5
    gc.collect()
    if change in ("swap_processors", "set_processor_scale", "scale_lora"):  # same weights: kept
        assert traced and all(r() is not None for r in traced)
        return
    assert traced and all(r() is None for r in traced)  # the old rings (and weights) freed


def test_a_swap_undone_with_new_processors_of_the_first_kind_takes_the_rings_back():
    """Processors made anew with the settings of those traced (a swap undone with fresh
    defaults, as users undo one) are the same transformer: they were told apart by
    identity, and every undo traced and compiled again."""
    pipe, serial, kwargs = _pair("pixart_alpha")
    first = generate(pipe, kwargs, steps=3)
    rings = dict(pipe._tokpipe_ring.denoisers["transformer"].rings)
    kinds = {name: type(p) for name, p in pipe.transformer.attn_processors.items()}
    CHANGES["swap_processors"](pipe.transformer)
    with pytest.warns(UserWarning, match=TRACED_ANEW):
        generate(pipe, kwargs, steps=3)
    pipe.transformer.set_attn_processor({name: kind() for name, kind in kinds.items()})
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=f".*{TRACED_ANEW}")
        again = generate(pipe, kwargs, steps=3)
    assert pipe._tokpipe_ring.denoisers["transformer"].rings == rings
    assert _relative(again, first) <= 1e-5
    assert _relative(again, generate(serial, kwargs, steps=3)) <= 1e-5


# Those whose pipelines create diffusers' (empty) hook registry on the transformer at the
# end of the first call, and a PAG pipeline (the rest: in the exhaustive set).
QUICK = ("chroma", "flux_fill", "latte", "wan", "sd3_pag")


@pytest.mark.parametrize("family", [
    name if name in QUICK else pytest.param(name, marks=pytest.mark.full)
    for name in {**pipelines.FAMILIES, **CONDITIONED, **PERTURBED}])
def test_nothing_is_traced_again_when_nothing_changed(family):
    """PAG pipelines swap their attention processors at every call, for new ones alike."""
    pipe, kwargs = {**pipelines.FAMILIES, **CONDITIONED, **PERTURBED}[family]()
    tp.pipelines.parallelize(pipe, **{**OPTIONS, "mode": "stale"})
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=f".*{TRACED_ANEW}")
        for steps in (3, 3, 4):
            generate(pipe, kwargs, steps=steps)


def test_an_unchanged_transformer_keeps_its_rings():
    """Weights written in place reach the traced ring as they are: no new trace."""
    pipe, serial, kwargs = _pair("pixart_alpha")
    generate(pipe, kwargs, steps=3)
    rings = dict(pipe._tokpipe_ring.denoisers["transformer"].rings)
    with torch.no_grad():
        for p in (pipe, serial):
            p.transformer.proj_out.weight.mul_(0.5)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=f".*{TRACED_ANEW}")
        ring = generate(pipe, kwargs, steps=3)
    assert pipe._tokpipe_ring.denoisers["transformer"].rings == rings
    assert _relative(ring, generate(serial, kwargs, steps=3)) <= 1e-5
