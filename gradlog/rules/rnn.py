"""``nn.RNN`` / ``nn.LSTM`` / ``nn.GRU`` (multi-layer, bidirectional, ``batch_first`` either way,
LSTM projections, padded tensors or a ``PackedSequence``), by :mod:`gradlog.rules.func`
(re-run per datum).

The input splits along its batch dimension (0 with ``batch_first``, else 1), the initial
state ``h_0`` (and ``c_0``) along 1; a missing initial state is passed as explicit zeros so
that ``vmap`` sees a batched one. Gradients reaching the final state ``h_n`` (and ``c_n``)
count as well as those reaching the output sequence.

A ``PackedSequence`` holds sequences of different lengths, each datum's its own: the input
and the output gradient are unpacked (to the original batch order, in which ``h_0``/``h_n``
are given too), and the datums of each length ``L`` are re-run together on their first ``L``
steps, a plain tensor call; the per-datum gradients are exactly those of the packed call,
the bidirectional one included (its reverse direction starts at each datum's last step).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pad_packed_sequence

from gradlog.errors import UnsupportedLayerError
from gradlog.rules.base import Capture, RuleResult, register_rule
from gradlog.rules.func import LeafSpec, func_grads

__all__ = ["rnn"]


def _batch_dim(module: nn.Module) -> int:
    return 0 if module.batch_first else 1


def _refuse(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    x = args[0] if args else kwargs.get("input")
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
    if isinstance(x, PackedSequence):
        return _packed(module, cap, wanted, x, hx)
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


def _packed(module: nn.RNNBase, cap: Capture, wanted: frozenset[str], x: PackedSequence,
            hx: Any) -> RuleResult:
    """A call on a ``PackedSequence``: the datums of each length re-run on their own steps."""
    B, bd = cap.batch_size, _batch_dim(module)
    lstm = isinstance(module, nn.LSTM)
    n_state = 2 if lstm else 1
    if int(x.batch_sizes[0]) != B:
        raise UnsupportedLayerError(
            f"the PackedSequence holds {int(x.batch_sizes[0])} sequences for B={B} datums: "
            "one sequence per datum is expected; use backend='loop'."
        )
    padded, lengths = pad_packed_sequence(x, batch_first=True)  # (B, T, D), (B,): datum order
    # leaves of the output: the PackedSequence's 4 fields, then h_n (, c_n)
    g_data = cap.grads[0]
    g_out = None
    if g_data is not None:
        g_seq = PackedSequence(g_data, x.batch_sizes, x.sorted_indices, x.unsorted_indices)
        g_out = pad_packed_sequence(g_seq, batch_first=True)[0]  # (B, T, H_out)
    g_state = [cap.grads[4 + k] if len(cap.grads) > 4 + k else None for k in range(n_state)]
    if hx is None:
        layers = module.num_layers * (2 if module.bidirectional else 1)
        h_size = module.proj_size if module.proj_size > 0 else module.hidden_size
        h0 = padded.new_zeros(layers, B, h_size)  # (layers, B, h_size)
        states = [h0, padded.new_zeros(layers, B, module.hidden_size)] if lstm else [h0]
    else:
        states = list(hx) if lstm else [hx]  # (layers, B, H) each, in datum order
    params = {k: p for k, p in module.named_parameters() if k in wanted}
    out: RuleResult = {k: torch.zeros((B, *p.shape), dtype=p.dtype, device=p.device)
                       for k, p in params.items()}
    for length in torch.unique(lengths).tolist():
        idx = torch.nonzero(lengths == length).flatten().to(padded.device)  # (n,)
        xs = padded[idx, :length]  # (n, L, D)
        gs = None if g_out is None else g_out[idx, :length]  # (n, L, H_out)
        if bd == 1:  # sequence-first layout: (L, n, ...)
            xs = xs.transpose(0, 1)
            gs = None if gs is None else gs.transpose(0, 1)
        st = [s.index_select(1, idx) for s in states]  # (layers, n, H)
        gst = [None if g is None else g.index_select(1, idx) for g in g_state]
        if gs is None and all(g is None for g in gst):
            continue
        group = dataclasses.replace(cap, args=(xs, tuple(st) if lstm else st[0]), kwargs={},
                                    grads=(gs, *gst), batch_size=int(idx.numel()))
        found = func_grads(
            module, params, group, args=(xs, tuple(st) if lstm else st[0]), kwargs={},
            in_specs=[LeafSpec(bd)] + [LeafSpec(1)] * n_state,
            out_dims=[bd] + [1] * n_state,
        )
        for k, v in found.items():
            out[k][idx] = v
    return out
