"""The tokpipe command on released models: planned at full size on the meta device, run
with fewer blocks, cast to another dtype, and predicted for GPUs (`--for`)."""

from __future__ import annotations

import json

import pytest

from tokpipe_compiler.cli import main


@pytest.fixture(autouse=True, scope="module")
def traced_once():
    """Each released model is traced once for this module's --for plans: Dynamo takes
    20-30 s over a full-depth model on these cores, and build_plan leaves its graph as it
    was. Keyed by what decides the graph: the class, its config, dtype and input shapes."""
    import tokpipe_compiler.api as api

    capture_graphs, traced = api.capture_graphs, {}

    def key(model, args, kwargs):
        config = json.dumps(dict(getattr(model, "config", {})), sort_keys=True, default=str)
        inputs = tuple((k, tuple(v.shape), v.dtype) for k, v in sorted(kwargs.items())
                       if hasattr(v, "shape"))
        return type(model), config, next(model.parameters()).dtype, len(args), inputs

    def once(model, args, kwargs):
        found = key(model, args, kwargs)
        if found not in traced:
            traced[found] = capture_graphs(model, args, kwargs)
        return traced[found]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(api, "capture_graphs", once)
        yield


def test_inspect_a_released_model_at_full_size_on_meta(capsys):
    """released:NAME plans the whole released model (24 blocks of SD3-medium, 4096 image
    tokens, guidance batch) without memory, in the dtype asked for."""
    argv = ["inspect", "released:sd3-medium", "--stages", "2", "--chunks", "2",
            "--dtype", "bfloat16"]
    assert main(argv) == 0
    printed = capsys.readouterr()
    assert "sd3-medium: SD3Transformer2DModel at its released widths, released depth, " \
           "latent grid 128 x 128, batch 2 (guidance), bfloat16 on meta" in printed.err
    assert "4096 tokens" in printed.out and "transformer_blocks.12-23" in printed.out
    # 2.03B parameters in bfloat16, and the positional table (a buffer)
    assert "weights (parameters and buffers) 3.9 GiB" in printed.out
    assert "  4096 + 333 unchunked  " in printed.out  # every chunk attends to the text too


def predicted_run(capsys, argv: list[str]) -> tuple[str, list[float], int, str]:
    """The host named in the --for line, its serial s, pipelined s, speedup and GiB, the
    plan's chunk count, and the line's steps (with where they come from)."""
    import re

    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    line = next(x for x in lines if x.startswith("predicted on"))
    chunks = int(re.search(r"x (\d+) chunk\(s\)", lines[0]).group(1))
    found = re.fullmatch(r"predicted on 2 x h200 \(nvlink4, ([a-zA-Z ]+)\), (\d+ steps "
                         r"\([^)]+\)) of the transformer in bfloat16(?:, plus [\d.]+ s of "
                         r"text encoders and VAE decode)?: serial ([\d.]+) s, pipelined "
                         r"([\d.]+) s \(([\d.]+)x, the GPUs idle \d+% of the ring's chunked "
                         r"steps, by the device model: [^)]*\); "
                         r"the busiest GPU holds ([\d.]+) GiB \(weights, K/V, boundary values\)"
                         r"(?:, and [\d.]+ GiB of text encoders)?(?:; slower than one GPU.*)?",
                         line)
    assert found, line
    return found.group(1), [float(x) for x in found.groups()[2:]], chunks, found.group(2)


def benchmarks_row(name: str, stages: int, host: str) -> tuple[int, list[float]]:
    """BENCHMARKS.md's H200 table row of stale `name` on `stages` GPUs with `host`: its
    chunk count, serial s, pipelined s and speedup."""
    import re
    from pathlib import Path

    text = (Path(__file__).parents[2] / "BENCHMARKS.md").read_text()
    found = re.search(rf"^\| {re.escape(name)} \| {stages} \| stale \| {host} \| ([^|]+) \| "
                      r"([\d.]+) \| ([\d.]+) \| ([\d.]+)x \|", text, re.MULTILINE)
    chunks = found.group(1)  # "1856 + 1 x 2240", "3 x 1408 (last 1280)"
    count = sum(int(n) for n in re.findall(r"(\d+) x", chunks)) + chunks.count("+")
    return count, [float(x) for x in found.groups()[1:]]


def test_plan_a_released_model_for_a_gpu(capsys):
    """--for h200: chunks="auto" chosen at the H200's rates and the runtime's host time for
    a ring of the pipeline's default steps (SD3: 28), and the predicted run printed as
    BENCHMARKS.md's table has it, text encoders and VAE decode included (it printed 20
    steps of the transformer alone, with chunks chosen for one call: 3 where the table has
    2); with --cuda-graphs a chunk's host time is a replay, so smaller chunks pay."""
    argv = ["inspect", "released:sd3-medium", "--stages", "2", "--chunks", "auto",
            "--dtype", "bfloat16", "--for", "h200"]
    host, (serial, pipelined, speedup, memory), chunks, steps = predicted_run(capsys, argv)
    assert host == "kernels launched one by one"
    assert steps == "28 steps (the pipeline's default; --steps sets another)"
    assert (chunks, [serial, pipelined, speedup]) == benchmarks_row("sd3-medium", 2, "launches")
    assert 2.0 < memory < 4.0  # half of 3.9 GiB of weights, the K/V of 12 blocks, buffers
    host, graphed, graphed_chunks, _ = predicted_run(capsys, [*argv, "--cuda-graphs"])
    assert host == "chunks replayed from CUDA graphs"
    assert (graphed_chunks, graphed[:3]) == benchmarks_row("sd3-medium", 2, "graphs")
    assert graphed_chunks > chunks
    for extra, message in ((["--run", "1", "--layers", "1"], "--for plans a released model"),
                           (["--mode", "sync"], "--for predicts stale-mode")):
        assert main([*argv, *extra]) == 2
        assert message in capsys.readouterr().err
    assert main([*argv[:-2], "--steps", "20"]) == 2
    assert "--steps sets the steps of the run --for predicts" in capsys.readouterr().err
    assert main([*argv[:-2], "--threads", "1"]) == 2
    assert "--threads sets the CPU threads of --run" in capsys.readouterr().err


def test_steps_of_a_gpu_prediction(tmp_path, capsys):
    """--steps sets the predicted run's steps; a released-format config of no released
    pipeline predicts 20 steps of the transformer alone."""
    from tokpipe_compiler import released

    argv = ["inspect", "released:pixart-alpha-xl-2-1024-ms", "--layers", "2", "--chunks", "4",
            "--dtype", "bfloat16", "--for", "h200"]
    *_, steps = predicted_run(capsys, argv)
    assert steps == "20 steps (the pipeline's default; --steps sets another)"
    _, ten, *_ = predicted_run(capsys, [*argv, "--steps", "10"])
    _, forty, _, steps = predicted_run(capsys, [*argv, "--steps", "40"])
    assert steps == "40 steps (--steps)" and forty[0] > 1.9 * ten[0]  # serial seconds
    config = tmp_path / "my-pixart.json"
    config.write_text(json.dumps(released.load("pixart-alpha-xl-2-1024-ms")))
    assert main([*argv[:1], f"released:{config}", *argv[2:]]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("predicted on"))
    assert "20 steps (no released pipeline to take a default from; --steps sets another) of " \
           "the transformer in bfloat16: serial" in line


def _for_line(capsys, argv: list[str]) -> tuple[str, str]:
    """The --for line and what went to stderr."""
    assert main(argv) == 0
    printed = capsys.readouterr()
    return next(x for x in printed.out.splitlines() if x.startswith("predicted on")), printed.err


def test_a_gpu_prediction_computes_in_the_models_dtype(capsys):
    """float32 (the default --dtype) runs without tensor cores, as PyTorch does by default:
    the H200's 67 TFLOP/s, not bf16's 989. It was priced at the bf16 rate (0.87 s serial
    against bf16's 0.69 s for full PixArt on 4 H200s: only its bytes differed)."""
    import re

    argv = ["inspect", "released:pixart-alpha-xl-2-1024-ms", "--layers", "4", "--stages", "2",
            "--chunks", "4", "--for", "h200"]
    half, _ = _for_line(capsys, [*argv, "--dtype", "bfloat16"])
    full, _ = _for_line(capsys, argv)
    assert "in float32 (no tensor cores, as PyTorch runs it by default: 67.0 TFLOP/s " \
           "peak against 989 in bfloat16)" in full
    serial = [float(re.search(r"serial ([\d.]+) s", x).group(1)) for x in (half, full)]
    assert serial[1] > 5 * serial[0], serial


def test_a_plan_larger_than_the_gpus_memory_is_warned_about(capsys):
    """FLUX.1-dev in float32 on one L20 (48 GB): 50.3 GiB on the GPU was printed without a
    word. The warning counts the text encoders every rank holds and names the ways out;
    two stages in bfloat16 fit."""
    argv = ["inspect", "released:flux1-dev", "--chunks", "4", "--for", "l20"]
    line, err = _for_line(capsys, [*argv, "--stages", "1"])
    assert "the busiest GPU holds 50.3 GiB (weights, K/V, boundary values), and 18.2 GiB " \
           "of text encoders" in line
    assert "tokpipe: warning: the busiest GPU would hold 50.3 GiB of the transformer and " \
           "18.2 GiB of text encoders (every rank encodes the prompt), against the 44.7 GiB " \
           "(48 GB) of one l20: this plan does not fit; plan more stages (--stages 3 or " \
           "more), halve the bytes with --dtype bfloat16 or encode the prompts beforehand" in err
    _, err = _for_line(capsys, [*argv, "--stages", "2", "--dtype", "bfloat16"])
    assert "would hold" not in err  # no word on fitting


def test_a_plan_slower_than_one_gpu_says_so(capsys):
    """DiT-XL/2 at 256 px on 8 H200s: 256 tokens a step, too few to share; it printed its
    0.86x without a remark."""
    argv = ["inspect", "released:dit-xl-2-256", "--stages", "8", "--chunks", "auto",
            "--dtype", "bfloat16", "--for", "h200"]
    line, _ = _for_line(capsys, argv)
    assert line.endswith("; slower than one GPU: this model's chunks are too short for 8 "
                         "h200s (fewer stages, or --cuda-graphs)"), line


def test_auto_chunks_without_a_gpu_say_whose_rates_chose_them(capsys):
    assert main(["inspect", "released:flux1-dev", "--stages", "2", "--chunks", "auto",
                 "--dtype", "bfloat16"]) == 0
    assert "chunks='auto' chose the chunks at this machine's CPU rates: --for h200" in \
        capsys.readouterr().out


def test_a_plan_that_leaves_no_room_for_activations_is_warned_about(capsys):
    """Wan 2.1 14B on four L20s in float32: 43.9 GiB of the transformer's on the busiest
    of them was printed without a word, and its 21.2 GiB UMT5 encoder did not fit beside
    it; in bfloat16 on two, 39.8 and 10.6 GiB. Eight in bfloat16 leave room."""
    argv = ["inspect", "released:wan2.1-t2v-14b", "--chunks", "auto", "--for", "l20"]
    _, err = _for_line(capsys, [*argv, "--stages", "4"])
    assert "43.9 GiB of the transformer and 21.2 GiB of text encoders" in err
    assert "this plan does not fit" in err
    _, err = _for_line(capsys, [*argv, "--stages", "8", "--dtype", "bfloat16"])
    assert "would hold" not in err, err


def test_a_released_format_config_builds_the_released_model(tmp_path, capsys):
    """A config file in the released format (class, config, inputs) given to a diffusers
    spec is read as one, not passed whole to from_config (which ignored it: a model of the
    class's defaults, 18 blocks for SD3, planned without a word)."""
    from tokpipe_compiler import released

    config = tmp_path / "my-sd3.json"
    config.write_text(json.dumps(released.load("sd3-medium")))
    argv = ["inspect", "diffusers:SD3Transformer2DModel", "--config", str(config),
            "--stages", "2", "--chunks", "2"]
    assert main(argv) == 0
    printed = capsys.readouterr()
    assert "transformer_blocks.12-23" in printed.out and "batch 2" in printed.err
    assert main(["inspect", "diffusers:FluxTransformer2DModel", "--config", str(config)]) == 2
    assert "is a SD3Transformer2DModel config, not FluxTransformer2DModel" in \
        capsys.readouterr().err


def test_run_a_released_model_with_fewer_blocks(capsys):
    argv = ["inspect", "released:dit-xl-2-256", "--layers", "1", "--grid", "16", "16",
            "--stages", "1", "--chunks", "2", "--run", "2"]
    assert main(argv) == 0
    printed = capsys.readouterr()
    assert "1 block(s) per kind, latent grid 16 x 16, batch 2 (guidance), float32 on cpu" in \
        printed.err
    assert "measured/predicted" in printed.out and "transformer_blocks.0 " not in printed.out


def test_a_released_model_in_another_dtype_is_cast_quietly(capfd):
    """diffusers' `to(dtype)` warned that modules "should be kept in float32: []" (none)."""
    argv = ["inspect", "released:dit-xl-2-256", "--layers", "1", "--stages", "1",
            "--chunks", "2", "--dtype", "bfloat16"]
    assert main(argv) == 0
    assert "should be kept in float32" not in capfd.readouterr().err


def test_a_released_model_keeps_its_float32_modules_as_loaded():
    """Wan names modules to keep in float32: cast as `from_pretrained(torch_dtype=...)`
    loads them (they stayed bfloat16 and diffusers warned, even at float32)."""
    import torch

    from tokpipe_compiler import released

    model = released.build("wan2.1-t2v-1.3b", 1)
    keep = model._keep_in_fp32_modules
    released.cast(model, torch.bfloat16)
    dtypes = {name: p.dtype for name, p in model.named_parameters()}
    kept = [n for n in dtypes if any(k in n.split(".") for k in keep)]
    assert kept and all(dtypes[n] == torch.float32 for n in kept)
    assert all(d == torch.bfloat16 for n, d in dtypes.items() if n not in kept)
