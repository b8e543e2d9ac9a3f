"""SPEC strings of the command line: what model to inspect, with example inputs.

    released:flux1-dev [--layers N] [--grid H W]            a released config (bundled, or
    released:path/to/config.json                            a file in their format): its
                                                            widths, inputs as its pipeline
                                                            passes them
    diffusers:DiTTransformer2DModel [--config config.json]   a diffusers class; inputs are
                                                            made from its config (a config
                                                            in the released format is read
                                                            as released:config.json)
    my_models:tiny_dit                                      a function returning
                                                            (model, args, kwargs)
    path/to/file.py:tiny_dit                                the same, from a file
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tokpipe_compiler.cli_released import (
    ReleasedBuild,
    check_same_class,
    is_released_file,
    load_released,
)

EXAMPLES = """examples:
  tokpipe inspect released:flux1-dev --stages 4 --chunks auto      (full size, no memory)
  tokpipe inspect released:sd3-medium --layers 2 --grid 32 32 --run 5
  tokpipe inspect diffusers:DiTTransformer2DModel --config dit.json --stages 2 --chunks 4
  tokpipe inspect my_models:tiny_dit --stages 2 --chunks 4 --mode stale --out plan_dump
      (my_models.py defines tiny_dit() returning (model, args, kwargs))
  tokpipe inspect path/to/models.py:tiny_dit --stages 4 --chunks 8"""

Loaded = tuple[torch.nn.Module, tuple, dict]


class SpecError(ValueError):
    """A SPEC that names nothing usable; the message says why and shows examples."""

    def __init__(self, message: str):
        super().__init__(f"{message}\n{EXAMPLES}")


def load_spec(spec: str, config: str | None = None, build: ReleasedBuild | None = None,
              run: bool = False) -> Loaded:
    """(model in eval mode, args, kwargs) for a SPEC. `build`: the depth, grid and dtype of
    a released model; `run`: the model will run (real weights), not only be planned."""
    source, sep, name = spec.partition(":")
    if not sep or not source or not name:
        raise SpecError(f"SPEC {spec!r} is not 'released:name', 'diffusers:ClassName' or "
                        "'module:function'")
    if source == "diffusers" and config is not None and is_released_file(config):
        check_same_class(name, config)
        source, name, config = "released", config, None
    if source == "released":
        if config is not None:
            raise SpecError("--config applies to diffusers:ClassName specs; a released "
                            "spec names its config (released:name or released:file.json)")
        return load_released(name, build or ReleasedBuild(), run)
    if build is not None and build != ReleasedBuild():
        raise SpecError("--layers, --grid and --dtype apply to released models only "
                        "(released:name, or diffusers:ClassName --config in the released "
                        "format)")
    if source == "diffusers":
        return _diffusers(name, config)
    if config is not None:
        raise SpecError("--config applies to diffusers:ClassName specs only")
    return _function(source, name)


# ---- module:function --------------------------------------------------------------------


def _function(source: str, name: str) -> Loaded:
    module = _import(source)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise SpecError(f"{source!r} has no function {name!r}")
    result = fn()
    if not (isinstance(result, tuple) and len(result) == 3
            and isinstance(result[0], torch.nn.Module)):
        raise SpecError(f"{source}:{name}() must return (model, args, kwargs), got "
                        f"{type(result).__name__}")
    model, args, kwargs = result
    return model.eval(), tuple(args), dict(kwargs or {})


def _import(source: str):
    if source.endswith(".py"):
        path = Path(source)
        if not path.is_file():
            raise SpecError(f"no file {source!r}")
        folder = str(path.resolve().parent)
        if folder not in sys.path:
            sys.path.insert(0, folder)  # as `python file.py` does: its imports beside it
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except ImportError as err:
            raise SpecError(f"{source} failed to import {err.name or ''}: {err} (the "
                            f"file's folder {folder} is on the path; set PYTHONPATH for "
                            "modules elsewhere)") from err
        return module
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` does: modules beside the user
    try:
        return importlib.import_module(source)
    except ModuleNotFoundError as err:
        raise SpecError(f"cannot import {source!r}: {err}") from err


# ---- diffusers:ClassName ----------------------------------------------------------------

BATCH, TEXT_TOKENS, TIMESTEP = 1, 8, 500


def _diffusers(name: str, config_path: str | None) -> Loaded:
    try:
        import diffusers
    except ImportError as err:
        raise SpecError("diffusers is not installed (pip install diffusers)") from err
    cls = getattr(diffusers, name, None)
    if not (inspect.isclass(cls) and issubclass(cls, torch.nn.Module)):
        raise SpecError(f"diffusers has no model class {name!r}")
    config = _json(Path(config_path)) if config_path else {}
    model = (cls.from_config(config) if config else cls()).eval()
    args, kwargs = diffusers_inputs(model)
    return model, args, kwargs


def diffusers_inputs(model: torch.nn.Module) -> tuple[tuple, dict]:
    """Example inputs from the model's config, by forward() parameter name."""
    cfg = dict(model.config)
    kwargs = {}
    for pname, param in inspect.signature(model.forward).parameters.items():
        if pname in _INPUTS:
            value = _INPUTS[pname](cfg)
            if value is not _SKIP:
                kwargs[pname] = value
        elif param.default is inspect.Parameter.empty and param.kind not in (
                param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise SpecError(f"cannot make an example for {type(model).__name__}.forward's "
                            f"argument {pname!r}; write a module:function spec that returns "
                            "(model, args, kwargs)")
    return (), kwargs


_SKIP = object()


def _side(cfg: dict) -> tuple[int, int]:
    size = cfg.get("sample_size") or 32
    return (size, size) if isinstance(size, int) else tuple(size)


def _text_width(cfg: dict) -> int | None:
    return (cfg.get("caption_channels") or cfg.get("joint_attention_dim")
            or cfg.get("cross_attention_dim"))


def _text(cfg: dict) -> Any:
    width = _text_width(cfg)
    return torch.randn(BATCH, TEXT_TOKENS, width) if width else _SKIP


def _labels(cfg: dict) -> Any:
    # DiT: class labels index an embedding of num_embeds_ada_norm classes.
    if cfg.get("norm_type") == "ada_norm_zero" and cfg.get("num_embeds_ada_norm"):
        return torch.zeros(BATCH, dtype=torch.long)
    return _SKIP


def _pooled(cfg: dict) -> Any:
    width = cfg.get("pooled_projection_dim")
    return torch.randn(BATCH, width) if width else _SKIP


_INPUTS: dict[str, Callable[[dict], Any]] = {
    "hidden_states": lambda cfg: torch.randn(BATCH, cfg.get("in_channels", 4), *_side(cfg)),
    "timestep": lambda cfg: torch.full((BATCH,), TIMESTEP, dtype=torch.long),
    "class_labels": _labels,
    "encoder_hidden_states": _text,
    "pooled_projections": _pooled,
    "added_cond_kwargs": lambda cfg: {"resolution": None, "aspect_ratio": None},
}


def _json(path: Path) -> dict:
    """A --config file's JSON; not JSON: an error naming the file and the place."""
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise SpecError(f"--config {path}: not valid JSON ({err})") from err
