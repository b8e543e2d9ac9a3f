"""`tokpipe generate`: its options checked before a run, what it passes to the pipeline's
call, and what it reports (the runs themselves: tests/slow/test_generate.py)."""

from __future__ import annotations

import re
import types
import warnings

import pytest
import torch

from tokpipe_compiler.cli import main
from tokpipe_compiler.core.errors import TokpipeError


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
    (["--tiny", "dit", "--cfg", "2", "--stages", "1", "--guidance-scale", "1"],
     "--guidance-scale 1 runs one (no classifier-free guidance): pass --cfg 1"),
])
def test_generate_released_options_that_do_not_fit_are_named(argv, message, capsys):
    assert main(["generate", *argv]) == 2
    assert message in capsys.readouterr().err


def test_generate_takes_a_distilled_guidance_of_1_with_true_cfg_on_two_branches():
    from tokpipe_compiler.cli import _parser
    from tokpipe_compiler.generate import check_args

    args = _parser().parse_args(["generate", "--released", "flux1-dev", "--cfg", "2",
                                 "--stages", "1", "--true-cfg-scale", "4", "--guidance-scale",
                                 "1", "--negative-prompt", "x"])
    with pytest.raises(TokpipeError, match="leave out --negative-prompt"):  # not cfg's
        check_args(args)


def test_generate_refuses_ranks_under_torchrun(capsys, monkeypatch):
    """Each torchrun process started --ranks more, which waited for each other silently."""
    from tokpipe_compiler.runtime import launch

    monkeypatch.setattr(launch, "launch", lambda run, world, **kw: pytest.fail("launched"))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert main(["generate", "--tiny", "dit", "--ranks", "2"]) == 2
    assert capsys.readouterr().err == (
        "tokpipe: error: --ranks 2 starts processes here, but a launcher (torchrun) started "
        "this one as a rank (WORLD_SIZE=2, RANK=1): leave out --ranks under torchrun, each "
        "process it starts is one rank (--nproc-per-node sets how many)\n")


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
    from tokpipe_compiler.generate_call import _per_prompt

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
    from tokpipe_compiler.generate_call import call_kwargs

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
    from tokpipe_compiler.generate_call import call_kwargs

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
    from tokpipe_compiler.generate_call import call_kwargs

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
    from tokpipe_compiler.generate_ranks import one_line_warnings
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


def test_generate_prints_what_rank_0_gathered(capsys, monkeypatch):
    """Rank 0's result holds every rank's memory table and profile (`run` gathers them),
    with --ranks as under torchrun, where the other ranks print nothing: they printed only
    their profile paths, and under torchrun only rank 0's memory table appeared."""
    from tokpipe_compiler import generate as generate_module
    from tokpipe_compiler.runtime import launch

    gathered = {**_ran(0), "memory": "rank 0: peak 1 MiB\nrank 1: peak 1 MiB",
                "traces": ["g1/profile_rank0.json", "g1/profile_rank1.json"]}
    monkeypatch.setattr(launch, "launch", lambda run, world, **kw: [gathered, _ran(1)])
    assert main(["generate", "--tiny", "dit", "--ranks", "2", "--profile", "g1"]) == 0
    out = capsys.readouterr().out
    assert "rank 0: peak 1 MiB\nrank 1: peak 1 MiB\n" in out
    assert "profile: g1/profile_rank0.json, g1/profile_rank1.json\n" in out
    # under torchrun each process is one rank
    monkeypatch.setattr(generate_module, "run",
                        lambda rank, world, args: gathered if rank == 0 else _ran(rank))
    monkeypatch.setenv("RANK", "1")
    assert main(["generate", "--tiny", "dit", "--profile", "g1"]) == 0
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize(("compiler", "serial"), [
    ("inductor", {"serial_compiled_s": 1.5}),
    ("eager", {}),
])
def test_generate_compare_names_each_sides_compiler(compiler, serial, capsys):
    """The serial pipeline runs eager while the stages default to Inductor: the speedup
    (1.43x against 0.85-1.58x eager on the tiny DiT) said nothing of it. With compiled
    stages the serial pipeline also runs compiled alike, and both speedups are given."""
    from tokpipe_compiler.cli import _parser
    from tokpipe_compiler.generate import report

    args = _parser().parse_args(["generate", "--tiny", "dit", "--compare", "--compiler",
                                 compiler])
    args.device = "cpu"
    report({**_ran(0), "serial_s": 2.0, "difference": 1e-6, **serial}, args)
    out = capsys.readouterr().out
    compiled = "eager" if compiler == "eager" else f"compiled by {compiler}"
    also = "" if compiler == "eager" else (
        "serial (compiled by inductor): 1.50 s; speedup 1.50x (the pipelining's alone: both "
        "sides compiled alike)\n")
    assert f"pipelined (2 stages x 4 chunks, stale, {compiled}, cpu): 1.00 s" in out
    assert "serial (eager): 2.00 s; speedup 2.00x; largest difference 1.00e-06 of the " \
           f"largest pixel\n{also}rank 0: peak" in out


def test_generate_compare_times_the_serial_pipeline_compiled_alike(monkeypatch):
    """--compare with compiled stages: rank 0 times the serial pipeline eager, then with
    its transformer compiled by the same compiler, and puts the eager one back."""
    from tokpipe_compiler import generate_serial

    pipe = types.SimpleNamespace(transformer=torch.nn.Linear(2, 2))
    eager = pipe.transformer
    ran: list[str] = []

    def timed(p, kwargs):
        ran.append(f"{type(p.transformer).__name__} {kwargs['num_inference_steps']}")
        return 1.0, ["image"]

    monkeypatch.setattr(generate_serial, "wait_for_each_other", lambda group: None)
    args = types.SimpleNamespace(compiler="inductor")
    runs = generate_serial.serial_runs(pipe, {"num_inference_steps": 4},
                                       {"num_inference_steps": 2}, args, 0, None, timed)
    assert ran == ["Linear 2", "Linear 4", "OptimizedModule 2", "OptimizedModule 4"]
    assert runs == {"serial_s": 1.0, "serial_images": ["image"], "serial_compiled_s": 1.0}
    assert pipe.transformer is eager
    # the other ranks wait, without running it: rank 0's time would share the machine
    assert generate_serial.serial_runs(pipe, {}, {}, args, 1, None, timed) is None
    assert len(ran) == 4


@pytest.mark.parametrize(("argv", "says"), [
    (["--tiny", "dit", "--prompt", "a cat"], "DiTPipeline draws a class label (--class-label) "
                                             "at its one size; leave out --prompt"),
    (["--released", "sd3-medium", "--class-label", "3"],
     "sd3-medium draws what its prompt embeddings say, not a class label; leave out "
     "--class-label"),
    (["--released", "dit-xl-2-256", "--prompt", "a cat"],
     "dit-xl-2-256 draws a class label (--class-label); leave out --prompt"),
    (["--released", "dit-xl-2-256", "--class-label", "1000"],
     "--class-label 1000: the pipeline's DiT draws classes 0 to 999"),
    (["--released", "dit-xl-2-256", "--class-label", "-5"],
     "--class-label -5: the pipeline's DiT draws classes 0 to 999"),
])
def test_generate_refuses_the_other_kinds_conditioning(argv, says):
    """--prompt for a class-conditional DiT and --class-label for a prompt pipeline were
    dropped without a word."""
    from tokpipe_compiler.cli import _parser
    from tokpipe_compiler.generate import check_args

    with pytest.raises(TokpipeError, match=re.escape(says)):
        check_args(_parser().parse_args(["generate", *argv]))


def test_a_prompt_pipeline_refuses_a_class_label():
    from tokpipe_compiler.cli import _parser
    from tokpipe_compiler.generate_call import call_kwargs

    class PixArtSigmaPipeline:
        def __call__(self, prompt, num_inference_steps, output_type): ...

    args = _parser().parse_args(["generate", "--tiny", "dit", "--class-label", "3"])
    with pytest.raises(TokpipeError, match="PixArtSigmaPipeline draws what a prompt says, "
                                           "not a class label; leave out --class-label"):
        call_kwargs(PixArtSigmaPipeline(), args)
    args.class_label, args.prompt = None, "a cat"
    assert call_kwargs(PixArtSigmaPipeline(), args)["prompt"] == "a cat"


def test_a_dit_pipeline_refuses_a_class_it_lacks():
    """Label 10 of a 10-class DiT is its unconditional one; -5 crashed in a kernel."""
    from tokpipe_compiler.cli import _parser
    from tokpipe_compiler.generate_call import call_kwargs

    class DiTPipeline:
        transformer = types.SimpleNamespace(config=types.SimpleNamespace(
            num_embeds_ada_norm=10))

    for label in (10, -5):
        args = _parser().parse_args(["generate", "--tiny", "dit", "--class-label", str(label)])
        with pytest.raises(TokpipeError, match=f"--class-label {label}: the pipeline's DiT "
                                               "draws classes 0 to 9"):
            call_kwargs(DiTPipeline(), args)
    args.class_label = 9
    assert call_kwargs(DiTPipeline(), args)["class_labels"] == [9]


def test_generate_help_shows_every_default():
    """--steps, --stages, --seed, --threads, --timeout and --dtype showed none."""
    import argparse

    from tokpipe_compiler.cli import _parser

    commands = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    generate = commands.choices["generate"]
    defaulted = [a for a in generate._actions  # not flags (False) nor --help (SUPPRESS)
                 if a.default is not None and not isinstance(a.default, bool)
                 and a.default != argparse.SUPPRESS]
    assert {a.dest for a in defaulted} >= {"steps", "stages", "seed", "threads", "timeout"}
    for action in defaulted:
        assert "default" in (action.help or ""), action.option_strings
    shown = generate.format_help()
    for default in ("(default 20)", "(default 2)", "(default 0)", "(default 3600)",
                    "(default float32)"):
        assert default in shown


@pytest.mark.parametrize(("argv", "message"), [
    (["--mode", "stale", "--warmup-steps", "0"],
     "needs --warmup-steps >= 1; pass --warmup-steps 1, or --per-call for per-call steps"),
    (["--cfg", "2", "--per-call"], "--cfg 2 runs the denoising loop itself; it cannot be "
                                   "combined with --per-call"),
    (["--chunks", "0"], "option 'chunks' must be an int >= 1"),
])
def test_generate_checks_the_pipelines_options_before_loading_it(argv, message, capsys,
                                                                monkeypatch):
    """They failed after --compare's serial run, minutes on a released pipeline, and on
    each rank, in parallelize's Python words."""
    from tokpipe_compiler import generate
    from tokpipe_compiler.runtime import launch

    monkeypatch.setattr(generate, "load_pipeline", lambda args: pytest.fail("loaded"))
    monkeypatch.setattr(launch, "launch", lambda *a, **kw: pytest.fail("launched"))
    assert main(["generate", "--tiny", "dit", "--compare", *argv]) == 2
    assert message in capsys.readouterr().err
