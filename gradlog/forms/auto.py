"""The closed set of forms (:data:`FORMS`), ``auto``, and planning forms for a run's
parameters (:func:`make_form`, :func:`form_from_spec`, :func:`plan_forms`).

``auto`` is never stored: planning turns it into a concrete form.

- **No budget:** the smallest exact form by bytes per record: ``full``, or ``factors``
  (Linear-like weights, when ``N (p + q) < p q``), or ``rows`` (Embeddings, when
  ``N (8 + s D) < s V D``); a tie goes to ``full``. Never larger than ``full``.
- **With a budget** (bytes per record for the parameter), the most faithful form that fits,
  in this order:

  1. the smallest exact form, if it fits;
  2. ``projection`` with the largest size ``r = budget // itemsize`` (two-sided ranks
     balanced, :func:`~gradlog.forms.projection.balanced_ranks`), if ``r >=
     min_projection_dim`` (default 16: below it inner products err by more than ~35%);
  3. ``topk`` with ``k = budget // (itemsize + 8)``, if ``k >= 1``;
  4. ``norm`` (0 bytes: the exact norm is in the index anyway).

:func:`plan_forms` plans every parameter of a run from its request; a budget per step is
shared among the ``auto`` parameters after the others' bytes, smallest exact form first, each
getting at most an equal share of what is left (water-filling: parameters that fit exactly
keep their exact form, the large ones share the rest equally).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

import torch

from gradlog.errors import ConfigError, StoreFormatError
from gradlog.forms.base import ArraySpec, Encoded, Form, ParamInfo, check_options
from gradlog.forms.factors import FactorsForm, RowsForm, warn_if_larger_than_full
from gradlog.forms.full import FullForm
from gradlog.forms.norm import NormForm
from gradlog.forms.projection import DEFAULT_DIM, ProjectionForm
from gradlog.forms.topk import TopKForm
from gradlog.grads import Material

__all__ = [
    "FIDELITY",
    "FORMS",
    "AutoForm",
    "FormRequest",
    "bytes_table",
    "form_from_spec",
    "make_form",
    "naming_errors",
    "plan_forms",
    "smallest_exact",
]

FIDELITY = ("exact", "projection", "topk", "norm")
"""What ``auto`` tries under a budget, most faithful first."""

FormRequest = str | Mapping[str, Any]
"""A form asked for: its name, or ``{"form": name, **options}``."""

_PROJECTION_OPTIONS = ("kind", "seed", "structure")


def smallest_exact(info: ParamInfo) -> Form:
    """The exact form with the fewest bytes per record (ties: ``full``)."""
    best = FullForm.plan(info)
    candidate = FactorsForm.plan(info)  # factors, rows, or full again for dense material
    if candidate.nbytes_per_record(info.itemsize) < best.nbytes_per_record(info.itemsize):
        return candidate
    return best


class AutoForm(Form):
    """Not a stored form: :meth:`plan` returns the concrete form (see the module doc)."""

    name: ClassVar[str] = "auto"
    exact: ClassVar[bool] = False

    @classmethod
    def plan(cls, info: ParamInfo, **options: Any) -> Form:
        """Options: ``budget`` (bytes per record; None: smallest exact form),
        ``min_projection_dim`` (16), and for a projection ``kind``, ``seed``, ``structure``."""
        check_options(cls.name, options, ("budget", "min_projection_dim", *_PROJECTION_OPTIONS))
        min_dim = options.get("min_projection_dim", 16)
        if not isinstance(min_dim, int) or isinstance(min_dim, bool) or min_dim < 1:
            raise ConfigError(
                f"form 'auto' min_projection_dim={min_dim!r} must be an integer >= 1 (the "
                "smallest projection auto may choose; default 16)."
            )
        exact = smallest_exact(info)
        budget = options.get("budget")
        if budget is None:
            return exact
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
            raise ConfigError(f"form 'auto' budget={budget!r} must be bytes per record (int).")
        if exact.nbytes_per_record(info.itemsize) <= budget:
            return exact
        dim = budget // info.itemsize
        if dim >= min_dim:
            projection = {k: options[k] for k in _PROJECTION_OPTIONS if k in options}
            return ProjectionForm.plan(info, dim=dim, **projection)
        k = budget // (info.itemsize + 8)
        if k >= 1:
            return TopKForm.plan(info, k=k)
        return NormForm.plan(info)

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> Form:
        raise StoreFormatError(
            "form 'auto' is never stored (planning replaces it by a concrete form); this "
            "parameter spec is damaged or from another gradlog."
        )

    def __repr__(self) -> str:
        return f"AutoForm(shape={self.shape}, unplanned)"

    def _unplanned(self) -> ConfigError:
        return ConfigError(
            "form 'auto' is only a request: use AutoForm.plan(info) (or "
            "make_form('auto', info)) and then the form it returns."
        )

    def spec(self) -> dict[str, Any]:
        raise self._unplanned()

    def arrays(self) -> dict[str, ArraySpec]:
        raise self._unplanned()

    def _encode(self, material: Material) -> Encoded:
        raise self._unplanned()

    def _inner(self, x: Encoded, y: Encoded, dtype: torch.dtype) -> torch.Tensor:
        raise self._unplanned()


FORMS: dict[str, type[Form]] = {
    form.name: form
    for form in (FullForm, FactorsForm, RowsForm, ProjectionForm, TopKForm, NormForm, AutoForm)
}
"""Every form, by the name a user asks for and a spec stores (``auto`` is only asked for)."""


def _split(request: FormRequest) -> tuple[str, dict[str, Any]]:
    if isinstance(request, str):
        return request, {}
    options = dict(request)
    name = options.pop("form", None)
    if not isinstance(name, str):
        raise ConfigError(f"a form request {dict(request)!r} needs 'form': a form's name.")
    return name, options


def _form_class(name: str) -> type[Form]:
    cls = FORMS.get(name)
    if cls is None:
        raise ConfigError(f"form {name!r} is not one of {list(FORMS)}.")
    return cls


def make_form(request: FormRequest, info: ParamInfo, **options: Any) -> Form:
    """The concrete form for a parameter from a request (``"factors"`` or
    ``{"form": "projection", "dim": 4096}``); ``options`` add to the request's. A zero-size
    parameter gets ``full`` (empty records; their norms, 0, are in the index) unless it
    asked for ``norm``. A ``projection`` by ``dim`` (or its default) of a parameter of at
    most ``dim`` elements (a bias, a norm's weight) gets ``full``: as many numbers, exact;
    explicit ``ranks`` are kept as asked.

    Raises:
        ConfigError: unknown form name (the message lists them) or option.
    """
    name, opts = _split(request)
    opts = {**opts, **options}
    form = _form_class(name).plan(info, **opts)
    if info.numel == 0 and not isinstance(form, (FullForm, NormForm)):
        return FullForm(info.shape)  # nothing to keep: its records are empty in every form
    if isinstance(form, ProjectionForm) and "ranks" not in opts and (
            info.numel <= opts.get("dim", DEFAULT_DIM)):
        # `dim` numbers hold the gradient itself: a projection would only add noise (a square
        # sign matrix can be singular) and cost a matmul. Not factors or rows, though smaller
        # at times: they are provisioned for the first batch's tokens, a projection for any.
        return FullForm(info.shape)
    warn_if_larger_than_full(form, info)  # asked for by name: say when full is smaller
    return form


def form_from_spec(spec: Mapping[str, Any]) -> Form:
    """The form a stored spec (``Form.spec()``) describes.

    Raises:
        StoreFormatError: unknown form or malformed spec.
    """
    name = spec.get("form")
    cls = FORMS.get(name) if isinstance(name, str) else None
    if cls is None or cls is AutoForm:
        raise StoreFormatError(
            f"parameter spec names form {name!r}; this gradlog reads "
            f"{[n for n in FORMS if n != AutoForm.name]}. Upgrade gradlog if the store is newer: "
            "pip install -U gradlog."
        )
    return cls.from_spec(spec)


def plan_forms(
    infos: Mapping[str, ParamInfo],
    requests: Mapping[str, FormRequest],
    *,
    budget_per_step: int | None = None,
    batch_size: int | None = None,
) -> dict[str, Form]:
    """Concrete forms for a run's parameters.

    Args:
        infos: Parameter name -> what its rule provides.
        requests: Parameter name -> requested form (resolved from the user's globs).
        budget_per_step: Bytes per step for all parameters, shared among the ``auto`` ones
            after the bytes of the others (see the module doc); None: no budget.
        batch_size: Records per step, to turn the budget into bytes per record.

    Raises:
        ConfigError: a request is invalid, or the budget cannot hold the non-``auto``
            parameters.
    """
    missing = sorted(set(infos) - set(requests))
    if missing:
        raise ConfigError(f"no form requested for parameters {missing}.")
    planned: dict[str, Form] = {}
    auto: dict[str, dict[str, Any]] = {}
    for name, info in infos.items():
        form_name, opts = _split(requests[name])
        if form_name == AutoForm.name and budget_per_step is not None and "budget" not in opts:
            auto[name] = opts
        else:
            with naming_errors(name, info, requests[name]):
                planned[name] = make_form(requests[name], info)
    if not auto or budget_per_step is None:
        return planned
    if batch_size is None or batch_size < 1:
        raise ConfigError("plan_forms needs batch_size >= 1 with budget_per_step.")
    fixed = sum(f.nbytes_per_record(infos[n].itemsize) for n, f in planned.items())
    per_record = int(budget_per_step) // batch_size
    left = per_record - fixed
    if left < 0:
        raise ConfigError(
            f"the byte budget of {budget_per_step} per step ({per_record} per record at "
            f"{batch_size} records per step) is below the {fixed} bytes per record of "
            "the parameters not planned by 'auto'. Raise the budget, or give those parameters "
            "form 'auto' or a smaller form."
        )
    exact = {n: smallest_exact(infos[n]) for n in auto}
    order = sorted(auto, key=lambda n: exact[n].nbytes_per_record(infos[n].itemsize))
    for i, name in enumerate(order):
        share = left // (len(order) - i)
        with naming_errors(name, infos[name], requests[name]):
            form = AutoForm.plan(infos[name], budget=share, **auto[name])
        planned[name] = form
        left -= form.nbytes_per_record(infos[name].itemsize)
    return {n: planned[n] for n in infos}


@contextlib.contextmanager
def naming_errors(
    name: str, info: ParamInfo, request: FormRequest, glob: str | None = None
) -> Iterator[None]:
    """Re-raise a :class:`ConfigError` of planning parameter ``name`` naming it, its request
    (and the ``form=`` glob that gave it) and how to give it another form."""
    try:
        yield
    except ConfigError as e:
        shown = request if isinstance(request, str) else dict(request)
        via = "" if glob is None else f" (form glob {glob!r})"
        named = "" if repr(name) in str(e) else f"parameter {name!r} (shape {info.shape}), "
        raise ConfigError(
            f"{named}form request {shown!r}{via}: {e} To give "
            "this parameter another form, put a glob that matches it first in form= (e.g. "
            f"form={{{name!r}: 'full', '*': ...}}: the first matching glob wins)."
        ) from None


def bytes_table(
    forms: Mapping[str, Form], *, batch_size: int, itemsize: int = 4
) -> list[dict[str, Any]]:
    """Rows for the start-of-recording print: per parameter its form, bytes per record and
    per step, and those of ``full``; a last row ``"(total)"`` sums them."""
    rows: list[dict[str, Any]] = []
    for name, form in forms.items():
        per = form.nbytes_per_record(itemsize)
        full = form.numel * itemsize
        rows.append(
            {
                "param": name,
                "form": form.name,
                "bytes_per_record": per,
                "bytes_per_step": per * batch_size,
                "full_bytes_per_step": full * batch_size,
            }
        )
    rows.append(
        {
            "param": "(total)",
            "form": "",
            "bytes_per_record": sum(r["bytes_per_record"] for r in rows),
            "bytes_per_step": sum(r["bytes_per_step"] for r in rows),
            "full_bytes_per_step": sum(r["full_bytes_per_step"] for r in rows),
        }
    )
    return rows
