"""parallelize(pipe) with the schedulers users bring: a scheduler replaced after a
generation (`from_config`, a copy), `step` options the ring cannot replay, and a subclass
whose `step` passes its arguments on; the scheduler keeps its class throughout.

Tolerance (float32): sync equals the serial pipeline within 1e-5 of its largest value.
"""

from __future__ import annotations

import copy
import warnings

import pytest

from tests.fixtures.pipelines import generate, parallelized, pixart_alpha
from tests.fixtures.tracing import rel_error

pytest.importorskip("diffusers")


@pytest.mark.parametrize("how", ["from_config", "deepcopy"])
def test_a_scheduler_made_from_the_routed_one_runs_theparallelized(how):
    """diffusers' idiom `pipe.scheduler = pipe.scheduler.__class__.from_config(...)` (or a
    copy) after a generation makes an instance of the routed class: it is routed anew (its
    steps ran outside the ring, 3.8 relative from serial)."""
    expected = generate(*pixart_alpha(), steps=3)
    pipe, kwargs = parallelized(pixart_alpha, mode="sync")
    generate(pipe, kwargs, steps=3)
    old = pipe.scheduler
    pipe.scheduler = (old.__class__.from_config(old.config) if how == "from_config"
                      else copy.deepcopy(old))
    assert rel_error(generate(pipe, kwargs, steps=3), expected) <= 1e-5


@pytest.mark.parametrize("options", [{"eta": 0.5}, {}])
def test_a_step_option_the_ring_cannot_replay_runs_per_call(options):
    """DDIM's eta > 0 reaches the scheduler through the pipeline's call (it draws noise at
    each step): the generation runs per call, says why, and equals the serial pipeline;
    eta at its default runs the ring."""
    from diffusers import DDIMScheduler

    def make():
        pipe, kwargs = pixart_alpha()
        pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config, clip_sample=False)
        return pipe, {**kwargs, **options}

    serial = generate(*make(), steps=3)
    pipe, kwargs = parallelized(make, mode="sync")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        latents = generate(pipe, kwargs, steps=3)
    said = [str(w.message) for w in caught if "runs per call" in str(w.message)]
    assert rel_error(latents, serial) <= 1e-5
    if options:
        assert said and "DDIMScheduler.step is called with eta=0.5" in said[0]
    else:
        assert not said


def test_a_scheduler_subclass_passing_its_arguments_on_runs_the_ring():
    """A user's scheduler subclass whose `step(self, *args, **kwargs)` hands them to
    `super().step`: the ring reads the step's arguments by its base's names (a bare
    KeyError: 'model_output' before), and the scheduler keeps its class."""
    import diffusers

    class Counting(diffusers.DPMSolverMultistepScheduler):
        def step(self, *args, **kwargs):
            return super().step(*args, **kwargs)

    def make():
        pipe, kwargs = pixart_alpha()
        pipe.scheduler = Counting.from_config(pipe.scheduler.config)
        return pipe, kwargs

    serial = generate(*make(), steps=3)
    pipe, kwargs = parallelized(make, mode="sync")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="tokpipe: .* runs per call")
        out = generate(pipe, kwargs, steps=3)
    assert rel_error(out, serial) <= 1e-5 and type(pipe.scheduler) is Counting
