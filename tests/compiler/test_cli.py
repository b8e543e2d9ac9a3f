"""The tokpipe command on a released model, a diffusers class, a module:function spec, and on
bad specs."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

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
            "--out", str(out), "--run", "2", "--threads", "1"]
    threads = torch.get_num_threads()
    try:
        assert main(argv) == 0
    finally:
        torch.set_num_threads(threads)
    printed = capsys.readouterr().out
    assert "measured/predicted" in printed and "2 call(s) on 1 CPU thread(s)" in printed
    assert json.loads((out / "trace.json").read_text())["traceEvents"]
    assert main(["inspect", f"{tmp_path / 'my_models.py'}:tiny_dit", "--stages", "1"]) == 0


def test_a_file_spec_imports_the_modules_beside_it(tmp_path, capsys, monkeypatch):
    """As `python file.py` runs it: a model file that imports its neighbours, named by
    path from another folder."""
    import sys

    (tmp_path / "my_models.py").write_text(MODULE)
    (tmp_path / "spec.py").write_text("from my_models import tiny_dit\n")
    (tmp_path / "broken.py").write_text("import no_such_neighbour_xyz\n")
    monkeypatch.setattr(sys, "path", list(sys.path))  # the folder added is taken back
    monkeypatch.chdir("/")
    assert main(["inspect", f"{tmp_path / 'spec.py'}:tiny_dit", "--stages", "2"]) == 0
    assert "2 stage(s)" in capsys.readouterr().out
    assert main(["inspect", f"{tmp_path / 'broken.py'}:f"]) == 2
    assert "failed to import no_such_neighbour_xyz" in capsys.readouterr().err


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


def test_more_chunks_than_units_plan_one_a_unit_with_a_warning(tmp_path, capsys, monkeypatch):
    (tmp_path / "my_models.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.warns(UserWarning, match="chunks=9 is more than the 4 units"):
        assert main(["inspect", "my_models:tiny_dit", "--chunks", "9"]) == 0
    assert "2 stage(s) x 4 chunk(s)" in capsys.readouterr().out


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


@pytest.mark.parametrize("flag", [["--run", "-1"], ["--stages", "0"], ["--warmup-steps", "x"],
                                  ["--threads", "0"]])
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
    for out in (blocker / "dump", blocker):  # under a file; a file itself
        with pytest.raises(SystemExit) as exit_info:  # at once: before a run it would lose
            main(["inspect", "my_models:tiny_dit", "--out", str(out)])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert "argument --out: " in err and str(out.name) in err and "Traceback" not in err
    assert "is a file, not a folder" in err


@pytest.mark.parametrize("value", ["nan", "inf", "x"])
def test_a_guidance_scale_that_is_no_finite_number_is_a_usage_error(value, capsys):
    """nan ran the pipeline unguided (nan > 1 is False), silently."""
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--tiny", "dit", "--guidance-scale", value])
    assert exit_info.value.code == 2
    assert f"argument --guidance-scale: must be a finite number, got '{value}'" in \
        capsys.readouterr().err


def test_a_config_file_that_is_not_json_is_named(tmp_path, capsys):
    (tmp_path / "broken.json").write_text('{"num_layers": 2,')
    assert main(["inspect", "diffusers:DiTTransformer2DModel", "--config",
                 str(tmp_path / "broken.json")]) == 2
    err = capsys.readouterr().err
    assert f"--config {tmp_path / 'broken.json'}: not valid JSON" in err
    assert "Traceback" not in err


def test_ctrl_c_ends_the_command_in_a_line(monkeypatch, capsys):
    import tokpipe_compiler.cli as cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_inspect", interrupted)
    assert main(["inspect", "my_models:tiny_dit"]) == 130
    assert capsys.readouterr().err == "tokpipe: interrupted\n"


def test_inspect_says_what_it_does_before_planning(capsys):
    """Planning a released model at full size takes a minute on a CPU, silently before."""
    assert main(["inspect", "released:dit-xl-2-256", "--layers", "1", "--stages", "1",
                 "--chunks", "2"]) == 0
    err = capsys.readouterr().err
    assert "tokpipe: tracing released:dit-xl-2-256 with Dynamo and planning 1 stage(s) on " \
        "the meta device" in err


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
