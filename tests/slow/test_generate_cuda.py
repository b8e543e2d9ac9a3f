"""`tokpipe generate` on CUDA (skipped without a GPU; scripts/gpu_check.sh runs it): a
released pipeline's ring (PixArt-alpha's and DiT's on one GPU, PixArt-alpha's on two over
NCCL), in sync mode, gives the serial pipeline's latents within 1e-5 relative (float32)."""

from __future__ import annotations

import re

import pytest
import torch

from tokpipe_compiler.cli import main

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not torch.cuda.is_available(),
                                                   reason="needs a CUDA GPU")]

ARGS = ["generate", "--released", "pixart-alpha-xl-2-1024-ms", "--layers", "2", "--grid",
        "32", "32", "--steps", "3", "--mode", "sync", "--compiler", "eager", "--compare",
        "--device", "cuda"]
# DiT's scheduler keeps its timesteps on the CPU and hands the model a CUDA copy
DIT = [*ARGS[:2], "dit-xl-2-256", *ARGS[3:]]


def _difference(out: str) -> float:
    return float(re.search(r"largest difference (\S+) of the largest latent", out)[1])


@pytest.mark.parametrize("args", [ARGS, DIT], ids=["pixart", "dit"])
def test_one_gpu_ring_equals_serial(capsys, args):
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "sync, cuda)" in out, out
    assert _difference(out) <= 1e-5, out


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_two_gpus_over_nccl_equal_serial(capsys):
    assert main([*ARGS, "--ranks", "2"]) == 0
    out = capsys.readouterr().out
    assert _difference(out) <= 1e-5, out
    assert "rank 0: peak" in out and "rank 1: peak" in out
