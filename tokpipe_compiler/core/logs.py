"""Logging through the standard `logging` module, under the `tokpipe_compiler` logger.

TOKPIPE_LOGS, read at import (in the manner of TORCH_LOGS), is a comma-separated list:

    passes     the graph after each compiler pass, stamped with the pass that made it
               (DEBUG on `tokpipe_compiler.passes`)
    plan       the plan summary whenever a graph is planned (INFO on `tokpipe_compiler.plan`)
    tokpipe    every tokpipe message at INFO; `+tokpipe` at DEBUG (dumps included)

TOKPIPE_LOGS_DIR=DIR also writes each pass dump to DIR/NNN_<pass>.py.

    TOKPIPE_LOGS=passes,plan python generate.py
    tokpipe_compiler.set_logs("passes", dump_dir="dumps")     # the same from Python

Loggers configured by the application (logging.basicConfig, dictConfig) work as usual;
a stderr handler is added only when nothing else would print the records.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
from collections.abc import Mapping
from pathlib import Path

import torch.fx

LOG = logging.getLogger("tokpipe_compiler")
PASSES = logging.getLogger("tokpipe_compiler.passes")
PLAN = logging.getLogger("tokpipe_compiler.plan")
ENV, DIR_ENV = "TOKPIPE_LOGS", "TOKPIPE_LOGS_DIR"
ARTIFACTS = {"passes": PASSES, "plan": PLAN}
_ALL = {"tokpipe": logging.INFO, "+tokpipe": logging.DEBUG}

_dump_dir: Path | None = None
_dump_index = itertools.count()
_handler: logging.Handler | None = None


def set_logs(spec: str = "", dump_dir: str | Path | None = None) -> None:
    """Turn on what `spec` names (the TOKPIPE_LOGS syntax); an empty spec turns all off."""
    global _dump_dir
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
    """Apply TOKPIPE_LOGS and TOKPIPE_LOGS_DIR; without TOKPIPE_LOGS leave logging alone."""
    if environ.get(ENV):
        set_logs(environ[ENV], environ.get(DIR_ENV) or None)


def dump_graph(pass_name: str, gm: torch.fx.GraphModule) -> None:
    """Log (and write, with a dump dir) `gm` as the pass `pass_name` left it."""
    if not PASSES.isEnabledFor(logging.DEBUG):
        return
    index = next(_dump_index)
    text = gm.print_readable(print_output=False)
    PASSES.debug("[tokpipe dump %03d, after pass %s]\n%s", index, pass_name, text)
    if _dump_dir is not None:
        _dump_dir.mkdir(parents=True, exist_ok=True)
        name = re.sub(r"[^A-Za-z0-9_]+", "_", pass_name)
        path = _dump_dir / f"{index:03d}_{name}.py"
        path.write_text(f"# tokpipe dump {index:03d}, made by pass: {pass_name}\n{text}")


def _ensure_handler() -> None:
    global _handler
    if _handler is not None or logging.getLogger().handlers or LOG.handlers:
        return
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("[%(name)s %(levelname)s] %(message)s"))
    LOG.addHandler(_handler)


configure_from_env()
