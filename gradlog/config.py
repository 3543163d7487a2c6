"""Recorder configuration: one frozen dataclass, validated when built, hashed into the store."""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

from gradlog.errors import ConfigError

__all__ = [
    "BATCH_REDUCTIONS",
    "DEFAULT_FORM",
    "STORAGE_DTYPES",
    "TOKEN_REDUCTIONS",
    "RecorderConfig",
    "form_rules",
]

BATCH_REDUCTIONS = ("mean", "sum")
TOKEN_REDUCTIONS = ("mean", "sum")
STORAGE_DTYPES = ("float32", "float64", "float16", "bfloat16", "bitroundN")
"""Storage dtypes (``bitroundN``: N of 23 mantissa bits kept, e.g. ``bitround9``);
gradlog.store.dtypes and schemas/FORMAT.md section 4.2 give each one's error."""


# Options added after format version 2 shipped, left out of the hashed JSON at their default
# so that stores recorded before them still resume.
_ADDED_LATER: dict[str, Any] = {"batch_grad": "autograd"}
FormRequest: TypeAlias = str | Mapping[str, Any]
"""A form asked for: its name, or ``{"form": name, **options}`` (gradlog.forms)."""

DEFAULT_FORM: tuple[tuple[str, FormRequest], ...] = (("*", "full"),)
"""Every parameter ``full``: what gradlog stored before forms existed."""

_PROJECTING = ("projection", "auto")  # requests that take a projection seed


def form_rules(form: Any) -> tuple[tuple[str, FormRequest], ...]:
    """``form=`` as ``((glob, request), ...)``: a single request applies to ``"*"``; a dict
    without a ``"form"`` key maps globs to requests (first match wins)."""
    if isinstance(form, str) or (isinstance(form, Mapping) and "form" in form):
        return (("*", _frozen(form)),)
    if isinstance(form, Mapping):
        pairs = list(form.items())
    elif isinstance(form, (list, tuple)) and all(
        isinstance(p, (list, tuple)) and len(p) == 2 for p in form
    ):
        pairs = [tuple(p) for p in form]
    else:
        raise ConfigError(
            f"form={form!r} must be a form name ('full', 'factors', 'projection', 'topk', "
            "'norm', 'auto'), a request {'form': 'projection', 'dim': 4096}, or a dict of "
            "glob -> request such as {'blocks.*.mlp.*': 'projection', '*': 'full'}."
        )
    if not pairs:
        raise ConfigError("form={} names no parameter; pass form='full' or some globs.")
    out = []
    for glob, request in pairs:
        if not isinstance(glob, str) or not glob:
            raise ConfigError(f"form globs must be non-empty strings, got {glob!r}.")
        if not isinstance(request, (str, Mapping)):
            raise ConfigError(
                f"form request for {glob!r} is {request!r}; expected a form name or a dict "
                "{'form': name, **options}."
            )
        out.append((glob, _frozen(request)))
    return tuple(out)


def check_forms(rules: Sequence[tuple[str, FormRequest]], budget: Any, seed: Any) -> None:
    """Refuse unknown forms and options now, not at the first backward."""
    from gradlog.forms import ParamInfo, make_form

    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int)
                               or budget < 0):
        raise ConfigError(f"form_budget={budget!r} must be bytes per step (an int >= 0) or None.")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ConfigError(f"projection_seed={seed!r} must be an integer >= 0.")
    try:
        json.dumps([[g, _jsonable(r)] for g, r in rules])
    except (TypeError, ValueError) as e:
        raise ConfigError(f"form options must be JSON values (they are stored): {e}") from None
    # A matrix and a vector: a request that fits neither is wrong whatever it matches; one
    # that fits only one kind of shape is checked against the parameters it matches
    # (planning.check_requests, when the recorder is built).
    dummies = (ParamInfo((8, 8), "factors", tokens=2), ParamInfo((8,)))
    for glob, request in rules:
        failed = []
        for dummy in dummies:
            try:
                make_form(_seeded(request, seed), dummy)
            except ConfigError as e:
                failed.append(e)
        if len(failed) == len(dummies):
            raise ConfigError(f"form for {glob!r}: {failed[0]}") from None


class _FrozenRequest(dict[str, Any]):
    """A request dict that hashes (the config is frozen); compares as a dict."""

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(json.dumps(self, sort_keys=True, default=str))


def _frozen(request: FormRequest) -> FormRequest:
    return request if isinstance(request, str) else _FrozenRequest(request)


def _jsonable(request: FormRequest) -> Any:
    return request if isinstance(request, str) else dict(request)


def _seeded(request: FormRequest, seed: int) -> FormRequest:
    name = request if isinstance(request, str) else request.get("form")
    if name not in _PROJECTING or not seed:
        return request
    options: dict[str, Any] = {"form": request} if isinstance(request, str) else dict(request)
    options.setdefault("seed", seed)
    return options


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
        form: How each parameter's per-datum gradients are kept (:mod:`gradlog.forms`): a
            request (``"full"``, ``"projection"``, ``{"form": "projection", "dim": 4096}``)
            for every parameter, or ``{glob: request}`` where the first matching glob wins
            (parameters no glob matches are ``full``). Stored as ``((glob, request), ...)``.
        form_budget: Bytes per step shared by the ``auto`` parameters (None: no budget).
        projection_seed: Base seed of every projection (mixed with each parameter's name).
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
    form: Any = "full"
    form_budget: int | None = None
    projection_seed: int = 0

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
        object.__setattr__(self, "form", form_rules(self.form))
        check_forms(self.form, self.form_budget, self.projection_seed)
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
        # Runs without forms keep the configuration (and hash) they had before forms existed.
        if self.form == DEFAULT_FORM and self.form_budget is None and not self.projection_seed:
            for key in ("form", "form_budget", "projection_seed"):
                del out[key]
        else:
            out["form"] = [[glob, _jsonable(req)] for glob, req in self.form]
        return out

    def request_for(self, name: str) -> FormRequest:
        """The form request of parameter ``name``: its first matching glob's, else ``full``;
        projection seeds default to :attr:`projection_seed`."""
        return self.rule_for(name)[1]

    def rule_for(self, name: str) -> tuple[str | None, FormRequest]:
        """``(glob, request)`` of parameter ``name``: its first matching glob and that glob's
        request (seeded as in :meth:`request_for`), else ``(None, "full")``."""
        for glob, request in self.form:
            if fnmatch.fnmatchcase(name, glob):
                return glob, _seeded(request, self.projection_seed)
        return None, "full"

    def check_form_globs(self, names: Sequence[str]) -> None:
        """Refuse ``form=`` globs that decide no parameter of ``names``: a glob that matches
        none (a typo) or whose every match an earlier glob takes (first match wins)."""
        for i, (glob, _) in enumerate(self.form):
            matched = [n for n in names if fnmatch.fnmatchcase(n, glob)]
            if not matched:
                shown = ", ".join(names[:20]) + (", ..." if len(names) > 20 else "")
                raise ConfigError(
                    f"form glob {glob!r} matches no recorded parameter, so its request would be "
                    f"ignored. Names are matched with fnmatch against: {shown or '(none)'}."
                )
            earlier = [g for g, _ in self.form[:i]]
            if all(any(fnmatch.fnmatchcase(n, g) for g in earlier) for n in matched):
                first = next(g for g in earlier if fnmatch.fnmatchcase(matched[0], g))
                raise ConfigError(
                    f"form glob {glob!r} matches {', '.join(matched[:6])}"
                    f"{', ...' if len(matched) > 6 else ''}, but an earlier glob ({first!r} for "
                    f"{matched[0]!r}) takes each of them (the first matching glob wins): put "
                    f"{glob!r} before it, or remove it."
                )

    def hash(self) -> str:
        """sha256 of the canonical JSON of the configuration."""
        text = json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()
