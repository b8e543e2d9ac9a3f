"""Module paths as plans and warnings name them: the model's own, whatever frame Dynamo
reached the module through."""

from __future__ import annotations

import pytest

from tokpipe_compiler.core.fx import _clean_module_path


@pytest.mark.parametrize(("dynamo", "named"), [
    ("L['self'].transformer_blocks[3].attn1", "transformer_blocks.3.attn1"),  # a forward
    ("L['self']", ""),
    # a ring's step, which calls the transformer's bound forward
    ("L['forward'].__self__.__dict__['_modules']['norm_out'].linear", "norm_out.linear"),
    ("L['forward'].__self__", ""),
    # diffusers' hooks call a block's forward through their fn_ref
    ("L['self'].fn_ref.original_forward.__self__.ff.net[0].proj", "ff.net.0.proj"),
])
def test_paths_are_the_models_own(dynamo, named):
    assert _clean_module_path(dynamo) == named
