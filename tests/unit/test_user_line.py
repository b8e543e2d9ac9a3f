"""Errors name the model's own source line, not a frame inside torch."""

from __future__ import annotations

import linecache
import os

import torch
import torch.fx

from tokpipe_compiler.core.errors import user_line

TORCH_FILE = os.path.join(os.path.dirname(torch.__file__), "_functorch", "vmap.py")


def node_with_trace(trace: str) -> torch.fx.Node:
    graph = torch.fx.Graph()
    node = graph.placeholder("x")
    node.meta["stack_trace"] = trace
    return node


def test_the_innermost_frame_outside_torch_is_named():
    trace = (f'  File "/models/dit.py", line 12, in forward\n    y = self.block(x)\n'
             f'  File "/models/block.py", line 40, in forward\n    a = torch.vmap(f)(x)\n'
             f'  File "{TORCH_FILE}", line 203, in _add_batch_dim\n    return op(x)\n')
    assert user_line(node_with_trace(trace)) == (
        'File "/models/block.py", line 40, in forward: a = torch.vmap(f)(x)')


def test_a_trace_only_inside_torch_names_its_innermost_frame():
    trace = f'  File "{TORCH_FILE}", line 203, in _add_batch_dim\n    return op(x)\n'
    assert user_line(node_with_trace(trace)) == (
        f'File "{TORCH_FILE}", line 203, in _add_batch_dim: return op(x)')


def test_a_statement_over_several_lines_is_quoted_whole(tmp_path):
    """A trace gives a call's first line; the rest is read from the file, or marked."""
    source = tmp_path / "block.py"
    source.write_text("def forward(q, k, v, mask):\n"
                      "    x = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,\n"
                      "                                       is_causal=True)\n")
    trace = f'  File "{source}", line 2, in forward\n' \
            "    x = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,\n"
    assert user_line(node_with_trace(trace)) == (
        f'File "{source}", line 2, in forward: x = F.scaled_dot_product_attention(q, k, v, '
        "attn_mask=mask, is_causal=True)")
    source.unlink()
    linecache.clearcache()
    assert user_line(node_with_trace(trace)).endswith("attn_mask=mask, ...")


def test_no_trace():
    assert user_line(node_with_trace("")) == "<unknown source line>"


def test_a_warning_names_the_line_outside_the_package_and_its_libraries():
    """`warn` from deep inside (here: a function of a tokpipe_compiler module called through
    contextlib) is attributed to the line that called into the package."""
    import contextlib
    import warnings

    from tokpipe_compiler.core.warn import warn

    inside = {"__name__": "tokpipe_compiler.pipelines.somewhere", "warn": warn,
              "contextlib": contextlib}
    exec("@contextlib.contextmanager\n"
         "def generation():\n"
         "    warn('tokpipe: runs per call')\n"
         "    yield\n", inside)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with inside["generation"]():  # the user's line
            pass
    assert [w.filename for w in record] == [__file__]
