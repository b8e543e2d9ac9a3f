"""CUDA graphs per chunk (`runtime/cuda_graphs.py`), checked on the CPU with an emulated
capture that has a graph's semantics: a replay reads what the capture read (the graph's own
input buffers and the persistent tensors, wherever the caller's inputs are now), runs
nothing at capture that a replay would not redo, and writes its results into the same
output buffers every time."""

from __future__ import annotations

import pytest
import torch

from tests.fixtures.models import TinyCausalLM, TinyDiT, dit_inputs
from tokpipe_compiler.runtime.cuda_graphs import COPIED, HOST, PERSISTENT, GraphedStage
from tokpipe_compiler.stage_programs import stage as stage_module

OPTIONS = {"stages": 2, "chunks": 4, "mode": "stale", "warmup_steps": 1, "compiler": "eager"}


def emulated_capture(fn, args, pool):
    """A graph of `fn` over `args`: outputs are buffers that only a replay fills."""
    outputs = [out.clone().fill_(float("nan")) for out in fn(*args)]

    def replay() -> None:
        for buffer, value in zip(outputs, fn(*args), strict=True):
            buffer.copy_(value)

    return replay, outputs


def graphed(fn, kinds, capture=emulated_capture) -> GraphedStage:
    return GraphedStage(fn, kinds, "0", device="cpu", capture=capture, new_pool=lambda: None)


def chunk_fn(x, w, cache, descriptor):
    """A stage in miniature: writes its chunk's row of the cache, reads the whole cache."""
    row = int(descriptor[0])
    cache[row] = x.sum(0)
    return [x @ w + cache.sum(0), x.mean()]


KINDS = [COPIED, PERSISTENT, PERSISTENT, HOST]


def calls(steps: int = 4, rows: int = 3):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(5, 4, generator=g), torch.tensor([row])) for _ in range(steps)
            for row in range(rows)]


def test_replays_compute_what_the_function_computes_with_one_graph_per_host_key():
    w = torch.randn(4, 4)
    eager_cache, graph_cache = torch.zeros(3, 4), torch.zeros(3, 4)
    stage = graphed(chunk_fn, KINDS)
    for x, descriptor in calls():
        expected = chunk_fn(x, w, eager_cache, descriptor)
        got = stage(x, w, graph_cache, descriptor)
        for e, g in zip(expected, got, strict=True):
            assert torch.equal(e, g)
        assert torch.equal(eager_cache, graph_cache)
    assert stage.captures == 3 and len(stage.graphs) == 3  # one per chunk row, never again


def test_returned_outputs_are_copies_that_later_replays_leave_alone():
    w, cache = torch.randn(4, 4), torch.zeros(3, 4)
    stage = graphed(chunk_fn, KINDS)
    results = [stage(x, w, cache, d)[0] for x, d in calls(steps=3, rows=1)]
    kept = [r.clone() for r in results]
    stage(torch.randn(5, 4), w, cache, torch.tensor([0]))
    assert all(torch.equal(r, k) for r, k in zip(results, kept, strict=True))
    assert results[1].data_ptr() != results[2].data_ptr()


def test_each_set_of_persistent_inputs_gets_its_own_graph():
    """Two guidance branches, each with its own caches, called in turn: one graph each,
    captured once, each writing its own cache."""
    w = torch.randn(4, 4)
    stage = graphed(chunk_fn, KINDS)
    caches = [torch.zeros(3, 4), torch.zeros(3, 4)]
    eager = [torch.zeros(3, 4), torch.zeros(3, 4)]
    d = torch.tensor([1])
    for x, _ in calls(steps=4, rows=1):
        for branch in (0, 1):
            got = stage(x + branch, w, caches[branch], d)
            expected = chunk_fn(x + branch, w, eager[branch], d)
            assert torch.equal(got[0], expected[0])
    assert stage.captures == 2 and len(stage.graphs) == 2
    assert torch.equal(caches[0], eager[0]) and torch.equal(caches[1], eager[1])


def test_a_persistent_input_that_moved_runs_eagerly_then_is_captured():
    w, d = torch.randn(4, 4), torch.tensor([1])
    stage = graphed(chunk_fn, KINDS)
    first_cache = torch.zeros(3, 4)
    for x, _ in calls(steps=2, rows=1):
        stage(x, w, first_cache, d)
    assert stage.captures == 1
    new_cache = torch.zeros(3, 4)  # caches allocated anew
    for x, _ in calls(steps=3, rows=1):
        out = stage(x, w, new_cache, d)
        assert torch.equal(new_cache[1], x.sum(0))
        assert torch.equal(out[0], x @ w + new_cache.sum(0))
    assert stage.captures == 2


def test_a_failing_capture_warns_and_the_stage_runs_as_is():
    def broken(fn, args, pool):
        raise RuntimeError("operation not permitted when stream is capturing")

    w, cache = torch.randn(4, 4), torch.zeros(3, 4)
    stage = graphed(chunk_fn, KINDS, capture=broken)
    x, d = torch.randn(5, 4), torch.tensor([0])
    stage(x, w, cache, d)
    with pytest.warns(UserWarning, match="stage 0 runs without CUDA graphs.*capture failed.*"
                                         "stream is capturing"):
        out = stage(x, w, cache, d)
    assert torch.equal(out[0], x @ w + cache.sum(0)) and not stage.enabled


def strict_fn(scale, shift, x):
    """Like an Inductor stage, which asserts the sizes and strides it was compiled for:
    `scale` a column slice of a wider projection (adaLN's chunks), `shift` a broadcast."""
    torch._C._dynamo.guards.assert_size_stride(scale, (2, 4), (12, 1))
    torch._C._dynamo.guards.assert_size_stride(shift, (2, 4), (0, 1))
    return [x * (1 + scale) + shift]


def strided_inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    projection = torch.randn(2, 12, generator=g)
    shift = torch.randn(4, generator=g).expand(2, 4)
    return projection[:, 4:8], shift, torch.randn(2, 4, generator=g)


def test_copied_inputs_keep_their_strides_in_the_graph():
    """A graph's input buffers have the strides the stage was compiled for: a contiguous
    copy of a column slice failed Inductor's stride assertion at capture on a GPU."""
    stage = graphed(strict_fn, [COPIED, COPIED, COPIED])
    for seed in range(4):
        scale, shift, x = strided_inputs(seed)
        got = stage(scale, shift, x)
        assert torch.equal(got[0], strict_fn(scale, shift, x)[0])
    assert stage.enabled and stage.captures == 1


def test_inputs_of_other_strides_get_their_own_graph():
    def fn(x):
        return [x * 2]

    stage = graphed(fn, [COPIED])
    wide = torch.randn(2, 12)
    for x in (wide[:, :4], wide[:, :4], wide[:, :4].contiguous(), wide[:, :4].contiguous()):
        assert torch.equal(stage(x)[0], x * 2)
    assert stage.captures == 2 and len(stage.graphs) == 2


def test_an_input_whose_elements_overlap_is_not_graphed():
    def fn(x):
        return [x + 1]

    stage = graphed(fn, [COPIED])
    base = torch.arange(6.0)
    windows = base.as_strided((3, 4), (1, 1))  # rows share elements (a sliding window)
    stage(windows)
    with pytest.warns(UserWarning, match=r"input 0 has overlapping strides \(1, 1\)"):
        out = stage(windows)
    assert torch.equal(out[0], windows + 1) and not stage.enabled


def test_a_large_host_input_is_not_baked_into_a_graph():
    def fn(x, table):
        return [x + table.sum()]

    stage = graphed(fn, [COPIED, HOST])
    table = torch.ones(100)
    stage(torch.ones(2), table)  # the first call runs eagerly, the second would capture
    with pytest.warns(UserWarning, match=r"input 1 \(shape \(100,\) on cpu\) is read on the host"):
        out = stage(torch.ones(2), table)
    assert torch.equal(out[0], torch.full((2,), 101.0))


def dit_calls(steps: int = 4) -> list[tuple]:
    """Two generations of `steps` steps with a falling timestep, each step two calls
    (guidance: two branches, each with its own caches); inputs vary per call."""
    latents, _, labels = dit_inputs(TinyDiT(grid=8), 8)
    return [(latents + 0.1 * g + 0.01 * i + branch, t.round().long()[None], labels + branch)
            for g in range(2) for i, t in enumerate(torch.linspace(900, 100, steps))
            for branch in (0, 1)]


def lm_calls(calls: int = 4) -> list[tuple]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(1, 16, 32, generator=g),) for _ in range(calls)]


def outputs(make_model, calls: list[tuple], **options) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = make_model().eval()
    compiled = torch.compile(model, backend="tokpipe", options={**OPTIONS, **options},
                             dynamic=False)
    with torch.no_grad():
        return [compiled(*args) for args in calls]


@pytest.mark.parametrize("make_model, calls, mode, graphs", [
    # per stage: the whole sequence (second generation's warmup) and 4 chunks, 2 branches
    (lambda: TinyDiT(depth=2, width=32, heads=2, grid=8), dit_calls(), "stale", [2, 2, 8, 8]),
    # causal mode has no warmup: 4 chunks per stage
    (lambda: TinyCausalLM(depth=2, width=32, heads=2), lm_calls(), "causal", [4, 4]),
], ids=["dit-stale-guidance", "lm-causal"])
def test_a_pipeline_with_graphed_stages_gives_the_same_bits(monkeypatch, make_model, calls,
                                                           mode, graphs):
    """Every stage of a two-stage pipeline graphed (weights and caches in place, chunk
    descriptors as host keys), over several calls: the same bits as without graphs."""
    made: list[GraphedStage] = []

    def emulated(self, fn, inputs):
        made.append(GraphedStage(fn, self.input_kinds(), str(self.graph.index), device="cpu",
                                 capture=emulated_capture, new_pool=lambda: None))
        return made[-1]

    monkeypatch.setattr(stage_module.StageProgram, "_graphed", emulated)
    expected = outputs(make_model, calls, mode=mode)
    got = outputs(make_model, calls, mode=mode, cuda_graphs=True)
    assert all(torch.equal(e, g) for e, g in zip(expected, got, strict=True))
    assert sorted(len(s.graphs) for s in made) == graphs
    # a new generation zeroes the caches in place: no chunk is captured twice
    assert all(s.captures == len(s.graphs) for s in made)
    kinds = made[-1].kinds
    assert kinds.count(HOST) == 1 and PERSISTENT in kinds and COPIED in kinds


def test_cuda_graphs_on_cpu_inputs_warn_once_per_stage_and_run_without():
    torch.manual_seed(0)
    model = TinyDiT(depth=2, width=32, heads=2, grid=8).eval()
    compiled = torch.compile(model, backend="tokpipe", dynamic=False,
                             options={**OPTIONS, "cuda_graphs": True})
    latents, t, labels = dit_inputs(model, 8)
    with pytest.warns(UserWarning) as caught:
        out = compiled(latents, t, labels)  # the whole sequence (warmup)
        compiled(latents, t - 1, labels)  # chunked: another chunk length, no new warning
    refused = [str(w.message) for w in caught if "without CUDA graphs" in str(w.message)]
    assert len(refused) == 2 and all("not on a CUDA device" in m for m in refused)
    torch.testing.assert_close(out, model(latents, t, labels), rtol=1e-5, atol=1e-6)


def test_cuda_capture_records_on_a_side_stream_without_a_device_sync(monkeypatch):
    """The capture sequence, against a recording stand-in for torch.cuda (no GPU here):
    the side stream waits for the caller, captures in thread-local mode into the pool, and
    the caller waits for the side stream; nothing synchronises the device."""
    from contextlib import contextmanager

    from tokpipe_compiler.runtime import cuda_graphs

    log = []

    class Stream:
        def __init__(self, name="side"):
            self.name = name

        def wait_stream(self, other):
            log.append(f"{self.name} waits {other.name}")

    class Graph:
        def capture_begin(self, pool=None, capture_error_mode="global"):
            log.append(f"begin pool={pool} mode={capture_error_mode}")

        def capture_end(self):
            log.append("end")

        def replay(self):
            log.append("replay")

    @contextmanager
    def on(stream):
        log.append(f"on {stream.name}")
        yield

    caller = Stream("caller")
    fake = type("FakeCuda", (), {
        "CUDAGraph": Graph, "Stream": lambda device: Stream(), "stream": on,
        "current_stream": lambda: caller, "current_device": lambda: 0,
        "synchronize": lambda: log.append("SYNC"),
    })
    monkeypatch.setattr(cuda_graphs.torch, "cuda", fake)
    monkeypatch.setattr(cuda_graphs, "_capture_streams", {})

    def fn(x):
        log.append("fn")
        return [x + 1]

    replay, outputs = cuda_graphs.cuda_capture(fn, [torch.zeros(2)], pool="P")
    replay()
    assert log == ["side waits caller", "on side", "begin pool=P mode=thread_local", "fn",
                   "end", "caller waits side", "replay"]
    assert torch.equal(outputs[0], torch.ones(2))
