"""CUDA graphs per chunk: a stage's kernels for one chunk launched by one graph replay.

At DiT widths a stage on a GPU is bound by launching its kernels from Python: a chunk
pass costs about what a whole pass costs (BENCHMARKS.md, "Chunking overhead on the GPU"),
so chunking multiplies the launch cost. A graph captured once per chunk replays all of a
chunk's launches for the cost of one.

A replay runs the captured kernels on the captured addresses, so the wrapper keeps every
input where the graph reads it:
- persistent inputs (weights, K/V and partial-sum caches) are read and written in place.
  Their addresses are part of the key: each guidance branch's caches get their own graphs,
  and caches that moved get new ones (the least recently used graphs beyond MAX_GRAPHS
  are dropped).
- per-call inputs (the chunk's tokens, boundary values, conditioning) are copied into the
  graph's own input buffers before each replay. A buffer has its input's strides (an
  Inductor stage asserts the strides it was compiled for: a column slice of the adaLN
  projection is not contiguous), and the strides are part of the key.
- host inputs (the chunk descriptor, read on the host by the runtime ops) are baked into
  the capture: their values are part of the key, so a stage has one graph per chunk (the
  descriptor holds the chunk's start and the cache it may see).
- outputs live in the graph's buffers, which its next replay overwrites: each replay
  returns copies (a value sent to another rank may still be in flight, and the executor
  keeps two steps of values).

A key's first call runs eagerly (lazy initialisation and Triton autotuning cannot be
captured; its result is real and returned), the second captures and replays, later calls
replay. All graphs of one stage share a memory pool: they replay one at a time and only
their (kept) output buffers outlive a replay.

The capture runs on a side stream with thread-local capture mode and no device-wide
synchronisation: NCCL's receives, posted ahead of need, may still be pending on other
streams (a device sync would wait for a peer that is itself waiting), and its watchdog
thread queries events while a capture runs.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import Any

import torch

from tokpipe_compiler.core.warn import warn

# A host tensor of more values than this is data, not a descriptor: not graphed.
MAX_HOST_VALUES = 64
# Graphs kept per stage and chunk length: chunks x guidance branches, with room to spare.
MAX_GRAPHS = 128

StageFn = Callable[..., Sequence[torch.Tensor]]
Replay = Callable[[], None]
# capture(fn, args, pool) -> (replay, output buffers); the outputs hold the results only
# after replay() (a CUDA capture records kernels without running them).
Capture = Callable[[StageFn, list, Any], tuple[Replay, list[torch.Tensor]]]


class NotGraphable(Exception):
    """A call this wrapper cannot capture; the message says why."""


def cuda_capture(fn: StageFn, args: list, pool: Any) -> tuple[Replay, list[torch.Tensor]]:
    graph = torch.cuda.CUDAGraph()
    caller, side = torch.cuda.current_stream(), _capture_stream(torch.cuda.current_device())
    side.wait_stream(caller)  # the inputs copied for the capture are ready
    with torch.cuda.stream(side):
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            outputs = list(fn(*args))
        finally:
            graph.capture_end()
    caller.wait_stream(side)
    return graph.replay, outputs


_capture_streams: dict[int, Any] = {}


def _capture_stream(device: int) -> Any:
    """One side stream per device for every capture: whatever a library initialises per
    stream on first use (cuBLAS workspaces) is then set up once, at the first capture."""
    if device not in _capture_streams:
        _capture_streams[device] = torch.cuda.Stream(device)
    return _capture_streams[device]


def new_cuda_pool() -> Any:
    return torch.cuda.graph_pool_handle()


HOST, PERSISTENT, COPIED = "host", "persistent", "copied"  # how a graph sees an input


@dataclass
class _Graph:
    replay: Replay
    args: list  # what the capture read: own buffers (copied), persistent tensors, host values
    outputs: list[torch.Tensor]
    # per copied input: the buffer's view that replays write, and the broadcast dims to skip
    writes: dict[int, tuple[torch.Tensor, tuple[int, ...]]]


class GraphedStage:
    """Calls `fn` (one stage at one chunk length) through one graph per key.

    `kinds[i]` says how input i reaches the graph: HOST (a small host tensor the ops read
    on the host, baked into the capture and part of the key), PERSISTENT (read and written
    in place: weights, caches) or COPIED (into the graph's own buffer before each replay).
    `device` is where the graph runs; `name` names the stage in warnings. On any capture
    failure the stage warns once and runs eagerly from then on.
    """

    def __init__(self, fn: StageFn, kinds: Sequence[str], name: str, device: str = "cuda",
                 capture: Capture = cuda_capture, new_pool: Callable[[], Any] = new_cuda_pool):
        self.fn = fn
        self.kinds = list(kinds)
        self._persistent, self._copied, self._host = (
            [i for i, k in enumerate(kinds) if k == kind] for kind in (PERSISTENT, COPIED, HOST))
        self._pick_persistent = _picker(self._persistent)
        self.name = name
        self.device = device
        self.capture = capture
        self.new_pool = new_pool
        self.pool: Any = None
        self.graphs: OrderedDict[tuple, _Graph] = OrderedDict()  # least recently used first
        self.seen: set[tuple] = set()  # keys whose eager first call has run
        self.enabled = True
        self.captures = 0  # graphs captured, recaptures included (for tests and reports)

    def __call__(self, *inputs: Any) -> Sequence[torch.Tensor]:
        if not self.enabled:
            return self.fn(*inputs)
        key = self.key(inputs)
        graph = self.graphs.get(key)
        if graph is not None:
            self.graphs.move_to_end(key)
            return self._replay(graph, inputs)
        if key not in self.seen:
            if len(self.seen) >= 4 * MAX_GRAPHS:
                self.seen.clear()
            self.seen.add(key)
            return self.fn(*inputs)
        try:
            self._check(inputs)
            graph = self._capture(inputs)
        except NotGraphable as e:
            return self._give_up(str(e), inputs)
        except Exception as e:  # whatever the capture trips on, the stage still runs
            return self._give_up(f"capture failed: {type(e).__name__}: {e}", inputs)
        self.graphs[key] = graph
        if len(self.graphs) > MAX_GRAPHS:
            self.graphs.popitem(last=False)
        return self._replay(graph, inputs)

    def key(self, inputs: Sequence[Any]) -> tuple:
        """What a graph is specific to: which persistent tensors it reads (by identity: a
        graph holds them, so an identity is never reused while it lives), the shapes and
        dtypes of copied inputs, and host values. Cheap: a stage has hundreds of weights."""
        return (tuple(map(id, self._pick_persistent(inputs))),
                tuple(_copied_key(inputs[i]) for i in self._copied),
                tuple(_host_key(inputs[i]) for i in self._host))

    def _check(self, inputs: Sequence[Any]) -> None:
        """Raises NotGraphable for inputs a graph cannot take (checked once per capture)."""
        for i, (kind, x) in enumerate(zip(self.kinds, inputs, strict=True)):
            if not isinstance(x, torch.Tensor):
                continue
            if kind == HOST and (x.device.type != "cpu" or x.numel() > MAX_HOST_VALUES):
                raise NotGraphable(f"input {i} (shape {tuple(x.shape)} on {x.device}) is "
                                   "read on the host: its values would be baked in")
            if kind != HOST and x.device.type != self.device:
                raise NotGraphable(f"input {i} is on {x.device}, not {self.device}")

    def _capture(self, inputs: Sequence[Any]) -> _Graph:
        if self.pool is None:
            self.pool = self.new_pool()
        args, writes = list(inputs), {}
        for i, (kind, x) in enumerate(zip(self.kinds, inputs, strict=True)):
            if not isinstance(x, torch.Tensor) or kind == PERSISTENT:
                continue
            args[i] = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)
            view, dims = _writable(args[i], i)
            view.copy_(_narrow(x, dims))
            if kind == COPIED:
                writes[i] = view, dims
        replay, outputs = self.capture(self.fn, args, self.pool)
        self.captures += 1
        return _Graph(replay, args, outputs, writes)

    def _replay(self, graph: _Graph, inputs: Sequence[Any]) -> list[torch.Tensor]:
        for i, (view, dims) in graph.writes.items():  # a few per chunk, not the weights
            view.copy_(_narrow(inputs[i], dims))
        graph.replay()
        return [out.clone() for out in graph.outputs]

    def _give_up(self, reason: str, inputs: Sequence[Any]) -> Sequence[torch.Tensor]:
        warn(f"tokpipe: cuda_graphs: stage {self.name} runs without CUDA graphs "
             f"({reason})")
        self.enabled = False
        self.graphs.clear()
        return self.fn(*inputs)


def _picker(indices: list[int]) -> Callable[[Sequence[Any]], tuple]:
    """A function returning the items at `indices` of a sequence, as a tuple."""
    if not indices:
        return lambda _: ()
    pick = itemgetter(*indices)
    return (lambda xs: (pick(xs),)) if len(indices) == 1 else pick


def _copied_key(x: Any) -> tuple:
    if isinstance(x, torch.Tensor):
        return tuple(x.shape), x.stride(), x.dtype
    return ("value", x)


def _broadcast_dims(x: torch.Tensor) -> tuple[int, ...]:
    """Dims along which `x` repeats one element (stride 0, as `expand` makes them)."""
    return tuple(d for d in range(x.dim()) if x.stride(d) == 0 and x.shape[d] > 1)


def _narrow(x: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    for d in dims:
        x = x.narrow(d, 0, 1)
    return x


def _writable(buffer: torch.Tensor, index: int) -> tuple[torch.Tensor, tuple[int, ...]]:
    """The view of `buffer` a copy can write (one element of each broadcast dim: writing
    it sets them all) and those dims; NotGraphable if other elements share memory."""
    dims = _broadcast_dims(buffer)
    view = _narrow(buffer, dims)
    if _overlaps(view):
        raise NotGraphable(f"input {index} has overlapping strides {buffer.stride()}")
    return view, dims


def _overlaps(x: torch.Tensor) -> bool:
    """Whether two elements of `x` may share memory. With dims ordered by stride, each must
    step past everything the smaller ones reach: a layout that passes cannot overlap (a
    few exotic ones that fail do not either; they are not graphed)."""
    span = 1  # elements from the first to the last one the smaller dims reach, plus one
    pairs = zip(x.stride(), x.shape, strict=True)
    for stride, size in sorted((st, s) for st, s in pairs if s > 1):
        if stride < span:
            return True
        span += stride * (size - 1)
    return False


def _host_key(x: Any) -> tuple:
    if isinstance(x, torch.Tensor) and x.numel() <= MAX_HOST_VALUES:
        return x.dtype, tuple(x.shape), tuple(x.flatten().tolist())
    return ("value", x) if not isinstance(x, torch.Tensor) else (id(x),)
