"""Dynamo's recompile limit, told as tokpipe's warning where it stops a function traced for
tokpipe: past it, Dynamo runs the function eagerly (unpipelined) with a log record only,
which `warnings` filters and test suites do not see."""

from __future__ import annotations

import logging
from types import CodeType

from tokpipe_compiler.core.warn import warn

_DYNAMO_LOGGER = "torch._dynamo.convert_frame"
_LIMIT_MESSAGE = "torch._dynamo hit config."
_TRACED: set[str] = set()  # the functions traced for tokpipe, as Dynamo's record names them


def note_traced(code: CodeType) -> None:
    """Dynamo traces `code` for the tokpipe backend now."""
    _TRACED.add(f"'{code.co_name}' ({code.co_filename}:{code.co_firstlineno})")
    logger = logging.getLogger(_DYNAMO_LOGGER)
    if not any(isinstance(f, _LimitSaid) for f in logger.filters):
        logger.addFilter(_LimitSaid())


class _LimitSaid(logging.Filter):
    """Passes every record on; one of a limit hit by a tokpipe function also warns."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        if isinstance(record.msg, str) and record.msg.startswith(_LIMIT_MESSAGE) \
                and len(args) >= 3 and args[2] in _TRACED:
            warn(
                f"tokpipe: Dynamo reached its {args[0]} ({args[1]}) for {args[2]}: from this "
                "call on it runs that function eagerly, unpipelined (each input shape, call "
                "form or option set compiled counts against the limit, over every compile of "
                "the same code); pass isolate_recompiles=True, recompile_limit=64 to "
                "torch.compile, or fewer shapes (TORCH_LOGS=recompiles says why each one "
                "was traced)")
        return True
