"""The README's first command, at a reduced size: it runs and checks its own output."""

from __future__ import annotations

import pytest
from PIL import Image

pytest.importorskip("sklearn")

from tokpipe_compiler.demo import main

pytestmark = pytest.mark.slow


def test_main_job_runs_and_reports(tmp_path, capsys):
    out = tmp_path / "demo.png"
    assert main(["--size", "small", "--steps", "4", "--chunks", "2", "--quiet",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    for line in ("serial", "pipelined", "speedup", "PSNR", "SSIM", "read as the class"):
        assert line in printed
    with Image.open(out) as image:
        # three panels of 2 x 5 digits of 8x8 with 1-pixel lines, 2-pixel gaps, 4x enlarged
        assert image.size == ((3 * (5 * 9 + 1) + 2 * 2) * 4, (2 * 9 + 1) * 4)
