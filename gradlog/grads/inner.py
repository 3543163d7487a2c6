"""Inner products and exact squared norms of per-datum gradients kept as material, without
forming the gradients: what forms compute from the arrays they store, and what recording's
exact norms are.

- factors: ``<g1^T a1, g2^T a2> = sum((g1 g2^T) * (a1 a2^T))`` costs ``N1 N2 (p + q)`` per
  pair against ``p q`` per record plus ``p q`` per pair when materialising;
  :func:`factored_inner` picks the cheaper by that count (both exact): factored for few
  tokens or few pairs (ghost norms: one pair per record, factored up to ``N (p + q) ~ p q``,
  less with symmetric blocks, :func:`ghost_cost`), materialised for many pairs of long
  records. With a dense gradient ``W``, ``<g^T a, W> = sum_n g_n^T W a_n``
  (:func:`factored_inner_dense`).
- rows: two sets of records are laid out over the union of the rows they use (U <= min(V,
  M N + K N)), so ``<x_i, y_j>`` costs ``U D`` per pair (:func:`rows_inner`).
- :func:`sqnorms`: the exact squared norms of any material (for factors the ghost norm or
  the materialised gradients, whichever counts fewer multiply-adds, :func:`norm_method`;
  each datum's distinct rows for rows,
  :func:`~gradlog.grads.norms.dense_sqnorms` for dense gradients).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from gradlog.errors import ConfigError
from gradlog.grads.material import MAX_ELEMENTS, Factors, Material, Rows, outer_sums
from gradlog.grads.norms import dense_sqnorms

__all__ = [
    "factor_group",
    "factored_group_dots",
    "factored_inner",
    "factored_inner_dense",
    "factored_sqnorms",
    "ghost_blocks",
    "ghost_cost",
    "grouped_sqnorms",
    "norm_method",
    "prefer_factored",
    "rows_inner",
    "sqnorms",
]

_SPEED = 1.0
"""Factored work counts as cheaper up to this many times the materialised multiply-adds.
Measured per multiply-add on CPU (tests/benchmarks/RESULTS.md, "Forms"): ghost norms ran
0.9x (N 128, 256x256), 1.0x (N 512, 2048x512) and 1.2x (N 512, 512x512, blocked) the time
of forming the gradients; stage 1 used 1.5, which picked the slower ghost norm at N 512."""

_GHOST_BLOCK = 256
"""Rows per block of a ghost norm: ``g g^T`` is symmetric, so with K blocks only the
K (K + 1) / 2 block pairs on and above the diagonal are multiplied (0.75 of the work for
K 2: 512 tokens). Measured at N 512, 2048x512 (B 4, one thread): blocks of 512, 256, 128,
64 rows took 59, 43, 46, 49 ms, forming the gradients 50 ms: smaller blocks save
multiply-adds but run slower."""


def ghost_blocks(n: int) -> int:
    """Blocks K a ghost norm over ``n`` rows is cut into (1: no cut below 2 blocks' rows)."""
    return max(1, n // _GHOST_BLOCK)


_FLOAT64_COST = 2
"""A float64 multiply-add counted as this many float32 ones (CPUs run float64 matrix products
at about half the float32 rate; data-centre GPUs at about the same)."""


def ghost_cost(n: int, p: int, q: int) -> int:
    """Work of one ghost norm ``sum((g g^T) * (a a^T))`` over ``n`` rows, blocked
    (:data:`_GHOST_BLOCK`), in float32 multiply-adds: ``n^2 (p + q) (K + 1) / (2 K)``
    float64 multiply-adds (see :func:`factored_sqnorms`) times :data:`_FLOAT64_COST`."""
    k = ghost_blocks(n)
    return _FLOAT64_COST * n * n * (p + q) * (k + 1) // (2 * k)


def prefer_factored(
    m: int, n1: int, k: int, n2: int, p: int, q: int, *, pairs: int | None = None
) -> bool:
    """Whether comparing ``m`` records of ``n1`` rows with ``k`` of ``n2`` rows is cheaper
    factored than materialised, for a ``(p, q)`` parameter (``pairs``: number of pairs
    compared, default all ``m k``; ``m`` for norms)."""
    pairs = m * k if pairs is None else pairs
    if pairs == m and n1 == n2 and m == k:  # norms: symmetric blocks (ghost_cost)
        factored = pairs * ghost_cost(n1, p, q)
    else:
        factored = pairs * n1 * n2 * (p + q)
    materialised = (m * n1 + (0 if pairs == m else k * n2)) * p * q + pairs * p * q
    return factored <= _SPEED * materialised


def factored_inner(
    g1: torch.Tensor,
    a1: torch.Tensor,
    g2: torch.Tensor,
    a2: torch.Tensor,
    *,
    dtype: torch.dtype = torch.float64,
    method: str = "auto",
) -> torch.Tensor:
    """``<g1_i^T a1_i, g2_j^T a2_j>`` for all pairs, ``(M, K)``, exact.

    Records compared with themselves (``g2 is g1 and a2 is a1``) give a symmetric result:
    only the blocks on and above the diagonal are computed, the others mirrored.

    Args:
        g1: ``(M, N1, p)``. a1: ``(M, N1, q)``. g2: ``(K, N2, p)``. a2: ``(K, N2, q)``.
        dtype: Computation and result dtype.
        method: ``"factored"`` (``sum((g1 g2^T) * (a1 a2^T))``), ``"materialised"`` (form
            the gradients, in chunks), or ``"auto"`` (the cheaper, :func:`prefer_factored`).
    """
    M, N1, p = g1.shape
    K, N2, q = g2.shape[0], g2.shape[1], a2.shape[2]
    if method == "auto":
        method = "factored" if prefer_factored(M, N1, K, N2, p, q) else "materialised"
    if method not in ("factored", "materialised"):
        raise ConfigError(f"method={method!r} is not one of ['auto', 'factored', 'materialised'].")
    same = g2 is g1 and a2 is a1
    out = torch.empty((M, K), dtype=dtype, device=g1.device)  # (M, K)
    if method == "factored":
        gy = _cast(g2, dtype).reshape(K * N2, p)  # (K*N2, p)
        ay = _cast(a2, dtype).reshape(K * N2, q)  # (K*N2, q)
        if same and (K * N2) ** 2 <= MAX_ELEMENTS:  # both Gram matrices whole, symmetric
            gg = _gram(gy).reshape(K, N2, K, N2)  # (K, N2, K, N2)
            s = gg.mul_(_gram(ay).reshape(K, N2, K, N2)).sum((1, 3))  # (K, K)
            return s.triu().add_(s.triu(1).T)  # symmetric to the bit, as the blocks below
        step = max(1, MAX_ELEMENTS // max(1, K * N1 * N2))  # records of x per chunk
        for i in range(0, M, step):
            m = min(step, M - i)
            j0 = i if same else 0  # columns before i mirror rows already computed
            if same:  # rows of the converted y
                gx, ax = gy[i * N1 : (i + m) * N1], ay[i * N1 : (i + m) * N1]  # (m*N1, p|q)
            else:
                gx = _cast(g1[i : i + m], dtype).reshape(-1, p)  # (m*N1, p)
                ax = _cast(a1[i : i + m], dtype).reshape(-1, q)  # (m*N1, q)
            k = K - j0
            gg = (gx @ gy[j0 * N2 :].T).reshape(m, N1, k, N2)  # (m, N1, k, N2)
            aa = (ax @ ay[j0 * N2 :].T).reshape(m, N1, k, N2)  # (m, N1, k, N2)
            out[i : i + m, j0:] = gg.mul_(aa).sum((1, 3))  # (m, k)
            if same:
                out[i + m :, i : i + m] = out[i : i + m, i + m :].T  # (K - i - m, m)
        return out
    step = max(1, MAX_ELEMENTS // max(1, p * q))  # records materialised at once
    for j in range(0, K, step):
        y = _materialise(g2[j : j + step], a2[j : j + step], dtype)  # (k, p q)
        for i in range(0, j + 1 if same else M, step):
            if same and i == j:
                out[j : j + y.shape[0], j : j + y.shape[0]] = _gram(y)  # (k, k)
                continue
            x = _materialise(g1[i : i + step], a1[i : i + step], dtype)  # (m, p q)
            block = _mm_t(x, y)  # (m, k)
            out[i : i + x.shape[0], j : j + y.shape[0]] = block
            if same:
                out[j : j + y.shape[0], i : i + x.shape[0]] = block.T
    return out


def _on_numpy(*ts: torch.Tensor) -> bool:
    """Whether products of these tensors go through numpy: CPU tensors outside autograd.

    On the CPU numpy's BLAS does a product with its own transpose (syrk) in half the
    multiply-adds of torch's ``x @ x.T`` (6 against 12 ms at 128 x 16384, float64), and
    keeping a block's products in one library avoids torch's OpenMP threads spinning while
    the BLAS threads run (medians 2x the minimum on 2 cores when mixed)."""
    return all(t.device.type == "cpu" and not t.requires_grad for t in ts)


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in ``dtype`` (:func:`_on_numpy`: through numpy, whose single-threaded cast
    does not wait on torch's threads: 1 ms against a 6 ms median for 1.5M elements)."""
    if t.dtype == dtype or dtype not in _NUMPY or not _on_numpy(t):
        return t.to(dtype)
    return torch.from_numpy(t.numpy().astype(_NUMPY[dtype]))


_NUMPY = {torch.float32: np.float32, torch.float64: np.float64}


def _gram(x: torch.Tensor) -> torch.Tensor:
    """``x x^T`` ``(n, n)`` of a matrix ``(n, d)`` (:func:`_on_numpy`: syrk on the CPU)."""
    if not _on_numpy(x):
        r = x @ x.T  # (n, n)
        return r.triu().add_(r.triu(1).T)  # symmetric to the bit, as syrk's
    xn = x.contiguous().numpy()  # (n, d)
    return torch.from_numpy(xn @ xn.T)  # (n, n)


def _mm_t(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``x y^T`` ``(m, k)`` of ``(m, d)`` and ``(k, d)`` (:func:`_on_numpy`)."""
    if not _on_numpy(x, y):
        return x @ y.T  # (m, k)
    return torch.from_numpy(x.numpy() @ y.numpy().T)  # (m, k)


def _materialise(g: torch.Tensor, a: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The gradients ``g_b^T a_b`` of factors, flat, formed in ``dtype``: ``(b, p q)``."""
    if not _on_numpy(g, a) or dtype not in (torch.float32, torch.float64):
        return torch.bmm(g.to(dtype).transpose(1, 2), a.to(dtype)).reshape(g.shape[0], -1)
    kind = np.float64 if dtype == torch.float64 else np.float32
    gn = g.numpy().astype(kind, copy=False)  # (b, N, p)
    an = a.numpy().astype(kind, copy=False)  # (b, N, q)
    return torch.from_numpy(np.matmul(gn.transpose(0, 2, 1), an).reshape(g.shape[0], -1))


def factored_inner_dense(
    g: torch.Tensor, a: torch.Tensor, other: torch.Tensor, *, dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """``<g_i^T a_i, W_k>`` ``(M, K)`` of factored records with dense gradients, exact.

    Contracted as ``sum_n g_in^T W_k a_in``, i.e. ``(g W_k) . a`` (or ``(a W_k^T) . g``,
    whichever intermediate is smaller): ``M N K p q`` multiply-adds and no record formed.
    Forming the records first costs ``M p q (N + K)``; the cheaper is taken (the
    contraction whenever ``K == 1``: one dense gradient, as influence compares with).

    Args:
        g: ``(M, N, p)``. a: ``(M, N, q)``.
        other: ``(K, p, q)`` dense gradients.
        dtype: Computation and result dtype.
    """
    M, N, p = g.shape
    q = a.shape[2]
    K = other.shape[0]
    w = _cast(other, dtype)  # (K, p, q)
    out = torch.empty((M, K), dtype=dtype, device=g.device)  # (M, K)
    if N * K > N + K:  # forming the records is cheaper
        flat = w.reshape(K, p * q)  # (K, p q)
        step = max(1, MAX_ELEMENTS // max(1, p * q))
        for i in range(0, M, step):
            out[i : i + step] = _mm_t(_materialise(g[i : i + step], a[i : i + step], dtype), flat)
        return out
    # contract W with the factor of the larger side; the other factor meets the result
    near, far, d = (g, a, q) if q <= p else (a, g, p)
    wk = (w if q <= p else w.transpose(1, 2)).permute(1, 0, 2)  # (p|q, K, d)
    wk = wk.reshape(wk.shape[0], K * d)  # (p|q, K d)
    step = max(1, MAX_ELEMENTS // max(1, N * K * d))
    for i in range(0, M, step):
        x = _cast(near[i : i + step], dtype)  # (m, N, p|q)
        m = x.shape[0]
        h = (x.reshape(m * N, -1) @ wk).reshape(m, N, K, d)  # (m, N, K, d)
        y = _cast(far[i : i + step], dtype)  # (m, N, d)
        out[i : i + m] = torch.einsum("mnkd,mnd->mk", h, y)  # (m, K)
    return out


def factored_group_dots(
    g: torch.Tensor,
    a: torch.Tensor,
    others: torch.Tensor,
    counts: list[int],
    *,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """``<g_i^T a_i, W_k>`` ``(M,)`` where the records come in consecutive groups, the
    ``k``-th of ``counts[k]`` records paired with ``others[k]`` (influence: the records of
    one step with the probe's gradient at that step), exact.

    The contraction of :func:`factored_inner_dense` with ``K == 1``, for every group in one
    batched matrix product (groups padded to the largest): a few large products rather than
    one small one per step, which on a few cores lose most of their time to thread start-up.

    Args:
        g: ``(M, N, p)``. a: ``(M, N, q)``.
        others: ``(S, p, q)`` dense gradients, one per group.
        counts: ``S`` group sizes summing to ``M``.
        dtype: Computation and result dtype.
    """
    M, N, p = g.shape
    q = a.shape[2]
    S = len(counts)
    L = max(counts, default=0)
    w = _cast(others, dtype)  # (S, p, q)
    near, far, d = (g, a, q) if q <= p else (a, g, p)
    if q > p:
        w = w.transpose(1, 2)  # (S, q, p)
    out = torch.empty(M, dtype=dtype, device=g.device)  # (M,)
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + c)
    step = max(1, MAX_ELEMENTS // max(1, L * N * (near.shape[2] + 2 * d)))  # groups at once
    for k0 in range(0, S, step):
        k1 = min(S, k0 + step)
        if all(c == L for c in counts[k0:k1]):  # equal groups: views, no copy
            x = _cast(near[starts[k0] : starts[k1]], dtype).reshape(k1 - k0, L * N, -1)
            y = _cast(far[starts[k0] : starts[k1]], dtype).reshape(k1 - k0, L * N, d)
        else:  # pad each group to L records (zero records score 0)
            x = near.new_zeros((k1 - k0, L * N, near.shape[2]), dtype=dtype)  # (s, L N, p|q)
            y = far.new_zeros((k1 - k0, L * N, d), dtype=dtype)  # (s, L N, d)
            for k in range(k0, k1):
                n = (starts[k + 1] - starts[k]) * N
                x[k - k0, :n] = near[starts[k] : starts[k + 1]].reshape(n, -1)
                y[k - k0, :n] = far[starts[k] : starts[k + 1]].reshape(n, d)
        h = torch.bmm(x, w[k0:k1])  # (s, L N, d)
        scores = h.mul_(y).reshape(k1 - k0, L, N * d).sum(2)  # (s, L)
        for k in range(k0, k1):
            out[starts[k] : starts[k + 1]] = scores[k - k0, : counts[k]]
    return out


def factored_sqnorms(
    g: torch.Tensor, a: torch.Tensor, *, dtype: torch.dtype = torch.float64, method: str = "auto",
    narrow: torch.dtype | None = None,
) -> torch.Tensor:
    """Ghost norms: ``||g_b^T a_b||^2 = sum((g_b g_b^T) * (a_b a_b^T))``, ``(B,)``, exact.

    Args:
        g: ``(B, N, p)``. a: ``(B, N, q)``.
        dtype: Result dtype, in which both paths accumulate their final sums. The
            materialised path forms the gradients in the inputs' dtype (at least float32),
            as recording computes them for ``full``, and squares them in ``dtype``. The
            factored path computes its Gram matrices in ``dtype`` too: their elementwise
            product sums ``N^2`` terms whose sizes are those of the squared per-token
            contributions, so a datum whose tokens' contributions cancel (a norm much smaller
            than the sum of the tokens' norms) would lose most of its digits in float32
            (a 1-8% error measured at N 64, 512x512), where the materialised path stays
            within float32 rounding of the gradient.
        method: ``"factored"``, ``"materialised"`` or ``"auto"`` (:func:`prefer_factored`).
        narrow: :attr:`Factors.narrow`: the materialised path forms float32 gradients from
            16-bit operands on a GPU's tensor cores (:func:`outer_sums`), as the Linear rule
            does.
    """
    B, N, p = g.shape
    q = a.shape[2]
    if method == "auto":
        method = "factored" if prefer_factored(B, N, B, N, p, q, pairs=B) else "materialised"
    if method not in ("factored", "materialised"):
        raise ConfigError(f"method={method!r} is not one of ['auto', 'factored', 'materialised'].")
    work = dtype if method == "factored" else _at_least_float32(g.dtype)
    per = N * N if method == "factored" else p * q
    step = max(1, MAX_ELEMENTS // max(1, per))
    if 0 < B <= step:  # one block of datums, the usual case: no result buffer nor slices
        return _factored_block(g, a, dtype, method, work, narrow)  # (B,)
    out = torch.empty(B, dtype=dtype, device=g.device)  # (B,)
    for i in range(0, B, step):
        out[i : i + step] = _factored_block(g[i : i + step], a[i : i + step], dtype, method,
                                            work, narrow)  # (b,)
    return out


def _factored_block(g: torch.Tensor, a: torch.Tensor, dtype: torch.dtype, method: str,
                    work: torch.dtype, narrow: torch.dtype | None) -> torch.Tensor:
    """:func:`factored_sqnorms` of the datums of ``g`` (b, N, p), ``a`` (b, N, q): ``(b,)``."""
    if method == "factored":
        return _ghost(g.to(work), a.to(work), dtype)  # (b,)
    narrow = narrow if work == torch.float32 else None
    if narrow is None:  # (16-bit factors held as such are widened by outer_sums, if at all)
        g, a = g.to(work), a.to(work)
    b, p, q = g.shape[0], g.shape[2], a.shape[2]
    x = torch.empty((b, p, q), dtype=work, device=g.device)  # (b, p, q)
    x = outer_sums(g, a, 1.0, x, narrow)
    return dense_sqnorms(x.reshape(b, -1), dtype)  # (b,)


def _at_least_float32(dtype: torch.dtype) -> torch.dtype:
    """``torch.promote_types(dtype, torch.float32)``; a dispatcher call only for rare dtypes."""
    if dtype in (torch.float32, torch.float64):
        return dtype
    if dtype in (torch.bfloat16, torch.float16):
        return torch.float32
    return torch.promote_types(dtype, torch.float32)


def _ghost(g: torch.Tensor, a: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``sum((g g^T) * (a a^T))`` per datum, ``(b,)`` in ``dtype``, over the block pairs on
    and above the diagonal (the others mirror them): :func:`ghost_cost`."""
    n = g.shape[1]
    k = ghost_blocks(n)
    if k == 1:  # one block pair: its sum is the result (10 ops a record where it took 20)
        gg = torch.bmm(g, g.transpose(1, 2))  # (b, n, n)
        aa = torch.bmm(a, a.transpose(1, 2))  # (b, n, n)
        return gg.mul_(aa).reshape(g.shape[0], -1).sum(1).to(dtype)  # (b,)
    cuts = [n * i // k for i in range(k + 1)]
    out = torch.zeros(g.shape[0], dtype=dtype, device=g.device)  # (b,)
    for i in range(k):
        gi, ai = g[:, cuts[i] : cuts[i + 1]], a[:, cuts[i] : cuts[i + 1]]  # (b, n_i, p|q)
        for j in range(i, k):
            gj, aj = g[:, cuts[j] : cuts[j + 1]], a[:, cuts[j] : cuts[j + 1]]
            gg = torch.bmm(gi, gj.transpose(1, 2))  # (b, n_i, n_j)
            aa = torch.bmm(ai, aj.transpose(1, 2))  # (b, n_i, n_j)
            part = gg.mul_(aa).reshape(g.shape[0], -1).sum(1).to(dtype)  # (b,) cascade sum
            out += part if i == j else 2 * part
    return out


def rows_inner(x: Rows, y: Rows, *, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``<x_i, y_j>`` ``(M, K)`` of two sets of sparse-row gradients (scale 1), exact, in
    ``dtype``: blocks of records whose union of rows keeps ``(m + k) U D`` elements within
    :data:`~gradlog.grads.material.MAX_ELEMENTS` are laid out densely over that union."""
    M, K = x.batch_size, y.batch_size
    D = x.width
    out = torch.empty((M, K), dtype=dtype, device=x.values.device)  # (M, K)
    per = max(1, D * (int(x.index.shape[1]) + int(y.index.shape[1])))
    step = max(1, int((MAX_ELEMENTS // per) ** 0.5))
    for i in range(0, M, step):
        for j in range(0, K, step):
            out[i : i + step, j : j + step] = _union_inner(
                x.index[i : i + step],
                x.values[i : i + step],
                y.index[j : j + step],
                y.values[j : j + step],
                D,
                dtype,
            )
    return out


def norm_method(g: torch.Tensor, a: torch.Tensor) -> str:
    """The ghost norm or materialise-then-reduce for factors ``g`` (B, N, p), ``a`` (B, N, q),
    by their counted multiply-adds (:func:`ghost_cost` against forming the gradients), on
    every device. The two round differently (the materialised gradients are float32), so the
    choice is a function of the shapes alone: a run recorded twice stores the same norms (on
    the CPU the faster of the two was once timed per process, and identical runs stored norms
    2.5e-8 apart). Where the counts are close, both took about the same time (0.9-1.2x)."""
    B, N, p = g.shape
    q = a.shape[2]
    factored, materialised = B * ghost_cost(N, p, q), B * (N * p * q + p * q)
    return "factored" if factored <= _SPEED * materialised else "materialised"


def sqnorms(material: Material, *, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Exact squared norms ``(B,)`` of per-datum gradients given as any material.

    Factors use the (blocked) ghost norm or materialise a few datums at a time, whichever
    :func:`norm_method` counts cheaper for their shape; rows sum their distinct rows'
    squares.
    """
    if isinstance(material, Factors):  # the scale applies to the result: no copy of g
        g, a = material.masked().held  # (dropped rows zeroed: they may hold anything)
        method = norm_method(g, a)
        out = factored_sqnorms(g, a, dtype=dtype, method=method, narrow=material.narrow)
        return out.mul_(material.scale**2) if material.scale != 1.0 else out
    if isinstance(material, Rows):
        return material.sqnorms(dtype)  # (B,)
    return dense_sqnorms(material.reshape(material.shape[0], -1), dtype)  # (B,)


def factor_group(material: Factors) -> tuple[Any, ...] | None:
    """The key under which :func:`grouped_sqnorms` takes several factors' norms in one pass
    (their shapes, dtypes, device, 16-bit promise and scale), or None: masked factors go
    alone (their rows are zeroed first)."""
    if material.mask is not None:
        return None
    g, a = material.held
    return (g.device, g.dtype, a.dtype, tuple(g.shape), tuple(a.shape), material.narrow,
            material.scale)


def grouped_sqnorms(materials: list[Factors], *,
                    dtype: torch.dtype = torch.float64) -> list[torch.Tensor]:
    """:func:`sqnorms` of factors of one :func:`factor_group`, ``(B,)`` each, in one pass over
    their datums stacked: a ~1B Llama's step has 112 Linear records in 3 shapes, whose norms
    took ~10 small operations each (the host's work, on a GPU the device waiting for it).
    The ghost norms are each record's own; materialised ones agree to float32 rounding (the
    stacked batch's matmul may block differently)."""
    first = materials[0]
    # at most MAX_ELEMENTS of factors a pass: the stacked copy (and its float64 widening in
    # a ghost norm) grows with the records, 7B-sized q/k/v/o of a step would be tens of GB
    k = max(1, MAX_ELEMENTS // max(1, sum(t.numel() for t in first.held)))
    if len(materials) > k:
        return [n for i in range(0, len(materials), k)
                for n in grouped_sqnorms(materials[i : i + k], dtype=dtype)]
    if len(materials) == 1:
        return [sqnorms(first, dtype=dtype)]
    g = torch.cat([f.held[0] for f in materials])  # (k B, N, p) as held (16-bit: half the copy)
    a = torch.cat([f.held[1] for f in materials])  # (k B, N, q)
    method = norm_method(*first.held)  # as each alone would
    out = factored_sqnorms(g, a, dtype=dtype, method=method, narrow=first.narrow)  # (k B,)
    if first.scale != 1.0:
        out.mul_(first.scale**2)
    return list(out.view(len(materials), -1).unbind(0))


def _union_inner(
    ix: torch.Tensor,
    vx: torch.Tensor,
    iy: torch.Tensor,
    vy: torch.Tensor,
    D: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Inner products ``(M, K)`` of two sets of sparse-row records (rows of D elements)
    laid out densely over the union of the rows they use."""
    used = torch.cat([ix[ix >= 0], iy[iy >= 0]])  # (n_used,)
    union = torch.unique(used)  # (U,) sorted
    U = int(union.numel())

    def lay_out(index: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        n = index.shape[0]
        slot = torch.searchsorted(union, index.clamp(min=0))  # (n, N) position in union
        flat = slot + torch.arange(n, device=index.device).unsqueeze(1) * U  # (n, N)
        keep = (index >= 0).reshape(-1)  # (n*N,)
        dense = values.new_zeros((n * U, D), dtype=dtype)  # (n*U, D)
        dense.index_add_(0, flat.reshape(-1)[keep], values.reshape(-1, D)[keep].to(dtype))
        return dense.reshape(n, U * D)  # (n, U*D)

    return lay_out(ix, vx) @ lay_out(iy, vy).T  # (M, K)
