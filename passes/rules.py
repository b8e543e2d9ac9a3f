"""The annotate pass's rule table: how each op moves the token axis.

Keyed by `core.ops.op_key`. Each rule module keeps its own table, merged here and only here;
an op with a rule in two tables fails at import. Supporting an op adds a rule to one of
them, not a branch in the pass. Nodes without token inputs are INVARIANT and need no rule.

    view_rules      elementwise ops, views, reshapes, permutations, padding
    axis_rules      indexing, split/chunk, repeats, cat/stack/pad_sequence, softmax, reductions
    compute_rules   contractions, norms, embeddings, attention
    grid_rules      convolution, pooling, nearest resampling, unfold over the token grid
"""

from __future__ import annotations

from typing import Any

from tokpipe_compiler.core.ops import merge_tables
from tokpipe_compiler.passes.axis_rules import AXIS_RULES, IN_PLACE
from tokpipe_compiler.passes.compute_rules import COMPUTE_RULES
from tokpipe_compiler.passes.grid_rules import GRID_RULES
from tokpipe_compiler.passes.rule_base import Rule
from tokpipe_compiler.passes.view_rules import VIEW_RULES

RULES: dict[Any, Rule] = merge_tables(
    {"views": VIEW_RULES, "axis": AXIS_RULES, "compute": COMPUTE_RULES, "grid": GRID_RULES})

__all__ = ["IN_PLACE", "RULES"]
