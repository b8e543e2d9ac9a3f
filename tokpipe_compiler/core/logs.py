"""Logging through the standard `logging` module, under the `tokpipe_compiler` logger.

TOKPIPE_LOGS, read at import (in the manner of TORCH_LOGS), is a comma-separated list:

    passes     the graph after each compiler pass, stamped with the pass that made it
               (DEBUG on `tokpipe_compiler.passes`)
    plan       the plan summary whenever a graph is planned (INFO on `tokpipe_compiler.plan`)
    tokpipe    every tokpipe message at INFO; `+tokpipe` at DEBUG (dumps included)

TOKPIPE_LOGS_DIR=DIR also writes each pass dump to DIR/NNN_<pass>.py. Where there are
several ranks (a process group of several, or a launcher's RANK and WORLD_SIZE), each rank
writes to DIR/rank<R>/ and its log lines name it: `[tokpipe_compiler.plan INFO rank 1]`.

    TOKPIPE_LOGS=passes,plan python generate.py
    tokpipe_compiler.set_logs("passes", dump_dir="dumps")     # the same from Python

Loggers configured by the application (logging.basicConfig, dictConfig) work as usual;
a stderr handler is added only when nothing else would print the records.

torch's own switches work too. TORCH_LOGS is read when torch is imported, before this
package can register names with it, so there the package's module name turns its logs on:

    TORCH_LOGS="+tokpipe_compiler"   every message at DEBUG, the pass dumps included
    TORCH_LOGS="tokpipe_compiler"    INFO: plan summaries, warnings
    TORCH_TRACE=DIR                  the plan (`tokpipe_plan`) and every pass's graph
                                     (`tokpipe_pass_<pass>`) as artifacts for tlparse

From Python, after import, the registered short names work as well:

    torch._logging.set_logs(modules={"tokpipe": logging.DEBUG})
    torch._logging.set_logs(modules={"tokpipe_passes": True, "tokpipe_plan": True})

torch then treats these loggers as its own: each of its configurations sets their levels
and handlers (and stops their records propagating to the root logger).
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import re
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch._logging
import torch.distributed as dist
import torch.fx

LOG = logging.getLogger("tokpipe_compiler")
PASSES = logging.getLogger("tokpipe_compiler.passes")
PLAN = logging.getLogger("tokpipe_compiler.plan")
ENV, DIR_ENV = "TOKPIPE_LOGS", "TOKPIPE_LOGS_DIR"
ARTIFACTS = {"passes": PASSES, "plan": PLAN}
_ALL = {"tokpipe": logging.INFO, "+tokpipe": logging.DEBUG}
TORCH_NAME = "tokpipe"  # torch._logging's short name for LOG
# torch._logging artifacts: name -> (logger, what it shows)
TORCH_ARTIFACTS = {
    "tokpipe_passes": (PASSES, "tokpipe: the graph after each compiler pass"),
    "tokpipe_plan": (PLAN, "tokpipe: the plan summary whenever a graph is planned"),
}

_dump_dir: Path | None = None
_dump_index = itertools.count()
_handler: logging.Handler | None = None


def set_logs(spec: str = "", dump_dir: str | Path | None = None) -> None:
    """Turn on what `spec` names (the TOKPIPE_LOGS syntax); an empty spec turns all off.
    `dump_dir`: where the pass dumps go (None: TOKPIPE_LOGS_DIR's, if set)."""
    global _dump_dir
    dump_dir = dump_dir or os.environ.get(DIR_ENV) or None
    names = [name.strip() for name in spec.split(",") if name.strip()]
    unknown = sorted(set(names) - set(ARTIFACTS) - set(_ALL))
    if unknown:
        raise ValueError(f"unknown {ENV} name(s) {unknown}; allowed: "
                         f"{sorted(ARTIFACTS) + sorted(_ALL)}, e.g. {ENV}=passes,plan")
    LOG.setLevel(min((_ALL[n] for n in names if n in _ALL), default=logging.NOTSET))
    for name, logger in ARTIFACTS.items():
        level = logging.DEBUG if name == "passes" else logging.INFO
        logger.setLevel(level if name in names else logging.NOTSET)
    _dump_dir = Path(dump_dir) if dump_dir else None
    if names:
        _ensure_handler()


def configure_from_env(environ: Mapping[str, str] = os.environ) -> None:
    """Apply TOKPIPE_LOGS and TOKPIPE_LOGS_DIR; without TOKPIPE_LOGS leave logging alone.
    A bad TOKPIPE_LOGS warns: a logging variable must not stop the package importing."""
    if environ.get(ENV):
        try:
            set_logs(environ[ENV], environ.get(DIR_ENV) or None)
        except ValueError as err:
            warnings.warn(f"tokpipe: {err}; logging left as it was", stacklevel=2)


def register_with_torch() -> None:
    """Make the loggers torch._logging's: `tokpipe` a log name for LOG, the pass dumps and
    the plan artifacts (on by name, or when an ancestor logs at DEBUG). Best effort: the
    registry is torch's internal API, and logging must never stop the compiler loading."""
    try:
        from torch._logging import _internal

        registry = _internal.log_registry
        if not registry.is_log(TORCH_NAME):
            _internal.register_log(TORCH_NAME, LOG.name)
        for name, (logger, description) in TORCH_ARTIFACTS.items():
            if not registry.is_artifact(name):
                _internal.register_artifact(name, description)
            logger.artifact_name = name  # what torch's getArtifactLogger would set
            registry.register_artifact_log(logger.name)
    except (ImportError, AttributeError, TypeError) as err:  # another torch's internals
        LOG.debug("not registered with torch._logging: %s", err)


def trace_artifact(name: str, payload: Callable[[], str]) -> None:
    """A string artifact in the TORCH_TRACE log (tlparse shows it with Dynamo's own);
    `payload` is called only when a trace is being written."""
    torch._logging.trace_structured(
        "artifact", metadata_fn=lambda: {"name": name, "encoding": "string"},
        payload_fn=payload, expect_trace_id=False)


def log_plan(plan: Any) -> None:
    """The plan summary: INFO on the plan logger, the `tokpipe_plan` artifact in a trace."""
    trace_artifact("tokpipe_plan", lambda: str(plan))
    if PLAN.isEnabledFor(logging.INFO):
        PLAN.info("%s", plan)


def dump_graph(pass_name: str, gm: torch.fx.GraphModule) -> None:
    """Log (and write, with a dump dir) `gm` as the pass `pass_name` left it; in a trace,
    the artifact `tokpipe_pass_<pass>`."""
    readable = functools.cache(lambda: gm.print_readable(print_output=False))
    trace_artifact(f"tokpipe_pass_{_file_name(pass_name)}", readable)
    if not PASSES.isEnabledFor(logging.DEBUG):
        return
    index = next(_dump_index)
    text = readable()
    PASSES.debug("[tokpipe dump %03d, after pass %s]\n%s", index, pass_name, text)
    if _dump_dir is not None:
        rank = rank_of_several()  # ranks that wrote one folder overwrote each other's dumps
        folder = _dump_dir if rank is None else _dump_dir / f"rank{rank}"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{index:03d}_{_file_name(pass_name)}.py"
        path.write_text(f"# tokpipe dump {index:03d}, made by pass: {pass_name}\n{text}")


def _file_name(pass_name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]+", "_", pass_name)


def rank_of_several() -> int | None:
    """This process's rank where there are several: in its process group, else as its
    launcher's RANK and WORLD_SIZE say (before the group starts); None in one process."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() if dist.get_world_size() > 1 else None
    world, rank = os.environ.get("WORLD_SIZE", ""), os.environ.get("RANK", "")
    return int(rank) if world.isdigit() and int(world) > 1 and rank.isdigit() else None


class RankFormatter(logging.Formatter):
    """`[logger LEVEL] message`, the rank in the brackets where there are several: their
    lines interleave on one console."""

    def __init__(self) -> None:
        super().__init__("[%(name)s %(levelname)s%(rank)s] %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        rank = rank_of_several()
        record.rank = "" if rank is None else f" rank {rank}"
        return super().format(record)


def _ensure_handler() -> None:
    global _handler
    if _handler is not None or logging.getLogger().handlers or LOG.handlers:
        return
    _handler = logging.StreamHandler()
    _handler.setFormatter(RankFormatter())
    LOG.addHandler(_handler)


register_with_torch()
configure_from_env()
