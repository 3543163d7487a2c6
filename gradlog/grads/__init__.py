"""Per-datum gradients as they cross the seams between rules, backends, forms and the store
(:mod:`gradlog.grads.material`), their exact norms (:mod:`gradlog.grads.norms`), and inner
products and norms computed from factors and rows without forming the gradients
(:mod:`gradlog.grads.inner`)."""

from gradlog.grads.inner import (
    factor_group,
    factored_inner,
    factored_sqnorms,
    ghost_blocks,
    ghost_cost,
    grouped_sqnorms,
    norm_method,
    prefer_factored,
    rows_inner,
    sqnorms,
)
from gradlog.grads.material import (
    MAX_ELEMENTS,
    Factors,
    Material,
    Rows,
    batch_size,
    batch_sum,
    chunks,
    dense,
    entries,
    factors_worthwhile,
    material_shape,
    outer_sums,
    select,
)
from gradlog.grads.norms import (
    SCRATCH_ELEMENTS,
    SMALL_ELEMENTS,
    dense_sqnorms,
    float64_sqnorms,
    norm_scratch,
    stacked_sqnorms,
)

__all__ = [
    "MAX_ELEMENTS",
    "SCRATCH_ELEMENTS",
    "SMALL_ELEMENTS",
    "Factors",
    "Material",
    "Rows",
    "batch_size",
    "batch_sum",
    "chunks",
    "dense",
    "dense_sqnorms",
    "entries",
    "factor_group",
    "factored_inner",
    "factored_sqnorms",
    "factors_worthwhile",
    "float64_sqnorms",
    "ghost_blocks",
    "ghost_cost",
    "grouped_sqnorms",
    "material_shape",
    "norm_method",
    "norm_scratch",
    "outer_sums",
    "prefer_factored",
    "rows_inner",
    "select",
    "sqnorms",
    "stacked_sqnorms",
]
