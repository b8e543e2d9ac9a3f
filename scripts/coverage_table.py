"""docs/models.md, the coverage table: its columns, rendering, and reading back (the
statuses `scripts/coverage.py --check` compares)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from tests.fixtures.zoo import ZOO

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "models.md"
MODES = ("sync", "stale", "causal")
RANKS = "2 ranks"  # the column of sync and stale on two gloo processes
RANK_MODES = ("sync", "stale")
TOLERANCE = 1e-5
STAGES = 2
SPLIT = "split"  # the traced cell of a class Dynamo traces as several graphs
# Statuses from best to worst: a class may not move right of its committed status.
RANK = {"matches": 0, "n/a": 0, SPLIT: 1, "runs": 1, "unpipelined": 1, "fails": 2,
        "untraced": 3, "unbuilt": 3}


SEMANTICS = """\
## What the modes mean for these models

**Joint text+image attention** (SD3, Flux and its kin, CogVideoX, AuraFlow, HunyuanVideo ...):
the text tokens are a whole, unchunked *segment* of the token axis (`TokenInfo.lead`/`trail`).
A chunk's attention runs over [text K/V, visible image K/V cache]. In `sync` (and warmup)
the one chunk is the whole fresh sequence: exact. In `stale` only a step's first chunk
computes the text stream (`text_chunks="first"`, the default; `passes/text_once.py`): its
text queries see its own image tokens fresh and the others' as the previous step left
them, the approximation PipeFusion makes for image tokens, and it writes the text K/V to
the caches. The later chunks run their graph without the text rows (the text stream is
dead code there) and attend to the text K/V the first chunk wrote: this step's text. So a
step computes the text once, not once per chunk (Flux at 1024 px: 512 text tokens against
4096/M image tokens a chunk, 1.33x the step's work at M = 4 with a copy per chunk).
`text_chunks="every"` gives every chunk its own copy of the text stream, computed from
that chunk's view of the caches. The two give nearly the same images: on seven pipelines
the outputs of the two differ by 1-7% of what each differs from serial (`BENCHMARKS.md`).
A graph whose image rows read the text other than through attention keeps a copy per
chunk. An exact pipelined
text stream does not exist: text K/V of block l+1 depend on every image token of block l,
so no chunk of block l+1 may start before all of block l is done; `sync` is the exact
choice. Image-only queries over [text, image] keys (PRX) need no text stream at all. A
graph that returns the text stream (a block's graph between graph breaks) returns the
first chunk's copy (the last chunk's with `"every"`, which saw every image token fresh).
Text joined to the image before a graph break (OmniGen) reaches the next graph inside its
token input: the slices that graph takes of it tell the text segment, and
the input is cut per chunk around it.

**Long skips** (HunyuanDiT, U-shaped): a skip value crosses stage boundaries as one
boundary value, sent from the stage that computes it to the one stage that reads it.

**Video** (CogVideoX, Wan, Latte, Allegro, HunyuanVideo ...): a grid unit is one latent
frame; chunks are contiguous frame ranges of the frames-first flattened token grid, and
positional tables are cut to the same ranges. Attention that runs per frame (Latte's
spatial blocks) carries the frames on its batch axis and is chunked without a cache. A
video of one latent frame has no frame axis left: its grid unit is a row of patches, as an
image's. LTX-Video packs its latents into one token axis before the transformer, so its
grid unit is one token (chunks may end inside a frame, which attention over every token
allows). A chunk count above the frames (`chunks=4` on a video of 2 or 3
latent frames) runs one chunk a frame, with a warning (`chunks="auto"` chooses per size).

**Sums over tokens** (a sum or mean over the token axis, group_norm over the token grid,
linear attention's K^T V as in Sana): pipelined like K/V (`passes/chunk_sums.py`). Each
keeps one partial sum per grid unit in a cache; chunk p sees this step's partials of the
units up to its own and the previous step's after them (`stale`), the whole sum in `sync`
and on warmup steps (exact). `causal` refuses them (it is exact, and a sum needs the tokens
after the chunk). A linear attention cache is (D+1)/(2 * tokens per unit) the size of a K/V
cache.

**Convolutions across token rows** ("same" convolutions, kernel 2p+1 with padding p, such
as Sana's 3x3 depthwise convolution in its feed-forward): the input is cached per grid
unit, and a chunk convolves its rows with a halo of p rows read from the cache, this
step's before it and the previous step's after it (`stale`, DistriFusion's stale halos;
`runtime/halo_conv.py`). Exact in `sync` and on warmup steps; `causal` refuses them. A max
over tokens stays unsupported.

**Causal mode** takes attention that is causal (`is_causal=True`, or a mask that hides every
later key). These models attend over the whole sequence: *n/a (no causal attention)*, or,
where their attention carries a mask (a text padding mask), *n/a (its mask is not causal)*:
the mask shows a chunk's queries keys of later chunks, which causal mode would drop.
"""


@dataclass
class Row:
    name: str
    traced: str
    modes: dict[str, str]
    drift: str = ""  # stale on a changed input: relative difference from eager
    ranks: str = ""  # sync and stale on two gloo ranks (with --ranks)

    def matches(self) -> bool:
        traced = self.traced == "yes" or self.traced.startswith(SPLIT)
        return traced and all(self.modes[m].startswith("matches") for m in RANK_MODES)


def committed_rows(text: str) -> list[Row]:
    """The rows of a rendered table, as Rows (cells kept whole)."""
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != len(MODES) + 4 or cells[0] == "class" or cells[0].startswith("-"):
            continue
        modes = {m: c for m, c in zip(MODES, cells[2:], strict=False) if c}
        rows.append(Row(cells[0], cells[1], modes, drift=cells[-1], ranks=cells[-2]))
    return rows


def committed_seconds(text: str) -> float:
    found = re.search(r"Run time (\d+) s", text)
    return float(found.group(1)) if found else 0.0


def render(rows: list[Row], seconds: float) -> str:
    traced = [r for r in rows if r.traced == "yes"]
    working = [r for r in traced if all(r.modes[m] == "matches" for m in ("sync", "stale"))]
    share = 100 * len(working) / max(1, len(traced))
    split = [r for r in rows if r.traced.startswith(SPLIT)]
    lines = [
        "# Model coverage",
        "",
        "Generated by `python scripts/coverage.py --ranks` (checked in CI by `--check`); do not "
        "edit.",
        f"Every transformer class diffusers {_diffusers_version()} exports, built from a small "
        "config in `tests/fixtures/zoo.py` with random weights, traced by Dynamo and run with "
        f"{STAGES} stages, eager stage graphs, float32. *matches*: max |out - eager| <= "
        f"{TOLERANCE:g} max |eager| (stale: on the second call with the same input). "
        f"*{RANKS}*: sync and stale, as above, on {STAGES} gloo processes of one stage each "
        "(`--ranks`; every class that matches in one process). "
        "*stale drift*: the same relative error for stale on the next denoising step "
        "(latents nudged by 5% noise, text unchanged): the PipeFusion approximation, which "
        "for joint text+image models includes the text stream's (see below). "
        f"*{SPLIT}*: Dynamo traces the class as several graphs (graph breaks); each mode runs "
        "the whole model through torch.compile with the backend against the model run "
        "eagerly, the graphs that hold attention over their tokens pipelined and the others "
        "run as traced (the cell counts the pipelined graphs).",
        "",
        f"Classes: {len(rows)}; built: {sum(r.name in ZOO for r in rows)}; traced as one "
        f"graph: {len(traced)}; sync and stale match eager: {len(working)} "
        f"({share:.0f}% of the traced); traced as several graphs: {len(split)}, matching "
        f"in sync and stale with a graph pipelined: {sum(r.matches() for r in split)}; "
        f"on {STAGES} ranks: {sum(r.ranks == 'matches' for r in rows)}. "
        f"Run time {seconds:.0f} s.",
        "",
        "| class | traced (full graph) | " + " | ".join(MODES) + f" | {RANKS} | stale drift |",
        "|---|---|" + "---|" * len(MODES) + "---|---|",
    ]
    for r in rows:
        modes = [r.modes.get(m, "") for m in MODES]
        lines.append(f"| {r.name} | {r.traced} | " + " | ".join(modes)
                     + f" | {r.ranks} | {r.drift} |")
    return "\n".join(lines) + "\n\n" + SEMANTICS


def _diffusers_version() -> str:
    import diffusers

    return diffusers.__version__


def statuses(text: str) -> dict[tuple[str, str], str]:
    """(class, column) -> the first word of each status in a rendered table."""
    out = {}
    columns = ("traced", *MODES, RANKS)
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != len(columns) + 2 or cells[0] == "class" or cells[0].startswith("-"):
            continue
        for column, cell in zip(columns, cells[1:], strict=False):
            word = re.split(r"[:(, ]", cell)[0] if cell else ""
            out[(cells[0], column)] = {"yes": "matches"}.get(word, word)
    return out


def regressions(old: str, new: str, columns: tuple[str, ...] = ("traced", *MODES)) -> list[str]:
    """Cells of `columns` that got worse from `old` to `new`."""
    before, after = statuses(old), statuses(new)
    return [f"{cls} {col}: {was} -> {after.get((cls, col), 'missing')}"
            for (cls, col), was in before.items() if col in columns and was
            if RANK.get(after.get((cls, col), "fails"), 2) > RANK.get(was, 2)]
