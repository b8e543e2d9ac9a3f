"""Cost rules on small graphs with known shapes, and calibration to seconds."""

from __future__ import annotations

import json
from dataclasses import asdict, replace

import pytest
import sympy
import torch
import torch.fx
import torch.nn.functional as F

from tokpipe_compiler.core.meta import (
    ATTENTION,
    INVARIANT_INFO,
    META_KEY,
    TOKEN,
    TokenInfo,
    token,
)
from tokpipe_compiler.core.ops import RuleCrashed, op_key
from tokpipe_compiler.costmodel import calibrate, cost
from tokpipe_compiler.costmodel.cost import C, N, graph_cost, node_cost


def traced(fn, inputs: dict[str, torch.Tensor], infos: dict[str, TokenInfo]) -> torch.fx.Graph:
    """Trace `fn`, record real outputs as example values, annotate nodes by name."""
    gm = torch.fx.symbolic_trace(fn)
    values = iter(inputs.values())
    env: dict[torch.fx.Node, object] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            env[node] = next(values)
        elif node.op != "output":
            args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), env.__getitem__)
            if node.op == "call_method":
                env[node] = getattr(args[0], node.target)(*args[1:], **kwargs)
            else:
                env[node] = node.target(*args, **kwargs)
        node.meta["example_value"] = env.get(node)
        node.meta[META_KEY] = infos.get(node.name, INVARIANT_INFO)
    return gm.graph


def only(graph: torch.fx.Graph, name: str) -> torch.fx.Node:
    return next(n for n in graph.nodes if n.name == name)


def at(expr: sympy.Expr, n: int, c: int = 0) -> float:
    return float(sympy.sympify(expr).subs({N: n, C: c}))


def test_linear_flops_scale_with_chunk():
    g = traced(
        lambda x, w, b: F.linear(x, w, b),
        {"x": torch.randn(2, 12, 20), "w": torch.randn(30, 20), "b": torch.randn(30)},
        {"x": token(1, 1), "linear": token(1, 1)},
    )
    cost = node_cost(only(g, "linear"), tokens=12)
    assert at(cost.flops, 5) == 2 * 2 * 5 * 30 * 20 + 2 * 5 * 30
    assert at(cost.matmul_flops, 5) == 2 * 2 * 5 * 30 * 20
    assert at(cost.bytes, 5) == 4 * (2 * 5 * 20 + 30 * 20 + 30 + 2 * 5 * 30)


def test_matmul_flops():
    g = traced(
        lambda a, b: torch.matmul(a, b),
        {"a": torch.randn(3, 12, 7), "b": torch.randn(3, 7, 5)},
        {"a": token(1, 1), "matmul": token(1, 1)},
    )
    assert at(node_cost(only(g, "matmul"), 12).flops, 4) == 2 * 3 * 4 * 5 * 7


def _sdpa_graph(kv_len: int, kv_tokens: bool, causal: bool = False) -> torch.fx.Graph:
    kv_info = token(2, 1) if kv_tokens else INVARIANT_INFO
    return traced(
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
        {
            "q": torch.randn(1, 2, 12, 8),
            "k": torch.randn(1, 2, kv_len, 8),
            "v": torch.randn(1, 2, kv_len, 8),
        },
        {
            "q": token(2, 1),
            "k": kv_info,
            "v": kv_info,
            "scaled_dot_product_attention": TokenInfo(ATTENTION, 2, 1),
        },
    )


def test_self_attention_flops_in_chunk_and_context():
    cost = node_cost(only(_sdpa_graph(12, True), "scaled_dot_product_attention"), 12)
    # q.k and p.v: 2 * 2 * D flops per (query, key) pair and head, plus softmax.
    assert sympy.expand(cost.flops - 2 * N * C * (4 * 8 + 5)) == 0
    assert cost.attention_flops == cost.flops
    assert at(cost.bytes, 3, 12) == 4 * (2 * 3 * 8 * 2 + 2 * 12 * 8 * 2)


def test_attention_counts_its_scores_and_its_products_over_padded_heads():
    cost = node_cost(only(_sdpa_graph(12, True), "scaled_dot_product_attention"), 12)
    assert sympy.expand(cost.attention_scores - 2 * N * C) == 0  # 2 heads
    assert sympy.expand(cost.attention_padded - 2 * N * C * 4 * 64) == 0  # heads of 8 -> 64
    assert cost.attention_at(3, 12) == (2 * 3 * 12, 2 * 3 * 12 * 4 * 64)
    twice = graph_cost([only(_sdpa_graph(12, True), "scaled_dot_product_attention")] * 2, 12)
    assert twice.attention_at(3, 12) == (4 * 3 * 12, 4 * 3 * 12 * 4 * 64)


def test_causal_attention_counts_half_its_own_block_plus_the_kernel_tile():
    cost = node_cost(only(_sdpa_graph(12, True, causal=True), "scaled_dot_product_attention"), 12)
    per_key = 2 * (4 * 8 + 5)  # heads * (q.k and p.v: 4 * D, softmax: 5) per query row
    flops, *_ = cost.at(4, 12)
    assert flops == per_key * 4 * (12 - 4 / 2)  # useful work: the context and half the block
    assert cost.at(4, 12, tile=2)[0] == per_key * 4 * (12 - 4 / 2 + 2 / 2)
    assert cost.at(4, 12, tile=64)[0] == per_key * 4 * 12  # a tile wider than the chunk
    tiled = replace(RATES, causal_tile=64.0)
    assert calibrate.seconds(cost, tiled, 4, 12) > calibrate.seconds(cost, RATES, 4, 12)
    assert calibrate.time_fn(cost, tiled)(4, 12) == pytest.approx(
        calibrate.seconds(cost, tiled, 4, 12))


def test_joint_attention_counts_the_text_where_the_chunk_computes_it():
    """4 text tokens before 12 image tokens: a chunk's queries hold the text only where it
    computes it (TEXT), its keys always hold it (fresh or cached), and a whole pass with
    the text is the full-size count."""
    joint = TokenInfo(TOKEN, 2, 1, lead=4)
    g = traced(
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v),
        {name: torch.randn(1, 2, 16, 8) for name in "qkv"},
        {"q": joint, "k": joint, "v": joint,
         "scaled_dot_product_attention": replace(joint, kind=ATTENTION)},
    )
    cost = node_cost(only(g, "scaled_dot_product_attention"), 12)
    per_pair = 2 * (4 * 8 + 5)  # heads * (q.k and p.v, softmax) per (query, key)
    assert cost.at(3, 12, text=0.0)[0] == per_pair * 3 * (4 + 12)
    assert cost.at(3, 12, text=1.0)[0] == per_pair * (4 + 3) * (4 + 12)
    assert cost.at(12, 12)[0] == per_pair * 16 * 16
    assert cost.text_rows == 4 and graph_cost(g.nodes, 12).text_rows == 4


def test_the_text_rows_count_in_the_rate_of_a_chunks_matrix_products():
    """A matmul's rate grows with its rows: a chunk of one image token and 4 text rows
    runs its linear at the rate of 5 rows, and without the text at the rate of 1."""
    joint = TokenInfo(TOKEN, 1, 1, lead=4)
    g = traced(lambda x, w: F.linear(x, w), {"x": torch.randn(1, 16, 8), "w": torch.randn(8, 8)},
               {"x": joint, "linear": joint})
    cost = node_cost(only(g, "linear"), 12)
    mm_only = replace(cost, bytes=sympy.Integer(0), launches=0)
    small = replace(RATES, matmul_half=16.0)
    for text, rows in ((1.0, 5), (0.0, 1)):
        mm = cost.at(1, 12, text=text)[2]
        assert calibrate.seconds(mm_only, small, 1, 12, text) == pytest.approx(
            mm / small.matmul_rate(rows))
    assert calibrate.time_fn(cost, RATES)(3, 12, 0.0) == pytest.approx(
        calibrate.seconds(cost, RATES, 3, 12, 0.0))
    assert calibrate.seconds(cost, RATES, 3, 12, 0.0) < calibrate.seconds(cost, RATES, 3, 12)


def test_the_text_streams_launches_are_left_out_of_chunks_without_the_text():
    """A node that computes only the text stream (no image rows) runs only where the chunk
    computes the text: its launches count at text=1, not at text=0, and a chunk's launch
    overhead follows."""
    text_only = TokenInfo(TOKEN, 1, 0, lead=4)
    joint = TokenInfo(TOKEN, 1, 1, lead=4)
    g = traced(lambda t, x: (F.gelu(t), F.gelu(x)),
               {"t": torch.randn(1, 4, 8), "x": torch.randn(1, 16, 8)},
               {"t": text_only, "x": joint, "gelu": text_only, "gelu_1": joint})
    total = graph_cost(g.nodes, 12)
    assert (total.launches, total.text_launches) == (2, 1)
    assert (total.launches_at(1.0), total.launches_at(0.0), total.launches_at(0.25)) == (
        2, 1, 1.25)
    overhead = calibrate.seconds(total, RATES, 3, 12) - calibrate.seconds(total, RATES, 3, 12,
                                                                          0.0)
    text_work = calibrate.seconds(replace(total, launches=0, text_launches=0), RATES, 3, 12) \
        - calibrate.seconds(replace(total, launches=0, text_launches=0), RATES, 3, 12, 0.0)
    assert overhead == pytest.approx(text_work + RATES.per_op_overhead)
    assert calibrate.time_fn(total, RATES)(3, 12, 0.0) == pytest.approx(
        calibrate.seconds(total, RATES, 3, 12, 0.0))


def test_cross_attention_keys_do_not_scale():
    cost = node_cost(only(_sdpa_graph(6, False), "scaled_dot_product_attention"), 12)
    assert C not in cost.flops.free_symbols
    assert at(cost.flops, 3) == 2 * 3 * 6 * (4 * 8 + 5)


def test_invariant_nodes_are_constant_and_views_free():
    g = traced(
        lambda t, w: F.silu(F.linear(t, w)).view(-1),
        {"t": torch.randn(1, 16), "w": torch.randn(32, 16)},
        {},
    )
    total = graph_cost(g.nodes, tokens=12)
    assert not total.flops.free_symbols and not total.bytes.free_symbols
    assert at(total.matmul_flops, 1) == 2 * 32 * 16
    assert node_cost(only(g, "view"), 12).bytes == 0
    assert total.launches == 2


def test_conv_patchify_scales_rows():
    g = traced(
        lambda x, w, b: torch.conv2d(x, w, b, stride=2),
        {"x": torch.randn(1, 3, 8, 8), "w": torch.randn(4, 3, 2, 2), "b": torch.randn(4)},
        {"x": token(2, 2), "conv2d": token(2, 1)},
    )
    # 16 tokens: a chunk of n tokens is n/4 output rows of 4 patches, 4 channels each.
    out = 4 * 4 * N / 4
    assert sympy.expand(node_cost(only(g, "conv2d"), 16).flops - (2 * out * 12 + out)) == 0


def test_einsum_and_unknown_ops_do_not_crash():
    g = traced(
        lambda a, b: torch.cumsum(torch.einsum("btd,de->bte", a, b), dim=1),
        {"a": torch.randn(2, 12, 5), "b": torch.randn(5, 3)},
        {"a": token(1, 1), "einsum": token(1, 1), "cumsum": token(1, 1)},
    )
    assert at(node_cost(only(g, "einsum"), 12).flops, 6) == 2 * 2 * 6 * 5 * 3
    assert at(node_cost(only(g, "cumsum"), 12).flops, 6) == 2 * 6 * 3


def test_cost_table_is_keyed_by_op_key_for_methods_and_functions():
    g = traced(
        lambda x, w: (x.softmax(-1), F.softmax(x, -1), torch.softmax(x, -1), x.view(-1),
                      torch.reshape(x, (-1,)), F.linear(x, w)),
        {"x": torch.randn(2, 12, 8), "w": torch.randn(4, 8)},
        {"x": token(1, 1)},
    )
    nodes = {n.name: n for n in g.nodes}
    softmaxes = [nodes[name] for name in ("softmax", "softmax_1", "softmax_2")]
    assert {op_key(n) for n in softmaxes} == {"method:softmax", F.softmax, torch.softmax}
    assert len({cost.RULES[op_key(n)] for n in softmaxes}) == 1
    assert len({node_cost(n, 12) for n in softmaxes}) == 1
    assert cost.RULES["method:view"] is cost.RULES[torch.reshape]
    assert node_cost(nodes["view"], 12) == node_cost(nodes["reshape"], 12) == cost.ZERO
    assert "linear" not in cost.RULES and op_key(nodes["linear"]) in cost.RULES


def test_a_crashing_cost_rule_raises_naming_the_op():
    g = traced(
        lambda x, w: F.linear(x, w),
        {"x": torch.randn(2, 12, 8), "w": torch.randn(4, 8)},
        {"x": token(1, 1), "linear": token(1, 1)},
    )
    del only(g, "x").meta["example_value"]  # its rule cannot size the contraction
    with pytest.raises(RuleCrashed, match="cost rule for 'linear'") as caught:
        node_cost(only(g, "linear"), 12)
    assert isinstance(caught.value.__cause__, TypeError)


RATES = calibrate.DeviceRates(
    matmul_flops=1e11, mem_bandwidth=1e10, attention_flops=5e10, per_op_overhead=1e-6,
    matmul_half=8.0,
)  # fmt: skip


def test_seconds_grows_with_chunk_and_matches_time_fn():
    cost = node_cost(only(_sdpa_graph(12, True), "scaled_dot_product_attention"), 12)
    times = [calibrate.seconds(cost, RATES, n, 12) for n in (1, 4, 12)]
    assert times == sorted(times) and times[0] > RATES.per_op_overhead
    assert calibrate.time_fn(cost, RATES)(4, 12) == pytest.approx(times[1])


def test_matmul_rate_saturates():
    assert RATES.matmul_rate(8) == pytest.approx(RATES.matmul_flops / 2)
    assert RATES.matmul_rate(10_000) > 0.99 * RATES.matmul_flops


def test_linear_records_its_product_shape():
    g = traced(
        lambda x, w, b: F.linear(x, w, b),
        {"x": torch.randn(2, 12, 20), "w": torch.randn(30, 20), "b": torch.randn(30)},
        {"x": token(1, 1), "linear": token(1, 1)},
    )
    (gemm,) = node_cost(only(g, "linear"), tokens=12).gemms
    assert (at(gemm.rows, 5), gemm.cols, gemm.depth, gemm.count) == (10, 30, 20, 1)
    twice = graph_cost([only(g, "linear")] * 2, tokens=12)
    assert [(at(g.rows, 5), g.count) for g in twice.gemms] == [(10, 2)]  # merged
    assert at(twice.gemms[0].flops, 5) == 2 * at(node_cost(only(g, "linear"), 12).matmul_flops, 5)


# One H200, bf16, x [m, C] @ W [C, out] replayed from a CUDA graph (benchmarks/gpu_rates.py,
# 2026-12-04): (C, out, m, TFLOP/s).
H200_GRAPHED = [
    (1152, 4608, 512, 468.4), (1152, 4608, 1024, 694.5), (1152, 4608, 2048, 706.8),
    (1152, 4608, 4096, 701.6), (1152, 4608, 8192, 725.9), (1152, 1152, 512, 275.1),
    (1152, 1152, 1024, 360.1), (1152, 1152, 2048, 564.9), (1152, 1152, 4096, 639.2),
    (1152, 1152, 8192, 697.0), (3072, 12288, 512, 733.6), (3072, 12288, 1024, 770.2),
    (3072, 12288, 2048, 789.9), (3072, 12288, 4096, 799.1), (3072, 12288, 8192, 687.1),
    (3072, 3072, 512, 555.6), (3072, 3072, 1024, 602.2), (3072, 3072, 2048, 630.2),
    (3072, 3072, 4096, 654.8), (3072, 3072, 8192, 733.7),
]


def test_waves_of_tiles_explain_the_h200s_products():
    """Each measured product within 0.75-1.35x of its waves of 128 x 128 tiles (0.84-1.33x
    today), 10% off on average; a rate by rows alone (the CPU's model) misses the narrow
    products by 1.6x."""
    import math

    from tokpipe_compiler.costmodel.hardware import DEVICES

    rates = DEVICES["h200"].rates()
    errors = []
    for width, out, m, tflops in H200_GRAPHED:
        measured = 2 * m * width * out / (tflops * 1e12)
        ratio = rates.gemm_seconds(m, out, width) / measured
        assert 0.75 < ratio < 1.35, (width, out, m, ratio)
        errors.append(abs(math.log(ratio)))
    assert sum(errors) / len(errors) < 0.12
    by_rows = replace(rates, sms=0, matmul_half=64.0, matmul_flops=494e12)
    narrow = 2 * 512 * 1152 * 1152
    assert narrow / by_rows.matmul_rate(512) < narrow / (275.1e12 * 1.5)


# The same GPU, SDPA over a stale chunk of L / M queries and all L keys, graphed: (batch,
# heads, head dim, L, TFLOP/s at M = 1, 2, 4, 8).
H200_ATTENTION = [
    (2, 16, 72, 4096, (389.6, 383.5, 371.6, 357.1)),
    (2, 16, 64, 4096, (479.0, 470.2, 453.9, 430.3)),
    (2, 16, 128, 4096, (685.2, 678.9, 654.8, 613.1)),
    (1, 24, 128, 4608, (661.9, 573.1, 561.2, 546.9)),
]


def test_scores_and_padded_heads_explain_the_h200s_attention():
    """Each of the 16 cases within 0.85-1.15x of the time per score plus products over
    head dims padded to 64; one flat rate over true FLOPs (the previous preset's 430
    TFLOP/s) misses heads of 128 by more than 1.4x."""
    import math

    from tokpipe_compiler.costmodel.hardware import DEVICES
    from tokpipe_compiler.costmodel.symbolic import padded_head

    rates = DEVICES["h200"].rates()
    flat_errors = []
    for batch, heads, dim, length, by_chunks in H200_ATTENTION:
        for chunks, tflops in zip((1, 2, 4, 8), by_chunks, strict=True):
            scores = batch * heads * (length // chunks) * length
            measured = 4 * scores * dim / (tflops * 1e12)
            model = rates.attention_by_score(scores, 4 * scores * padded_head(dim))
            assert 0.85 < model / measured < 1.15, (dim, chunks, model / measured)
            flat_errors.append(abs(math.log(measured / (4 * scores * dim / 430e12))))
    assert max(flat_errors) > math.log(1.4)


def test_a_product_too_small_for_the_gpu_pays_a_whole_wave():
    rates = calibrate.DeviceRates(matmul_flops=132e12, mem_bandwidth=1e12,
                                  attention_flops=1e14, per_op_overhead=0.0, sms=132)
    one_tile = rates.gemm_seconds(1, 128, 1024)
    assert rates.gemm_seconds(128, 128, 1024) == one_tile
    assert rates.gemm_seconds(128 * 132, 128, 1024) == one_tile  # one full wave
    assert rates.gemm_seconds(128 * 133, 128, 1024) == 2 * one_tile
    assert rates.gemm_seconds(0, 128, 1024) == 0.0


def test_seconds_time_products_by_shape_only_with_multiprocessors():
    g = traced(
        lambda x, w: F.linear(x, w),
        {"x": torch.randn(1, 4096, 1152), "w": torch.randn(1152, 1152)},
        {"x": token(1, 1), "linear": token(1, 1)},
    )
    cost = node_cost(only(g, "linear"), tokens=4096)
    gpu = calibrate.DeviceRates(matmul_flops=7.78e14, mem_bandwidth=3.84e12,
                                attention_flops=4.3e14, per_op_overhead=0.0, sms=132)
    flat = replace(gpu, sms=0)
    small, full = (calibrate.seconds(cost, gpu, n, 4096) for n in (512, 4096))
    assert small > full / 8 * 1.5  # 36 tiles on 132 SMs: most of the GPU idles
    assert calibrate.seconds(cost, flat, 512, 4096) < small
    assert calibrate.time_fn(cost, gpu)(512, 4096) == pytest.approx(small)
    assert calibrate.time_fn(cost, flat)(512, 4096) == pytest.approx(
        calibrate.seconds(cost, flat, 512, 4096))


def test_attention_by_score_only_where_the_device_has_a_time_per_score():
    cost = node_cost(only(_sdpa_graph(12, True), "scaled_dot_product_attention"), 12)
    by_score = replace(RATES, score_seconds=1e-9)
    scores, padded = cost.attention_at(4, 12)
    assert calibrate.seconds(cost, by_score, 4, 12) - calibrate.seconds(cost, RATES, 4, 12) \
        == pytest.approx(by_score.attention_by_score(scores, padded)
                         - cost.at(4, 12)[3] / RATES.attention_flops)
    assert calibrate.time_fn(cost, by_score)(4, 12) == pytest.approx(
        calibrate.seconds(cost, by_score, 4, 12))


def test_rates_cache_roundtrip(tmp_path, monkeypatch):
    monkeypatch.setenv(calibrate.CACHE_ENV, str(tmp_path))
    calls = []
    monkeypatch.setattr(calibrate, "measure_rates", lambda d, t: calls.append(d) or RATES)
    assert calibrate.load_or_measure("cpu", 3) == RATES
    path = tmp_path / "rates-cpu-3.json"
    assert json.loads(path.read_text())["rates"]["matmul_half"] == 8.0
    assert calibrate.load_or_measure("cpu", 3) == RATES
    assert calls == ["cpu"]
    path.write_text("{not json")
    assert calibrate.load_or_measure("cpu", 3) == RATES and len(calls) == 2
    older = {k: v for k, v in asdict(RATES).items() if k != "causal_tile"}
    key = calibrate.cache_key("cpu", 3)
    path.write_text(json.dumps({"key": key, "rates": older}))  # a version that measured less
    assert calibrate.load_or_measure("cpu", 3) == RATES and len(calls) == 3
