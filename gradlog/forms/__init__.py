"""Forms: how each parameter's per-datum gradients are kept.

:data:`FORMS` is the closed set, by name: ``full`` (the tensor), ``factors`` (exact factors of
a Linear-like weight), ``rows`` (an Embedding's distinct rows, exact), ``projection`` (random
projection from stored seeds), ``topk`` (largest-magnitude entries), ``norm`` (the norm
only) and ``auto`` (planned into one of the others). ``README.md`` in this folder says how
to write a form and how the recorder, the writer, the reader and the analysis use them. The
material forms encode (:class:`~gradlog.grads.Factors`, :class:`~gradlog.grads.Rows`, dense
tensors) and the math on it live one layer down, in :mod:`gradlog.grads`.

    info = ParamInfo((256, 1024), source="factors", tokens=128, name="blocks.0.mlp.proj.weight")
    form = make_form({"form": "projection", "dim": 1024}, info)
    arrays = form.encode(Factors(g, a))         # {"proj": (B, 32, 32)}
    form.inner(arrays, arrays)                  # (B, B) estimated <g_i, g_j>
    project(test_grad, form.spec())             # a test example's gradient, same space
"""

from __future__ import annotations

from gradlog.forms.auto import (
    FIDELITY,
    FORMS,
    AutoForm,
    FormRequest,
    bytes_table,
    form_from_spec,
    make_form,
    naming_errors,
    plan_forms,
    smallest_exact,
)
from gradlog.forms.base import SOURCES, ArraySpec, Encoded, Form, ParamInfo, Stored
from gradlog.forms.factors import FactorsForm, RowsForm
from gradlog.forms.full import FullForm
from gradlog.forms.norm import NormForm
from gradlog.forms.projection import ProjectionForm, param_seed, project, random_matrix
from gradlog.forms.topk import TopKForm
from gradlog.grads import Material  # noqa: F401  TRANSITIONAL: gradlog/planning.py imports it

__all__ = [
    "FIDELITY",
    "FORMS",
    "SOURCES",
    "ArraySpec",
    "AutoForm",
    "Encoded",
    "FactorsForm",
    "Form",
    "FormRequest",
    "FullForm",
    "NormForm",
    "ParamInfo",
    "ProjectionForm",
    "RowsForm",
    "Stored",
    "TopKForm",
    "bytes_table",
    "form_from_spec",
    "make_form",
    "naming_errors",
    "param_seed",
    "plan_forms",
    "project",
    "random_matrix",
    "smallest_exact",
]
