"""Text segments computed once a step: by its first chunk, not by every chunk.

Joint attention carries the text tokens whole with every chunk (`segments.py`), so a step
of M chunks computes the text stream M times: at 512 text tokens and 4096 image tokens
(Flux at 1024 px), 4 chunks do 1.33x the work of one whole pass. In stale mode a chunk
attends to the other chunks' K/V as the caches hold them; the text's can be held the same
way. So only the step's first chunk computes the text, and writes its K/V to the caches
(`chunking.assemble` keeps its copy of the text stream); every later chunk runs its graph
without the segments:

    q = cat([txt_q, img_q], 2)      [1, 2, 512 + n, 64]   ->   q = cat([img_q], 2)  [1, 2, n, 64]
    kv_attention(..., lead=512)                            ->   kv_attention(..., segments=False)
    txt = out[:, :512]; txt + ...                          ->   (dead)

and attends to the text's K/V as the first chunk of its step left them in the cache.
A value that is only a segment (the text stream) gets zero rows there, and a stage output
of that kind an empty tensor, which the transports send as nothing.
"""

from __future__ import annotations

import torch
import torch.fx

from tokpipe_compiler.core.args import arg
from tokpipe_compiler.core.errors import TokpipeError, describe
from tokpipe_compiler.core.fx import example_value
from tokpipe_compiler.core.meta import INVARIANT_INFO, META_KEY, TokenInfo
from tokpipe_compiler.passes.split import live_nodes
from tokpipe_compiler.runtime.kv_attention import kv_attention

_CATS = (torch.cat, torch.concat, torch.concatenate)
_EVERY = "pass options={'text_chunks': 'every'} to compute the text in every chunk"


def _info(node: object) -> TokenInfo:
    if isinstance(node, torch.fx.Node):
        return node.meta.get(META_KEY, INVARIANT_INFO)
    return INVARIANT_INFO


def _joins_segments(node: torch.fx.Node) -> bool:
    """A concatenation along the token axis that puts segments around a chunk's rows."""
    info = _info(node)
    if node.target not in _CATS or not (info.carries_tokens and info.segmented
                                        and info.per_unit):
        return False
    return arg(node, 1, "dim", 0) % example_value(node).dim() == info.axis


def why_kept(gm: torch.fx.GraphModule) -> str:
    """Why every chunk of a step must compute the text segments itself ('' if it need not).
    Sums over a token axis that holds segments are refused before (annotate); what is left
    is a value computed from the text that meets the image rows other than in attention."""
    for node in gm.graph.nodes:
        if _info(node).only_segment:
            for user in node.users:
                if user.op != "output" and not _info(user).only_segment \
                        and not _joins_segments(user):
                    return f"{describe(user)} reads the text segment {node.name} " \
                           "other than by joining it to the image tokens"
    return ""


def drop_segments(graph: torch.fx.Graph) -> None:
    """Rewrites a stage graph already sized for a chunk without segments (`specialize`):
    joins leave the segments out, attention reads them from its cache, outputs that are
    only segments become empty, and what computed the segments is removed."""
    for node in graph.nodes:
        if node.target is kv_attention and _info(arg(node, 1, "k")).segmented:
            node.kwargs = {**node.kwargs, "segments": False}
        elif _joins_segments(node):
            pieces = [p for p in arg(node, 0, "tensors") if _info(p).per_unit]
            node.args = (pieces, _info(node).axis)
            node.kwargs = {}
    output = next(n for n in graph.nodes if n.op == "output")
    reference = _rows_input(graph)
    with graph.inserting_before(output):
        output.args = (tuple(_empty_if_segment(graph, v, reference) for v in output.args[0]),)
    _drop_dead(graph)
    # Attention among text tokens alone (QwenImage 2.1's text segment over its own keys)
    # writes no rows here and its output is unused: DCE keeps it only because it writes.
    for node in list(graph.nodes):
        if node.target is kv_attention and not node.users \
                and _info(arg(node, 1, "k")).only_segment:
            graph.erase_node(node)
    _drop_dead(graph)
    for node in graph.nodes:
        if node.op == "call_function" and node.target is not kv_attention \
                and _info(node).only_segment:
            raise TokpipeError(f"{describe(node)} still computes the text segment in a "
                               f"chunk that leaves it to the step's first chunk; {_EVERY}")


def _drop_dead(graph: torch.fx.Graph) -> None:
    """Removes what the graph no longer needs, keeping the in-place writes into what it
    needs (`split.live_nodes`)."""
    live = live_nodes(graph)
    for node in reversed(list(graph.nodes)):
        if node not in live and node.op != "placeholder":
            graph.erase_node(node)


def _rows_input(graph: torch.fx.Graph) -> torch.fx.Node:
    """A stage input holding the chunk's rows: empty outputs are made on its device."""
    for node in graph.nodes:
        if node.op == "placeholder" and _info(node).carries_tokens and _info(node).per_unit:
            return node
    raise TokpipeError("a stage without the chunk's rows among its inputs cannot leave the "
                       f"text segments to the step's first chunk; {_EVERY}")


def _empty_if_segment(graph: torch.fx.Graph, value: object,
                      reference: torch.fx.Node) -> object:
    if not isinstance(value, torch.fx.Node) or not _info(value).only_segment:
        return value
    full = example_value(value)
    shape = list(full.shape)
    shape[_info(value).axis] = 0
    empty = graph.call_method("new_empty", (reference, tuple(shape)), {"dtype": full.dtype})
    empty.meta.update(value.meta)
    return empty

