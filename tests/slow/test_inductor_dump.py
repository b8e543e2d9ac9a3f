"""plan.save writes Inductor's output code for the stages a program compiled."""

from __future__ import annotations

import pytest

from tests.fixtures.models import TinyDiT, dit_inputs
from tests.fixtures.tracing import trace


@pytest.mark.slow
def test_save_includes_inductor_output_code(tmp_path):
    # No blocks: patchify and unpatchify only, the smallest graph Inductor can compile here.
    model = TinyDiT(depth=0, width=16, heads=2, grid=8).eval()
    traced = trace(model, *dit_inputs(model, 8))
    program = traced.program(stages=1, chunks=1, mode="sync", compiler="inductor")
    program(*traced.inputs)
    files = program.plan.save(tmp_path, program)
    code = [f for f in files if "inductor" in f.name]
    assert [f.name for f in code] == ["stage_0_inductor_4u.py"]
    source = code[0].read_text()
    compile(source, str(code[0]), "exec")
    assert "def call(" in source
