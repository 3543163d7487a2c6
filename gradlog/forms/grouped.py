"""Projections of several parameters' records of one shape, taken in one pass.

A step of a transformer records many parameters of a few shapes: a ~1B Llama's 112 Linear
weights come in 3, its 33 RMSNorm weights in 1. Encoded one by one, each record's
``projection`` cost its own casts, matmuls and exact norm, ~20 small operations: on a GPU
~2,500 launches a step beside the plain step's ~4,000, on a step already waiting on the host
(tests/benchmarks/RESULTS.md). Here a group's factors (or vectors) are concatenated once and
projected by batched matmuls with each parameter's own matrices stacked, and their exact
norms are taken together as ``norm`` takes them (:func:`~gradlog.grads.grouped_sqnorms`).

Each record keeps its own projection (its own seeded matrices, the same products; batched
matmuls may block the sums differently: float rounding) and its own exact norm.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch

from gradlog.forms.base import Encoded
from gradlog.forms.projection import ProjectionForm
from gradlog.grads import (
    MAX_ELEMENTS,
    Factors,
    dense_sqnorms,
    factor_group,
    factored_sqnorms,
    norm_method,
    outer_sums,
)

__all__ = ["encode_factors", "group_key", "project_vectors"]

_STACKS_KEPT = 4
"""Stacked matrices kept per form (one group a run, usually; more if its groups vary)."""


def group_key(form: ProjectionForm, material: Any) -> tuple[Any, ...] | None:
    """The key under which this record is projected with others (:func:`encode_factors`,
    :func:`project_vectors`), or None: alone (masked factors, rows, dense matrices, a
    dense projection streamed block by block).

    Vectors take their exact norms elsewhere (small ones stacked, by the caller); factors
    here."""
    if isinstance(material, Factors):
        group = factor_group(material)  # (None for masked factors)
        if group is None or form.structure != "two_sided":
            return None
        return ("factors", group, form.ranks, form.factored_is_cheaper(material))
    if (isinstance(material, torch.Tensor) and form.structure == "dense"
            and material.dim() == 2 and material.is_floating_point()
            and form.matrices(material.device, ProjectionForm.compute_dtype(material.dtype))):
        # (a matrix cached whole: not streamed block by block)
        return ("vectors", material.device, material.dtype, tuple(material.shape), form.ranks)
    return None


def encode_factors(forms: Sequence[ProjectionForm], materials: Sequence[Factors], *,
                   dtype: torch.dtype = torch.float64) -> list[tuple[Encoded, torch.Tensor]]:
    """Each record's two-sided projection and exact squared norms ``(B,)`` in ``dtype``, for
    factors of one :func:`group_key`, by the route each alone would take: ghost norms and
    ``(g P0)^T (a P1)``, or the gradients formed and their norms and projections taken from
    them. A bounded share of the records at a time (:data:`~gradlog.grads.MAX_ELEMENTS`
    of concatenated factors, or of formed gradients)."""
    first = materials[0]
    B, N, p = first.held[0].shape
    q = first.held[1].shape[2]
    factored = forms[0].factored_is_cheaper(first)
    k = max(1, MAX_ELEMENTS // max(1, N * (p + q) * B if factored else p * q * B))
    if len(materials) > k:
        return [out for i in range(0, len(materials), k)
                for out in encode_factors(forms[i : i + k], materials[i : i + k], dtype=dtype)]
    if len(materials) == 1:
        return [forms[0].encode_with_norms(first, dtype=dtype)]
    n = len(materials)
    g = torch.cat([f.held[0] for f in materials])  # (n B, N, p) as held
    a = torch.cat([f.held[1] for f in materials])  # (n B, N, q)
    work = ProjectionForm.compute_dtype(first.dtype)
    if factored:
        squares = factored_sqnorms(g, a, dtype=dtype, method=norm_method(*first.held),
                                   narrow=first.narrow)  # (n B,)
        out = _factored(forms, g.to(work), a.to(work), n)  # (n B, r0, r1)
        if first.scale != 1.0:
            out.mul_(first.scale)
            squares.mul_(first.scale**2)
    else:  # as Factors.dense forms them, the scale folded into the matmul
        x = torch.empty((n * B, p, q), dtype=first.dtype, device=g.device)  # (n B, p, q)
        x = outer_sums(g, a, first.scale, x, first.narrow)
        squares = dense_sqnorms(x.reshape(n * B, -1), dtype)  # (n B,)
        out = _formed(forms, x.to(work), n)  # (n B, r0, r1)
    r0, r1 = forms[0].ranks
    return [({"proj": proj}, sq) for proj, sq in zip(out.view(n, B, r0, r1).unbind(0),
                                                    squares.view(n, B).unbind(0), strict=True)]


def _factored(forms: Sequence[ProjectionForm], g: torch.Tensor, a: torch.Tensor,
              n: int) -> torch.Tensor:
    """``(g_b P0)^T (a_b P1)`` of n records' concatenated factors ``(n B, N, p|q)``, each
    with its form's matrices: ``(n B, r0, r1)``."""
    nB, N, p = g.shape
    q = a.shape[2]
    p0, p1 = _stacked(forms, g.device, g.dtype)  # (n, p, r0), (n, q, r1)
    r0, r1 = forms[0].ranks
    gp = torch.bmm(g.view(n, nB // n * N, p), p0).view(nB, N, r0)  # (n B, N, r0)
    ap = torch.bmm(a.view(n, nB // n * N, q), p1).view(nB, N, r1)  # (n B, N, r1)
    return torch.bmm(gp.transpose(1, 2), ap)  # (n B, r0, r1)


def _formed(forms: Sequence[ProjectionForm], x: torch.Tensor, n: int) -> torch.Tensor:
    """``P0^T X_b P1`` of n records' gradients ``(n B, p, q)``, each with its form's
    matrices, in the cheaper order (as ProjectionForm's own dense path): ``(n B, r0, r1)``."""
    nB, p, q = x.shape
    B = nB // n
    p0, p1 = _stacked(forms, x.device, x.dtype)  # (n, p, r0), (n, q, r1)
    r0, r1 = forms[0].ranks
    left = p0.transpose(1, 2).unsqueeze(1).expand(n, B, r0, p).reshape(nB, r0, p)  # (n B, r0, p)
    if p * q * r1 + p * r1 * r0 <= r0 * p * q + r0 * q * r1:
        xp = torch.bmm(x.view(n, B * p, q), p1).view(nB, p, r1)  # (n B, p, r1)
        return torch.bmm(left, xp)  # (n B, r0, r1)
    px = torch.bmm(left, x)  # (n B, r0, q)
    return torch.bmm(px.view(n, B * r0, q), p1).view(nB, r0, r1)  # (n B, r0, r1)


def project_vectors(forms: Sequence[ProjectionForm],
                    vectors: Sequence[torch.Tensor]) -> list[Encoded]:
    """Each record's dense projection, for vectors ``(B, n)`` of one :func:`group_key`: one
    batched matmul with the stacked matrices (a GPT's biases and norm weights were a
    matmul each)."""
    if len(vectors) == 1:
        return [forms[0].encode(vectors[0])]
    work = ProjectionForm.compute_dtype(vectors[0].dtype)
    (mats,) = _stacked(forms, vectors[0].device, work)  # (k, n, r)
    x = torch.stack([v if v.dtype == work else v.to(work) for v in vectors])  # (k, B, n)
    return [{"proj": proj} for proj in torch.bmm(x, mats).unbind(0)]  # (B, r) each


def _stacked(forms: Sequence[ProjectionForm], device: torch.device,
             dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """The forms' matrices stacked, ``(k, rows, r)`` each: made once per group and kept on
    its first form, each form's own cached matrices then views into them (no second copy
    in memory)."""
    first = forms[0]
    key = (tuple(id(f) for f in forms), device, dtype)
    kept = first.stacks.get(key)
    if kept is not None and all(a is b for a, b in zip(kept[1], forms, strict=True)):
        return cast(tuple[torch.Tensor, ...], kept[0])
    mats = [f.matrices(device, dtype) for f in forms]
    stacks = tuple(torch.stack(side) for side in zip(*mats, strict=True))
    for i, form in enumerate(forms):
        form.share_matrices(device, dtype, tuple(s[i] for s in stacks))
    if len(first.stacks) >= _STACKS_KEPT:
        first.stacks.clear()
    first.stacks[key] = (stacks, tuple(forms))
    return stacks
