"""What the driver asks the cost model while it plans: node weights for partition, each
stage's Cost, predicted stage times for chunks="auto", and what a sent byte is worth."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.fx

from tokpipe_compiler.core.fx import example_value
from tokpipe_compiler.costmodel import calibrate
from tokpipe_compiler.costmodel.chunk_choice import StageTime
from tokpipe_compiler.costmodel.cost import Cost, graph_cost, node_cost
from tokpipe_compiler.costmodel.hardware import LINKS
from tokpipe_compiler.costmodel.host import planning_host, runtime_host
from tokpipe_compiler.passes.partition import Partition
from tokpipe_compiler.passes.weight_transforms import transform_stages


def flops_weight(tokens: int, chunk_tokens: int,
                 text: float = 1.0) -> Callable[[torch.fx.Node], float]:
    """A node's FLOPs on one chunk of `chunk_tokens` attending over all `tokens` that
    computes `text` of the text segments (`cost.TEXT`)."""
    return lambda node: node_cost(node, tokens).at(chunk_tokens, tokens, 0, text)[0]


def stage_costs(cut: Partition, stages: int, tokens: int) -> list[Cost]:
    """Each stage's Cost: its token nodes and the weight transforms it computes at each
    chunk (a GGUF weight unpacked: `passes/weight_transforms.py`). Call before
    chunk_attention: it replaces the attention nodes."""
    members: list[list[torch.fx.Node]] = [[] for _ in range(stages)]
    for node in cut.order:
        members[cut.stage_of[node]].append(node)
    if cut.order:
        gm = cut.order[0].graph.owning_module
        for node, stage in transform_stages(gm, cut.stage_of).items():
            members[stage].append(node)
    return [graph_cost(nodes, tokens) for nodes in members]


def token_device(token_input: torch.fx.Node) -> str:
    """The device the token input lives on."""
    value = example_value(token_input)
    return str(value.device) if isinstance(value, torch.Tensor) else "cpu"


def device_rates(token_input: torch.fx.Node) -> tuple[str, calibrate.DeviceRates]:
    """The device the token input lives on and its calibrated rates."""
    device = token_device(token_input)
    return device, calibrate.load_or_measure(device)


def stage_times(cut: Partition, stages: int, tokens: int, token_input: torch.fx.Node,
                cuda_graphs: bool = False) -> list[StageTime]:
    """Seconds per chunk of each stage of `cut`, at the rates of the token input's device,
    and at least the host's time per call there (costmodel/host.py)."""
    device, rates = device_rates(token_input)
    host = planning_host(device, cuda_graphs)
    return [host.bound(calibrate.time_fn(cost, rates), cost.launches_at)
            for cost in stage_costs(cut, stages, tokens)]


def launch_bound(costs: list[Cost], chunk_tokens: int, tokens: int,
                 token_input: torch.fx.Node) -> list[tuple[int, float, float]]:
    """(stage, host s, device s) of each stage whose chunk of `chunk_tokens` takes its
    host longer to launch, kernel by kernel, than its device to run, on a CUDA device."""
    if not token_device(token_input).startswith("cuda"):
        return []  # before the rates: a CPU plan reads none for this
    device, rates = device_rates(token_input)
    host = runtime_host(device, cuda_graphs=False)
    timed = [(s, host.call_seconds(cost.launches), calibrate.seconds(cost, rates, chunk_tokens,
                                                                      tokens))
             for s, cost in enumerate(costs)]
    return [(s, launching, running) for s, launching, running in timed if launching > running]


def send_cost(token_input: torch.fx.Node) -> float:
    """FLOPs one byte sent between ranks is worth: the device's matrix rate over the link's
    bandwidth (gloo on a CPU copies through memory; GPUs are assumed on PCIe, the slower
    case). Zero when every stage runs in this process."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return 0.0
    device, rates = device_rates(token_input)
    if device.startswith("cuda"):
        return rates.matmul_flops / LINKS["pcie4"].bandwidth
    return rates.matmul_flops / rates.mem_bandwidth
