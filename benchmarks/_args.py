"""Argument parsing shared by the benchmark scripts: a wrong count, name or chunk count fails
when the arguments are parsed, before a model is built or a serial run is timed, and
`--help` shows every default."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable


class DefaultsFormatter(argparse.HelpFormatter):
    """Help that ends each option's text with its default as it would be typed ("2 4 8", not
    "[2, 4, 8]"), where it has one: not None, not a flag's False."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        default = action.default
        if not action.help or default is None or default is False \
                or default is argparse.SUPPRESS:
            return action.help
        shown = " ".join(map(str, default)) if isinstance(default, list | tuple) else default
        return f"{action.help} (default: {str(shown).replace('%', '%%')})"


def parser_for(doc: str) -> argparse.ArgumentParser:
    """A parser described by the first paragraph of a script's docstring, whole."""
    first = doc.strip().split("\n\n")[0]
    return argparse.ArgumentParser(description=" ".join(first.split()),
                                   formatter_class=DefaultsFormatter)


def at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: a whole number >= `minimum`."""

    def whole(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return whole


positive_int = at_least(1)


def positive_float(text: str) -> float:
    """An argparse type: a number > 0 (a time limit in seconds)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def chunk_count(text: str) -> int | str:
    """An argparse type: "auto" (the cost model chooses) or a chunk count >= 1."""
    if text == "auto":
        return text
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected auto or a chunk count >= 1, got {text!r}") from None


def one_of(names: Iterable[str], what: str) -> Callable[[str], str]:
    """An argparse type: one of `names`; a wrong one is refused with the valid ones listed.
    For lists too long to show as `choices` in the usage line (`what` names them)."""
    valid = tuple(names)

    def name(text: str) -> str:
        if text not in valid:
            raise argparse.ArgumentTypeError(
                f"unknown {what} {text!r}; choose from {', '.join(map(repr, valid))}")
        return text

    return name
