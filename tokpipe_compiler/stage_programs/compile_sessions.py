"""The sessions of string-backend compiles: one per `torch.compile(..., backend="tokpipe")`
call, told by the identity of its `options` dict (the one object Dynamo hands every
recompile of that call) and its `mode` (compiles without options are told apart by mode
only).

A session is held weakly: its graphs' programs (which Dynamo's code cache holds) keep it,
so one that Dynamo dropped (`torch._dynamo.reset()`, a module freed) goes with its caches
instead of living as long as the process. The options are copied when the session is
made: torch hands the backend the dict itself, and a dict changed after that (for the next
compile) would otherwise change this compile's later graphs.
"""

from __future__ import annotations

import copy
import weakref
from typing import Any, NamedTuple

from tokpipe_compiler.core.warn import warn
from tokpipe_compiler.stage_programs.session import Session


class CompileSessions(NamedTuple):
    """Where the programs of one torch.compile call are: `own`, its session, once Dynamo
    traced a graph for it; `alike`, those of calls with equal options. Dynamo takes equal
    options for one backend (`_TorchCompileWrapper.__eq__`) and serves a call from another
    call's graphs, whose programs are then in that call's session."""

    own: Session | None
    alike: list[Session]

    @property
    def every(self) -> list[Session]:
        return ([self.own] if self.own is not None else []) + self.alike


class _Entry(NamedTuple):
    options: Any  # the dict torch.compile was given (held to compare by identity)
    mode: str | None
    session: weakref.ref
    copied: Any  # the options as the session's first graph saw them


_ENTRIES: list[_Entry] = []

CHANGED = ("tokpipe: the options dict given to torch.compile changed after its first graph "
           "was traced; the graphs of that compile keep the options they were first traced "
           "with. Pass each torch.compile its own dict (or a tp.backend(**options) object)")


def session_for(options: Any, mode: str | None) -> tuple[Session, Any]:
    """The session of the compile whose options are `options` and its options as first
    seen (made now at its first graph)."""
    entry = _entry(options, mode)
    if entry is not None:
        _warn_if_changed(entry, options)
        return entry.session(), entry.copied
    session = Session()
    _ENTRIES.append(_Entry(options, mode, weakref.ref(session), _copied(options)))
    return session, _ENTRIES[-1].copied


def warn_if_changed(options: Any, mode: str | None) -> None:
    """Warns (once per compile) where the options dict of a compile changed since its first
    graph: also where Dynamo serves a later compile given the same dict from this one's
    graphs (a model of the same class), which never reaches the backend."""
    entry = _entry(options, mode)
    if entry is not None:
        _warn_if_changed(entry, options)


def _entry(options: Any, mode: str | None) -> _Entry | None:
    """The live entry of the compile given `options` (the dict itself) and `mode`."""
    return next((e for e in _live() if e.options is options and e.mode == mode), None)


def _warn_if_changed(entry: _Entry, options: Any) -> None:
    session = entry.session()
    if not _equal(entry.copied, options) and "options changed" not in session.warned:
        session.warned.add("options changed")
        warn(CHANGED)


def sessions_for_options(options: Any, mode: str | None = None) -> CompileSessions:
    """The sessions of the torch.compile call whose options are `options` (and mode
    `mode`)."""
    live = [(entry, entry.session()) for entry in _live()]
    own = next((s for e, s in live if e.options is options and e.mode == mode), None)
    alike = [s for e, s in live
             if e.options is not options and e.mode == mode and _equal(e.options, options)]
    return CompileSessions(own, alike)


def _live() -> list[_Entry]:
    """The entries whose session lives, dropping the others."""
    _ENTRIES[:] = [entry for entry in _ENTRIES if entry.session() is not None]
    return list(_ENTRIES)


def _copied(options: Any) -> Any:
    try:
        return copy.deepcopy(options)
    except Exception:  # an option value that cannot be copied: as given
        return dict(options) if isinstance(options, dict) else options


def _equal(a: Any, b: Any) -> bool:
    """`a == b` as Dynamo compares backend options; False where that is not a bool (an
    option holding a tensor)."""
    try:
        return bool(a == b)
    except (RuntimeError, TypeError, ValueError):
        return False
