"""``nn.RNN`` / ``nn.LSTM`` / ``nn.GRU`` (multi-layer, bidirectional, ``batch_first`` either way,
LSTM projections), by :mod:`gradlog.rules.func` (re-run per datum).

The input splits along its batch dimension (0 with ``batch_first``, else 1), the initial
state ``h_0`` (and ``c_0``) along 1; a missing initial state is passed as explicit zeros so
that ``vmap`` sees a batched one. Gradients reaching the final state ``h_n`` (and ``c_n``)
count as well as those reaching the output sequence.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence

from gradlog.errors import UnsupportedLayerError
from gradlog.rules.base import Capture, RuleResult, register_rule
from gradlog.rules.func import LeafSpec, func_grads

__all__ = ["rnn"]


def _batch_dim(module: nn.Module) -> int:
    return 0 if module.batch_first else 1


def _refuse(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    x = args[0] if args else kwargs.get("input")
    if isinstance(x, PackedSequence):
        return ("a call on a PackedSequence is not supported yet; pass a padded tensor (and "
                "mask the loss) or use backend='loop'.")
    if isinstance(x, torch.Tensor) and x.dim() != 3:
        return ("a call on an unbatched (2-D) input is not supported yet; add a batch "
                "dimension or use backend='loop'.")
    return None


@register_rule(nn.RNN, nn.LSTM, nn.GRU, name="rnn", batch_dim=_batch_dim, uses_torch_func=True,
               refuse=_refuse, views_own_result=True)
def rnn(module: nn.RNNBase, cap: Capture, wanted: frozenset[str]) -> RuleResult:
    """Per-datum gradients of every weight and bias of every layer and direction."""
    reason = _refuse(module, cap.args, cap.kwargs)
    if reason is not None:
        raise UnsupportedLayerError(reason)
    x = cap.args[0] if cap.args else cap.kwargs["input"]
    hx = cap.args[1] if len(cap.args) > 1 else cap.kwargs.get("hx")
    B, bd = cap.batch_size, _batch_dim(module)
    lstm = isinstance(module, nn.LSTM)
    if hx is None:
        layers = module.num_layers * (2 if module.bidirectional else 1)
        h_size = module.proj_size if module.proj_size > 0 else module.hidden_size
        h0 = x.new_zeros(layers, B, h_size)  # (layers, B, h_size)
        hx = (h0, x.new_zeros(layers, B, module.hidden_size)) if lstm else h0
    n_state = 2 if lstm else 1
    params = {k: p for k, p in module.named_parameters() if k in wanted}
    out: RuleResult = dict(func_grads(
        module, params, cap, args=(x, hx), kwargs={},
        in_specs=[LeafSpec(bd)] + [LeafSpec(1)] * n_state,  # input; h_0 (, c_0): (layers, B, H)
        out_dims=[bd] + [1] * n_state,  # output; h_n (, c_n)
    ))
    return out
