"""Per-datum gradients as they cross the seams between rules, backends, forms and the store
(:mod:`gradlog.grads.material`), and their exact norms (:mod:`gradlog.grads.norms`)."""

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
    select,
)
from gradlog.grads.norms import SCRATCH_ELEMENTS, dense_sqnorms, float64_sqnorms, norm_scratch

__all__ = [
    "MAX_ELEMENTS",
    "SCRATCH_ELEMENTS",
    "Factors",
    "Material",
    "Rows",
    "batch_size",
    "batch_sum",
    "chunks",
    "dense",
    "dense_sqnorms",
    "entries",
    "factors_worthwhile",
    "float64_sqnorms",
    "material_shape",
    "norm_scratch",
    "select",
]
