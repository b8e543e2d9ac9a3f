"""The transformer's side of a probed step: how it was called, and what it answers.

At a probed step the transformer does not compute: it returns a random probe shaped like
its real output (found once per call signature by a fake-tensor run), drawn from a seed
every rank shares, and zeros for any other output tensor.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from tokpipe_compiler.core.errors import TokpipeError
from tokpipe_compiler.pipelines.glue import first_tensor, first_value
from tokpipe_compiler.planning.module_attributes import Attributes, plain_attributes

PROBE_SEED = 0x70C  # every rank draws the same probes
FAKE_TENSOR_LOG = "torch._subclasses.fake_tensor"


class RingUnavailable(TokpipeError):
    """Found at a step's probes: ring mode cannot replay this call's loop. Nothing real has
    been computed yet, so the call starts again per call, from the same random state
    (`parallelize`)."""


# diffusers' modular pipelines log every error that leaves a block, with its traceback
_MODULAR_LOG = "diffusers.modular_pipelines.modular_pipeline"


@contextlib.contextmanager
def refusals_unlogged() -> Iterator[None]:
    """Within it, diffusers' modular pipelines do not log a RingUnavailable leaving their
    blocks (a traceback of some 120 lines ahead of the one-line warning that says the call
    starts again per call); other errors they log as ever."""

    def keep(record: logging.LogRecord) -> bool:  # logged while its except clause runs
        return not isinstance(sys.exc_info()[1], RingUnavailable)

    log = logging.getLogger(_MODULAR_LOG)
    log.addFilter(keep)
    try:
        yield
    finally:
        log.removeFilter(keep)


@dataclass(frozen=True)
class Spec:
    """A tensor's shape, dtype and device (a pytree leaf)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    def zeros(self) -> torch.Tensor:
        return torch.zeros(self.shape, dtype=self.dtype, device=self.device)


def probe(structure: Any, step: int, call: int) -> Any:
    """A random answer: one tensor shaped like the first output tensor, or, where the
    output's first value is a list of per-sample predictions (Z-Image), one per item."""
    items = _item_list(structure)
    gen = torch.Generator().manual_seed(PROBE_SEED + 1009 * step + call)
    if items is not None:
        return [torch.randn(i.shape, generator=gen).to(dtype=i.dtype, device=i.device)
                for i in items]
    spec = first_tensor(structure, leaf=Spec)
    drawn = torch.randn(spec.shape, generator=gen)
    if call == 2 and len(spec.shape) > 1 and spec.shape[1] > 1:
        # The second call of a step (calls count from 1; a guidance branch): its even rows
        # along axis 1 near the first call's (1.1 x, plus noise), where guidance moves the
        # prediction little, as a real step's does: a guided norm below the conditional
        # one there tells a rescale clamped to 1 (LongCat's) from one that is not
        # (QwenImage's).
        first_gen = torch.Generator().manual_seed(PROBE_SEED + 1009 * step + 1)
        near = 1.1 * torch.randn(spec.shape, generator=first_gen) + 0.05 * drawn
        rows = torch.arange(spec.shape[1]) % 2 == 0
        drawn = torch.where(rows.reshape(1, -1, *[1] * (len(spec.shape) - 2)), near, drawn)
    return drawn.to(dtype=spec.dtype, device=spec.device)


def _item_list(structure: Any) -> list[Spec] | None:
    """The output's first value where it is a list of same-shaped tensors."""
    structure = first_value(structure)
    if isinstance(structure, list) and structure and all(
            isinstance(i, Spec) and i.shape == structure[0].shape for i in structure):
        return structure
    return None


def with_probe(structure: Any, answer: Any) -> Any:
    """The output structure with the probe as its first tensor (its items, for a list
    of per-sample predictions), zeros for the rest."""
    if isinstance(answer, list):
        items = _item_list(structure)
        leaves, spec = pytree.tree_flatten(structure)
        ids = {id(i) for i in items}
        answers = iter(answer)
        filled = [next(answers) if id(leaf) in ids else leaf.zeros()
                  if isinstance(leaf, Spec) else leaf for leaf in leaves]
        return pytree.tree_unflatten(filled, spec)
    leaves, spec = pytree.tree_flatten(structure)
    first = next(i for i, leaf in enumerate(leaves) if isinstance(leaf, Spec))
    filled = [answer if i == first else leaf.zeros() if isinstance(leaf, Spec) else leaf
              for i, leaf in enumerate(leaves)]
    return pytree.tree_unflatten(filled, spec)


def output_structure(forward: Callable[..., Any], call: dict[str, Any]) -> Any:
    """`forward(**call)`'s output with each tensor as a Spec, from a fake-tensor run. Where
    that fails (inputs that do not fit the transformer, an op fake tensors cannot run),
    from the real call: it raises what the pipeline's own call would raise."""
    weights = _weights(_module_of(forward))
    try:
        out = _fake_forward(forward, call)
    except TokpipeError:
        raise
    except Exception:
        _check_kept(weights)
        with torch.no_grad():
            out = forward(**call)
    _check_kept(weights)
    return pytree.tree_map_only(torch.Tensor,
                                lambda t: Spec(tuple(t.shape), t.dtype, t.device), out)


def fake_run_error(forward: Callable[..., Any], call: dict[str, Any]) -> str | None:
    """Why `forward(**call)` fails on fake tensors (its first line), None if it runs."""
    weights = _weights(_module_of(forward))
    try:
        _fake_forward(forward, call)
    except TokpipeError:
        raise
    except Exception as err:  # any failure of the model's own code on these inputs
        return f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err) else ''}"
    finally:
        _check_kept(weights)
    return None


def fake_run_fits(forward: Callable[..., Any], call: dict[str, Any]) -> bool:
    return fake_run_error(forward, call) is None


def _fake_forward(forward: Callable[..., Any], call: dict[str, Any]) -> Any:
    """`forward(**call)` on fake copies of the call's tensors, fake tensors' logs quiet.
    Code compiled in the model (blocks under diffusers' compile_repeated_blocks) runs
    eagerly: Inductor's kernels would read fake tensors' storage, which they have none of."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    module = _module_of(forward)
    attributes, caches = plain_attributes(module), _caches(module)
    try:
        with _quiet(FAKE_TENSOR_LOG), torch.compiler.set_stance("force_eager"), \
                FakeTensorMode(allow_non_fake_inputs=True) as mode:
            return forward(**pytree.tree_map_only(torch.Tensor, mode.from_tensor, call))
    finally:
        _restore_attributes(attributes)
        _clear_filled(caches)


def _module_of(forward: Callable[..., Any]) -> Any:
    """The module whose forward `forward` is: its bound method's, or the module a diffusers
    hook's `functools.partial(new_forward, module)` passes."""
    module = getattr(forward, "__self__", None)
    if module is None and isinstance(forward, functools.partial):
        module = next((a for a in forward.args if isinstance(a, torch.nn.Module)), None)
    return module


Caches = list[tuple[Any, int]]


def _caches(module: Any) -> Caches:
    """The `functools.lru_cache`s of the methods of `module`'s modules' classes (QwenImage's
    rotary tables; diffusers' `lru_cache_unless_export` holds one in its wrapper's
    closure), with the misses each has had."""
    if not isinstance(module, torch.nn.Module):
        return []
    found: dict[int, Any] = {}
    for cls in {c for owner in module.modules() for c in type(owner).__mro__}:
        for attr in vars(cls).values():
            cells = getattr(attr, "__closure__", None) or ()
            for candidate in (attr, *(cell.cell_contents for cell in cells
                                      if _has_contents(cell))):
                if callable(getattr(candidate, "cache_clear", None)) and \
                        callable(getattr(candidate, "cache_info", None)):
                    found[id(candidate)] = candidate
    return [(cache, cache.cache_info().misses) for cache in found.values()]


def _has_contents(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018 (an empty cell raises)
    except ValueError:
        return False
    return True


def _clear_filled(caches: Caches) -> None:
    """Empties each cache a fake run added entries to: they hold fake tensors, which a
    later real call outside Dynamo (whose trace skips diffusers' caches) would be served."""
    for cache, misses in caches:
        if cache.cache_info().misses != misses:
            cache.cache_clear()


def _restore_attributes(attributes: Attributes) -> None:
    """Puts back each plain attribute a fake run left holding fake tensors: a cache the
    model fills on its first call (Z-Image's rotary table, `rope_embedder.freqs_cis`)
    would otherwise serve fake tensors to every later real call."""
    from torch._subclasses.fake_tensor import is_fake

    for owner, before in attributes:
        for name, value in list(vars(owner).items()):
            if value is before.get(name) or not any(
                    is_fake(t) for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)):
                continue
            if name in before:
                vars(owner)[name] = before[name]
            else:
                del vars(owner)[name]


Weights = list[tuple[torch.nn.Module, str, torch.Tensor, torch.device]]


def _weights(module: Any) -> Weights:
    """Each parameter and buffer of `module`, where it is and on which device."""
    if not isinstance(module, torch.nn.Module):
        return []
    return [(owner, name, tensor, tensor.device) for owner in module.modules()
            for name, tensor in [*owner._parameters.items(), *owner._buffers.items()]
            if tensor is not None]


def _check_kept(weights: Weights) -> None:
    """Raises where a forward run on fake tensors replaced or moved the model's weights (a
    hook that casts or moves them as modules run, which `hook_reasons` did not know)."""
    from torch._subclasses.fake_tensor import is_fake

    changed = [name for owner, name, tensor, device in weights
               if owner._parameters.get(name, owner._buffers.get(name)) is not tensor
               or tensor.device != device or is_fake(tensor)]
    if changed:
        raise TokpipeError(
            f"the transformer's forward, run on fake tensors to learn its outputs, replaced "
            f"or moved {len(changed)} of its weights ({', '.join(changed[:3])}...): something "
            "at its modules' calls (a hook) casts or moves them. The transformer may be left "
            "unusable: load it again, and parallelize with ring=False")


@contextlib.contextmanager
def _quiet(logger: str) -> Iterator[None]:
    """`logger`'s records below CRITICAL dropped (fake tensors log each failing op's
    traceback as an ERROR before raising)."""
    log = logging.getLogger(logger)
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)


def bind_call(forward: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The call's arguments by parameter name (**kwargs spread out), their dicts and lists
    copied: a pipeline may pass one dict to both guidance branches' calls and change it in
    between (Flux's IP-adapter embeds in `joint_attention_kwargs`), after the first call is
    recorded but before the ring reads it. An argument passed as None where its
    parameter defaults to None is left out, as a call that does not pass it (LongCat-Image
    passes `guidance=None` to the conditional branch's call only)."""
    signature = inspect.signature(forward)
    bound = signature.bind(*args, **kwargs)
    arguments = {name: _containers_copied(value) for name, value in bound.arguments.items()
                 if not (value is None and name in signature.parameters
                         and signature.parameters[name].default is None)}
    for name, param in signature.parameters.items():
        if param.kind is inspect.Parameter.VAR_KEYWORD and name in arguments:
            arguments.update(arguments.pop(name))
        elif param.kind is inspect.Parameter.VAR_POSITIONAL and arguments.get(name):
            raise TokpipeError("the transformer's forward takes *args; ring mode needs "
                               "named inputs")
    return arguments


def _containers_copied(value: Any) -> Any:
    """`value` with its dicts, lists and tuples copied, their items (tensors) shared."""
    if type(value) is dict:
        return {k: _containers_copied(v) for k, v in value.items()}
    if type(value) is list:
        return [_containers_copied(v) for v in value]
    if type(value) is tuple:
        return tuple(_containers_copied(v) for v in value)
    return value
