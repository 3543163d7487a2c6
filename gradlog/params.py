"""Selecting the parameters to record, under the user's own names."""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence

from torch import nn

from gradlog.errors import ParamSelectionError

__all__ = ["clean_name", "select_params"]

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
    return selected
