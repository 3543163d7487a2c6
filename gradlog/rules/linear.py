"""Linear layers: ``nn.Linear``, GPT-2 style ``Conv1D`` (transformers) and ``nn.Linear``
subclasses replayed against ``F.linear`` (``FalconLinear``), any leading dims.

For an input ``A`` (B, N, d_in) and output gradient ``G`` (B, N, d_out), with N the product of
the middle dimensions (tokens, pixels, ...), datum b's weight gradient is
``sum_n g_{b,n} a_{b,n}^T = G_b^T A_b``: one batched matmul per layer, the same FLOPs as the
batch's own weight gradient. LoRA adapters are Linear layers and need nothing more.
"""

from __future__ import annotations

import math
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from gradlog.errors import BackendError
from gradlog.grads import Factors, outer_sums
from gradlog.rules.base import (
    Capture,
    RuleResult,
    attributes,
    forward_call,
    one_feature_dim,
    register_rule,
)

__all__ = ["as_rows", "conv1d_gpt2", "is_gpt2_conv1d", "linear"]

_WEIGHT_BIAS = attributes("weight", "bias")  # not e.g. prune's weight_orig


def as_rows(t: torch.Tensor, batch_size: int, width: int, what: str) -> torch.Tensor:
    """View ``t`` (B, ..., width) as (B, N, width), N the product of the middle dimensions."""
    if t.dim() < 2 or t.shape[0] != batch_size or t.shape[-1] != width:
        raise BackendError(
            f"{what} has shape {tuple(t.shape)}; expected (B={batch_size}, ..., {width}) with "
            "the batch first. Keep the batch dimension when calling the layer (a Linear "
            "accepts any leading dimensions), or use backend='loop'."
        )
    if t.dim() == 3:  # already (B, N, width): no view op (two a Linear call)
        return t
    return t.reshape(batch_size, math.prod(t.shape[1:-1]), width)  # (a width of 0 too)


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in ``dtype`` (autocast's narrower inputs widened); as is when it already is."""
    return t if t.dtype == dtype else t.to(dtype)


def _detached(t: torch.Tensor) -> torch.Tensor:
    """``t`` cut from the graph: a captured tensor is detached; a copy the rule made (widened
    under autocast, rules run without grad) already is (a ``detach`` is a dispatcher call)."""
    return t.detach() if t.requires_grad else t


_NARROW = (torch.bfloat16, torch.float16)


def _outer_sum(left: torch.Tensor, right: torch.Tensor, cap: Capture, dtype: torch.dtype,
               narrow: torch.dtype | None) -> torch.Tensor:
    """``scale * left_b^T right_b`` for each b, in ``dtype``: (B, N, p), (B, N, q) ->
    (B, p, q). With ``narrow``, the operands may be held in it (autocast's)."""
    B, N, p = left.shape
    q = right.shape[-1]
    scale = cap.scale
    out = cap.empty((B, p, q), dtype, left.device)  # (B, p, q)
    if N == 1:  # one row per datum: an outer product, cheaper than a k=1 matmul
        left, right = _as(left, dtype), _as(right, dtype)  # (products of 16-bit: in dtype)
        lhs = left[:, 0, :, None] * scale if scale != 1 else left[:, 0, :, None]  # (B, p, 1)
        return torch.mul(lhs, right[:, 0, None, :], out=out)  # (B, p, q)
    return outer_sums(left, right, scale, out, narrow)  # (B, p, q)


@register_rule(nn.Linear, name="linear", feature_dims=one_feature_dim, covers=_WEIGHT_BIAS,
               views_own_result=True)
def linear(module: nn.Linear, cap: Capture, wanted: frozenset[str]) -> RuleResult:
    """``y = x W^T + b`` on (B, ..., d_in): weight ``G_b^T A_b``, bias ``sum_n g_{b,n}``."""
    return _affine(cap, wanted, module.in_features, module.out_features, module.weight.dtype,
                   "Linear", transposed=False)


@register_rule("transformers.models.falcon.modeling_falcon.FalconLinear", name="linear_like",
               feature_dims=one_feature_dim, covers=_WEIGHT_BIAS)
def linear_like(module: nn.Linear, cap: Capture, wanted: frozenset[str]) -> RuleResult:
    """An ``nn.Linear`` subclass with a forward of its own that computes ``x W^T + b`` too
    (transformers' ``FalconLinear``: ``input @ W.T + b``), matched by qualified class name.
    Its first call is replayed in float64 at a random weight and bias against ``F.linear``
    before the Linear's rule is trusted (a forward computing otherwise is re-run per datum)."""
    from gradlog.rules.func import generic
    from gradlog.rules.replay import replays

    tensors = [t for t in (*cap.args, *cap.kwargs.values()) if isinstance(t, torch.Tensor)]
    if len(tensors) != 1 or not module.weight.is_floating_point():
        return generic(module, cap, wanted)
    x, made = tensors[0], cast(dict[str, torch.Tensor], {})

    def probe() -> dict[str, torch.Tensor]:  # (on the first call only: replays caches)
        if not made:
            generator = torch.Generator().manual_seed(0)
            made.update({k: torch.randn(p.shape, dtype=torch.float64, generator=generator)
                         .to(x.device) for k, p in module.named_parameters(recurse=False)})
            made["x"] = x.detach().to(torch.float64)
        return made

    def theirs() -> torch.Tensor:
        at = probe()
        out: torch.Tensor = forward_call(module, {k: v for k, v in at.items() if k != "x"},
                                            (at["x"],))
        return out

    def ours() -> tuple[torch.Tensor]:
        at = probe()
        return (F.linear(at["x"], at["weight"], at.get("bias")),)

    if not replays(module, "", theirs, ours, module.in_features):
        return generic(module, cap, wanted)
    return linear(module, cap, wanted)


def is_gpt2_conv1d(module: nn.Module) -> bool:
    """Whether ``module`` is transformers' GPT-2 ``Conv1D`` (``y = x W + b``, W (d_in, nf)):
    matched by class name and library, so transformers is never imported, and by layout. A
    class of another library or the user's named ``Conv1D`` (a temporal convolution) is
    not: it got this rule by its name, and a wrong formula."""
    cls = type(module)
    weight, nf = getattr(module, "weight", None), getattr(module, "nf", None)
    return (cls.__name__ == "Conv1D" and cls.__module__.split(".")[0] == "transformers"
            and isinstance(weight, nn.Parameter) and weight.dim() == 2 and weight.shape[1] == nf)


@register_rule("Conv1D", name="conv1d_gpt2", feature_dims=one_feature_dim,
               covers=_WEIGHT_BIAS, views_own_result=True, accepts=is_gpt2_conv1d)
def conv1d_gpt2(module: nn.Module, cap: Capture, wanted: frozenset[str]) -> RuleResult:
    """transformers' ``Conv1D`` (GPT-2): ``y = x W + b`` with W (d_in, d_out): weight
    ``A_b^T G_b``. Matched by class name, so transformers is never imported."""
    weight = cast(torch.Tensor, module.weight)  # (d_in, d_out)
    d_in, d_out = weight.shape
    return _affine(cap, wanted, d_in, d_out, weight.dtype, "Conv1D", transposed=True)


def _affine(cap: Capture, wanted: frozenset[str], d_in: int, d_out: int, dtype: torch.dtype,
            what: str, *, transposed: bool) -> RuleResult:
    """Per-datum gradients of an affine layer from its input and output gradient rows: the
    weight ``G_b^T A_b`` (``transposed``: W stored (d_in, d_out), ``A_b^T G_b``), or its
    factors when its form takes them; the bias ``sum_n g_{b,n}``."""
    B = cap.batch_size
    g = as_rows(cap.grad_output, B, d_out, f"{what} output gradient")  # (B, N, d_out)
    # A 16-bit output gradient of float32 weights: the layer ran under autocast, whose matmul
    # took the input in that dtype too; the weight's gradients are those of that matmul.
    # Its operands are then kept in that dtype: factors hold half the memory, and the GPU's
    # tensor cores take them as they are (widened copies were most of a step's added kernels).
    narrow = g.dtype if g.dtype in _NARROW and dtype == torch.float32 else None
    out: RuleResult = {}
    if "weight" in wanted:
        a = as_rows(cap.input, B, d_in, f"{what} input")  # (B, N, d_in)
        if narrow is not None and a.dtype == torch.float32:
            a = a.to(narrow)  # as autocast rounded it
        elif narrow is not None and a.dtype != narrow:
            narrow = None  # not autocast's pattern: no promise about the values
        gw = g if narrow is not None else _as(g, dtype)
        a = a if narrow is not None else _as(a, dtype)
        left, right = (a, gw) if transposed else (gw, a)
        if "weight" in cap.factored:  # never formed: the form encodes from the factors
            out["weight"] = Factors(_detached(left), _detached(right), scale=cap.scale,
                                    narrow=narrow)
        else:  # (B, d_out, d_in) or transposed
            out["weight"] = _outer_sum(left, right, cap, dtype, narrow)
    if "bias" in wanted:
        out["bias"] = _as(g, dtype).sum(1).mul_(cap.scale)  # (B, d_out)
    return out
