"""Recorder configuration, validated when built.

:class:`RecorderConfig` says what is recorded and how (stored in the run and hashed: a resumed
run must match it); :class:`RecordingOptions` says how this process records (not stored).
Each option is declared and documented once, on one of the two; :func:`split_options` sorts
``GradRecorder``'s keyword options between them and refuses unknown names.
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import hashlib
import json
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeAlias

import numpy as np

from gradlog.backends import BACKENDS
from gradlog.backends.hooks import BATCH_GRADS
from gradlog.errors import ConfigError, InputError
from gradlog.forms import FORMS, ParamInfo, make_form
from gradlog.store.dtypes import COMPRESSIONS, default_compression, storage_dtype
from gradlog.store.writer import DEFAULT_QUEUE_BYTES

if TYPE_CHECKING:
    import torch

__all__ = [
    "BATCH_REDUCTIONS",
    "DEFAULT_FORM",
    "TOKEN_REDUCTIONS",
    "RecorderConfig",
    "RecordingOptions",
    "form_rules",
    "split_options",
]

BATCH_REDUCTIONS = ("mean", "sum")
TOKEN_REDUCTIONS = ("mean", "sum")


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
            f"form={form!r} must be a form name (one of {list(FORMS)}), a request "
            "{'form': 'projection', 'dim': 4096}, or a dict of glob -> request such as "
            "{'blocks.*.mlp.*': 'projection', '*': 'full'}."
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


def _plain_ints(obj: Any, names: Sequence[str]) -> None:
    """Numpy's and other integral scalars as Python ints (they are stored as JSON)."""
    for name in names:
        value = getattr(obj, name)
        if isinstance(value, numbers.Integral) and not isinstance(value, (bool, int)):
            object.__setattr__(obj, name, int(value))


def _choice(name: str, value: object, allowed: Sequence[str]) -> None:
    if value not in allowed:
        raise ConfigError(f"{name}={value!r} is not one of {list(allowed)}; pass one of those.")


@dataclass(frozen=True)
class RecorderConfig:
    """What a :class:`~gradlog.GradRecorder` records and how: stored with the run and hashed
    (``resume=True`` requires the same configuration). Each attribute is also a keyword
    option of ``GradRecorder(model, path, **options)``.

    Attributes:
        params: Glob pattern(s) over ``model.named_parameters()`` names (wrapper prefixes such
            as DDP's ``module.`` and torch.compile's ``_orig_mod.`` stripped); only parameters
            with ``requires_grad`` are recorded.
        backend: How per-datum gradients are computed, a key of ``gradlog.backends.BACKENDS``:
            ``"auto"`` (default: the hooks backend), ``"hooks"`` (per-datum gradients from the
            one ordinary backward), ``"loop"`` (one backward per datum, the reference) or
            ``"vmap"`` (``torch.func``; needs ``GradRecorder.step``).
        batch_reduction: ``p.grad`` is the gradient of ``losses.mean()`` or ``losses.sum()``.
        token_reduction: How ``(B, T)`` per-token losses become a datum's loss: ``mean`` over
            the datum's unmasked tokens or their ``sum``.
        dtype: Storage dtype of gradients: ``float32`` (lossless, default), ``float64``, or
            lossy ``bfloat16``, ``float16`` (underflows for small gradients: not advised) and
            ``bitroundN`` (float32 rounded to N mantissa bits, e.g. ``bitround9``);
            schemas/FORMAT.md section 4.2 gives each one's error. Reads return float32.
        compression: ``none``, ``lz4`` or ``zstd`` (blosc, bitshuffle, level 1); ``auto``
            (default) resolves to ``lz4`` for ``bitroundN`` and ``none`` otherwise, chosen by
            measurement (FORMAT.md section 4.3: lossless compression gains 1.17x on float32
            gradients, not worth a core).
        every: Record every N-th step only (``step % every == 0``); the others train without
            recording.
        check_every: Verify ``sum_b w_b g_b == p.grad`` on the first recorded step and every
            N-th after it; 0 disables the check.
        check_rtol: Relative tolerance of that check (on the norm of the difference).
        vmap_randomness: ``randomness=`` of ``torch.func.vmap`` for the vmap backend
            (``"different"`` gives each datum its own dropout mask, as a batch does).
        metadata: Free-form JSON-serialisable user metadata stored with the run.
        batch_grad: ``p.grad`` of recorded ``nn.Linear``/GPT-2 ``Conv1D`` weights under the
            hooks backend: ``"autograd"`` (default: autograd's own, bitwise as without
            gradlog) or ``"sum"`` (``sum_b w_b g_b`` of the per-datum gradients, skipping
            autograd's weight-gradient matmul: one matmul less per layer, a recorded step
            ~10-25% cheaper, ``p.grad`` equal to float rounding; :mod:`gradlog.backends.fused`).
        form: How each parameter's per-datum gradients are kept (:mod:`gradlog.forms`): a
            request for every parameter (a key of ``gradlog.forms.FORMS`` such as ``"full"``,
            the default, or ``{"form": "projection", "dim": 4096}``), or ``{glob: request}``
            where the first matching glob wins (parameters no glob matches are ``full``).
            Stored as ``((glob, request), ...)``. Planned at the first recorded backward, when
            token counts are known; the plan (bytes per step per parameter) is logged and kept
            in ``GradRecorder.plan``.
        form_budget: Bytes per step shared by the ``auto`` parameters (the most faithful forms
            that fit); None: ``auto`` is the smallest exact form.
        projection_seed: Base seed of every projection (mixed with each parameter's name and
            stored in its spec, so any gradient can be projected alike later: ``run.project``).
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
        _plain_ints(self, ("every", "check_every", "form_budget", "projection_seed"))
        if isinstance(self.params, str):
            object.__setattr__(self, "params", (self.params,))
        if (not isinstance(self.params, (list, tuple)) or not self.params
                or not all(isinstance(p, str) and p for p in self.params)):
            raise ConfigError(
                f"params={self.params!r} must be a glob pattern or a non-empty list of them, "
                "e.g. params='*' or params=['blocks.*.mlp.*']."
            )
        object.__setattr__(self, "params", tuple(self.params))
        _choice("backend", self.backend, list(BACKENDS))
        _choice("batch_reduction", self.batch_reduction, BATCH_REDUCTIONS)
        _choice("token_reduction", self.token_reduction, TOKEN_REDUCTIONS)
        storage_dtype(self.dtype)  # raises ConfigError listing the storage dtypes
        _choice("compression", self.compression, ("auto", *COMPRESSIONS))
        if self.compression == "auto":
            object.__setattr__(self, "compression", default_compression(self.dtype))
        _choice("vmap_randomness", self.vmap_randomness, ("different", "same", "error"))
        _choice("batch_grad", self.batch_grad, BATCH_GRADS)
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
        # None is no metadata; a copy, so that the caller's later changes are not stored.
        try:
            object.__setattr__(self, "metadata", dict(self.metadata or {}))
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


@dataclass(frozen=True)
class RecordingOptions:
    """How this process records a run: not stored with it, not hashed (a resumed run may
    change them). Each attribute is also a keyword option of
    ``GradRecorder(model, path, **options)``.

    Attributes:
        optimizer: If given, each step's learning rate is read from its first param group
            when ``lr`` is not passed; for Adam, AdamW and SGD its state at recorded steps is
            kept too (``optimizer_state``), for ``run.influence(kind="optimizer")``.
        overwrite: Replace an existing gradlog store at ``path`` (a non-store directory is
            never deleted).
        resume: Continue the store at ``path`` after its last committed step (e.g. after a
            crash): its configuration must match this one; records of uncommitted steps are
            discarded; steps continue after the last committed one. Without a store at
            ``path``, recording starts a new one.
        queue_bytes: Capacity, in bytes, of the queue feeding the background writer. When the
            disk is slower than training, ``backward`` blocks until there is room (nothing is
            dropped). A batch larger than the capacity waits for an empty queue. Default: one
            batch's gradients, so one batch is written while the next is computed (about two
            batches of gradients in memory at most).
        durable: ``fsync`` each step's data before committing it, so committed steps survive
            power loss, not only a crash of the process.
        distributed: Record every rank of a torch.distributed run into the one store at
            ``path`` (:mod:`gradlog.distributed`). ``None`` (default): when the model is a
            ``DistributedDataParallel`` and the process group has several ranks. Every rank
            opens the recorder with the same arguments; ``datum_ids`` are global (e.g. from
            ``DistributedSampler``); weights are such that ``sum_b w_b g_b`` over all ranks'
            records equals the all-reduced ``p.grad``. ``False``: this process alone.
        probes: ``(loss_fn, batch)`` of held-out examples whose per-datum gradients are
            recorded at every recorded step (same parameters, same storage), for influence
            exact in time (``run.influence``). ``loss_fn(model, batch)`` returns ``(P,)``
            per-probe or ``(P, T)`` per-token losses (reduced like the training losses;
            ``(loss_fn, batch, mask)`` with a ``(P, T)`` mask of the tokens that count, as
            ``rec.backward``'s ``mask=``). The
            probe gradients are taken by ``torch.autograd.grad`` on a separate forward, once
            per recorded step at its first backward call, after the training backward and at
            the same parameter values; ``p.grad``, the optimizer and the RNG stream that
            training sees are untouched (the forward runs under a forked RNG, in the model's
            current train/eval mode). Costs one forward and one backward batched over the
            probes per recorded step (``P`` backwards where vmap cannot batch an operation).
        probe_ids: One distinct int >= 0 per probe (default ``0 .. P-1``).
        tokens: Rows per datum to provision for ``factors``/``rows`` forms (default: the
            first recorded batch's); a later batch with more tokens per datum is refused.
        planned_steps: Steps the run will record, for the projected store size printed at the
            start (a warning when it exceeds the free disk space).
        records_per_step: Records one step holds (all its micro-batches), over which
            ``form_budget`` is split and for which the plan counts bytes per step. Default:
            the first recorded batch's size, which undercounts under gradient accumulation
            (several ``backward`` calls per step): the forms are planned at the first
            backward, before the step's other micro-batches. If the first recorded step then
            holds more records, ``GradRecorder.plan`` and the projected size are corrected
            when it commits, with a ``UserWarning`` when that exceeds ``form_budget``.
        optimizer_state: What of ``optimizer``'s state is kept at recorded steps, for
            ``run.influence(kind="optimizer")`` (Adam/AdamW: the diagonal preconditioner of
            each recorded parameter; SGD: its momentum settings): ``"auto"`` (float32, and
            bfloat16 for ``projection``/``topk``/``norm`` parameters), ``"float32"``,
            ``"bfloat16"``, or ``"none"``. Its bytes per step are in the plan.
        break_lease: Take over the store's writer lease (one writer per store,
            ``schemas/FORMAT.md`` section 15) when its holder runs on another host and has
            not renewed it for its TTL (5 min): that writer looks dead. A holder of this host
            that is gone is taken over without it; a live one never (``StoreLockedError``).
        watch_ops: When the hooks backend watches the model's forward for uses of recorded
            parameters outside their modules (a tied head written by hand, PEFT's LoRA
            embedding; :mod:`gradlog.backends.hooks.operations`): ``"auto"`` (default: the
            first forwards, every forward once such a use was seen, and the forward after
            one whose module calls changed, that one being checked at every entry instead)
            or ``"always"`` (every forward; ~3% of a small model's CPU step).
    """

    optimizer: torch.optim.Optimizer | None = None
    overwrite: bool = False
    resume: bool = False
    queue_bytes: int | None = DEFAULT_QUEUE_BYTES
    durable: bool = True
    distributed: bool | None = None
    probes: tuple[Any, ...] | None = None
    probe_ids: Any = None
    tokens: int | None = None
    planned_steps: int | None = None
    records_per_step: int | None = None
    optimizer_state: str = "auto"
    break_lease: bool = False
    watch_ops: str = "auto"

    def __post_init__(self) -> None:
        _choice("watch_ops", self.watch_ops, ("auto", "always"))
        _plain_ints(self, ("tokens", "planned_steps", "records_per_step"))
        for name in ("tokens", "planned_steps", "records_per_step"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise InputError(f"{name}={value!r} must be a positive int or None.")
        for name in ("overwrite", "resume", "durable", "break_lease"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):  # ("yes" is truthy)
                raise InputError(f"{name}={getattr(self, name)!r} must be True or False.")
        if self.distributed is not None and not isinstance(self.distributed, (bool, np.bool_)):
            raise InputError(f"distributed={self.distributed!r} must be True, False or None.")
        if self.probe_ids is not None and self.probes is None:
            raise InputError("probe_ids were given without probes=(loss_fn, batch): pass both, "
                             "or neither.")
        probes = self.probes
        if probes is not None and not (
            isinstance(probes, tuple) and len(probes) in (2, 3) and callable(probes[0])
        ):
            raise InputError(
                f"probes must be a pair (loss_fn, batch) with loss_fn(model, batch) returning "
                f"per-probe losses, or (loss_fn, batch, mask) for per-token losses with a "
                f"mask of the tokens that count, got {type(probes).__name__}."
            )


def split_options(
    config: RecorderConfig | None, options: Mapping[str, Any]
) -> tuple[RecorderConfig, RecordingOptions]:
    """``GradRecorder``'s keyword options sorted between the two dataclasses, each built
    (and so validated) from its own.

    Args:
        config: A configuration built beforehand, or None (then built from ``options``).
        options: Fields of :class:`RecorderConfig` (unless ``config`` is given) and of
            :class:`RecordingOptions`, by name.

    Raises:
        ConfigError: an unknown option (listing the valid names, with the likeliest one), or
            a configuration option passed beside ``config``.
    """
    stored = [f.name for f in dataclasses.fields(RecorderConfig)]
    local = [f.name for f in dataclasses.fields(RecordingOptions)]
    unknown = [name for name in options if name not in stored and name not in local]
    if unknown:
        name = unknown[0]
        close = difflib.get_close_matches(name, stored + local, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(
            f"GradRecorder got an unknown option {name!r}.{hint} Valid options: "
            f"{sorted(stored + local)} (documented on gradlog.RecorderConfig and "
            "gradlog.config.RecordingOptions)."
        )
    given = {name: options[name] for name in stored if name in options}
    if config is not None and given:
        raise ConfigError(
            f"GradRecorder got config= and configuration options {sorted(given)}: pass the "
            "configuration one way, e.g. dataclasses.replace(config, ...) as config=."
        )
    if config is not None and not isinstance(config, RecorderConfig):
        raise ConfigError(
            f"config must be a gradlog.RecorderConfig, got {type(config).__name__}."
        )
    recorder_config = config if config is not None else RecorderConfig(**given)
    return recorder_config, RecordingOptions(**{n: options[n] for n in local if n in options})
