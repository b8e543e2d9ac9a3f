"""The demo's --out: an image path, or a folder to put the default name in; a suffix that is
no image format is refused before the (minutes long) run, not when saving after it."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from tokpipe_compiler import demo


def test_a_folder_gets_the_default_name(tmp_path: Path):
    parser = argparse.ArgumentParser()
    assert demo.image_path(tmp_path, parser) == tmp_path / demo.DEFAULT_NAME
    assert demo.image_path(tmp_path / "new", parser) == tmp_path / "new" / demo.DEFAULT_NAME
    assert demo.image_path(tmp_path / "a.jpg", parser) == tmp_path / "a.jpg"


def test_a_suffix_that_is_no_image_is_refused_before_the_run(capsys):
    with pytest.raises(SystemExit) as exit_info:
        demo.main(["--out", "result.txt"])
    assert exit_info.value.code == 2
    assert "'.txt' is not an image format" in capsys.readouterr().err
