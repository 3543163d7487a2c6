"""``nn.LayerNorm`` and ``nn.RMSNorm`` over the trailing ``normalized_shape``, any leading dims,
and the RMSNorm classes of libraries (transformers' ``LlamaRMSNorm`` and its kin).

The affine weight multiplies the normalised input ``x_hat``, so datum b's weight gradient is
``sum_n g_{b,n} * x_hat_{b,n}`` and its bias gradient ``sum_n g_{b,n}``. ``x_hat`` is recomputed
from the captured input with the same functional op as the forward (one elementwise pass).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from gradlog.errors import BackendError
from gradlog.rules.base import (
    Capture,
    RuleResult,
    attributes,
    forward_call,
    register_rule,
    widen,
)

__all__ = [
    "is_layer_norm_like",
    "is_rms_norm_like",
    "layer_norm",
    "layer_norm_like",
    "per_datum_sum",
    "rms_norm",
    "rms_norm_like",
]

_WEIGHT_BIAS = attributes("weight", "bias")  # not e.g. prune's weight_orig


def per_datum_sum(t: torch.Tensor, batch_size: int, n_trailing: int) -> torch.Tensor:
    """Sum ``t`` (B, ..., *trailing) over the middle dimensions: (B, *trailing)."""
    trailing = t.shape[t.dim() - n_trailing :]
    if t.dim() < n_trailing + 1 or t.shape[0] != batch_size:
        raise BackendError(
            f"normalisation input of shape {tuple(t.shape)} has no batch dimension of size "
            f"B={batch_size} before its normalised dimensions {tuple(trailing)}."
        )
    return t.reshape(batch_size, -1, *trailing).sum(1)  # (B, *trailing)


def _normalized_dims(module: nn.Module) -> int:
    return len(cast(tuple[int, ...], module.normalized_shape))


def _affine(
    x_hat: torch.Tensor, cap: Capture, wanted: frozenset[str], n_trailing: int, dtype: torch.dtype,
    channels_first: bool = False,
) -> RuleResult:
    B = cap.batch_size
    g = cap.grad_output.to(dtype)  # (B, ..., *shape)
    if channels_first:  # (B, C, ...): the features last
        g, x_hat = g.movedim(1, -1), x_hat.movedim(1, -1)
    out: RuleResult = {}
    if "weight" in wanted:
        out["weight"] = per_datum_sum(g * x_hat.to(dtype), B, n_trailing).mul_(cap.scale)
    if "bias" in wanted:
        out["bias"] = per_datum_sum(g, B, n_trailing).mul_(cap.scale)  # (B, *shape)
    return out


@register_rule(nn.LayerNorm, name="layer_norm", feature_dims=_normalized_dims,
               covers=_WEIGHT_BIAS)
def layer_norm(module: nn.LayerNorm, cap: Capture, wanted: frozenset[str]) -> RuleResult:
    """LayerNorm: ``x_hat = (x - mean) / sqrt(var + eps)`` over ``normalized_shape``."""
    shape, dtype = tuple(module.normalized_shape), _param_dtype(module)
    x = widen(cap.input, dtype)  # autocast: normalise in the parameters' precision
    x_hat = F.layer_norm(x, shape, None, None, module.eps)  # (B, ..., *shape)
    return _affine(x_hat, cap, wanted, len(shape), dtype)


def _param_dtype(module: nn.Module) -> torch.dtype:
    weight = getattr(module, "weight", None)  # (a plain attribute read: no generator)
    if isinstance(weight, torch.Tensor):
        return weight.dtype
    return next(module.parameters()).dtype


if hasattr(nn, "RMSNorm"):  # torch >= 2.4

    @register_rule(nn.RMSNorm, name="rms_norm", feature_dims=_normalized_dims,
                   covers=attributes("weight"))
    def rms_norm(module: nn.RMSNorm, cap: Capture, wanted: frozenset[str]) -> RuleResult:
        """RMSNorm: ``x_hat = x / sqrt(mean(x^2) + eps)`` over ``normalized_shape``."""
        shape, dtype = tuple(module.normalized_shape), _param_dtype(module)
        x = widen(cap.input, dtype)  # autocast: normalise in the parameters' precision
        x_hat = F.rms_norm(x, shape, None, module.eps)  # (B, ..., *shape)
        return _affine(x_hat, cap, wanted, len(shape), dtype)


_EPSILON = ("variance_epsilon", "eps", "epsilon")  # (transformers: Llama's, Gemma's, ...)


def _epsilon(module: nn.Module) -> float | None:
    for name in _EPSILON:
        value = getattr(module, name, None)
        if isinstance(value, (float, int)) and not isinstance(value, bool):
            return float(value)
    return None


def is_rms_norm_like(module: nn.Module) -> bool:
    """An RMSNorm class of a library's or the user's own (transformers' ``LlamaRMSNorm``,
    ``GemmaRMSNorm``, ``T5LayerNorm``, ...: no common base, so matched by name): one weight
    over the last dimension and an epsilon. Its forward is replayed before it is trusted."""
    if not type(module).__name__.endswith(("RMSNorm", "T5LayerNorm")):
        return False
    params = dict(module.named_parameters(recurse=False))
    if set(params) != {"weight"} or params["weight"].dim() != 1:
        return False
    if any(True for child in module.children() for _ in child.parameters()):
        return False
    return _epsilon(module) is not None


@register_rule(name="rms_norm_like", accepts=is_rms_norm_like, feature_dims=lambda m: 1,
               covers=attributes("weight"))
def rms_norm_like(module: nn.Module, cap: Capture, wanted: frozenset[str]) -> RuleResult:
    """``w * x_hat`` or ``(1 + w) * x_hat`` (Gemma), ``x_hat = x / sqrt(mean(x^2) + eps)``
    in float32 at least, as transformers computes it: either way datum b's weight gradient is
    ``sum_n g * x_hat``. Another forward (a gate argument, another normalisation) fails the
    replay and is re-run per datum."""
    from gradlog.rules.func import generic
    from gradlog.rules.replay import replays

    tensors = [t for t in (*cap.args, *cap.kwargs.values()) if isinstance(t, torch.Tensor)]
    weight, eps = module.weight, _epsilon(module)
    if len(tensors) != 1 or eps is None or not isinstance(weight, torch.Tensor):
        return generic(module, cap, wanted)
    dtype = _param_dtype(module)
    x = tensors[0].to(torch.promote_types(dtype, torch.float32))
    x_hat = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)  # (B, ..., d)
    def formula() -> tuple[torch.Tensor, torch.Tensor]:  # (at the module's weight)
        w = weight.detach().to(x_hat.dtype)
        return w * x_hat, (1 + w) * x_hat

    own = (lambda: module.forward(tensors[0]), formula)  # (run on the first call only)
    if not replays(module, "", *_probes(module, tensors[0], eps), x.shape[-1], torch.float32,
                   own):
        return generic(module, cap, wanted)
    return _affine(x_hat, cap, wanted, 1, dtype)


def _probes(module: nn.Module, x: torch.Tensor, eps: float) -> tuple[
        Callable[[], torch.Tensor], Callable[[], tuple[torch.Tensor, ...]]]:
    """The module's forward and the formula's candidates on the call's input, in float64,
    at two random weights: a weight at its initial value (0 for Gemma's, 1 for Llama's) would
    not tell ``w * x_hat`` from ``(1 + w) * x_hat`` from a norm of ``x * (1 + w)``, and
    float64 leaves only the module's own rounding (transformers' float32) to allow for."""
    made: dict[str, torch.Tensor] = {}  # (built on the first call only: replays caches)

    def probe() -> tuple[torch.Tensor, torch.Tensor]:
        if not made:
            x64 = x.detach().to(torch.float64)
            generator = torch.Generator().manual_seed(0)
            made["x"] = x64
            made["w"] = torch.randn(2, x.shape[-1], dtype=torch.float64,
                                    generator=generator).to(x.device)
        return made["x"], made["w"]

    def theirs() -> torch.Tensor:
        x64, w = probe()
        return torch.stack([forward_call(module, {"weight": w_}, (x64,)) for w_ in w])

    def ours() -> tuple[torch.Tensor, ...]:
        x64, w = probe()
        x_hat = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
        return torch.stack([w_ * x_hat for w_ in w]), torch.stack([(1 + w_) * x_hat for w_ in w])

    return theirs, ours


def is_layer_norm_like(module: nn.Module) -> bool:
    """A LayerNorm class of a library's or the user's own, other than ``nn.LayerNorm``'s
    forward (transformers' ``CohereLayerNorm``, ``NemotronLayerNorm1P``, ``DebertaLayerNorm``,
    ConvNeXt's, SAM's, and T5-style RMS norms named ``...LayerNorm``: Pix2Struct's, Udop's,
    SwitchTransformers'): one weight over the last dimension, maybe a bias of its size, and
    an epsilon. Its forward is replayed before it is trusted (:func:`layer_norm_like`)."""
    if not type(module).__name__.endswith(("LayerNorm", "LayerNorm1P")):
        return False
    if isinstance(module, nn.LayerNorm) and type(module).forward is nn.LayerNorm.forward:
        return False  # (nn.LayerNorm's rule)
    params = dict(module.named_parameters(recurse=False))
    if set(params) not in ({"weight"}, {"weight", "bias"}) or params["weight"].dim() != 1 or (
            "bias" in params and params["bias"].shape != params["weight"].shape):
        return False
    if any(True for child in module.children() for _ in child.parameters()):
        return False
    return _epsilon(module) is not None


def _layer(x: torch.Tensor, eps: float, dim: int) -> torch.Tensor:
    return (x - x.mean(dim, keepdim=True)) * torch.rsqrt(
        x.var(dim, unbiased=False, keepdim=True) + eps)


def _rms(x: torch.Tensor, eps: float, dim: int) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(dim, keepdim=True) + eps)


_NORMALISED: dict[str, tuple[Callable[[torch.Tensor, float, int], torch.Tensor], int]] = {
    "layer": (_layer, -1),  # x_hat, and the dimension it normalises (the weight's), by what
    "rms": (_rms, -1),  # a replay may find the forward does
    "layer, channels first": (_layer, 1),  # ((B, C, H, W): ConvNeXt's, SAM's)
}


def _along(p: torch.Tensor, dim: int, ndim: int) -> torch.Tensor:
    """A ``(d,)`` weight or bias shaped to broadcast along dimension ``dim`` of ``ndim``."""
    return p if dim == -1 or ndim < 3 else p.view(-1, *[1] * (ndim - 2))


_FOUND: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()
"""Which ``x_hat`` of :data:`_NORMALISED` each module's forward was found computing."""


@register_rule(name="layer_norm_like", accepts=is_layer_norm_like, feature_dims=lambda m: 1,
               covers=_WEIGHT_BIAS)
def layer_norm_like(module: nn.Module, cap: Capture, wanted: frozenset[str]) -> RuleResult:
    """``w * x_hat + b`` or ``(1 + w) * x_hat + b`` (Nemotron's), the bias optional, with
    ``x_hat`` a layer norm's or an RMS norm's over the last dimension, or a layer norm's over
    the channels of ``(B, C, ...)`` (ConvNeXt's ``channels_first``), in float32 at least:
    datum b's weight gradient is ``sum_n g * x_hat``, its bias's ``sum_n g``. Which ``x_hat``
    it is, the first call's forward at random weights tells; the replay then checks that
    one (:func:`.replay.replays`). Another forward (another normalisation) matches none and
    is re-run per datum."""
    from gradlog.rules.func import generic
    from gradlog.rules.replay import replays

    tensors = [t for t in (*cap.args, *cap.kwargs.values()) if isinstance(t, torch.Tensor)]
    weight, eps = module.weight, _epsilon(module)
    if len(tensors) != 1 or eps is None or not isinstance(weight, torch.Tensor):
        return generic(module, cap, wanted)
    bias = getattr(module, "bias", None)
    bias = bias if isinstance(bias, torch.Tensor) else None
    dtype = _param_dtype(module)
    x = tensors[0].to(torch.promote_types(dtype, torch.float32))
    found = _FOUND.get(module)
    if found is None:
        found = _FOUND[module] = _which(module, tensors[0], eps, bias is not None)
    normalised, dim = _NORMALISED[found]

    def formula() -> tuple[torch.Tensor, torch.Tensor]:  # (at the module's weight and bias)
        x_hat = normalised(x, eps, dim)
        w = _along(weight.detach().to(x_hat.dtype), dim, x_hat.dim())
        b = 0 if bias is None else _along(bias.detach().to(x_hat.dtype), dim, x_hat.dim())
        return w * x_hat + b, (1 + w) * x_hat + b

    own = (lambda: module.forward(tensors[0]), formula)  # (run on the first call only)
    theirs, ours = _affine_probes(module, tensors[0], eps, found, bias is not None)
    width = x.shape[dim] if x.dim() > max(dim, 0) else 0
    if not replays(module, found, theirs, ours, width, torch.float32, own) or (
            width != weight.shape[0]):  # (a call of another layout than the first's)
        return generic(module, cap, wanted)
    return _affine(normalised(x, eps, dim), cap, wanted, 1, dtype, channels_first=dim == 1)


def _which(module: nn.Module, x: torch.Tensor, eps: float, biased: bool) -> str:
    """The ``x_hat`` (:data:`_NORMALISED`) whose candidates the module's forward gives at
    random weights, in float64 (the first, when none does: its replay then fails)."""
    from gradlog.rules.replay import close

    for variant, (_, dim) in _NORMALISED.items():
        try:
            with torch.no_grad():
                theirs, ours = _affine_probes(module, x, eps, variant, biased)
                got = theirs()
                if any(close(got, c, x.shape[dim], torch.float32) for c in ours()):
                    return variant
        except Exception:  # (a forward that takes other arguments, an input this variant
            continue  # cannot normalise: the replay says so)
    return next(iter(_NORMALISED))


def _affine_probes(module: nn.Module, x: torch.Tensor, eps: float, variant: str, biased: bool
                   ) -> tuple[Callable[[], torch.Tensor], Callable[[], tuple[torch.Tensor, ...]]]:
    """:func:`_probes` for a norm with a bias: the forward and the formula's candidates
    (``variant`` of :data:`_NORMALISED`) in float64 at two random weights and biases."""
    normalised, dim = _NORMALISED[variant]
    made: dict[str, torch.Tensor] = {}  # (built on the first call only: replays caches)

    def probe() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not made:
            generator = torch.Generator().manual_seed(0)
            made["x"] = x.detach().to(torch.float64)
            made["w"], made["b"] = torch.randn(2, 2, x.shape[dim], dtype=torch.float64,
                                               generator=generator).to(x.device)
            if not biased:
                made["b"] = torch.zeros_like(made["b"])
        return made["x"], made["w"], made["b"]

    def theirs() -> torch.Tensor:
        x64, w, b = probe()
        return torch.stack([
            forward_call(module, {"weight": w_, "bias": b_} if biased else {"weight": w_},
                            (x64,)) for w_, b_ in zip(w, b, strict=True)])

    def ours() -> tuple[torch.Tensor, ...]:
        x64, w, b = probe()
        x_hat = normalised(x64, eps, dim)
        pairs = [(_along(w_, dim, x_hat.dim()), _along(b_, dim, x_hat.dim()))
                 for w_, b_ in zip(w, b, strict=True)]
        return (torch.stack([w_ * x_hat + b_ for w_, b_ in pairs]),
                torch.stack([(1 + w_) * x_hat + b_ for w_, b_ in pairs]))

    return theirs, ours
