"""torch's switches turn on the project's logs: TORCH_LOGS, torch._logging.set_logs and
TORCH_TRACE (tlparse artifacts). Each case runs in a fresh interpreter: torch reads its
environment at import, and its configuration takes over the loggers it names."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMPILE = """
import torch
import tokpipe_compiler as tp
from tests.fixtures.models import TinyDiT, dit_inputs

model = TinyDiT(depth=1, width=16, heads=2, grid=8).eval()
backend = tp.backend(stages=2, chunks=2, compiler="eager")
compiled = torch.compile(model, backend=backend, dynamic=False)
with torch.no_grad():
    compiled(*dit_inputs(model, 8))
"""
PASSES = ["annotate", "partition", "chunk_attention", "chunk_sums", "weight_transforms",
          "split/stage_0", "split/stage_1"]


def run(code: str, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items()
               if k not in {"TORCH_LOGS", "TORCH_TRACE", "TOKPIPE_LOGS", "TOKPIPE_LOGS_DIR"}}
    environ.update(env, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=environ,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def dumped_passes(stderr: str) -> list[str]:
    return [line.split("after pass ")[1].split("]")[0] for line in stderr.splitlines()
            if "[tokpipe dump" in line]


def test_torch_logs_debug_turns_on_the_pass_dumps():
    stderr = run(COMPILE, TORCH_LOGS="+tokpipe_compiler").stderr
    assert dumped_passes(stderr) == PASSES
    assert "tokpipe plan" in stderr


def test_torch_logs_info_shows_the_plan_not_the_dumps():
    stderr = run(COMPILE, TORCH_LOGS="tokpipe_compiler").stderr
    assert "tokpipe plan" in stderr
    assert dumped_passes(stderr) == []


def test_without_torch_logs_nothing_is_printed():
    stderr = run(COMPILE).stderr
    assert "tokpipe plan" not in stderr and dumped_passes(stderr) == []


@pytest.mark.parametrize("modules", ['{"tokpipe": logging.DEBUG}', '{"tokpipe_passes": True}'])
def test_registered_names_work_in_set_logs(modules):
    setup = ("import logging\nimport torch\nimport tokpipe_compiler\n"
             f"torch._logging.set_logs(modules={modules})\n")
    stderr = run(setup + COMPILE).stderr
    assert dumped_passes(stderr) == PASSES


def test_torch_trace_holds_the_plan_and_every_pass(tmp_path):
    run(COMPILE, TORCH_TRACE=str(tmp_path))
    text = "\n".join(p.read_text() for p in tmp_path.iterdir() if p.is_file())
    assert '"name": "tokpipe_plan"' in text
    for name in PASSES:
        assert f'"name": "tokpipe_pass_{name.replace("/", "_")}"' in text
    assert "tokpipe plan" in text  # the payload: the plan's summary
    assert "class GraphModule" in text  # the payload: a pass's graph
