"""Registers the runtime's custom ops (`tokpipe::*`) on the dispatcher with plain kernels.

`torch.library.custom_op` wraps every call in an autograd layer and a version-bump layer
that rebuilds the argument list: about 0.1 ms a call on the CPU, and a stage calls its ops
once per layer and chunk, so that cost grows with the chunk count (see
benchmarks/overhead.py). These ops serve inference only: nothing differentiates through
the K/V or partial-sum caches. So each op is defined here with its Python function as the
kernel for every backend, and its fake implementation for tracing and the meta device.

Every op returns contiguous tensors, from its kernel and its fake implementation alike:
Inductor compiles the code around an op for the strides the fake one gave and checks them
at run time, and a kernel's natural strides (a convolution over a window cut from a cache,
a group norm of a strided input) need not be the fake's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch

_LIBRARY = torch.library.Library("tokpipe", "DEF")


def define_op(
    name: str, kernel: Callable, fake: Callable, mutates: Sequence[str] = ()
) -> torch._ops.OpOverload:
    """Defines `tokpipe::name` with the schema of `kernel`'s type hints (`mutates` names the
    arguments it writes in place) and returns the op's one overload, callable as `kernel`
    is. The overload, not the packet: traced calls then record the target that the
    compiler's rule tables are keyed by."""
    schema = torch.library.infer_schema(kernel, mutates_args=tuple(mutates))
    _LIBRARY.define(name + schema, tags=(torch.Tag.pt2_compliant_tag,))
    # One kernel for every backend; the fake one wins on Meta and under fake tensors.
    _LIBRARY.impl(name, _contiguous(kernel), "CompositeExplicitAutograd")
    torch.library.register_fake(f"tokpipe::{name}", _contiguous(fake), lib=_LIBRARY)
    return getattr(torch.ops.tokpipe, name).default


def _contiguous(fn: Callable) -> Callable:
    """`fn` with its tensor output made contiguous (no copy when it is already)."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        out = fn(*args, **kwargs)
        return out.contiguous() if isinstance(out, torch.Tensor) else out

    return call
