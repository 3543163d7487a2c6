"""Forms: how each parameter's per-datum gradients are kept.

:data:`FORMS` is the closed set, by name: ``full`` (the tensor), ``factors`` (exact factors of
a Linear-like weight), ``rows`` (an Embedding's distinct rows, exact), ``projection`` (random
projection from stored seeds), ``topk`` (largest-magnitude entries), ``norm`` (the norm
only) and ``auto`` (planned into one of the others). ``README.md`` in this folder says how
the recorder, the writer, the reader and the analysis use them.

    info = ParamInfo((256, 1024), source="factors", tokens=128, name="blocks.0.mlp.proj.weight")
    form = make_form({"form": "projection", "dim": 1024}, info)
    arrays = form.encode(Factors(g, a))         # {"proj": (B, 32, 32)}
    form.inner(arrays, arrays)                  # (B, B) estimated <g_i, g_j>
    project(test_grad, form.spec())             # a test example's gradient, same space
"""

from __future__ import annotations

from gradlog.forms.auto import (
    FIDELITY,
    AutoForm,
    FormRequest,
    bytes_table,
    form_from_spec,
    make_form,
    plan_forms,
    smallest_exact,
)
from gradlog.forms.base import (
    SOURCES,
    ArraySpec,
    Encoded,
    Factors,
    Form,
    Material,
    ParamInfo,
    Rows,
    batch_sum,
    dense,
    entries,
    factors_worthwhile,
)
from gradlog.forms.factors import FactorsForm, factored_inner, factored_sqnorms
from gradlog.forms.full import FullForm
from gradlog.forms.norm import NormForm, sqnorms
from gradlog.forms.projection import ProjectionForm, param_seed, project, random_matrix
from gradlog.forms.rows import RowsForm
from gradlog.forms.topk import TopKForm

__all__ = [
    "FIDELITY",
    "FORMS",
    "SOURCES",
    "ArraySpec",
    "AutoForm",
    "Encoded",
    "Factors",
    "FactorsForm",
    "Form",
    "FormRequest",
    "FullForm",
    "Material",
    "NormForm",
    "ParamInfo",
    "ProjectionForm",
    "Rows",
    "RowsForm",
    "TopKForm",
    "batch_sum",
    "bytes_table",
    "dense",
    "entries",
    "factored_inner",
    "factored_sqnorms",
    "factors_worthwhile",
    "form_from_spec",
    "make_form",
    "param_seed",
    "plan_forms",
    "project",
    "random_matrix",
    "smallest_exact",
    "sqnorms",
]

FORMS: dict[str, type[Form]] = {
    FullForm.name: FullForm,
    FactorsForm.name: FactorsForm,
    RowsForm.name: RowsForm,
    ProjectionForm.name: ProjectionForm,
    TopKForm.name: TopKForm,
    NormForm.name: NormForm,
    AutoForm.name: AutoForm,
}
"""Every form, by the name a user asks for and a spec stores (``auto`` is only asked for)."""
