"""The released models (tokpipe_compiler/released/configs/) at full size and depth, on the
meta device:
the fixture builds what was released, and every plan (2, 4, 8 stages) covers the released
image tokens with stages within 10% of an even split, or says why not.

Each config is traced once (20-50 s of Dynamo at full depth on 2 cores) and planned for
every stage count from that graph. Tracing all 17 takes minutes: three configs that stand
for the families' problems run by default (and in CI), the rest with `-m full`.
"""

from __future__ import annotations

import inspect
import time

import diffusers
import pytest
import torch

import tokpipe_compiler as tp
from tests.fixtures.released_plans import BALANCE, STAGES, plan, trace
from tests.fixtures.zoo import ZOO
from tokpipe_compiler import released
from tokpipe_compiler.costmodel import calibrate

# Stand-ins that run by default: a plain DiT, long skips (HunyuanDiT), two kinds of blocks
# with joint attention (Flux).
FAST = ("dit-xl-2-256", "hunyuandit-v1.2", "flux1-schnell")

# Configs whose plans fail in passes this file does not own: strict xfails, so a fix
# shows up as a failure here until the entry is removed.
BROKEN: dict[str, str] = {}

PLAN_SECONDS = 120  # one build_plan of a full-size model (Dynamo's trace not counted)


# The rest run with `-m full`. Their blocks are planned and run at released widths, with
# few layers, in CI by tests/slow/test_released_families.py (sync and stale): video
# chunked by frames (Latte), the longest sequence (Wan, 32760 tokens), SD3's joint blocks
# and its last one that drops the text stream.


def _param(name: str):
    marks = [] if name in FAST else [pytest.mark.slow, pytest.mark.full]
    if name in BROKEN:
        marks.append(pytest.mark.xfail(reason=BROKEN[name], strict=True))
    return pytest.param(name, marks=marks, id=name)


@pytest.mark.parametrize("name", released.NAMES)
def test_full_size_model_is_the_released_one(name):
    """All 17 configs are here; at full depth the class counts the released parameters,
    and the inputs are keyword arguments of its forward."""
    assert len(released.NAMES) == 17
    spec = released.load(name)
    model = released.build(name, layers=None, device="meta")
    assert all(p.is_meta for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == spec["params"]
    kwargs = released.inputs(name, device="meta")
    accepted = inspect.signature(model.forward).parameters
    assert set(kwargs) <= set(accepted), set(kwargs) - set(accepted)
    assert kwargs["hidden_states"].shape[0] == 2
    if spec["inputs"]["text_tokens"]:
        text = (2, spec["inputs"]["text_tokens"], spec["inputs"]["text_width"])
        assert tuple(kwargs["encoder_hidden_states"].shape) == text


def test_meta_models_are_planned_with_the_cpu_rates(tmp_path, monkeypatch):
    """chunks="auto" asks the cost model for seconds at the token input's device: meta has
    no clock, so the CPU's rates are used (measured or cached), never a "meta" measurement."""
    monkeypatch.setenv(calibrate.CACHE_ENV, str(tmp_path))
    measured = []
    # Fixed rates: a real measurement on a busy machine is refused and not cached.
    rates = calibrate.DeviceRates(matmul_flops=1e11, mem_bandwidth=5e10, attention_flops=5e10,
                                  per_op_overhead=2e-6, matmul_half=8.0)
    monkeypatch.setattr(calibrate, "measure_rates",
                        lambda device, threads: measured.append(device) or rates)
    name = "DiTTransformer2DModel"
    with torch.device("meta"):
        model = diffusers.DiTTransformer2DModel(**ZOO[name].config).eval()
    inputs = {k: v.to("meta") for k, v in ZOO[name].inputs(0).items()}
    plan = tp.explain(model, (), inputs, stages=2, chunks="auto", compiler="eager")
    assert len(plan.chunks) >= 1 and measured == ["cpu"]
    assert [p.name for p in tmp_path.iterdir()] == [calibrate.cache_path("cpu").name]


@pytest.mark.parametrize("name", [_param(n) for n in released.NAMES])
def test_plans_cover_the_image_tokens_in_balanced_stages(name):
    gm = trace(name)
    for stages in STAGES:
        start = time.perf_counter()
        planned = plan(gm, stages)
        seconds = time.perf_counter() - start
        where = f"{name} at {stages} stages"
        assert planned.plan.tokens == released.image_tokens(name), where
        assert len(planned.plan.stages) == stages and len(planned.plan.chunks) == stages
        # Every released config balances within 10% at 2-8 stages (none needs an exception).
        assert planned.balance <= BALANCE, f"{where}: max/mean {planned.balance:.3f}"
        assert not planned.warnings, where
        assert seconds < PLAN_SECONDS, f"{where}: planned in {seconds:.0f} s"

