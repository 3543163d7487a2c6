"""``nn.MultiheadAttention``, by :mod:`gradlog.rules.func` (re-run per datum).

The forward reads ``out_proj.weight`` / ``out_proj.bias`` directly instead of calling
``out_proj``, so this rule covers them too (``out_proj``'s own hooks would never fire).
Query, key and value split along the batch dimension (0 with ``batch_first``, else 1), the
key padding mask along 0, a 3-D attention mask ``(B * heads, L, S)`` by groups of ``heads``
rows; a 2-D mask is shared.
"""

from __future__ import annotations

import inspect
from typing import Any, cast

import torch
from torch import nn

from gradlog.errors import UnsupportedLayerError
from gradlog.rules.base import Capture, RuleResult, register_rule
from gradlog.rules.func import LeafSpec, func_grads

__all__ = ["multihead_attention"]

_SIGNATURE = inspect.signature(nn.MultiheadAttention.forward)


def _covers(module: nn.Module) -> dict[str, nn.Parameter]:
    own = dict(module.named_parameters(recurse=False))
    out_proj = cast(nn.Module, module.out_proj)
    own.update({f"out_proj.{k}": p for k, p in out_proj.named_parameters()})
    return own


def _batch_dim(module: nn.Module) -> int:
    return 0 if module.batch_first else 1


def _refuse(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    query = args[0] if args else kwargs.get("query")
    if isinstance(query, torch.Tensor) and query.dim() != 3:
        return ("a call on unbatched (2-D) inputs is not supported yet; add a batch dimension "
                "or use backend='loop'.")
    return None


@register_rule(
    nn.MultiheadAttention,
    name="multihead_attention",
    covers=_covers,
    batch_dim=_batch_dim,
    uses_torch_func=True,
    refuse=_refuse,
    views_own_result=True,  # batch_first: a transpose of out_proj's result
)
def multihead_attention(
    module: nn.MultiheadAttention, cap: Capture, wanted: frozenset[str]
) -> RuleResult:
    """Per-datum gradients of the projections by ``torch.func`` over the captured call."""
    reason = _refuse(module, cap.args, cap.kwargs)
    if reason is not None:
        raise UnsupportedLayerError(reason)
    bound = _SIGNATURE.bind(module, *cap.args, **cap.kwargs)
    arguments = {k: v for k, v in bound.arguments.items() if k != "self"}
    B, bd = cap.batch_size, _batch_dim(module)
    specs: dict[str, LeafSpec] = {"query": LeafSpec(bd), "key": LeafSpec(bd), "value": LeafSpec(bd)}
    if arguments.get("key_padding_mask") is not None:
        specs["key_padding_mask"] = LeafSpec(0)  # (B, S)
    mask = arguments.get("attn_mask")
    if mask is not None and mask.dim() == 3:  # (B * heads, L, S): datum b owns `heads` rows
        arguments["attn_mask"] = mask.reshape(B, module.num_heads, *mask.shape[1:])
        specs["attn_mask"] = LeafSpec(0, unsqueeze=False)  # per datum (heads, L, S)
    params = {k: p for k, p in _covers(module).items() if k in wanted}
    names = list(arguments)  # (as the call passed them: its pre-hooks see the same args)
    at = min(len(cap.args), 3)
    out: RuleResult = dict(func_grads(
        module, params, cap, args=tuple(arguments[k] for k in names[:at]),
        kwargs={k: arguments[k] for k in names[at:]},
        in_specs=[specs.get(k) for k in arguments],
        out_dims=[bd, 0],  # attn_output; attn_weights are (B, ..., L, S) either way
    ))
    return out
