"""Rules: per-layer formulas from captured (input, output-gradient) to per-datum gradients.

One file per layer family; each registers its rule in :data:`RULES` (by module type, or by
class name for libraries gradlog does not import) with :func:`register_rule`. Modules without
a rule use :data:`GENERIC`, a per-module ``torch.func`` computation. ``README.md`` in this
folder explains how to write a rule.
"""

from __future__ import annotations

from gradlog.rules import (
    adapters,
    attention,
    conv,
    embedding,
    embedding_bag,
    experts,
    group_norm,
    layer_norm,
    linear,
    rnn,
)
from gradlog.rules.base import (
    RULES,
    Capture,
    Rule,
    RuleFn,
    RuleResult,
    find_rule,
    own_params,
    register_rule,
)
from gradlog.rules.func import GENERIC, LeafSpec, active_randomness, func_grads
from gradlog.rules.randomness import track_dropout

__all__ = [
    "GENERIC",
    "RULES",
    "Capture",
    "LeafSpec",
    "Rule",
    "RuleFn",
    "RuleResult",
    "active_randomness",
    "find_rule",
    "func_grads",
    "own_params",
    "register_rule",
    "track_dropout",
]

# The family modules register their rules on import.
del (adapters, attention, conv, embedding, embedding_bag, experts, group_norm, layer_norm, linear,
     rnn)
