"""Forms of a run's parameters: planned at the first recorded backward, then applied.

The recorder knows what each parameter's rule hands over (dense gradients, factors, sparse
rows) and how many tokens a datum has only at the first backward, so that is where the
requests of ``form=`` become concrete forms (:func:`plan`). This module also says what the
plan costs (:func:`plan_table`, :func:`check_free_space`) and turns each batch's material
into the arrays and exact norms the writer takes (:func:`encode`).
"""

from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol, cast

import torch

from gradlog.errors import InputError
from gradlog.forms import (
    Form,
    FullForm,
    ParamInfo,
    ProjectionForm,
    form_from_spec,
    make_form,
    naming_errors,
    plan_forms,
)
from gradlog.forms.grouped import encode_factors, group_key, project_vectors
from gradlog.grads import (
    SMALL_ELEMENTS,
    Factors,
    Material,
    batch_size,
    factor_group,
    grouped_sqnorms,
    material_shape,
    sqnorms,
    stacked_sqnorms,
)
from gradlog.store.fs import ObjectPath, store_path

__all__ = [
    "FormRequests",
    "array_specs",
    "check_free_space",
    "check_requests",
    "encode",
    "format_bytes",
    "forms_from_specs",
    "keeps_material",
    "material_tokens",
    "plan",
    "plan_table",
]


class FormRequests(Protocol):
    """What planning reads of the configuration (:class:`gradlog.config.RecorderConfig`,
    one layer above: planning only reads it)."""

    @property
    def form_budget(self) -> int | None: ...

    def rule_for(self, name: str) -> tuple[str | None, str | Mapping[str, Any]]: ...

    def request_for(self, name: str) -> str | Mapping[str, Any]: ...

    def check_form_globs(self, names: list[str]) -> None: ...


def check_requests(config: FormRequests, params: Mapping[str, torch.Tensor]) -> None:
    """Refuse, when the recorder is built, ``form=`` globs that decide no parameter and
    requests that cannot apply to a parameter's shape (naming it and the fix), rather than at
    the first backward. What depends on the material (factors, token counts, the budget's
    share) is checked when planning.

    Raises:
        ConfigError: the glob or the parameter, its request and the fix.
    """
    names = list(params)
    config.check_form_globs(names)
    for name, p in params.items():
        glob, request = config.rule_for(name)
        if request == FullForm.name:
            continue
        info = ParamInfo(tuple(p.shape), name=name)  # dense: every form plans from it
        with naming_errors(name, info, request, glob):
            make_form(request, info)


def _form_name(config: FormRequests, name: str) -> Any:
    """The name of the form parameter ``name`` asks for."""
    request = config.request_for(name)
    return request if isinstance(request, str) else request.get("form")


def keeps_material(config: FormRequests, names: list[str]) -> frozenset[str]:
    """Parameters whose request is not plain ``full``: the hooks backend hands their
    factors or sparse rows over instead of adding them into dense gradients."""
    return frozenset(name for name in names if _form_name(config, name) != FullForm.name)


DENSE_ENCODED = ("projection", "topk", "norm")
"""Forms that encode dense per-datum gradients as well as factors (``factors`` and ``auto``
need the factors to stay compact)."""


def dense_when_fused(config: FormRequests, fused: frozenset[str]) -> frozenset[str]:
    """The fused weights (``batch_grad="sum"``) whose form encodes dense gradients: a call
    that fuses forms them in the backward anyway (their sum is the weight gradient), so the
    form takes them as they are; a call that does not (under autocast) hands factors."""
    return frozenset(name for name in fused if _form_name(config, name) in DENSE_ENCODED)


def material_tokens(materials: Mapping[str, Material], tokens: int | None = None) -> int:
    """The rows per datum a plan of ``materials`` provisions: the most of any factors or
    sparse rows, and at least ``tokens`` (0 when every material is dense). Ranks of a
    distributed run agree on the largest before one of them plans for all."""
    most = tokens or 0
    for name, material in materials.items():
        info = ParamInfo.of(material, name=name)
        if info.source != "dense":
            most = max(most, info.tokens or 0)
    return most


def plan(
    config: FormRequests,
    materials: Mapping[str, Material],
    *,
    itemsize: int,
    tokens: int | None = None,
    records_per_step: int | None = None,
) -> dict[str, Form]:
    """Concrete forms for every parameter from its first batch of material.

    Args:
        config: The recorder's configuration (``form``, ``form_budget``, seed).
        materials: Parameter name -> the first backward's material.
        itemsize: Bytes of one stored float.
        tokens: Rows per datum to provision for factors and sparse rows (default: the
            first batch's).
        records_per_step: Records a step holds, over which ``form_budget`` (bytes per step)
            is split (default: the first batch's; with gradient accumulation a step holds
            several batches).
    """
    infos = {}
    for name, material in materials.items():
        info = ParamInfo.of(material, name=name, itemsize=itemsize)
        if tokens is not None and info.source != "dense":
            info = ParamInfo(info.shape, info.source, max(tokens, info.tokens or 0), itemsize, name)
        infos[name] = info
    requests = {name: config.request_for(name) for name in materials}
    batch = batch_size(next(iter(materials.values()))) if materials else 1
    forms = plan_forms(infos, requests, budget_per_step=config.form_budget,
                       batch_size=records_per_step or batch)
    for name, form in forms.items():  # errors then say which tokens= to raise
        request = requests[name]
        requested = None if isinstance(request, str) else request.get("tokens")
        if isinstance(requested, int) and getattr(form, "tokens", None) == requested:
            form.requested_tokens = requested
    return forms


def forms_from_specs(specs: Mapping[str, Mapping[str, Any]]) -> dict[str, Form]:
    """The forms a (resumed) store's parameter specs describe."""
    return {name: form_from_spec(spec["form_spec"]) for name, spec in specs.items()}


def array_specs(form: Form) -> dict[str, dict[str, Any]]:
    """A form's arrays as the writer and the parameter spec take them: name ->
    ``{"shape": [...], "kind": "float" | "int64"}``."""
    return {key: {"shape": list(a.shape), "kind": a.kind} for key, a in form.arrays().items()}


def encode(
    forms: Mapping[str, Form], materials: Mapping[str, Material]
) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """Each parameter's arrays for the writer and its exact float64 norms ``(B,)``, both on
    the material's device (staging brings them to the host without a sync per parameter).

    Raises:
        InputError: a batch does not fit its planned form (more tokens than provisioned).
    """
    arrays: dict[str, dict[str, torch.Tensor]] = {}
    squares: dict[str, torch.Tensor] = {}
    together: dict[tuple[Any, ...], list[str]] = {}  # small dense records: norms stacked
    grouped: dict[tuple[Any, ...], list[str]] = {}  # factors of one shape: norms in one pass
    projected: dict[tuple[Any, ...], list[str]] = {}  # projections of one shape: one pass
    with torch.no_grad():
        for name, material in materials.items():
            form = forms[name]
            if material_shape(material) != form.shape:
                raise InputError(
                    f"parameter {name!r} has per-datum gradients of shape "
                    f"{material_shape(material)}, its form was planned for {form.shape}."
                )
            try:
                joint = group_key(form, material) if isinstance(form, ProjectionForm) else None
                if joint is not None:  # projected with its group below (factors: norms too)
                    projected.setdefault(joint, []).append(name)
                    if joint[0] == "factors":
                        continue
                if isinstance(material, torch.Tensor) and _norms_together(form, material):
                    if joint is None:
                        enc = form.encode(material)
                    key = (material.device, material.dtype, tuple(material.shape))
                    together.setdefault(key, []).append(name)
                elif joint is not None:  # (a vector whose norms are not stacked)
                    squares[name] = sqnorms(cast(torch.Tensor, material))
                elif (isinstance(material, Factors) and _norms_plain(form)
                      and (group := factor_group(material)) is not None):
                    enc = form.encode(material)
                    grouped.setdefault(group, []).append(name)
                else:
                    enc, squares[name] = form.encode_with_norms(material)
            except InputError as e:
                if form.requested_tokens is not None:
                    fix = (
                        "raise 'tokens' in its form= request to the most tokens a datum will "
                        "have (GradRecorder(..., tokens=N) does not apply to a request that "
                        "sets its own)."
                    )
                else:
                    fix = (
                        "pass GradRecorder(..., tokens=N) with the most tokens a datum will "
                        "have to provision for longer batches."
                    )
                raise InputError(
                    f"parameter {name!r} ({form.name}): {e} The form was planned at the "
                    f"first recorded backward; {fix}"
                ) from None
            if joint is None:
                arrays[name] = enc
        for (kind, *_), names in projected.items():
            members = [cast(ProjectionForm, forms[n]) for n in names]
            if kind == "factors":
                for n, (enc, sq) in zip(names, encode_factors(
                        members, [cast(Factors, materials[n]) for n in names]), strict=True):
                    arrays[n], squares[n] = enc, sq
            else:
                arrays.update(zip(names, project_vectors(
                    members, [cast(torch.Tensor, materials[n]) for n in names]), strict=True))
        for names in together.values():
            stacked = stacked_sqnorms([cast(torch.Tensor, materials[n]) for n in names])  # (k, B)
            squares.update(zip(names, stacked.unbind(0)))
        for names in grouped.values():
            squares.update(zip(names, grouped_sqnorms([cast(Factors, materials[n])
                                                       for n in names])))  # (B,) each
    arrays = {name: {k: v.detach() if v.requires_grad else v for k, v in arrays[name].items()}
              for name in materials}  # (in the parameters' order)
    return arrays, _norms({name: squares[name] for name in materials})


def _norms_together(form: Form, material: torch.Tensor) -> bool:
    """Whether a record's exact norms may be taken with other small records' (one stacked
    pass, :func:`~gradlog.grads.stacked_sqnorms`): a dense float tensor of at most
    :data:`~gradlog.grads.SMALL_ELEMENTS` in all, of a form whose encoding does not form
    them."""
    return (form.norms_apart and material.is_floating_point()
            and material.dtype != torch.float64
            and material.numel() <= SMALL_ELEMENTS)


def _norms_plain(form: Form) -> bool:
    """Whether the form takes a record's norms apart from its encoding, as the base class
    does (``norm``, ...): then factors' norms may be taken with others' of their shape
    (:func:`~gradlog.grads.grouped_sqnorms`). ``projection`` and ``full`` form them with
    their encoding when that is cheaper; ``topk`` on its way."""
    return type(form)._encode_with_norms is Form._encode_with_norms


def _norms(squares: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Norms from squared norms ``(B,)``, one stacked op per device (37 parameters' separate
    clamps and roots were ~70 small ops a step)."""
    by_device: dict[torch.device, list[str]] = {}
    for name, sq in squares.items():
        by_device.setdefault(sq.device, []).append(name)
    out: dict[str, torch.Tensor] = {}
    for names in by_device.values():
        roots = torch.stack([squares[n].to(torch.float64) for n in names]).clamp_min_(0).sqrt_()
        out.update(zip(names, roots.unbind(0)))  # (P, B) float64 -> P x (B,)
    return {name: out[name] for name in squares}


def plan_table(
    forms: Mapping[str, Form],
    *,
    batch: int,
    itemsize: int,
    steps: int | None = None,
    records_from: str | None = None,
) -> str:
    """The start-of-recording summary: per parameter its form and bytes per step (and
    ``full``'s) for ``batch`` records per step, the total, and the projected size for
    ``steps`` steps; ``records_from`` says where the records per step come from."""
    rows = []
    for name, form in forms.items():
        per_step = form.nbytes_per_record(itemsize) * batch
        full = form.numel * itemsize * batch
        rows.append((name, form.name, per_step, full))
    total = sum(r[2] for r in rows)
    total_full = sum(r[3] for r in rows)
    width = max([len("parameter")] + [len(r[0]) for r in rows])
    lines = [f"{'parameter':<{width}}  {'form':<10}  {'bytes/step':>12}  {'full bytes/step':>15}"]
    for name, form_name, per_step, full in rows:
        lines.append(f"{name:<{width}}  {form_name:<10}  {per_step:>12,}  {full:>15,}")
    share = f" ({100 * total / total_full:.2f}% of full)" if total_full else ""
    lines.append(f"{'(total)':<{width}}  {'':<10}  {total:>12,}  {total_full:>15,}{share}")
    if records_from is not None:
        lines.append(f"bytes per step for {batch:,} records per step ({records_from})")
    if steps is not None:
        lines.append(f"projected size for {steps:,} steps: {format_bytes(total * steps)}")
    return "\n".join(lines)


def check_free_space(path: str | os.PathLike[str] | ObjectPath, nbytes: int) -> str | None:
    """Warn (and return the message) when ``nbytes`` exceed the free space where ``path``
    lives; None when they fit or the free space cannot be read (object storage)."""
    local = store_path(path)
    if not isinstance(local, Path):  # an object store: no disk of ours to ask
        return None
    where = local
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        free = shutil.disk_usage(where).free
    except OSError:
        return None
    if nbytes <= free:
        return None
    message = (
        f"gradlog: the planned recording needs {format_bytes(nbytes)}, but only "
        f"{format_bytes(free)} are free where {path} lives. Record less (form= projections, "
        "form_budget=, params=, every=, dtype='bfloat16') or free space; recording continues "
        "and fails cleanly, steps committed, if the disk fills."
    )
    warnings.warn(message, UserWarning, stacklevel=3)
    return message


def format_bytes(n: float) -> str:
    """``n`` bytes for people: ``"512 B"``, ``"1.5 MiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} PiB"  # pragma: no cover
