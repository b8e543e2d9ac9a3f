"""Where `tokpipe generate` runs: --device resolved against the GPUs there are, --ranks
against one GPU a rank, --cuda-graphs only on CUDA; the pipeline's call moved whole."""

from __future__ import annotations

import pytest
import torch

from tokpipe_compiler.cli import main
from tokpipe_compiler.core.errors import TokpipeError
from tokpipe_compiler.run_device import rank_device, resolve_device, to_device


@pytest.fixture
def gpus(monkeypatch):
    """Pretend this machine has `n` CUDA GPUs."""
    def have(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    return have


def test_auto_is_the_gpu_where_there_is_one(gpus):
    gpus(0)
    assert resolve_device("auto", 2, False) == "cpu"
    gpus(2)
    assert resolve_device("auto", 2, True) == "cuda"
    assert resolve_device("cpu", 2, False) == "cpu"  # asked for: the CPU, GPUs or not


def test_a_rank_a_gpu(gpus):
    gpus(1)
    with pytest.raises(TokpipeError, match=r"--ranks 2 on CUDA needs a GPU per rank.*has 1: "
                                           r"pass --ranks 1 or fewer, or --device cpu"):
        resolve_device("auto", 2, False)


def test_cuda_asked_for_without_a_gpu(gpus):
    gpus(0)
    with pytest.raises(TokpipeError, match="sees no CUDA GPU here; pass --device cpu"):
        resolve_device("cuda", 1, False)
    with pytest.raises(TokpipeError, match=r"--cuda-graphs .* needs --device cuda"):
        resolve_device("auto", 1, True)


def test_the_command_refuses_before_building_anything(gpus, capsys):
    gpus(0)
    assert main(["generate", "--tiny", "dit", "--device", "cuda"]) == 2
    assert "--device cuda" in capsys.readouterr().err
    assert main(["generate", "--released", "pixart-alpha-xl-2-1024-ms", "--cuda-graphs"]) == 2
    assert "needs --device cuda" in capsys.readouterr().err


def test_the_pipeline_and_its_tensors_move():
    pipe = torch.nn.Linear(2, 2)
    embeds = torch.ones(1, 3, 2)
    moved = to_device(pipe, {"prompt_embeds": embeds, "guidance_scale": 4.5},
                      torch.device("meta"))
    assert pipe.weight.device.type == "meta"
    assert moved["prompt_embeds"].device.type == "meta" and moved["guidance_scale"] == 4.5
    assert embeds.device.type == "cpu"  # the caller's tensors are left as they were


def test_a_rank_resolves_auto_itself(gpus):
    """`generate.run` called without the command's checks (benchmarks do) still runs."""
    gpus(0)
    assert rank_device("auto") == torch.device("cpu")


def test_a_busy_machine_is_noted_before_a_timed_run(monkeypatch):
    """The demo and the benchmarks that time ranks say when other processes hold the cores
    (their speedups fell to 1.0-1.4x under a load of 3-7, with nothing said)."""
    from tokpipe_compiler import run_device

    monkeypatch.setattr(run_device.os, "getloadavg", lambda: (3.2, 1.0, 1.0))
    assert run_device.busy_note().startswith("note: the load average is 3.2 before the run")
    monkeypatch.setattr(run_device.os, "getloadavg", lambda: (0.3, 1.0, 1.0))
    assert run_device.busy_note() is None
