"""PEFT adapter layers that build a weight or a scaling from their parameters alone.

PEFT's LoRA layers call small ``nn.Linear`` children (their own rule covers them), but other
adapters turn their parameters into a weight, a rotation or a scaling *outside* any layer
call: IA3 multiplies activations by a learned vector, LoHa and LoKr build a weight delta by
Hadamard and Kronecker products, BOFT rotates the base weight, AdaLoRA multiplies ``lora_A``
by ``lora_E``, FourierFT, VB-LoRA, RandLoRA, HRA and C3A build their deltas likewise. Each
datum uses all of such a built tensor, so the op-level capture
(:mod:`gradlog.backends.hooks.operations`) cannot split it and refuses. These rules take the
adapter layer itself as the unit (keyed by PEFT's qualified class names; gradlog does not
import PEFT) and cover the parameters it holds in its ``ParameterDict``/``ModuleDict``
children:

- IA3 (``peft.tuners.ia3.layer.Linear``): a closed form. ``y = base(x) * s`` gives
  ``sum_t g * base(x)``; the feed-forward form ``y = base(x * s)`` gives
  ``sum_t x * (g W)``. One recomputed matmul per call.
- the others: :func:`~gradlog.rules.func.func_grads`, the layer alone re-run per datum (its
  frozen base layer included). Their forwards draw random numbers in training mode even at
  dropout 0 (LoHa/LoKr ``torch.rand(1) > module_dropout``, BOFT's multiplicative dropout
  ``torch.randint``), which a re-run cannot reproduce: with those rates at 0 the draws
  change nothing, so the re-run takes that path in eval mode; a rate above 0 is refused.

The base layer's own parameters stay with the base layer's rule (a recorded bias is the
``nn.Linear`` rule's); a call with PEFT's mixed-adapter batches (``adapter_names=``) is
refused (each datum its adapter: the re-run would give every datum all of them).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from gradlog.rules.base import Capture, RuleResult, one_feature_dim, register_rule, widen
from gradlog.rules.func import func_grads
from gradlog.rules.linear import is_gpt2_conv1d

__all__ = ["BUILT", "IA3"]

IA3 = "peft.tuners.ia3.layer.Linear"

BUILT: dict[str, tuple[str, ...]] = {
    "peft.tuners.loha.layer.Linear": ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b",
                                      "hada_t1", "hada_t2"),
    "peft.tuners.lokr.layer.Linear": ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2",
                                      "lokr_w2_a", "lokr_w2_b", "lokr_t2"),
    "peft.tuners.boft.layer.Linear": ("boft_R", "boft_s"),
    "peft.tuners.adalora.layer.SVDLinear": ("lora_A", "lora_B", "lora_E", "ranknum"),
    "peft.tuners.fourierft.layer.FourierFTLinear": ("fourierft_spectrum",),
    "peft.tuners.hra.layer.HRALinear": ("hra_u",),
    "peft.tuners.vblora.layer.Linear": ("vblora_logits_A", "vblora_logits_B",
                                        "vblora_vector_bank"),
    "peft.tuners.randlora.layer.Linear": ("randlora_lambda", "randlora_gamma"),
    "peft.tuners.c3a.layer.C3ALinear": ("c3a_kernel",),
}
"""PEFT layer (qualified class name) -> the attributes holding its adapter parameters
(``ParameterDict``s by adapter name). VB-LoRA's vector bank is one ``ParameterDict`` that
every layer holds: each layer's call adds its share, as for a tied weight."""


def _held(names: tuple[str, ...]) -> Any:
    def covers(module: nn.Module) -> dict[str, nn.Parameter]:
        out: dict[str, nn.Parameter] = {}
        for attr in names:
            held = getattr(module, attr, None)
            if isinstance(held, nn.Module):
                out.update({f"{attr}.{k}": p for k, p in held.named_parameters()})
        return out

    covers.__name__ = "peft_adapter_params"
    return covers


def _mixed(kwargs: dict[str, Any]) -> str | None:
    if kwargs.get("adapter_names") is not None:
        return ("it is called with adapter_names= (PEFT's mixed-adapter batch: each datum "
                "its own adapter); not yet supported: use backend='loop'.")
    return None


# -- IA3: closed form ---------------------------------------------------------------------

def _ia3_refuse(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    mixed = _mixed(kwargs)
    if mixed is not None:
        return mixed
    base = module.get_base_layer()  # type: ignore[operator]
    # nn.Linear (and its quantisation-free subclasses) or GPT-2's Conv1D
    linear = type(base).__name__ == "Linear" or is_gpt2_conv1d(base)
    if not linear or len(args) != 1 or kwargs:
        return (f"its base layer is a {type(base).__name__} called with {len(args)} positional "
                f"and {len(kwargs)} keyword arguments; gradlog's IA3 rule knows nn.Linear and "
                "GPT-2 Conv1D base layers called on one input only (not yet others): use "
                "backend='loop'.")
    return None


@register_rule(IA3, name="peft_ia3", covers=_held(("ia3_l",)), feature_dims=one_feature_dim,
               refuse=_ia3_refuse)
def ia3_linear(module: Any, cap: Capture, wanted: frozenset[str]) -> RuleResult:
    """``y = base(x) * s`` (or ``base(x * s)`` for feed-forward layers), ``s`` the product of
    the active adapters' vectors: ``sum_t g * base(x)`` (or ``sum_t x * (g W)``), each
    adapter's times the other active adapters' product."""
    vectors = {name: p for name, p in module.ia3_l.items()}
    active = [a for a in module.active_adapters if a in vectors]
    dtype = next(iter(vectors.values())).dtype
    x, g = widen(cap.input, dtype), widen(cap.grad_output, dtype)
    B = cap.batch_size
    out: RuleResult = {}
    used = active and not (module.disable_adapters or module.merged)
    if used:
        base = module.get_base_layer()
        weight = widen(base.weight.detach(), dtype)
        if is_gpt2_conv1d(base):
            weight = weight.T  # GPT-2's Conv1D holds (in, out)
        bias = None if base.bias is None else widen(base.bias.detach(), dtype)
        with torch.no_grad():
            if module.is_feedforward:
                per = (x * (g @ weight)).reshape(B, -1, x.shape[-1]).sum(1)  # (B, in)
            else:
                y = torch.nn.functional.linear(x, weight, bias)  # base(x), recomputed
                per = (g * y).reshape(B, -1, g.shape[-1]).sum(1)  # (B, out)
            per = per * cap.scale
    for path in wanted:
        name = path.split(".", 1)[1]
        p = vectors[name]
        if not used or name not in active:
            out[path] = torch.zeros((B, *p.shape), dtype=p.dtype, device=p.device)
            continue
        others = per
        for a in active:
            if a != name:
                others = others * vectors[a].detach().flatten()
        out[path] = others.reshape(B, *p.shape).to(p.dtype).clone()
    return out


# -- weights built from parameters: the layer re-run per datum -----------------------------

def _rates(module: nn.Module) -> list[tuple[str, float]]:
    """The layer's random draws in training mode: (what, rate) for its active adapters."""
    found: list[tuple[str, float]] = []
    for a in getattr(module, "active_adapters", ()):
        for attr in ("module_dropout", "rank_dropout"):  # LoHa, LoKr (floats by adapter)
            rates = getattr(module, attr, None)
            if isinstance(rates, dict) and a in rates:
                found.append((f"{attr}[{a!r}]", float(rates[a])))
        drops = getattr(module, "boft_dropout", None)  # BOFT's multiplicative dropout
        if isinstance(drops, nn.ModuleDict) and a in drops:
            found.append((f"boft_dropout[{a!r}]", float(getattr(drops[a], "p", 0.0))))
    return found


def _built_refuse(module: nn.Module, args: tuple[Any, ...],
                  kwargs: dict[str, Any]) -> str | None:
    if module.training:
        drawn = [f"{what}={rate}" for what, rate in _rates(module) if rate > 0]
        if drawn:
            return (f"{type(module).__module__}.{type(module).__qualname__} drops adapters at "
                    f"random in training mode ({', '.join(drawn)}), which its per-datum re-run "
                    "cannot reproduce: not yet supported. Set those rates to 0 or use "
                    "backend='loop'.")
    return _mixed(kwargs)


@contextlib.contextmanager
def _without_draws(module: nn.Module) -> Iterator[None]:
    """The layer's own training flag (and BOFT's dropouts) off, every rate being 0: its
    forward is then the same function without drawing (refused otherwise)."""
    flipped = [module] if module.training and isinstance(
        getattr(module, "module_dropout", None), dict) else []  # LoHa, LoKr
    drops = getattr(module, "boft_dropout", None)
    if isinstance(drops, nn.ModuleDict):
        flipped += [m for m in drops.values() if m.training]
    for m in flipped:
        m.training = False
    try:
        yield
    finally:
        for m in flipped:
            m.training = True


def built_adapter(module: nn.Module, cap: Capture, wanted: frozenset[str]) -> RuleResult:
    """The adapter layer alone, re-run per datum (:func:`func_grads`)."""
    params = dict(module.named_parameters(remove_duplicate=False))
    with _without_draws(module):
        return dict(func_grads(module, {k: params[k] for k in wanted}, cap))


for _name, _attrs in BUILT.items():
    register_rule(_name, name="peft_" + _name.split(".")[2], covers=_held(_attrs),
                  uses_torch_func=True, refuse=_built_refuse)(built_adapter)
del _name, _attrs
