"""`tokpipe generate` on the built-in tiny DiT pipeline: two ranks in sync mode (the loop as
one ring) give the serial pipeline's image within 1e-5 relative, and so does per-call mode;
one process writes a profile and the image."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from tokpipe_compiler.cli import _parser, main
from tokpipe_compiler.generate import load_pipeline

pytestmark = [pytest.mark.slow, pytest.mark.ranks]


# Per call across ranks is tested without the command (tests/slow/test_distributed.py).
@pytest.mark.parametrize("loop", ["ring", pytest.param("per-call", marks=pytest.mark.full)])
def test_two_ranks_sync_equal_the_serial_pipeline(tmp_path, capsys, loop):
    """Two images of one class label (--images 2: a latent batch of two, four rows with
    guidance)."""
    extra = ["--per-call"] if loop == "per-call" else []
    assert main(["generate", "--tiny", "dit", "--steps", "3", "--mode", "sync", "--ranks", "2",
                 "--compiler", "eager", "--compare", "--images", "2", "--out", str(tmp_path),
                 *extra]) == 0
    out = capsys.readouterr().out
    assert "for 3 steps, 2 images" in out, out
    difference = float(re.search(r"largest difference (\S+)", out)[1])
    assert difference <= 1e-5, out
    assert "rank 0: peak" in out and "rank 1: peak" in out  # each rank's memory
    images = [np.asarray(Image.open(tmp_path / f"image_{i}.png")) for i in range(2)]
    assert all(image.shape == (64, 64, 3) and image.std() > 0 for image in images)
    assert not np.array_equal(*images)  # each from its own noise


def test_bfloat16_in_one_process_is_near_the_serial_pipeline(capsys):
    """--dtype reaches the tiny pipeline too; in bfloat16 the ring's float32 scheduler
    update differs from diffusers' by bfloat16 rounding."""
    args = _parser().parse_args(["generate", "--tiny", "dit", "--dtype", "bfloat16"])
    assert load_pipeline(args)[0].transformer.dtype == torch.bfloat16
    assert main(["generate", "--tiny", "dit", "--steps", "3", "--mode", "sync", "--dtype",
                 "bfloat16", "--compiler", "eager", "--compare"]) == 0
    out, err = capsys.readouterr()
    difference = float(re.search(r"largest difference (\S+)", out)[1])
    assert difference <= 2e-2, out
    # what each stretch of the run is doing, before it starts
    assert "serial: a 2-step call, then the timed one" in err, err
    assert "pipelined: a first call traces, plans and compiles the stages (eager)" in err, err


def test_one_process_profile(tmp_path, capsys):
    assert main(["generate", "--tiny", "dit", "--steps", "2", "--compiler", "eager",
                 "--profile", "--out", str(tmp_path)]) == 0
    trace = (tmp_path / "profile_rank0.json").read_text()
    assert "tokpipe/stage1/" in trace  # the pipeline's own ranges
    assert "saved 1 file(s)" in capsys.readouterr().out


def test_auto_chunks_time_the_program_their_warmup_made(capsys):
    """chunks="auto" chooses by the generation's length (here a 1-step ring gets other
    chunks than a 7-step one): the warmup runs the timed length, so the timed call makes
    no program and one chunk count is reported."""
    assert main(["generate", "--tiny", "dit", "--steps", "8", "--chunks", "auto",
                 "--compiler", "eager"]) == 0
    out, err = capsys.readouterr()
    assert re.search(r"2 stages x auto \(\d+\) chunks", out), out  # one chunk count
    assert "new program" not in err, err


def test_cfg_parallel_alone_has_no_pipelined_program_to_report(capsys):
    """--cfg 2 --stages 1: each rank runs one guidance branch whole; the run reports that
    instead of failing on the missing program, and equals the serial pipeline."""
    assert main(["generate", "--tiny", "dit", "--steps", "3", "--cfg", "2", "--stages", "1",
                 "--ranks", "2", "--compiler", "eager", "--compare"]) == 0
    out = capsys.readouterr().out
    assert "pipelined (each branch whole, guidance branches on 2 rank groups" in out, out
    assert "rank 1: no pipelined program" in out, out
    difference = float(re.search(r"largest difference (\S+)", out)[1])
    assert difference <= 1e-5, out


def test_a_local_pipeline_folder_with_its_text_encoder_on_two_ranks(tmp_path, capsys):
    """--model PATH: a saved PixArt-alpha pipeline with its tokenizer and T5 encoder, a
    prompt and a negative prompt, two images of it at a size of our choosing, on two gloo
    ranks: sync gives the serial pipeline's pixels within 1e-5, and the images are
    saved."""
    pytest.importorskip("transformers")
    from tests.fixtures.local_pipelines import save_pixart

    folder = save_pixart(tmp_path / "pixart")
    assert main(["generate", "--model", str(folder), "--prompt", "a cat on the mat",
                 "--negative-prompt", "blue sky", "--size", "48", "64", "--steps", "3",
                 "--mode", "sync", "--ranks", "2", "--compiler", "eager", "--compare",
                 "--images", "2", "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    difference = float(re.search(r"largest difference (\S+) of the largest pixel", out)[1])
    assert difference <= 1e-5, out
    images = [np.asarray(Image.open(tmp_path / "out" / f"image_{i}.png")) for i in range(2)]
    assert all(image.shape == (48, 64, 3) and image.std() > 0 for image in images)
    assert not np.array_equal(*images)


def test_errors_are_named(tmp_path, capsys):
    assert main(["generate", "--model", str(tmp_path)]) == 2
    assert "no model_index.json" in capsys.readouterr().err


def test_a_released_joint_attention_pipeline_on_two_ranks_equals_serial(capsys):
    """SD3-medium's widths and 333 text tokens in its pipeline, guided, two images of one
    prompt, on two gloo ranks: sync gives the serial pipeline's latents within 1e-5
    relative."""
    assert main(["generate", "--released", "sd3-medium", "--steps", "3", "--mode", "sync",
                 "--ranks", "2", "--compiler", "eager", "--compare", "--images", "2"]) == 0
    out = capsys.readouterr().out
    assert "2 images" in out, out
    difference = float(re.search(r"largest difference (\S+) of the largest latent", out)[1])
    assert difference <= 1e-5, out
    assert "rank 0: peak" in out and "rank 1: peak" in out



def test_rank_0s_result_speaks_for_every_rank(tmp_path):
    """What `generate` prints under torchrun, where no launcher collects the ranks' results:
    rank 0's holds every rank's memory table and profile path (only its own printed), and
    rank 0 alone ran the serial pipeline while the other waited (every rank ran it, and
    rank 0's timed run shared the machine with the others')."""
    from tokpipe_compiler.generate import check_args, run
    from tokpipe_compiler.runtime.launch import launch

    args = _parser().parse_args(["generate", "--tiny", "dit", "--steps", "2", "--compiler",
                                 "eager", "--compare", "--profile", str(tmp_path)])
    check_args(args)
    first, other = launch(run, 2, args=(args,), timeout=600)
    assert re.fullmatch(r"rank 0: peak .*\nrank 1: peak .*", first["memory"], re.S)
    assert first["traces"] == [str(tmp_path / f"profile_rank{r}.json") for r in range(2)]
    assert "serial_s" in first and "difference" in first
    assert "serial_s" not in other


def test_torchrun_ranks_with_their_own_hash_seeds_run_the_pipeline():
    """torchrun starts each rank as a process of its own, string hashing seeded apart (the
    launcher forks its ranks from one): the ranks' fingerprints of one scheduler agree."""
    from tokpipe_compiler.runtime.launch import _free_port

    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(_free_port()), "-m", "tokpipe_compiler.cli", "generate",
         "--tiny", "dit", "--steps", "2", "--compiler", "eager"],
        env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "pipelined" in done.stdout
