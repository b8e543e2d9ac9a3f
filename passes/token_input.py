"""Which graph input carries the tokens, and its candidate token axes (annotate's seed).

Named (`token_input`): the placeholder whose user argument (`core.fx.argument_of`) is that
name, however it was passed (by name, by keyword into **kwargs, by position into a decorated
forward's *args); a number is a position in the call's *args, else a position among the
graph's user inputs.

Found: among the user float inputs of rank >= 3 (else token ids: an integer [batch, tokens]
input looked up in an embedding, a language model's), the one the graph's output is made from,
told by the graph's structure rather than by size (at released sizes the text embedding
is the largest input: PixArt's T5 120 x 4096 against latents 4 x 128 x 128). A diffusion
transformer's output is the latent it was given, in its layout (same shape; other channels
for a learned variance, [B, C', F, H, W] for video) or packed (Flux's [B, tokens, C]); a
conditioning stream (text, pooled embeddings) reaches the output only through attention
keys and values or modulation, never in its own shape. So, best first:
  1. inputs the output depends on at all (FX ancestry; an attention mask, even a float
     [B, 1, L, L] one larger than the tokens, only weighs scores: not through it);
  2. by how the input's shape matches an output's: equal shape; equal but for one axis
     (channels); equal element count (a packed layout); no match;
  3. not a conditioning stream by its name (`CONDITIONING`): where no shape matches (a
     latent grid the patches do not tile, which the model crops), the latent, not the text;
  4. the larger input, then the earlier one.

A piece of a model split at graph breaks (`piece_token_input`) is ranked by input name
first: its output is an intermediate value, often the refined text (HunyuanVideo 1.5's
first piece returns its text in the text's shape), so shapes would pick the text. The
conditioning streams go last by the names diffusers gives them (`CONDITIONING`).
"""

from __future__ import annotations

import re

import torch
import torch.fx
import torch.nn.functional as F

from tokpipe_compiler.core.args import SDPA, bound_args
from tokpipe_compiler.core.errors import NoTokenInput, TokpipeError
from tokpipe_compiler.core.fx import (
    argument_of,
    example_value,
    input_label,
    is_user_input,
    node_shape,
    position_of,
)

ATTENTION_OPS = (F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention)
EMBEDDING_OPS = (F.embedding, torch.embedding)
# Argument names of conditioning streams (text, image embeddings) in diffusers' models.
CONDITIONING = ("encoder_hidden_states", "cap_feats", "text_", "prompt_embeds")
# A language model's keys and values of earlier calls (transformers' Cache objects), never
# the call's tokens: a decode step's float inputs of rank 4, beside its one token's id.
PAST_KEYS_VALUES = ("past_key_values", "past_key_value", "cache", "layer_past", "kv_cache",
                    "kv_caches", "cache_params", "mems")
# transformers' Cache objects, however passed: cache.layers[0].keys, cache.key_cache[0]
_CACHE_PATH = re.compile(r"\.(layers\[\d+\]\.(keys|values)|key_cache|value_cache)\b")
_RESUMED = re.compile(r"^l_(stack\d+(_\d+)*_)?")  # Dynamo's prefixes of a placeholder name


class UnknownTokenInput(TokpipeError):
    """`token_input` names no input of this graph. The backend tells a misspelt name (an
    error) from a graph of a model split by graph breaks that does not read it."""

    def __init__(self, choice: str, inputs: list[str | int]):
        super().__init__(f"token_input={choice!r} names no input of the graph; its inputs "
                         f"are {inputs}")
        self.choice = choice
        self.inputs = inputs


def find_token_input(gm: torch.fx.GraphModule, choice: str | int | None) -> torch.fx.Node:
    """The placeholder carrying the tokens: named by `choice` (see the module's docstring),
    or found by the graph's structure."""
    inputs = _user_inputs(gm)
    if isinstance(choice, str):
        return _tokens_shaped(_named(inputs, choice), choice)
    if isinstance(choice, int):
        return _tokens_shaped(_positional(inputs, choice), choice)
    candidates = _candidates(inputs)
    return max(candidates, key=_ranking(gm, candidates))


def piece_token_input(gm: torch.fx.GraphModule) -> torch.fx.Node:
    """The token input of a piece: found as by find_token_input, conditioning streams last
    (see the module's docstring)."""
    candidates = _candidates(_user_inputs(gm))
    rank = _ranking(gm, candidates)
    return max(candidates, key=lambda n: (not is_conditioning(n), rank(n)))


def is_conditioning(node: torch.fx.Node) -> bool:
    """Whether the input's name is one diffusers gives a conditioning stream (a value a
    resume function after a graph break holds on its stack keeps the name after Dynamo's
    `l_stack0_1_` prefix)."""
    name = str(argument_of(node) or node.name)
    return _RESUMED.sub("", name).startswith(CONDITIONING)


def _user_inputs(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder" and is_user_input(n)]


def _candidates(inputs: list[torch.fx.Node]) -> list[torch.fx.Node]:
    """Float inputs of rank >= 3; where there are none, token ids (a language model's)."""
    candidates = [n for n in inputs if _is_float(n) and len(node_shape(n)) >= 3
                  and not _past_keys_values(n)] or _token_ids(inputs)
    if not candidates:
        raise NoTokenInput(
            "no input looks like a token sequence (a float tensor of rank >= 3, or token "
            "ids [batch, tokens] looked up in an embedding); pass "
            "options={'token_input': NAME} to name it"
        )
    return candidates


def _past_keys_values(node: torch.fx.Node) -> bool:
    """Whether the input is read off a language model's cache of earlier calls' keys and
    values (`cache.layers[0].keys`, `past_key_values[0][0]`)."""
    label = input_label(node) or ""
    return re.split(r"[.\[]", label, maxsplit=1)[0] in PAST_KEYS_VALUES or \
        _CACHE_PATH.search(label) is not None


def _token_ids(inputs: list[torch.fx.Node]) -> list[torch.fx.Node]:
    """Integer [batch, tokens] inputs looked up in an embedding table, best first (ties in
    the ranking go to the earlier): `input_ids` by name, then the larger table (GPT-2's
    positions and token types index tables of their own, smaller than the vocabulary
    where the config is a released one)."""
    found = []
    for node in inputs:
        value = example_value(node)
        if isinstance(value, torch.Tensor) and value.dim() == 2 and \
                not value.is_floating_point() and value.dtype != torch.bool:
            table = _looked_up(node)
            if table is not None:
                found.append((argument_of(node) != "input_ids", -node_shape(table)[0], node))
    return [node for *_, node in sorted(found, key=lambda f: f[:2])]


def _looked_up(node: torch.fx.Node, depth: int = 3) -> torch.fx.Node | None:
    """The embedding table `node`, or a view of it (GPT-2's `input_ids.view(-1, L)`),
    indexes (None: none)."""
    for user in node.users:
        if user.target in EMBEDDING_OPS and user.args[:1] == (node,):
            return user.args[1]
        if depth and user.target in _ID_VIEWS and user.args[:1] == (node,):
            table = _looked_up(user, depth - 1)
            if table is not None:
                return table
    return None


_ID_VIEWS = ("view", "reshape", "contiguous", torch.reshape)


def _named(inputs: list[torch.fx.Node], choice: str) -> torch.fx.Node:
    for node in inputs:
        # The placeholder's own name still works for graphs without Dynamo's sources.
        if choice in (argument_of(node), node.name, node.target):
            return node
    raise UnknownTokenInput(choice, [_shown(n) for n in inputs])


def _tokens_shaped(node: torch.fx.Node, choice: str | int) -> torch.fx.Node:
    """`node`, chosen by `token_input`, where it can carry tokens: a tensor with a batch
    and a token axis at least (a label or a timestep has no token axis)."""
    value = example_value(node)
    if not isinstance(value, torch.Tensor) or value.dim() < 2:
        shown = (f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor)
                 else f"a {type(value).__name__}")
        raise TokpipeError(f"token_input={choice!r} is {shown}, which has no token axis: "
                           "name the input that carries the tokens (the latents, or a "
                           "sequence [batch, tokens, ...]), or leave token_input out to have "
                           "it found")
    return node


def _positional(inputs: list[torch.fx.Node], choice: int) -> torch.fx.Node:
    for node in inputs:
        if position_of(node) == choice:  # a position in *args
            return node
    if not 0 <= choice < len(inputs):
        raise TokpipeError(f"token_input={choice} is out of range: {len(inputs)} inputs "
                           f"{[_shown(n) for n in inputs]}")
    return inputs[choice]


def _ranking(gm: torch.fx.GraphModule, candidates: list[torch.fx.Node]):
    """Sort key of a candidate: (reaches the output, shape match, not named as a
    conditioning stream, size, earlier)."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    reached = _value_ancestors(output)
    outputs = [node_shape(n) for n in output.all_input_nodes if node_shape(n) is not None]
    order = {node: i for i, node in enumerate(candidates)}

    def key(node: torch.fx.Node) -> tuple:
        shape = node_shape(node)
        match = max((_shape_match(shape, out) for out in outputs), default=0)
        return node in reached, match, not is_conditioning(node), shape.numel(), -order[node]

    return key


def _shape_match(shape: torch.Size, out: torch.Size) -> int:
    """3: equal; 2: same rank, one axis differs (channels); 1: equal element count; 0."""
    if shape == out:
        return 3
    if len(shape) == len(out) and sum(a != b for a, b in zip(shape, out, strict=True)) == 1:
        return 2
    return 1 if shape.numel() == out.numel() else 0


def _value_ancestors(node: torch.fx.Node) -> set[torch.fx.Node]:
    """The nodes `node` is computed from, not following attention masks."""
    seen: set[torch.fx.Node] = set()
    stack = list(node.all_input_nodes)
    while stack:
        current = stack.pop()
        if current not in seen:
            seen.add(current)
            stack.extend(_value_inputs(current))
    return seen


def _value_inputs(node: torch.fx.Node) -> list[torch.fx.Node]:
    """A node's inputs, but for the mask of a scaled_dot_product_attention."""
    if node.op != "call_function" or node.target not in ATTENTION_OPS:
        return node.all_input_nodes
    mask = bound_args(node, SDPA).get("attn_mask")
    return [n for n in node.all_input_nodes if n is not mask]


def seed_axes(node: torch.fx.Node) -> list[int]:
    """Candidate token axes, in order: rows of an image latent [B, C, H, W]; the sequence of
    tokens [B, L, D] (or [B, C, L]) or ids [B, L]; frames of a video [B, C, F, H, W] (or
    [B, F, C, H, W]). A video of one frame (an image in a video model's layout, Z-Image's
    [B, C, 1, H, W]) is cut along its rows, axis 3 in both layouts: one frame is one grid
    row, which no chunking can cut."""
    shape = node_shape(node)
    if len(shape) == 5:
        return list(dict.fromkeys(3 if shape[a] == 1 else a for a in (2, 1)))
    return {2: [1], 3: [1, 2], 4: [2]}.get(len(shape), [1])


def _shown(node: torch.fx.Node) -> str | int:
    argument = argument_of(node)
    return node.name if argument is None else argument


def _is_float(node: torch.fx.Node) -> bool:
    value = example_value(node)
    return isinstance(value, torch.Tensor) and value.is_floating_point()
