"""Selecting the parameters to record, under the user's own names."""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from gradlog.errors import (
    FrozenParamError,
    InputError,
    ParamSelectionError,
    UnsupportedLayerError,
)

__all__ = ["check_differentiable", "clean_name", "select_params"]

# Prefixes added by wrappers, never by the user: DDP/DataParallel and torch.compile.
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def clean_name(name: str) -> str:
    """Strip wrapper prefixes (``module.``, ``_orig_mod.``) from a parameter name."""
    stripped = True
    while stripped:
        stripped = False
        for prefix in _WRAPPER_PREFIXES:
            if name.startswith(prefix):
                name, stripped = name[len(prefix) :], True
    return name


def select_params(model: nn.Module, patterns: Sequence[str]) -> dict[str, nn.Parameter]:
    """Parameters of ``model`` whose cleaned name matches any glob in ``patterns``.

    Tied parameters appear once, under the first name ``named_parameters()`` gives them.

    Raises:
        ParamSelectionError: a pattern matches no parameter, or matches only frozen ones.
    """
    named = [(clean_name(n), p) for n, p in model.named_parameters()]
    selected: dict[str, nn.Parameter] = {}
    for pattern in patterns:
        matched = [(n, p) for n, p in named if fnmatch.fnmatchcase(n, pattern)]
        trainable = [(n, p) for n, p in matched if p.requires_grad]
        if not matched:
            names = [n for n, _ in named]
            shown = ", ".join(names[:12]) + (", ..." if len(names) > 12 else "")
            raise ParamSelectionError(
                f"params pattern {pattern!r} matches no parameter of {type(model).__name__}. "
                f"Names are matched with fnmatch against: {shown or '(the model has none)'}."
            )
        if not trainable:
            frozen = ", ".join(n for n, _ in matched[:6])
            raise ParamSelectionError(
                f"params pattern {pattern!r} matches only frozen parameters ({frozen}); they get "
                "no gradient. Set requires_grad=True on them or choose other parameters."
            )
        for n, p in trainable:
            selected.setdefault(n, p)
    _refuse_sparse_grads(model, selected)
    return selected


def _refuse_sparse_grads(model: nn.Module, selected: Mapping[str, nn.Parameter]) -> None:
    """``Embedding``/``EmbeddingBag(sparse=True)`` give sparse gradients, which per-datum
    accumulation, the self-check and the store do not take: refused before any step."""
    recorded = {id(p): n for n, p in selected.items()}
    for name, module in model.named_modules():
        if not isinstance(module, (nn.Embedding, nn.EmbeddingBag)) or module.sparse is not True:
            continue
        # (its registered parameter: reading ``module.weight`` would evaluate a
        # parametrization, and spectral_norm's then steps its power iteration)
        weight = dict(module.named_parameters(recurse=False)).get("weight")
        if id(weight) in recorded:
            raise UnsupportedLayerError(
                f"{type(module).__name__} {name!r} has sparse=True, so autograd gives its "
                f"weight {recorded[id(weight)]!r} a sparse gradient, which gradlog does not "
                "record. Build it with sparse=False (the optimizer then gets a dense gradient; "
                "form='rows' still stores only the rows each datum touched), or leave its "
                "weight out with params=."
            )


def _names(names: Sequence[str], limit: int = 6) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f", ... ({len(names)} in all)" if len(names) > limit else "")


def check_differentiable(
    params: Mapping[str, nn.Parameter], losses: torch.Tensor | None = None
) -> None:
    """Refuse, before any backward, a batch whose recorded gradients autograd cannot give.

    Turns autograd's "One of the differentiated Tensors does not require grad" and "element 0
    of tensors does not require grad and does not have a grad_fn" into errors that name the
    parameters and the fix. ``params`` are the recorded parameters, by recorded name;
    ``losses`` the per-datum losses (not checked if None).

    Raises:
        FrozenParamError: a recorded parameter has ``requires_grad=False`` (frozen after the
            recorder selected it).
        InputError: ``losses`` do not require grad (computed without grad, detached, or
            depending on no trainable parameter, e.g. through a reentrant checkpoint whose
            inputs do not require grad).
    """
    frozen = [n for n, p in params.items() if not p.requires_grad]
    if frozen:
        raise FrozenParamError(
            f"recorded parameter(s) {_names(frozen)} have requires_grad=False (frozen after "
            "the GradRecorder selected them), so autograd computes no gradient for them. "
            "Freeze before creating the GradRecorder (params='*' selects only parameters that "
            "require grad), pass params= patterns that leave them out, or unfreeze them with "
            "p.requires_grad_(True)."
        )
    if losses is not None and not losses.requires_grad:
        raise InputError(
            "the losses do not require grad, so none of the recorded parameters "
            f"({_names(list(params))}) can get a gradient. Causes and fixes: the losses were "
            "computed under torch.no_grad() or .detach()-ed: compute them from the model's "
            "output inside the training step; every parameter they depend on is frozen "
            "(requires_grad=False): unfreeze those you train and record; "
            "torch.utils.checkpoint(..., use_reentrant=True) wraps a segment none of whose "
            "inputs require grad (e.g. after a frozen embedding), so its output carries no "
            "gradient: pass use_reentrant=False, or make the segment's input require grad "
            "(hidden.requires_grad_(True); in transformers, model.enable_input_require_grads())."
        )
