"""What the ranks of one pipeline agree on before they run: the calibrated rates they plan
with (rank 0's), and at each generation's first call and each ring run a fingerprint of
the options, the plan and the inputs. Both travel over the program's transport, so
every wait is bounded by its timeout and fails with a named error instead of hanging.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable, Collection, Sequence
from dataclasses import astuple, fields
from typing import Any

import torch

from tokpipe_compiler.core.errors import PeerStopped, TokpipeError
from tokpipe_compiler.core.warn import warn
from tokpipe_compiler.costmodel.calibrate import DeviceRates
from tokpipe_compiler.planning.plan import Plan
from tokpipe_compiler.runtime.transport import WHOLE, MessageKey, TensorSpec, as_bytes
from tokpipe_compiler.stage_programs.generations import TIMESTEP_NAMES
from tokpipe_compiler.stage_programs.plan_reads import input_labels
from tokpipe_compiler.stage_programs.weight_values import first_differing

FINGERPRINT_BYTES = 16 * 1024  # fixed, so that ranks that disagree still exchange it
RATES_STEP = -1  # the rates travel before any step's message
FINGERPRINT_STEP = -3  # not a program's call count: ranks' programs may count apart
LEFT = "left"  # a fingerprint's stand-in from a rank whose call raised (`send_leave`)
CALL = "call"  # the parallelized pipeline call a fingerprint belongs to (StepMarks.call)
STEP_COUNTS = ("ring steps", "scheduler steps")  # plan entries a caller adds: steps to run
LATE_PEER = ("The ranks begin each generation together: a rank that has not begun this one "
             "may still be in the last, running steps this rank did not run. Run as many "
             "steps (num_inference_steps) on every rank.")


def exchange_rates(transport, device: str, local: Callable[[], DeviceRates]) -> DeviceRates:
    """Rank 0's rates of `device` (`local()` there) on every rank: rank 0 sends them to each
    other rank, which measures nothing."""
    spec = TensorSpec((len(fields(DeviceRates)),), torch.float64)
    what = f"rank 0's calibrated rates of {device}, which every rank plans with"
    if transport.rank == 0:
        mine = local()
        data = torch.tensor(astuple(mine), dtype=torch.float64, device=transport.device)
        for peer in range(1, transport.world_size):
            transport.send(MessageKey(RATES_STEP, peer, WHOLE, "rates", what), data, peer)
        transport.flush()
        return mine
    key = MessageKey(RATES_STEP, transport.rank, WHOLE, "rates", what)
    values = transport.post_recv(key, 0, spec).wait().cpu().tolist()
    return DeviceRates(*values)


def fingerprint(plan: Plan, calls: Sequence[tuple]) -> dict[str, Any]:
    """What every rank must share, as plain data: the options (but the timeout), the plan's
    layout and graphs, the shapes and dtypes of the inputs of the first of `calls` and
    checksums of the user's over every call (a ring's steps)."""
    args = calls[0]
    names = input_labels(plan)
    token = plan.graphs.input_names.index(plan.token_input)
    user = {names[i]: arg for i, arg in enumerate(args) if names[i] is not None}
    weights = [_describe(arg) for i, arg in enumerate(args) if names[i] is None]
    graphs = [plan.graphs.prelude.code, *(stage.gm.code for stage in plan.graphs.stages)]
    return {
        "options": {k: repr(v) for k, v in plan.config.as_dict().items() if k != "timeout"},
        "plan": {"stages": len(plan.stages), "units": plan.units, "tokens": plan.tokens,
                 "chunks": [c.units for c in plan.chunks], "token input": plan.token_input,
                 "graphs": _crc("\n".join(graphs))},
        "inputs": {name: _describe(arg) for name, arg in user.items()},
        "weights": _crc(json.dumps(weights)),
        "token": str(names[token]),
        "checksums": _checksums(names, calls),
    }


def exchange_fingerprints(transport, mine: dict[str, Any], when: str) -> list[dict[str, Any]]:
    """Every rank's fingerprint, in rank order. Messages have a fixed size and key, so
    that ranks meet whatever each has run before (one rank's program may be new, another's
    have run generations), and each pair posts in one order (the lower rank sends first),
    which NCCL needs and gloo accepts. In a parallelized pipeline's call (`CALL`), what is
    left of an earlier call (a peer's check this rank never took, a leave) is passed over,
    and a peer's leave of this call (`send_leave`) raises PeerStopped once the exchange is
    done, so that no message is left waiting."""
    rank, world = transport.rank, transport.world_size
    spec = TensorSpec((FINGERPRINT_BYTES,), torch.uint8)
    data = _encode(mine).to(transport.device)

    handles = {}
    for peer in range(world):
        if peer == rank:
            continue
        if rank < peer:
            transport.send(_key(peer, when), data, peer)
        handles[peer] = transport.post_recv(_key(rank, when), peer, spec)
        if rank > peer:
            transport.send(_key(peer, when), data, peer)
    received = {}
    for peer, handle in handles.items():
        fp = _decode(handle.wait())
        while _earlier(fp, mine.get(CALL)):
            fp = _decode(transport.post_recv(_key(rank, when), peer, spec).wait())
        received[peer] = fp
    stopped = {peer: fp[LEFT] for peer, fp in received.items() if LEFT in fp}
    transport.let_sends_wait(stopped)  # a peer that left takes this one at its next call
    transport.flush()
    if stopped:
        # a peer that left on a failed wait (a lost rank) may leave no group to run in
        lost = any(reason.startswith(("TransportError", "GroupClosed"))
                   for reason in stopped.values())
        raise PeerStopped(
            f"rank(s) {sorted(stopped)} left this pipeline call, their call raising "
            f"({'; '.join(stopped.values())}); seen here at {when}: this call stops too, "
            + ("and the process group may carry no message after the failure the peer "
               "met (a rank lost): restart the ranks if the next call fails" if lost
               else "and the next one runs as ever"))
    return [mine if r == rank else received[r] for r in range(world)]


def _earlier(fp: dict[str, Any], call: int | None) -> bool:
    """A message of an earlier pipeline call than `call` (None: outside one), or a leave
    met outside a pipeline call."""
    if call is None:  # outside a pipeline call, nothing of one is meant for this exchange
        return LEFT in fp or fp.get(CALL) is not None
    return fp.get(CALL) is not None and fp[CALL] < call


def send_leave(transport, reason: str, call: int) -> None:
    """This rank left pipeline call `call` between per-call steps, its call raising: each
    peer gets, in place of its next fingerprint, a message that stops its call
    (`exchange_fingerprints`) rather than one that never comes. Not flushed: a peer whose
    call was over takes it at its next exchange, which passes it over."""
    data = _encode({LEFT: reason, CALL: call}).to(transport.device)
    for peer in range(transport.world_size):
        if peer != transport.rank:
            transport.send(_key(peer, "a peer's leaving"), data, peer)


def _key(dst: int, when: str) -> MessageKey:
    what = f"the fingerprint of {when} (options, plan, inputs)"
    return MessageKey(FINGERPRINT_STEP, dst, WHOLE, "fingerprint", what)


def pipeline_entry(scheduler: Any, ring: bool) -> dict[str, str]:
    """What a parallelized pipeline's ranks must share beyond the transformer's program:
    the scheduler (class and configuration) and whether the call runs as a ring."""
    config = json.dumps(_public(dict(getattr(scheduler, "config", {}))), sort_keys=True,
                        default=str)
    return {"scheduler": f"{type(scheduler).__name__} (configuration {_crc(config)})",
            "runs": "as a ring" if ring else "per call"}


def _public(config: dict[str, Any]) -> dict[str, Any]:
    """A configuration as every process spells it: without diffusers' bookkeeping keys
    ("_use_default_values" lists a set, in an order that string hashing makes differ
    between processes that torchrun starts; "_name_or_path" is where it was loaded from),
    sets sorted."""
    def canonical(value: Any) -> Any:
        if isinstance(value, (set, frozenset)):
            return sorted(map(canonical, value), key=repr)
        if isinstance(value, dict):
            return {str(k): canonical(v) for k, v in value.items()}
        return value

    return {k: canonical(v) for k, v in config.items() if not str(k).startswith("_")}


def check_agreement(every: list[dict[str, Any]], when: str,
                    parameters: Sequence[str] = ()) -> None:
    """Raises if the ranks' fingerprints differ in anything that shapes the messages, in
    the parameters' values or in the token input's; warns if only other inputs' values
    differ. `when`: the call they were taken at; `parameters`: the names of the parameters
    in the fingerprint's digests; both for the messages."""
    pipeline = _differences("pipeline", [fp.get("pipeline", {}) for fp in every])
    if pipeline:  # named first: the programs' other differences follow from it
        raise TokpipeError(
            f"the ranks' pipelines differ at {when}:\n  " + "\n  ".join(pipeline) + "\n"
            "Every rank must run the same pipeline, with the same scheduler and configuration "
            "(one that runs per call on one rank and as a ring on another cannot meet).")
    differences = [line for part in ("options", "plan", "inputs")
                   for line in _differences(part, [fp[part] for fp in every])]
    inputs_differ = bool(_differing([fp["inputs"] for fp in every]))
    if any(fp["weights"] != every[0]["weights"] for fp in every) and not inputs_differ:
        # with other input shapes, buffers sized by the inputs (a positional table) differ
        # as a consequence: named, they would send the reader to the checkpoint
        differences.append("weights: the parameters or buffers the graphs read differ "
                           "between ranks in number, shape or dtype (another checkpoint, or "
                           "adapters loaded, enabled or disabled on one rank only: LoRA's "
                           "disable_lora, set_adapters)")
    if any(line.startswith("plan 'graphs'") for line in differences):
        differences.append("(the traced graphs differ: a constant they hold, a Python "
                           "number the model or step reads, a global or closure value such "
                           "as a guidance scale, a module's attribute or an attention "
                           "processor's setting such as set_ip_adapter_scale's, or the code "
                           "itself)")
    if differences:
        raise TokpipeError(
            f"the ranks disagree at {when} of a pipelined program, so they cannot run "
            "one pipeline:\n  " + "\n  ".join(differences) + "\nEvery rank must compile the "
            "same model with the same options and call it with inputs of the same shapes "
            "and dtypes" + (", and run as many steps (num_inference_steps)."
                            if _differ(every, STEP_COUNTS) else "."))
    _check_parameter_values([fp.get("weight values", "") for fp in every], parameters)
    checksums = [fp["checksums"] for fp in every]
    differing = _differing(checksums)
    sums = _differences("checksums", checksums)
    token = every[0]["token"]
    if token in differing:
        raise TokpipeError(
            f"the token input {_token_name(token)} has other values on other ranks, but "
            "every rank must "
            "be called with the same inputs:\n  " + "\n  ".join(sums) + "\nSeed the random "
            "generator identically on every rank before drawing the latents (a pipeline's "
            "generator=torch.Generator().manual_seed(seed), or torch.manual_seed(seed) "
            "before drawing them yourself), or draw them on one rank and broadcast them.")
    schedule = _differences("checksums", checksums, SCHEDULE)
    if schedule:
        raise TokpipeError(
            "the ranks run different schedules, so every rank would get one mixed "
            "generation:\n  " + "\n  ".join(schedule) + "\nRun the same scheduler, with "
            "the same configuration (its class, shift, ...), and the same guidance scale on "
            "every rank; pass the same timesteps to a model compiled directly.")
    if sums:
        # named without checksums: the same text at the generation's first call and at
        # its ring run warns once
        warn("inputs differ between ranks (each stage reads its own rank's copy, and "
             "every rank gets the one output they make: another rank's request where only "
             "its stages read them, a mix of requests where several do): "
             + ", ".join(map(_user_name, differing)) + ". Pass the same inputs on every "
             "rank (one request for all, drawn with the same seed or broadcast from rank "
             "0); to stop on this, warnings.filterwarnings('error', 'inputs differ "
             "between ranks') on every rank")


def _check_parameter_values(digests: list[str], parameters: Sequence[str]) -> None:
    """Raises if the ranks hold other values in the model's parameters (`weight_values`)."""
    if len(set(digests)) == 1:
        return
    first = first_differing(digests, len(parameters))
    named = f", {parameters[first]!r} the first of them" if first is not None else ""
    raise TokpipeError(
        f"the ranks hold other values in the model's parameters{named}: each rank would run "
        "its stages with its own, and every rank would get one mixed model's output. Load "
        "the same weights on every rank: the same checkpoint, or a random initialisation "
        "seeded alike (torch.manual_seed(seed) before building the model), and the same "
        "LoRA adapters, fused or set on every rank. Where the weights are alike, the ranks "
        "called different models of one architecture: call the pipelined models (or "
        "pipelines) in the same order on every rank.")


# The step's inputs from the schedule: a ring's timestep, input scale, update coefficients
# and guidance scale, and a timestep passed to a model compiled directly. Ranks that differ
# on them run different generations.
SCHEDULE = frozenset({"scale", "coeffs", "guidance", *TIMESTEP_NAMES})


def _token_name(name: str) -> str:
    """The token input as the caller knows it: a ring's carried `sample` is the latents."""
    return f"{name!r} (the latents)" if name == "sample" else repr(name)


def _user_name(name: str) -> str:
    """An input as the caller knows it: a ring's fixed transformer inputs are the
    transformer's arguments (`input_encoder_hidden_states`)."""
    if name.startswith("input_"):
        return f"the transformer's {name.removeprefix('input_')!r}"
    return repr(name)


def _differ(every: list[dict[str, Any]], fields: Sequence[str]) -> bool:
    """Whether any of the plan's `fields` differs between the ranks."""
    return any(fp["plan"].get(f) != every[0]["plan"].get(f) for fp in every for f in fields)


def _differing(values: list[dict[str, Any]]) -> list[str]:
    """The fields whose value differs between the ranks (a rank's missing one included)."""
    return [field for field in sorted({f for v in values for f in v})
            if any(v.get(field, "missing") != values[0].get(field, "missing") for v in values)]


def _differences(part: str, values: list[dict[str, Any]],
                 among: Collection[str] | None = None) -> list[str]:
    """'<part> <field>: rank 0 <value>, rank 1 <value>' for each field that differs (of
    `among`, where given)."""
    label = {"inputs": "input", "checksums": "input"}.get(part, part)
    what = "checksum " if part == "checksums" else ""
    lines = []
    for field in _differing(values):
        if among is None or field in among:
            ranks = ", ".join(f"rank {r} {v.get(field, 'missing')}" for r, v in enumerate(values))
            lines.append(f"{label} {field!r}: {what}{ranks}")
    return lines


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}"
    return repr(value)


def _checksums(names: list[str | None], calls: list[tuple]) -> dict[str, str]:
    """Each user input's checksum over `calls`: one value's where every call passes the
    same, else a digest of each call's. A value passed to several calls is read once."""
    seen: dict[int, str] = {}
    host = HostViews()

    def checksum(value: Any) -> str:
        if id(value) not in seen:
            seen[id(value)] = _checksum(host.of(value))
        return seen[id(value)]

    sums = {}
    for i, name in enumerate(names):
        if name is not None:
            each = [checksum(call[i]) for call in calls]
            sums[name] = each[0] if len(set(each)) == 1 else _crc(",".join(each))
    return sums


class HostViews:
    """Host copies of device tensors for checksums. A ring's per-step values are views of
    one table on the device: the table comes to the host once, not once a step (each copy
    waits for the device), and each view is read from that copy."""

    def __init__(self, host_too: bool = False):
        self.host_too = host_too  # views of CPU tensors as well (tests)
        self._bases: dict[int, torch.Tensor] = {}

    def of(self, value: Any) -> Any:
        if not isinstance(value, torch.Tensor) or value._base is None or (
                value.device.type == "cpu" and not self.host_too):
            return value
        base = value._base
        if id(base) not in self._bases:
            self._bases[id(base)] = base.detach().cpu()
        on_host = self._bases[id(base)]
        if on_host.stride() != base.stride() or value.dtype != base.dtype:
            return value  # laid out otherwise, or a view as another dtype: copy it alone
        offset = value.storage_offset() - base.storage_offset() + on_host.storage_offset()
        return on_host.as_strided(value.shape, value.stride(), offset)


def _checksum(value: Any) -> str:
    """CRC32 of the bytes (a tensor's on the CPU: once a generation and once a ring run)."""
    if isinstance(value, torch.Tensor):
        return f"{zlib.crc32(as_bytes(value.detach().cpu()).numpy()):08x}"
    return _crc(repr(value))


def _crc(text: str) -> str:
    return f"{zlib.crc32(text.encode()):08x}"


def _encode(fp: dict[str, Any]) -> torch.Tensor:
    """JSON padded to FINGERPRINT_BYTES; a fingerprint too long keeps its digests only."""
    text = json.dumps(fp)
    if len(text.encode()) > FINGERPRINT_BYTES:
        sums = fp["checksums"]
        fp = {k: (v if k in ("plan", "weights", "token", "watches", CALL)
                  else _crc(v) if k == "weight values" else _crc(json.dumps(v)))
              for k, v in fp.items()}
        fp["inputs"] = {"(all, digest)": fp["inputs"]}
        token = fp["token"]
        fp["checksums"] = {token: sums.get(token, ""), "(the others, digest)": fp["checksums"]}
        text = json.dumps(fp)
    data = text.encode().ljust(FINGERPRINT_BYTES)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _decode(data: torch.Tensor) -> dict[str, Any]:
    return json.loads(bytes(data.cpu().numpy()).decode())
