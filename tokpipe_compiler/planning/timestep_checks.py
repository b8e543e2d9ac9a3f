"""How a compiled model's calls carry their timestep, which tells a call's denoising step,
guidance branch and generation (`stage_programs/generations.py`): a misspelt `timestep_input`
raises, and the two ways a stale pipeline would quietly lose its steps warn.

- No timestep among the inputs: every call is the next step of one generation and one
  branch, so a second image (or the other guidance branch) reads the first's K/V.
- A timestep passed as a Python number: Dynamo specialises a graph on its value, so every
  step is a new graph, planned anew, which starts a new generation: every step runs as
  warmup, unpipelined.
"""

from __future__ import annotations

from tokpipe_compiler.core.errors import TokpipeError
from tokpipe_compiler.runtime.caches import AnyCacheSpec, CacheSpec
from tokpipe_compiler.stage_programs.generations import timestep_names


def check_timestep_input(choice: str | int | None, parameters: set[str],
                         inputs: list[tuple[str, str | int | None]] = ()) -> None:
    """Raises where the option `timestep_input` names no parameter of any function Dynamo
    traced for the model (`parameters`; "**" among them: any name may be one; a position
    is one of a forward that takes *args), or names one the graph reads entries of (a
    dict: the entry is the timestep). `inputs`: the graph's inputs, as (Dynamo source,
    argument name)."""
    if choice is None:
        return
    names = {name for _, name in inputs}
    if isinstance(choice, int):
        _check_position(choice, parameters, names)
        return
    inside = [str(name) for source, name in inputs
              if source.startswith(f"L[{choice!r}][") and name is not None]
    if inside and choice not in names:
        likely = next((n for n in timestep_names() if n in inside), inside[0])
        raise TokpipeError(
            f"timestep_input={choice!r} names a parameter the model reads entries of (a "
            f"dict or list; they reach the graph as {inside}): name the entry that holds "
            f"the timestep, timestep_input={likely!r} say")
    if choice in parameters or choice in names or "**" in parameters:
        return
    raise TokpipeError(f"timestep_input={choice!r} names no parameter of the model's "
                       f"forward; its parameters are {sorted(parameters - {'self'})}")


def _check_position(choice: int, parameters: set[str], names: set[str | int | None]) -> None:
    """A position names an input of a forward that takes *args (diffusers' wrapped forwards
    called positionally); one the call holds, or any where the frame is unknown."""
    if choice in names or parameters & {"*", "**"}:
        return
    named = sorted(p for p in parameters if p not in ("self", "*", "**"))
    likely = next((n for n in timestep_names() if n in named), named[0] if named else None)
    raise TokpipeError(
        f"timestep_input={choice} names a position in the call, which names an input only "
        f"where the forward takes *args; this model's forward names its parameters {named}: "
        f"name the one that carries the timestep (timestep_input={likely!r}, say)"
        if named else f"timestep_input={choice} names no input of the call")


def number_timestep(numbers: dict[str, int | float], choice: str | None) -> str | None:
    """The warning for a timestep passed as a Python number (None: it is not)."""
    name = next((n for n in timestep_names(choice) if n in numbers), None)
    if name is None:
        return None
    return (f"tokpipe: the timestep argument {name!r} is a Python number ({numbers[name]!r}): "
            "Dynamo specialises a graph on its value, so each step is a new graph, planned "
            "(and compiled) anew, and each new graph starts a new generation: every step "
            "runs unpipelined, as warmup, and past Dynamo's recompile limit the model runs "
            f"eagerly. Pass it as a tensor: {name}=torch.tensor({numbers[name]!r})")


def reads_last_call(caches: list[AnyCacheSpec]) -> bool:
    """Whether a stale plan's chunks read what an earlier call left: K/V of later chunks'
    tokens, or a sum's partials. Where all attention is causal over no tokens after the
    chunked ones, a chunk reads only what this call wrote, and calls need no timestep to
    be told apart (stale is then exact). Tokens after the chunked ones (the first chunk
    computes them) attend to every chunk's, the later ones' from the last call."""
    return any(not isinstance(cache, CacheSpec) or not cache.causal or cache.trail
               for cache in caches)


def missing_timestep(inputs: list[str | int], choice: str | int | None) -> str:
    """The warning for a stale pipeline whose calls carry no timestep it knows."""
    looked = f"timestep_input={choice!r}" if choice is not None else \
        f"a parameter named one of {list(timestep_names())}"
    among = f"among the model's inputs {inputs}" if inputs else \
        "(the graph's inputs carry no parameter names: a forward wrapped as (*args, **kwargs)?)"
    name = ("Pass the timestep by keyword (timestep=t), or give its position in the call: "
            "options={'timestep_input': POSITION} (the forward takes *args, so the inputs "
            "are numbered by position)" if any(isinstance(i, int) for i in inputs)
            else "Name the timestep with options={'timestep_input': NAME}")
    return (f"tokpipe: mode='stale' found no timestep {among} "
            f"({looked}): every call counts as the next step of one generation and one "
            "guidance branch, so a second image, or a second branch of a step, attends to "
            "the first's K/V (not where a mask hides every later token, as a causal language "
            "model's does: there stale is exact and this can be ignored). "
            f"{name}, or call tp.reset(compiled) between generations and run one branch per "
            "call")
