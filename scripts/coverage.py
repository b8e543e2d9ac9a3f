"""Model coverage: every transformer class diffusers exports, traced and run in each mode.

    python scripts/coverage.py --ranks    # writes docs/models.md, with its "2 ranks" column
    python scripts/coverage.py            # the same on one process (that column left empty)
    python scripts/coverage.py --check    # fails if a class that worked stops working
    python scripts/coverage.py SD3Transformer2DModel   # print some rows only
    python scripts/coverage.py --ranks --update SanaTransformer2DModel   # redo rows in place

Small configs and inputs come from tests/fixtures/zoo.py; a class without an entry gets a row that
says so. Each mode is compared with the Dynamo graph run as is (eager) on the same inputs; a
class Dynamo traces as several graphs (graph breaks) runs whole through torch.compile with the
backend, against the model run eagerly.
"""

from __future__ import annotations

import argparse
import inspect
import multiprocessing
import os
import re
import sys
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import tokpipe_compiler as tp  # noqa: E402
from scripts.coverage_table import (  # noqa: E402
    DOC,
    MODES,
    RANK_MODES,
    RANKS,
    SPLIT,
    STAGES,
    TOLERANCE,
    Row,
    committed_rows,
    committed_seconds,
    regressions,
    render,
)
from tests.fixtures.tracing import rel_error  # noqa: E402
from tests.fixtures.zoo import ZOO, build  # noqa: E402
from tokpipe_compiler import Config  # noqa: E402
from tokpipe_compiler.planning.capture import Captured, capture  # noqa: E402
from tokpipe_compiler.planning.driver import build_plan  # noqa: E402
from tokpipe_compiler.runtime.launch import launch  # noqa: E402
from tokpipe_compiler.stage_programs.distributed import make_program  # noqa: E402
from tokpipe_compiler.stage_programs.pipelined import PipelinedProgram  # noqa: E402


def transformer_classes() -> list[str]:
    import diffusers
    from diffusers import ModelMixin

    names = []
    for name in dir(diffusers):
        value = getattr(diffusers, name, None)
        if (inspect.isclass(value) and issubclass(value, ModelMixin)
                and value.__module__.startswith("diffusers.models.transformers")):
            names.append(name)
    return sorted(names)


def one_line(err: BaseException) -> str:
    """The reason of an error in one line: the op and why, for tokpipe's own errors."""
    text = str(err)
    op = re.search(r"^\s*- (\w+)\(", text, re.M)
    why = re.search(r"why: (.*)", text)
    if op and why:
        return f"{op.group(1)}: {why.group(1)}"
    first = text.strip().splitlines()[0] if text.strip() else type(err).__name__
    first = re.sub(_SOURCE, r"\1:\2", first)  # the user's line as file:line, for room
    return f"{type(err).__name__}: {first}"[:160]


# 'File "/path/to/model.py", line 661, in forward: code' (up to ", which ...")
_SOURCE = re.compile(r'File "(?:[^"]*/)?([^"/]+)", line (\d+), in [^:]+: .*?(?=, which|$)')


def graph_args(captured: Captured, inputs: dict) -> list:
    """The graph's inputs with the user inputs of `inputs` in place of the traced ones."""
    tensors = {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)}
    return captured.with_arguments(tensors, strict=False)


def first_tensor(values) -> torch.Tensor:
    if hasattr(values, "to_tuple"):  # a diffusers output (a model run whole)
        values = values.to_tuple()
    values = values if isinstance(values, (tuple, list)) else [values]
    # a tensor, or a list of one per sample (Wan-Animate-2's output)
    values = [v[0] if isinstance(v, list) and v else v for v in values]
    return next(v for v in values if isinstance(v, torch.Tensor))


def run_mode(captured: Captured, name: str, mode: str,
             make=PipelinedProgram) -> tuple[str, str]:
    """(status, stale drift) of one mode; `make(plan)`: the program (in process, or this
    rank's part under torch.distributed)."""
    entry, gm = ZOO[name], captured.gm
    a = graph_args(captured, entry.inputs(1))
    b = graph_args(captured, next_step(entry.inputs(1)))
    with torch.no_grad():
        refs = first_tensor(gm(*a)), first_tensor(gm(*b))
    config = Config(stages=STAGES, chunks=entry.chunks, mode=mode, warmup_steps=1,
                    compiler="eager", timeout=120.0)
    programs: list = []

    def run(args: list) -> torch.Tensor:
        if not programs:
            programs.append(make(build_plan(gm, config)))
        return first_tensor(programs[0](*args))

    return measure(run, (a, b), refs, mode)


def run_split(model: torch.nn.Module, name: str, mode: str, graphs: int) -> tuple[str, str]:
    """(status, stale drift) of one mode of a model Dynamo traces as `graphs` graphs: the
    whole model compiled with the backend (under torch.distributed, this rank's part)."""
    entry = ZOO[name]
    a, b = entry.inputs(1), next_step(entry.inputs(1))
    with torch.no_grad():
        refs = first_tensor(model(**a)), first_tensor(model(**b))
    torch.compiler.reset()
    backend = tp.backend(stages=STAGES, chunks=entry.chunks, mode=mode, warmup_steps=1,
                         compiler="eager", timeout=120.0)
    compiled = torch.compile(model, backend=backend, dynamic=False)
    status, drift = measure(lambda inputs: first_tensor(compiled(**inputs)), (a, b), refs,
                            mode)
    pipelined = len(tp.programs(backend))
    if status == "matches" and not pipelined:
        return "unpipelined: no graph holds attention over its tokens (matches eager)", drift
    if status.startswith(("matches", "runs")):
        status = f"{status}, {pipelined} of {graphs} graphs pipelined"
    return status, drift


def measure(run, inputs: tuple, refs: tuple, mode: str) -> tuple[str, str]:
    """(status, stale drift): `run` on the first inputs (twice in stale mode) against the
    first reference; stale on the second inputs (the next step) against the second."""
    try:
        with torch.no_grad():
            out = run(inputs[0])
            if mode == "stale":
                out = run(inputs[0])  # repeated input: stale K/V are the fresh ones
    except Exception as err:  # a row per failure is the point
        if mode == "causal" and "needs causal attention" in str(err):
            return "n/a (no causal attention)", ""
        if mode == "causal" and "a padding or bidirectional mask" in str(err):
            return "n/a (its mask is not causal)", ""
        return f"fails: {one_line(err)}", ""
    error = rel_error(out, refs[0])
    status = "matches" if error <= TOLERANCE else f"runs (max rel err {error:.1e})"
    drift = ""
    if mode == "stale":
        with torch.no_grad():
            drift = f"{rel_error(run(inputs[1]), refs[1]):.1e}"
    return status, drift


def next_step(inputs: dict) -> dict:
    """The inputs of a following denoising step: latents nudged by 5% noise, timestep a
    little lower, text unchanged (what stale K/V approximate in practice)."""
    g = torch.Generator().manual_seed(99)
    out = dict(inputs)
    latents = next(k for k in ("hidden_states", "x", "decoder_input_tokens", "inputs_embeds")
                   if k in out)
    value = out[latents]  # a tensor, or a list of one per sample (Wan-Animate-2)
    nudged = [v + 0.05 * torch.randn(v.shape, generator=g)
              for v in (value if isinstance(value, list) else [value])]
    out[latents] = nudged if isinstance(value, list) else nudged[0]
    for key in ("timestep", "t", "timesteps", "decoder_noise_time"):
        if isinstance(out.get(key), torch.Tensor):
            lower = out[key] * 0.98 if out[key].is_floating_point() else out[key] - 1
            out[key] = lower
    return out


def cover(name: str) -> Row:
    if name not in ZOO:
        return Row(name, "unbuilt: no small config in tests/fixtures/zoo.py", {})
    try:
        model = build(name)
        inputs = ZOO[name].inputs(0)
        graphs = capture(model, kwargs=inputs, fresh=True)
    except Exception as err:
        return Row(name, f"untraced: {one_line(err)}", {})
    row = Row(name, "yes" if len(graphs) == 1 else f"{SPLIT}: {len(graphs)} graphs "
              "(graph breaks)", {})
    for mode in MODES:
        if len(graphs) == 1:
            row.modes[mode], drift = run_mode(graphs[0], name, mode)
        else:
            row.modes[mode], drift = run_split(model, name, mode, len(graphs))
        row.drift = row.drift or drift
    return row


def cover_all(names: list[str], jobs: int) -> list[Row]:
    """cover() of each class, in `jobs` worker processes (Dynamo traces on one core)."""
    if jobs <= 1:
        _one_thread()
        return [_report(cover(name)) for name in names]
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(jobs, mp_context=context, initializer=_one_thread) as pool:
        return [_report(row) for row in pool.map(cover, names)]


def _one_thread() -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")


def _report(row: Row) -> Row:
    print(f"{row.name}: {row.traced} {row.modes}", file=sys.stderr, flush=True)
    return row


def on_rank(rank: int, world: int, names: list[str]) -> dict[str, str]:
    """Each class's sync and stale on this rank of a gloo group: its status cell."""
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    out = {}
    for name in names:
        try:
            model = build(name)
            graphs = capture(model, kwargs=ZOO[name].inputs(0), fresh=True)
            results = [run_split(model, name, mode, len(graphs))[0] if len(graphs) > 1 else
                       run_mode(graphs[0], name, mode, lambda plan: make_program(plan, None))[0]
                       for mode in RANK_MODES]
        except Exception as err:  # a cell per failure is the point
            results = [f"fails: {one_line(err)}"]
        bad = [r for r in results if not r.startswith("matches")]
        out[name] = bad[0] if bad else "matches"
    return out


def cover_ranks(rows: list[Row]) -> None:
    """Fill the "2 ranks" cell of every row that matches in one process (one gloo group
    for all of them: two processes, started once)."""
    names = [r.name for r in rows if r.matches()]
    per_rank = launch(on_rank, STAGES, args=(names,), timeout=3600)
    for row in rows:
        if row.name in per_rank[0]:
            cells = {per_rank[rank][row.name] for rank in range(STAGES)}
            row.ranks = "matches" if cells == {"matches"} else sorted(cells - {"matches"})[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="compare with the committed table; fail on regressions")
    parser.add_argument("--ranks", action="store_true",
                        help=f"also run the matching classes on {STAGES} gloo ranks")
    parser.add_argument("--update", action="store_true",
                        help="run the given classes and replace their rows in docs/models.md")
    parser.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1),
                        help="classes covered at once, one process and one thread each "
                             "(default: the CPU count, at most 4)")
    parser.add_argument("classes", nargs="*",
                        help="only these classes, printed (default: all, into docs/models.md)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    start = time.perf_counter()
    rows = cover_all(args.classes or transformer_classes(), args.jobs)
    if args.ranks:
        cover_ranks(rows)
    text = render(rows, time.perf_counter() - start)
    if args.check:
        columns = ("traced", *MODES, *((RANKS,) if args.ranks else ()))
        lost = regressions(DOC.read_text(), text, columns)
        for line in lost:
            print(f"regression: {line}", file=sys.stderr)
        return 1 if lost else 0
    if args.update and args.classes:  # these rows anew, the others as committed
        committed = DOC.read_text()
        fresh = {r.name: r for r in rows}
        rows = [fresh.pop(r.name, r) for r in committed_rows(committed)] + list(fresh.values())
        seconds = committed_seconds(committed) + time.perf_counter() - start
        text = render(sorted(rows, key=lambda r: r.name), seconds)
    elif args.classes:  # a partial run prints its rows and leaves the table alone
        print(text)
        return 0
    DOC.parent.mkdir(exist_ok=True)
    DOC.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
