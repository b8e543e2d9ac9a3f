"""The README's first command, at a reduced size: it runs and checks its own output."""

from __future__ import annotations

import pytest
from PIL import Image

from tokpipe_compiler.demo import main

pytestmark = pytest.mark.slow


def test_main_job_runs_and_reports(tmp_path, capsys):
    out = tmp_path / "demo.png"
    assert main(["--size", "small", "--steps", "4", "--chunks", "2", "--quiet",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    for line in ("serial", "pipelined", "speedup", "max |pipelined - serial|"):
        assert line in printed
    with Image.open(out) as image:
        assert image.size == (128, 128)  # 16x16 latent, 8x upscaled
