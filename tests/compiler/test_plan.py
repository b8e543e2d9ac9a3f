"""explain() and the Plan: its numbers agree with each other and with the model; the dump
opens in ordinary tools; per-pass logging."""

from __future__ import annotations

import functools
import json
import logging

import pytest
import torch
from PIL import Image

import tokpipe_compiler as tp
from tests.fixtures.models import TinyCausalLM, TinyDiT, dit_inputs
from tokpipe_compiler.core import logs
from tokpipe_compiler.planning.layers import compress_layers, layer_of
from tokpipe_compiler.runtime.schedule import COMPUTE


@functools.cache
def dit_plan(stages: int = 3, chunks: int = 5, mode: str = "stale") -> tuple:
    model = TinyDiT(depth=4, width=32, heads=2, grid=16).eval()
    args = dit_inputs(model, 16)
    return model, tp.explain(model, args, stages=stages, chunks=chunks, mode=mode,
                             compiler="eager")


def model_bytes(model) -> int:
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def named_bytes(model) -> dict[str, int]:
    tensors = [*model.named_parameters(), *model.named_buffers()]
    return {name: t.numel() * t.element_size() for name, t in tensors}


def test_stage_parameter_bytes_sum_to_the_model():
    """Each weight once: the stages' own, plus the prelude's (which ranks share)."""
    model, plan = dit_plan()
    own = sum(s.param_bytes - s.prelude_param_bytes for s in plan.stages)
    assert own + plan.prelude_param_bytes == plan.model_param_bytes == model_bytes(model)
    assert all(s.param_bytes > s.prelude_param_bytes > 0 for s in plan.stages)


def test_the_printed_weights_say_they_hold_buffers_too():
    """The figure counts buffers (a positional table, say) with the parameters."""
    from tokpipe_compiler.inspection.report import human_bytes

    model, plan = dit_plan()
    text = str(plan)
    assert f"weights (parameters and buffers) {human_bytes(model_bytes(model))}" in text
    assert "weights held" in text and "params held" not in text


def test_a_rank_holds_its_stage_and_its_share_of_the_prelude():
    """A block's modulation (`ada`) runs in the prelude on every rank whose stage runs part
    of the block; the timestep and label embeddings feed every block, so every rank."""
    model, plan = dit_plan()
    sizes = named_bytes(model)
    shared = sum(b for n, b in sizes.items() if n.startswith(("t_mlp.", "label.")))
    for s in plan.stages:
        blocks = {layer_of(m) for m in s.modules if m.startswith("blocks.")}
        prelude = shared + sum(sizes[f"{b}.ada.{p}"] for b in blocks for p in ("weight", "bias"))
        runs = set(s.modules) | ({""} if "embed" in s.modules else set())  # "": pos table
        own = sum(b for n, b in sizes.items() if n.rpartition(".")[0] in runs)
        assert (s.param_bytes, s.prelude_param_bytes) == (own + prelude, prelude), s.index


@pytest.mark.parametrize("steps", [1, 3])
def test_every_chunk_once_per_stage_per_step(steps):
    _, plan = dit_plan()
    schedule = plan.distributed_schedule(steps)
    seen = [(a.step, a.stage, a.chunk) for rank in schedule.ranks for a in rank
            if a.kind == COMPUTE]
    expected = [(t, s, c) for t in range(steps) for s in range(len(plan.stages))
                for c in range(len(plan.chunks))]
    assert sorted(seen) == expected


def test_schedules_are_built_once_per_layout():
    _, plan = dit_plan()
    world = len(plan.stages)
    assert plan.distributed_schedule(2) is plan.schedule(steps=2, world=world)
    ring = plan.schedule(steps=2, world=world, carries={world - 1: {0}})
    assert ring is plan.schedule(steps=2, world=world, carries={world - 1: {0}})
    assert ring is not plan.distributed_schedule(2)
    assert plan.schedule().ranks != plan.distributed_schedule().ranks  # world 1: one rank


@pytest.mark.parametrize("chunks", [1, 3, 5, 8])
def test_chunks_tile_the_token_range(chunks):
    _, plan = dit_plan(chunks=chunks)
    summary = plan.summary()
    assert [c.index for c in plan.chunks] == list(range(chunks))
    tokens = [t for c in summary["chunks"] for t in range(*c["tokens"])]
    assert tokens == list(range(plan.tokens))
    units = [u for c in plan.chunks for u in range(c.start, c.stop)]
    assert units == list(range(plan.units))


def test_summary_numbers():
    _, plan = dit_plan()
    text = str(plan)
    assert text.startswith("tokpipe plan: 3 stage(s) x 5 chunk(s), mode=stale, 1 warmup "
                           "step(s), compiler=eager, attention=sdpa\n")
    for s in plan.stages:
        assert f"\n{s.index:>5}  " in text
        assert "def forward" in s.code
        assert "f32[" in s.code and "test_plan" not in s.code  # shapes; the model's lines
        assert "models.py" in s.code
    summary = plan.summary()
    stage0 = summary["stages"][0]
    chunk0 = plan.chunks[0]
    assert stage0["send_bytes_per_chunk"][0] == plan.stages[0].send_bytes_per_unit * chunk0.units
    # Two token rows of 8 tokens each. Stage 0 ends between block 1's qkv projection and its
    # attention: the residual stream (32 floats wide) and q, k, v (96) are live there. That
    # cut balances the 3 stages to max/mean 1.04; on the residual stream alone, 1.22.
    assert stage0["send_bytes_per_chunk"][0] == chunk0.units * 8 * (32 + 96) * 4
    assert summary["stages"][-1]["send_bytes_per_chunk"] == [0] * len(plan.chunks)
    # A chunk of twice the rows costs about twice the FLOPs (attention over the same context).
    flops = stage0["flops_per_chunk"]
    assert 1.9 < flops[0] / flops[-1] < 2.1
    assert sum(s["kv_cache_bytes"] for s in summary["stages"]) == 4 * 2 * 64 * 32 * 4


def test_the_plan_says_how_balanced_its_stages_are():
    """The partition's imbalance is on the plan, printed and in the summary; a plan that
    cannot balance (more stages than blocks) says why in print(plan), not only in a warning
    that a notebook may hide."""
    _, balanced = dit_plan()
    assert balanced.imbalance < 1.10 and not balanced.imbalance_warning
    assert f"slowest stage costs {balanced.imbalance:.2f}x an even share\n" in str(balanced)
    model = TinyDiT(depth=1, width=32, heads=2, grid=16).eval()
    with pytest.warns(UserWarning, match="tokpipe"):
        lopsided = tp.explain(model, dit_inputs(model, 16), stages=4, chunks=4,
                              compiler="eager")
    assert lopsided.imbalance > 1.10 and lopsided.imbalance_warning
    assert f"(unbalanced: {lopsided.imbalance_warning})" in str(lopsided)
    assert lopsided.summary()["imbalance"] == lopsided.imbalance


def test_causal_chunks_cost_more_later():
    model = TinyCausalLM(depth=2, width=32, heads=2).eval()
    import torch

    plan = tp.explain(model, (torch.randn(1, 16, 32),), stages=2, chunks=4, mode="causal",
                      compiler="eager")
    flops = [plan.stage_flops(0, c) for c in plan.chunks]
    assert flops == sorted(flops) and flops[0] < flops[-1]
    assert [plan.context_tokens(c) for c in plan.chunks] == [4, 8, 12, 16]
    # Causal calls each fill and drain the pipeline: no PipeFusion ring bubble (stale's).
    assert "PipeFusion ring" not in str(plan)
    assert "PipeFusion ring" in str(dit_plan()[1])


def test_bubble_of_balanced_stages_is_the_fill(monkeypatch):
    _, plan = dit_plan()
    monkeypatch.setattr(type(plan), "stage_flops", lambda self, stage, chunk: 1.0)
    s, m = len(plan.stages), len(plan.chunks)
    assert plan.bubble_fraction(1) == pytest.approx((s - 1) / (m + s - 1))
    # A ring fills once: over many steps the bubble shrinks towards zero.
    assert plan.bubble_fraction(20) == pytest.approx((s - 1) / (20 * m + s - 1))


def test_save_writes_files_that_open(tmp_path):
    _, plan = dit_plan()
    files = plan.save(tmp_path)
    names = {f.name for f in files}
    assert {"plan.json", "plan.txt", "prelude.py", "schedule.png", "partition.png"} <= names
    assert {f"stage_{s.index}.py" for s in plan.stages} <= names
    summary = json.loads((tmp_path / "plan.json").read_text())
    assert summary == json.loads(json.dumps(plan.summary()))
    assert len(summary["stages"]) == len(plan.stages)
    for path in tmp_path.glob("*.py"):
        compile(path.read_text(), str(path), "exec")
    for path in tmp_path.glob("*.png"):
        with Image.open(path) as image:
            image.verify()
            assert image.size[0] > 100 and image.size[1] > 50


def test_the_partition_lists_each_layer_of_a_stage_once():
    """Flux's traced graph interleaves its blocks' nodes with top-level ones; the partition
    (and its chart: one bar per entry) still holds each layer once, its FLOPs summed."""
    from tests.fixtures.zoo import ZOO, build

    model = build("FluxTransformer2DModel").eval()
    plan = tp.explain(model, kwargs=ZOO["FluxTransformer2DModel"].inputs(0), stages=2,
                      chunks=2, compiler="eager")
    for stage in plan.stages:
        layers = [layer for layer, _ in stage.layer_flops]
        assert len(layers) == len(set(layers)), layers
    assert {"transformer_blocks.0", "single_transformer_blocks.0"} <= {
        layer for s in plan.stages for layer, _ in s.layer_flops}


def test_layers_compress():
    assert layer_of("transformer_blocks.3.attn1.to_q") == "transformer_blocks.3"
    assert layer_of("pos_embed.proj") == "pos_embed"
    paths = ["embed", "blocks.0", "blocks.1", "blocks.2", "blocks.4", "norm", "out"]
    assert compress_layers(paths) == ["embed", "blocks.0-2", "blocks.4", "norm", "out"]


def test_pass_dumps_are_stamped_with_their_pass(caplog, tmp_path):
    model = TinyDiT(depth=1, width=16, heads=2, grid=8).eval()
    logs.set_logs("passes,plan", dump_dir=tmp_path)
    try:
        with caplog.at_level(logging.DEBUG, logger="tokpipe_compiler"):
            tp.explain(model, dit_inputs(model, 8), stages=2, chunks=2, compiler="eager")
    finally:
        logs.set_logs("")
    dumps = [r.getMessage() for r in caplog.records if r.name == "tokpipe_compiler.passes"]
    passes = [m.split("after pass ")[1].split("]")[0] for m in dumps]
    assert passes == ["annotate", "partition", "chunk_attention", "chunk_sums",
                      "weight_transforms", "split/stage_0", "split/stage_1"]
    assert any(r.name == "tokpipe_compiler.plan" and "tokpipe plan" in r.getMessage()
               for r in caplog.records)
    files = sorted(tmp_path.glob("*.py"))
    assert [f.name.split("_", 1)[1] for f in files] == [
        "annotate.py", "partition.py", "chunk_attention.py", "chunk_sums.py",
        "weight_transforms.py", "split_stage_0.py", "split_stage_1.py"]
    assert files[2].read_text().startswith("# tokpipe dump")


@pytest.mark.parametrize(("launched", "folder", "prefix"), [
    ({"RANK": "1", "WORLD_SIZE": "2"}, "rank1", "[tokpipe_compiler.passes DEBUG rank 1] "),
    ({"RANK": "0", "WORLD_SIZE": "1"}, ".", "[tokpipe_compiler.passes DEBUG] "),
    ({}, ".", "[tokpipe_compiler.passes DEBUG] "),
])
def test_each_of_several_ranks_dumps_to_its_folder_and_names_itself(launched, folder, prefix,
                                                                     tmp_path, monkeypatch):
    """Every rank wrote the same file names into one folder, and log lines without rank."""
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in launched.items():
        monkeypatch.setenv(name, value)
    logs.set_logs("passes", dump_dir=tmp_path)
    try:
        logs.dump_graph("annotate", torch.fx.symbolic_trace(torch.nn.ReLU()))
    finally:
        logs.set_logs("")
    assert [str(p.parent.relative_to(tmp_path)) for p in tmp_path.rglob("*.py")] == [folder]
    record = logging.LogRecord(logs.PASSES.name, logging.DEBUG, __file__, 1, "graph", None, None)
    assert logs.RankFormatter().format(record) == f"{prefix}graph"


def test_logs_from_environment_and_bad_names():
    logs.configure_from_env({"TOKPIPE_LOGS": "passes"})
    try:
        assert logs.PASSES.isEnabledFor(logging.DEBUG)
    finally:
        logs.set_logs("")
    assert not logs.PASSES.isEnabledFor(logging.DEBUG)
    with pytest.raises(ValueError, match="allowed"):
        logs.set_logs("pases")
    with pytest.warns(UserWarning, match="allowed.*logging left as it was"):
        logs.configure_from_env({"TOKPIPE_LOGS": "pases"})  # at import: not an error


def test_set_logs_dumps_where_the_environment_says(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKPIPE_LOGS_DIR", str(tmp_path))
    monkeypatch.delenv("RANK", raising=False)
    logs.set_logs("passes")
    try:
        logs.dump_graph("annotate", torch.fx.symbolic_trace(torch.nn.ReLU()))
    finally:
        logs.set_logs("")
    assert [p.name.split("_", 1)[1] for p in tmp_path.glob("*.py")] == ["annotate.py"]


def test_plans_name_the_models_modules_and_token_argument():
    """A ring's plan named its layers `L.forward.__self__.transformer_blocks.0` and its token
    input by its graph name ('l_sample_'), unlike the same model's direct compile."""
    from tests.fixtures.pipelines import generate, sd3

    pipe, kwargs = sd3()
    tp.pipelines.parallelize(pipe, stages=2, chunks=2, compiler="eager")
    generate(pipe, kwargs, steps=2)
    ring = str(tp.pipelines.programs(pipe)[0].plan)
    assert "token input 'sample'" in ring
    assert "pos_embed, transformer_blocks.0" in ring and "__self__" not in ring
    _, plan = dit_plan()
    assert "token input 'latents'" in str(plan)
