"""Module paths grouped into layers for summaries: 'blocks.3.attn.qkv' -> 'blocks.3'."""

from __future__ import annotations

import re

_RUN = re.compile(r"^(.*\.)(\d+)$")


def layer_of(path: str) -> str:
    """The path up to its first index ('transformer_blocks.3'), else its first part."""
    parts = path.split(".") if path else []
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return parts[0] if parts else ""


def compress_layers(layers: list[str]) -> list[str]:
    """Distinct layers in order, consecutive indices merged: blocks.0, blocks.1 -> blocks.0-1."""
    out: list[tuple[str, int, int] | str] = []
    for layer in layers:
        if not layer or (out and _last_name(out[-1]) == layer):
            continue
        match = _RUN.match(layer)
        last = out[-1] if out else None
        if match and isinstance(last, tuple) and last[0] == match[1] and last[2] + 1 == int(
            match[2]
        ):
            out[-1] = (last[0], last[1], int(match[2]))
        elif match:
            out.append((match[1], int(match[2]), int(match[2])))
        else:
            out.append(layer)
    return [_render(item) for item in out]


def _last_name(item: tuple[str, int, int] | str) -> str:
    return item if isinstance(item, str) else f"{item[0]}{item[2]}"


def _render(item: tuple[str, int, int] | str) -> str:
    if isinstance(item, str):
        return item
    prefix, first, last = item
    return f"{prefix}{first}" if first == last else f"{prefix}{first}-{last}"
