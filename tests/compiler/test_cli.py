"""The tokpipe command on a released model, a diffusers class, a module:function spec, and on
bad specs."""

from __future__ import annotations

import json
import textwrap
import warnings

import pytest

from tokpipe_compiler.cli import main

DIT_CONFIG = {"num_attention_heads": 2, "attention_head_dim": 8, "in_channels": 4,
              "out_channels": 8, "num_layers": 2, "sample_size": 8, "patch_size": 2,
              "num_embeds_ada_norm": 10}

MODULE = textwrap.dedent("""
    from tests.fixtures.models import TinyDiT, dit_inputs

    def tiny_dit():
        model = TinyDiT(depth=2, width=16, heads=2, grid=8)
        return model, dit_inputs(model, 8), {}

    def not_a_triple():
        return 3
""")


def test_inspect_a_diffusers_class(tmp_path, capsys):
    pytest.importorskip("diffusers")
    config = tmp_path / "dit.json"
    config.write_text(json.dumps(DIT_CONFIG))
    out = tmp_path / "dump"
    argv = ["inspect", "diffusers:DiTTransformer2DModel", "--config", str(config),
            "--stages", "2", "--chunks", "2", "--out", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "2 stage(s) x 2 chunk(s)" in printed and "transformer_blocks.0" in printed
    assert json.loads((out / "plan.json").read_text())["config"]["stages"] == 2
    assert (out / "stage_1.py").exists() and (out / "schedule.png").exists()


def test_inspect_a_function_and_run_it(tmp_path, capsys, monkeypatch):
    (tmp_path / "my_models.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "dump"
    argv = ["inspect", "my_models:tiny_dit", "--stages", "2", "--chunks", "4", "--mode", "stale",
            "--out", str(out), "--run", "2"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "measured/predicted" in printed
    assert json.loads((out / "trace.json").read_text())["traceEvents"]
    assert main(["inspect", f"{tmp_path / 'my_models.py'}:tiny_dit", "--stages", "1"]) == 0


@pytest.mark.parametrize(("spec", "message"), [
    ("nocolon", "is not 'released:name', 'diffusers:ClassName' or 'module:function'"),
    ("diffusers:NoSuchModel", "diffusers has no model class 'NoSuchModel'"),
    ("no_such_module_xyz:f", "cannot import 'no_such_module_xyz'"),
    ("my_models:missing", "has no function 'missing'"),
    ("my_models:not_a_triple", "must return (model, args, kwargs)"),
    ("missing_file.py:f", "no file 'missing_file.py'"),
])
def test_bad_specs_fail_clearly(spec, message, tmp_path, capsys, monkeypatch):
    (tmp_path / "my_models.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["inspect", spec]) == 2
    err = capsys.readouterr().err
    assert message in err and "examples:" in err and "tokpipe inspect diffusers:" in err


def test_too_many_stages_is_a_clear_error(tmp_path, capsys, monkeypatch):
    (tmp_path / "my_models.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["inspect", "my_models:tiny_dit", "--chunks", "9"]) == 2
    assert "chunks=9 is more than the 4 rows" in capsys.readouterr().err


@pytest.mark.filterwarnings("ignore:tokpipe.*cannot be balanced")
def test_stages_without_work_are_named(tmp_path, capsys, monkeypatch):
    """20 stages of a 2-block model leave some computing nothing: a warning names them."""
    (tmp_path / "my_models.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.warns(UserWarning, match=r"stages=20 leaves stage\(s\) 1,.*use fewer stages"):
        assert main(["inspect", "my_models:tiny_dit", "--stages", "20"]) == 0


@pytest.mark.parametrize(("chunks", "shown"), [("auto", "chunk(s)"), ("8,4,4", "x 3 chunk(s)")])
def test_chunks_as_auto_or_token_lengths(chunks, shown, tmp_path, capsys, monkeypatch):
    (tmp_path / "my_models.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["inspect", "my_models:tiny_dit", "--chunks", chunks]) == 0
    assert shown in capsys.readouterr().out


def test_unreadable_chunks_are_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["inspect", "my_models:tiny_dit", "--chunks", "many"])
    assert exit_info.value.code == 2
    assert "--chunks must be auto, a count or comma-separated token lengths" in \
        capsys.readouterr().err


@pytest.mark.parametrize("flag", [["--run", "-1"], ["--stages", "0"], ["--warmup-steps", "x"]])
def test_bad_counts_are_usage_errors(flag, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["inspect", "my_models:tiny_dit", *flag])
    assert exit_info.value.code == 2
    assert f"argument {flag[0]}: must be an integer >=" in capsys.readouterr().err


def test_a_missing_config_file_is_named(capsys):
    assert main(["inspect", "diffusers:DiTTransformer2DModel", "--config", "nope.json"]) == 2
    err = capsys.readouterr().err
    assert "tokpipe: error:" in err and "nope.json" in err and "Traceback" not in err


def test_a_syntax_error_in_the_model_file_is_named(tmp_path, capsys):
    (tmp_path / "broken.py").write_text("def tiny_dit(:\n    pass\n")
    assert main(["inspect", f"{tmp_path / 'broken.py'}:tiny_dit"]) == 2
    err = capsys.readouterr().err
    assert "broken.py, line 1" in err and "Traceback" not in err


def test_an_unwritable_out_folder_is_named(tmp_path, capsys, monkeypatch):
    (tmp_path / "my_models.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["inspect", "my_models:tiny_dit", "--out", str(blocker / "dump")]) == 2
    err = capsys.readouterr().err
    assert "tokpipe: error:" in err and "dump" in err and "Traceback" not in err


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
    assert "  4096 + 333 text  " in printed.out  # every chunk attends to the text too


def predicted_run(capsys, argv: list[str]) -> tuple[str, list[float], int]:
    """The host named in the --for line, its serial s, pipelined s, speedup and GiB, and
    the plan's chunk count."""
    import re

    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    line = next(x for x in lines if x.startswith("predicted on"))
    chunks = int(re.search(r"x (\d+) chunk\(s\)", lines[0]).group(1))
    found = re.fullmatch(r"predicted on 2 x h200 \(nvlink4, ([a-zA-Z ]+)\), 20 steps of the "
                         r"transformer in bfloat16: serial ([\d.]+) s, pipelined ([\d.]+) s "
                         r"\(([\d.]+)x\); "
                         r"the busiest GPU holds ([\d.]+) GiB \(weights, K/V, boundary values\)",
                         line)
    assert found, line
    return found.group(1), [float(x) for x in found.groups()[1:]], chunks


def test_plan_a_released_model_for_a_gpu(capsys):
    """--for h200: chunks="auto" chosen at the H200's rates and the runtime's host time, and
    the predicted run printed (two GPUs cannot more than double the transformer's speed);
    with --cuda-graphs a chunk's host time is a replay, so smaller chunks pay."""
    argv = ["inspect", "released:sd3-medium", "--stages", "2", "--chunks", "auto",
            "--dtype", "bfloat16", "--for", "h200"]
    host, (serial, pipelined, speedup, memory), chunks = predicted_run(capsys, argv)
    assert host == "kernels launched one by one"
    assert 1.0 < speedup < 2.0 and serial > pipelined > 0
    assert 2.0 < memory < 4.0  # half of 3.9 GiB of weights, the K/V of 12 blocks, buffers
    host, graphed, graphed_chunks = predicted_run(capsys, [*argv, "--cuda-graphs"])
    assert host == "chunks replayed from CUDA graphs"
    assert 1.0 < graphed[2] < 2.0 and graphed_chunks > chunks
    for extra, message in ((["--run", "1", "--layers", "1"], "--for plans a released model"),
                           (["--mode", "sync"], "--for predicts stale-mode")):
        assert main([*argv, *extra]) == 2
        assert message in capsys.readouterr().err


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
    word. The warning names the ways out; two stages in bfloat16 fit."""
    argv = ["inspect", "released:flux1-dev", "--chunks", "4", "--for", "l20"]
    line, err = _for_line(capsys, [*argv, "--stages", "1"])
    assert "the busiest GPU holds 50.3 GiB" in line
    assert "tokpipe: warning: the busiest GPU would hold 50.3 GiB, more than the 44.7 GiB " \
           "(48 GB) of one l20, before any activations: this plan does not fit; plan more " \
           "stages (--stages 2 or more) or halve the bytes with --dtype bfloat16" in err
    _, err = _for_line(capsys, [*argv, "--stages", "2", "--dtype", "bfloat16"])
    assert "would hold" not in err  # no word on fitting


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


@pytest.mark.parametrize(("argv", "message"), [
    (["released:no-such-model"], "no released config 'no-such-model'; the bundled ones are"),
    (["released:missing.json"], "no released-format config file 'missing.json'"),
    (["my_models:tiny_dit", "--layers", "2"], "--layers, --grid and --dtype apply to released"),
    (["released:flux1-dev", "--run", "1"], "flux1-dev at its released depth holds 44.3 GiB"),
    (["released:sd3-medium", "--grid", "16"],
     "sd3-medium: a latent grid of 2 sizes (height, width), not (16,)"),
])
def test_bad_released_specs_fail_clearly(argv, message, tmp_path, capsys, monkeypatch):
    from tokpipe_compiler import cli_released

    (tmp_path / "my_models.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(cli_released, "available_memory", lambda: 16 * 2**30)
    assert main(["inspect", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "message"), [
    (["--released", "sd3-medium", "--prompt", "a cat"], "leave out --prompt"),
    (["--released", "sd3-medium", "--out", "x"], "they make latents, not images"),
    (["--tiny", "dit", "--layers", "2"], "--layers sizes a --released pipeline"),
    (["--tiny", "dit", "--grid", "8", "8"], "--grid sizes a --released pipeline"),
    (["--released", "pixart-alpha"], "did you mean pixart-alpha-xl-2-1024-ms?"),
    (["--released", "sd3-medium", "--negative-prompt", "x"], "leave out --negative-prompt"),
    (["--released", "sd3-medium", "--size", "64", "64"], "sized by --grid"),
    (["--tiny", "dit", "--size", "64", "64"], "DiTPipeline draws a class label"),
    (["--tiny", "dit", "--frames", "9"], "leave out --frames"),
    (["--released", "wan2.1-t2v-1.3b", "--frames", "9"], "frames first for video"),
    (["--released", "sd3-medium", "--text-length", "9"], "leave out --text-length"),
    (["--released", "wan2.1-t2v-1.3b", "--grid", "16", "16"],
     "wan2.1-t2v-1.3b: a latent grid of 3 sizes (frames, height, width), not (16, 16)"),
    (["--tiny", "dit", "--ranks", "3"], "--ranks 3 starts 3 processes, but --stages 2 x "
                                        "--cfg 1 runs on 2: pass --ranks 2 (or --ranks 1"),
    (["--tiny", "dit", "--ranks", "2", "--stages", "1"], "runs on 1: pass --ranks 1\n"),
])
def test_generate_released_options_that_do_not_fit_are_named(argv, message, capsys):
    assert main(["generate", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("seconds", ["-5", "0", "nan", "inf", "1e9", "soon"])
def test_generate_takes_a_timeout_it_can_keep(seconds, capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--tiny", "dit", "--timeout", seconds])
    assert f"--timeout: must be seconds in (0, 604800], got {seconds!r}" in \
        capsys.readouterr().err


def test_generate_refuses_a_released_pipeline_whose_ranks_would_not_fit(capsys, monkeypatch):
    from tokpipe_compiler import cli_released

    monkeypatch.setattr(cli_released, "available_memory", lambda: 16 * 2**30)
    assert main(["generate", "--released", "flux1-dev", "--layers", "4", "--ranks", "2"]) == 2
    err = capsys.readouterr().err
    assert "with 4 block(s) of each kind, in 2 processes, holds" in err
    assert "pass --layers" in err


def test_generate_images_go_by_the_pipelines_own_argument():
    from tokpipe_compiler.core.errors import TokpipeError
    from tokpipe_compiler.generate import _per_prompt

    class Video:
        def __call__(self, prompt: str, num_videos_per_prompt: int = 1): ...

    class Single:
        def __call__(self, prompt: str): ...

    assert _per_prompt(Video(), 3) == {"num_videos_per_prompt": 3}
    assert _per_prompt(Single(), 1) == {}
    with pytest.raises(TokpipeError, match="Single takes no number of images per prompt"):
        _per_prompt(Single(), 2)


def test_generate_passes_the_prompt_options_to_the_pipeline_call():
    from tokpipe_compiler.cli import _parser
    from tokpipe_compiler.generate import call_kwargs

    class TextToImage:
        def __call__(self, prompt: str, negative_prompt: str | None = None,
                     height: int | None = None, width: int | None = None,
                     num_images_per_prompt: int = 1): ...

    args = _parser().parse_args(["generate", "--model", "x", "--prompt", "a cat",
                                 "--negative-prompt", "blur", "--size", "48", "64",
                                 "--images", "2", "--steps", "3"])
    assert call_kwargs(TextToImage(), args) == {
        "prompt": "a cat", "negative_prompt": "blur", "height": 48, "width": 64,
        "num_images_per_prompt": 2, "num_inference_steps": 3, "output_type": "np"}


class TrueGuidance:
    """Flux's call: a negative prompt guides only with true_cfg_scale above 1."""

    def __call__(self, prompt: str, negative_prompt: str | None = None,
                 true_cfg_scale: float = 1.0, guidance_scale: float = 3.5): ...


@pytest.mark.parametrize(("extra", "expected", "error"), [
    (["--negative-prompt", "blur", "--true-cfg-scale", "4"],
     {"negative_prompt": "blur", "true_cfg_scale": 4.0}, None),
    (["--negative-prompt", "blur"], None, "only with true classifier-free guidance"),
    (["--true-cfg-scale", "4"], None, "give --negative-prompt too"),
])
def test_generate_guides_flux_over_a_negative_prompt_only_when_told(extra, expected, error):
    """FluxPipeline dropped --negative-prompt without a word (true_cfg_scale defaults to 1)."""
    from tokpipe_compiler.cli import _parser
    from tokpipe_compiler.core.errors import TokpipeError
    from tokpipe_compiler.generate import call_kwargs

    args = _parser().parse_args(["generate", "--model", "x", "--prompt", "a cat", *extra])
    if error is not None:
        with pytest.raises(TokpipeError, match=error):
            call_kwargs(TrueGuidance(), args)
        return
    kwargs = call_kwargs(TrueGuidance(), args)
    assert {k: kwargs[k] for k in expected} == expected


def test_generate_passes_frames_and_text_length_to_pipelines_that_take_them():
    from tokpipe_compiler.cli import _parser
    from tokpipe_compiler.core.errors import TokpipeError
    from tokpipe_compiler.generate import call_kwargs

    class Video:
        def __call__(self, prompt: str, num_frames: int = 81, max_sequence_length: int = 512):
            ...

    args = _parser().parse_args(["generate", "--model", "x", "--prompt", "a", "--frames", "9",
                                 "--text-length", "16"])
    kwargs = call_kwargs(Video(), args)
    assert (kwargs["num_frames"], kwargs["max_sequence_length"]) == (9, 16)
    with pytest.raises(TokpipeError, match="TrueGuidance takes no frames"):
        call_kwargs(TrueGuidance(), args)


def test_generate_says_when_the_pipeline_made_fewer_images(capsys):
    """CogVideoX's pipeline takes num_videos_per_prompt and makes one video whatever it is."""
    from tokpipe_compiler.cli import _parser
    from tokpipe_compiler.generate import report

    args = _parser().parse_args(["generate", "--model", "x", "--prompt", "a", "--images", "2"])
    args.device = "cpu"
    report({"made": 1, "pipelined_s": 1.0, "chunks": [4], "made_while_timed": 0,
            "memory": ""}, args)
    out, err = capsys.readouterr()
    assert ", 1 images" in out and "2 images asked, the pipeline made 1" in err


@pytest.mark.parametrize("argv, counts, shown", [
    (["--chunks", "4"], [4], "4 chunks"),
    (["--chunks", "auto"], [2, 3], "auto (2 or 3) chunks"),
    (["--chunks", "4", "--mode", "sync"], [1], "1 chunk (4 asked: sync mode runs each step whole)"),
    (["--chunks", "96,32"], [2], "2 chunks (96,32 tokens)"),
    (["--chunks", "96,32", "--mode", "sync"], [1],
     "1 chunk (96,32 asked: sync mode runs each step whole)"),
    (["--chunks", "4", "--cfg", "2"], [], "4 chunks"),
])
def test_generate_reports_the_chunks_its_programs_ran(argv, counts, shown):
    from tokpipe_compiler.cli import _parser
    from tokpipe_compiler.generate import chunks_ran

    args = _parser().parse_args(["generate", "--tiny", "dit", *argv])
    assert chunks_ran(counts, args) == shown


@pytest.mark.parametrize(("rank", "world", "prefix"), [(1, 2, "warning (rank 1): "),
                                                       (0, 1, "warning: ")])
def test_generate_shows_a_warning_on_one_line_with_its_rank(rank, world, prefix, capsys):
    """Not Python's default: a line of the command's own code (or multiprocessing's)."""
    from tokpipe_compiler.generate import one_line_warnings
    from tokpipe_compiler.passes.partition import ImbalanceWarning

    with one_line_warnings(rank, world):
        warnings.warn("2 stages cannot be balanced", ImbalanceWarning, stacklevel=1)
    assert capsys.readouterr().err == f"{prefix}ImbalanceWarning: 2 stages cannot be balanced\n"


@pytest.mark.parametrize(("argv", "folder"), [
    (["--tiny", "dit", "--profile"], "."),
    (["--tiny", "dit", "--profile", "--out", "images"], "images"),
    (["--tiny", "dit", "--profile", "traces", "--out", "images"], "traces"),
    (["--released", "sd3-medium", "--profile", "traces"], "traces"),  # which has no --out
])
def test_generate_profiles_to_the_folder_its_help_names(argv, folder):
    from tokpipe_compiler.cli import _parser
    from tokpipe_compiler.generate import profile_folder

    parser = _parser()
    args = parser.parse_args(["generate", *argv])
    assert str(profile_folder(args)) == folder
    assert args.profile is not None and parser.parse_args(["generate", *argv[:2]]).profile is None


def _ran(rank: int) -> dict:
    """What a rank's run of `tokpipe generate --profile` returns."""
    return {"pipelined_s": 1.0, "made": 1, "chunks": [4], "made_while_timed": 0,
            "memory": f"rank {rank}: peak 1 MiB", "traces": [f"g1/profile_rank{rank}.json"]}


def test_generate_prints_every_ranks_profile(capsys, monkeypatch):
    from tokpipe_compiler import generate as generate_module
    from tokpipe_compiler.runtime import launch

    monkeypatch.setattr(launch, "launch", lambda run, world, **kw: [_ran(r) for r in range(world)])
    assert main(["generate", "--tiny", "dit", "--ranks", "2", "--profile", "g1"]) == 0
    assert "profile: g1/profile_rank0.json, g1/profile_rank1.json\n" in capsys.readouterr().out
    # under torchrun each process is one rank: the others print their own
    monkeypatch.setattr(generate_module, "run", lambda rank, world, args: _ran(rank))
    monkeypatch.setenv("RANK", "1")
    assert main(["generate", "--tiny", "dit", "--profile", "g1"]) == 0
    assert capsys.readouterr().out == "profile (rank 1): g1/profile_rank1.json\n"
