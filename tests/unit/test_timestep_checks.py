"""Which stale plans read what an earlier call left, so that calls without a timestep
cannot be told apart (planning/timestep_checks.py reads_last_call)."""

from __future__ import annotations

import torch

from tokpipe_compiler.planning.timestep_checks import reads_last_call
from tokpipe_compiler.runtime.caches import CacheSpec, SumCacheSpec


def _kv(causal: bool, lead: int = 0, trail: int = 0) -> CacheSpec:
    return CacheSpec(0, "k", "v", (1, 2, 16, 8), (1, 2, 16, 8), torch.float32, 2, lead, trail,
                     causal)


def test_only_causal_attention_over_no_later_tokens_reads_this_call_alone():
    assert not reads_last_call([])  # nothing held between calls
    assert not reads_last_call([_kv(True), _kv(True, lead=3)])  # a start token: written first
    assert reads_last_call([_kv(False)])
    assert reads_last_call([_kv(True), _kv(False)])
    # tokens after the chunked ones, computed by the first chunk, attend to every chunk's
    assert reads_last_call([_kv(True, trail=2)])
    assert reads_last_call([_kv(True), SumCacheSpec(1, "s", (4, 8), torch.float32)])
