"""Recorder configuration: one frozen dataclass, validated when built, hashed into the store."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gradlog.errors import ConfigError

__all__ = ["BATCH_REDUCTIONS", "STORAGE_DTYPES", "TOKEN_REDUCTIONS", "RecorderConfig"]

BATCH_REDUCTIONS = ("mean", "sum")
TOKEN_REDUCTIONS = ("mean", "sum")
STORAGE_DTYPES = ("float32", "float64", "float16", "bfloat16", "bitroundN")
"""Storage dtypes (``bitroundN``: N of 23 mantissa bits kept, e.g. ``bitround9``);
gradlog.store.dtypes and schemas/FORMAT.md section 4.2 give each one's error."""


# Options added after format version 2 shipped, left out of the hashed JSON at their default
# so that stores recorded before them still resume.
_ADDED_LATER: dict[str, Any] = {"batch_grad": "autograd"}


def _choice(name: str, value: object, allowed: Sequence[str]) -> None:
    if value not in allowed:
        raise ConfigError(f"{name}={value!r} is not one of {list(allowed)}; pass one of those.")


@dataclass(frozen=True)
class RecorderConfig:
    """What a :class:`~gradlog.GradRecorder` records and how.

    Attributes:
        params: Glob patterns over ``model.named_parameters()`` names (wrapper prefixes such as
            DDP's ``module.`` stripped); only parameters with ``requires_grad`` are recorded.
        backend: How per-datum gradients are computed; a key of ``gradlog.backends.BACKENDS``.
        batch_reduction: ``p.grad`` is the gradient of ``losses.mean()`` or ``losses.sum()``.
        token_reduction: How ``(B, T)`` per-token losses become a datum's loss: ``mean`` over
            the datum's unmasked tokens or their ``sum``.
        dtype: Storage dtype of gradients: ``float32`` (lossless, default), ``float64``, or
            lossy ``bfloat16``, ``float16`` (underflows for small gradients: not advised) and
            ``bitroundN`` (float32 rounded to N mantissa bits); reads return float32.
        compression: ``none``, ``lz4`` or ``zstd`` (blosc, bitshuffle, level 1); ``auto``
            (default) resolves to ``lz4`` for ``bitroundN`` and ``none`` otherwise, chosen by
            measurement (FORMAT.md section 4.3).
        every: Record every N-th ``backward`` call's step; the others train without recording.
        check_every: Verify ``sum_b w_b g_b == p.grad`` on the first recorded step and every
            N-th after it; 0 disables the check.
        check_rtol: Relative tolerance of that check (on the norm of the difference).
        batch_grad: ``p.grad`` of recorded Linear weights under the hooks backend:
            ``"autograd"`` (default: autograd's own, bitwise as without gradlog) or ``"sum"``
            (``sum_b w_b g_b`` of the per-datum gradients, skipping autograd's weight-gradient
            matmul: faster, equal to float rounding; :mod:`gradlog.backends.fused`).
        vmap_randomness: ``randomness=`` of ``torch.func.vmap`` for the vmap backend
            (``"different"`` gives each datum its own dropout mask, as a batch does).
        metadata: Free-form JSON-serialisable user metadata stored with the run.
    """

    params: tuple[str, ...] = ("*",)
    backend: str = "auto"
    batch_reduction: str = "mean"
    token_reduction: str = "mean"
    dtype: str = "float32"
    every: int = 1
    check_every: int = 100
    check_rtol: float = 1e-4
    vmap_randomness: str = "different"
    metadata: dict[str, Any] = field(default_factory=dict)
    compression: str = "auto"
    batch_grad: str = "autograd"

    def __post_init__(self) -> None:
        from gradlog.backends import BACKENDS

        if isinstance(self.params, str):
            object.__setattr__(self, "params", (self.params,))
        if not self.params or not all(isinstance(p, str) and p for p in self.params):
            raise ConfigError(
                f"params={self.params!r} must be a glob pattern or a non-empty list of them, "
                "e.g. params='*' or params=['blocks.*.mlp.*']."
            )
        object.__setattr__(self, "params", tuple(self.params))
        _choice("backend", self.backend, list(BACKENDS))
        _choice("batch_reduction", self.batch_reduction, BATCH_REDUCTIONS)
        _choice("token_reduction", self.token_reduction, TOKEN_REDUCTIONS)
        from gradlog.store.dtypes import COMPRESSIONS, default_compression, storage_dtype

        storage_dtype(self.dtype)  # raises ConfigError listing the storage dtypes
        _choice("compression", self.compression, ("auto", *COMPRESSIONS))
        if self.compression == "auto":
            object.__setattr__(self, "compression", default_compression(self.dtype))
        _choice("vmap_randomness", self.vmap_randomness, ("different", "same", "error"))
        _choice("batch_grad", self.batch_grad, ("autograd", "sum"))
        if self.batch_grad == "sum" and BACKENDS[self.backend].name != "hooks":
            raise ConfigError(
                f"batch_grad='sum' applies to the hooks backend (backend='auto' or 'hooks'), "
                f"not backend={self.backend!r}: the vmap backend always sums per-datum "
                "gradients into p.grad and the loop backend never does."
            )
        for name in ("every", "check_every"):
            value = getattr(self, name)
            minimum = 1 if name == "every" else 0
            if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
                raise ConfigError(f"{name}={value!r} must be an integer >= {minimum}.")
        if not (isinstance(self.check_rtol, (int, float)) and self.check_rtol > 0):
            raise ConfigError(f"check_rtol={self.check_rtol!r} must be a positive number.")
        try:
            json.dumps(self.metadata)
        except (TypeError, ValueError) as e:
            raise ConfigError(
                f"metadata must be JSON-serialisable (it is stored in the run's attributes): {e}"
            ) from None

    def to_json(self) -> dict[str, Any]:
        """The configuration as plain JSON values (lists for tuples)."""
        out = dataclasses.asdict(self)
        out["params"] = list(self.params)
        for name, default in _ADDED_LATER.items():
            if out[name] == default:  # stores recorded before the option keep their hash
                del out[name]
        return out

    def hash(self) -> str:
        """sha256 of the canonical JSON of the configuration."""
        text = json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()
