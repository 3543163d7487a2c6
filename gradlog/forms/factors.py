"""``factors``: the exact factors ``g_b`` (N, p) and ``a_b`` (N, q) of ``g_b^T a_b``.

For a Linear-like weight ``(p, q)`` the per-datum gradient is ``G_b^T A_b`` (output
gradients times inputs, summed over the datum's N tokens). Storing the two factors costs
``N (p + q)`` floats instead of ``p q``: smaller when ``N < p q / (p + q)``
(:func:`~gradlog.forms.base.factors_worthwhile`), e.g. 64 tokens for 128 x 128, 2048 for
4096 x 4096. Exact.

Arrays: ``g`` (records, tokens, p) and ``a`` (records, tokens, q), where ``tokens`` is the
provisioned rows per datum (the spec's ``tokens``, normally the context length). A datum
with fewer rows (padding, dropped tokens) has zero rows after its own; the scale of the
gradient is folded into ``g``.

Comparisons never need the gradients. ``<g1^T a1, g2^T a2> = sum((g1 g2^T) * (a1 a2^T))``
costs ``N1 N2 (p + q)`` per pair against ``p q`` per record plus ``p q`` per pair when
materialising; :func:`factored_inner` picks the cheaper by that count (both exact): factored
for few tokens or few pairs (ghost norms: one pair per record, factored up to
``N (p + q) ~ p q``, less with symmetric blocks), materialised for many pairs of long records.

A bias of a Linear-like layer has the gradient ``sum_n g_{b,n}`` (``Factors.bias()``): its
factored form is its full form, so ``factors`` asked for a vector plans ``full``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from gradlog.errors import ConfigError, InputError
from gradlog.forms.base import (
    MAX_ELEMENTS,
    ArraySpec,
    Encoded,
    Factors,
    Form,
    Material,
    ParamInfo,
    check_options,
    dense_sqnorms,
    spec_fields,
)
from gradlog.forms.full import FullForm

__all__ = [
    "FactorsForm",
    "factored_inner",
    "factored_sqnorms",
    "ghost_blocks",
    "ghost_cost",
    "prefer_factored",
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
    out = torch.empty((M, K), dtype=dtype, device=g1.device)  # (M, K)
    if method == "factored":
        step = max(1, MAX_ELEMENTS // max(1, K * N1 * N2))  # records of x per chunk
        gy = g2.to(dtype).reshape(K * N2, p)  # (K*N2, p)
        ay = a2.to(dtype).reshape(K * N2, q)  # (K*N2, q)
        for i in range(0, M, step):
            gx = g1[i : i + step].to(dtype)  # (m, N1, p)
            ax = a1[i : i + step].to(dtype)  # (m, N1, q)
            m = gx.shape[0]
            gg = (gx.reshape(m * N1, p) @ gy.T).reshape(m, N1, K, N2)  # (m, N1, K, N2)
            aa = (ax.reshape(m * N1, q) @ ay.T).reshape(m, N1, K, N2)  # (m, N1, K, N2)
            out[i : i + m] = gg.mul_(aa).sum((1, 3))  # (m, K)
        return out
    if method != "materialised":
        raise ConfigError(f"method={method!r} is not one of ['auto', 'factored', 'materialised'].")
    step = max(1, MAX_ELEMENTS // max(1, p * q))  # records materialised at once
    for j in range(0, K, step):
        y = torch.bmm(
            g2[j : j + step].to(dtype).transpose(1, 2), a2[j : j + step].to(dtype)
        ).reshape(-1, p * q)  # (k, p q)
        for i in range(0, M, step):
            x = torch.bmm(
                g1[i : i + step].to(dtype).transpose(1, 2), a1[i : i + step].to(dtype)
            ).reshape(-1, p * q)  # (m, p q)
            out[i : i + x.shape[0], j : j + y.shape[0]] = x @ y.T  # (m, k)
    return out


def factored_sqnorms(
    g: torch.Tensor, a: torch.Tensor, *, dtype: torch.dtype = torch.float64, method: str = "auto"
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
    """
    B, N, p = g.shape
    q = a.shape[2]
    if method == "auto":
        method = "factored" if prefer_factored(B, N, B, N, p, q, pairs=B) else "materialised"
    if method not in ("factored", "materialised"):
        raise ConfigError(f"method={method!r} is not one of ['auto', 'factored', 'materialised'].")
    work = dtype if method == "factored" else torch.promote_types(g.dtype, torch.float32)
    out = torch.empty(B, dtype=dtype, device=g.device)  # (B,)
    per = N * N if method == "factored" else p * q
    step = max(1, MAX_ELEMENTS // max(1, per))
    for i in range(0, B, step):
        gb = g[i : i + step].to(work)  # (b, N, p)
        ab = a[i : i + step].to(work)  # (b, N, q)
        if method == "factored":
            out[i : i + gb.shape[0]] = _ghost(gb, ab, dtype)  # (b,)
        else:
            x = torch.bmm(gb.transpose(1, 2), ab).reshape(gb.shape[0], -1)  # (b, p q)
            out[i : i + gb.shape[0]] = dense_sqnorms(x, dtype)  # (b,)
    return out


def _ghost(g: torch.Tensor, a: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``sum((g g^T) * (a a^T))`` per datum, ``(b,)`` in ``dtype``, over the block pairs on
    and above the diagonal (the others mirror them): :func:`ghost_cost`."""
    n = g.shape[1]
    k = ghost_blocks(n)
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


class FactorsForm(Form):
    """Exact factors of a Linear-like weight (see the module doc).

    Args:
        shape: The weight's shape ``(p, q)``.
        tokens: Rows per datum provisioned in the arrays (>= 1).
    """

    name: ClassVar[str] = "factors"
    exact: ClassVar[bool] = True

    def __init__(self, shape: tuple[int, ...], tokens: int) -> None:
        super().__init__(shape)
        if len(self.shape) != 2:
            raise ConfigError(f"form 'factors' needs a matrix parameter, got shape {self.shape}.")
        if tokens < 1:
            raise ConfigError(f"form 'factors' needs tokens >= 1 (rows per datum), got {tokens}.")
        self.tokens = int(tokens)

    @classmethod
    def plan(cls, info: ParamInfo, **options: Any) -> Form:
        """``factors`` for a parameter whose rule gives factors; the exact factored form
        otherwise: ``rows`` for sparse rows (an Embedding's rows are its factors), ``full``
        for dense gradients (a bias, a LayerNorm weight). Option: ``tokens`` (rows per
        datum to provision; default ``info.tokens``)."""
        check_options(cls.name, options, ("tokens",))
        if info.source == "rows":
            from gradlog.forms.rows import RowsForm

            return RowsForm.plan(info, **options)
        if info.source != "factors":
            return FullForm.plan(info)
        tokens = options.get("tokens", info.tokens)
        if not isinstance(tokens, int) or isinstance(tokens, bool):
            raise ConfigError(f"form 'factors' option tokens={tokens!r} must be an integer.")
        form = cls(info.shape, tokens)
        if "tokens" in options:
            form.requested_tokens = tokens
        return form

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> FactorsForm:
        f = spec_fields(spec, cls.name, {"tokens": int})
        return cls(f["shape"], f["tokens"])

    def spec(self) -> dict[str, Any]:
        return {"form": self.name, "shape": list(self.shape), "tokens": self.tokens}

    def arrays(self) -> dict[str, ArraySpec]:
        p, q = self.shape
        return {"g": ArraySpec((self.tokens, p)), "a": ArraySpec((self.tokens, q))}

    def encode(self, material: Material) -> Encoded:
        """Factors with scale and mask folded in, padded (or compacted) to ``tokens`` rows.

        Raises:
            InputError: the material is not :class:`Factors`, or a datum has more
                contributing rows than ``tokens``.
        """
        self._check_material(material)
        if not isinstance(material, Factors):
            raise InputError(
                f"form 'factors' stores factors, but got dense per-datum gradients of shape "
                f"{tuple(material.shape) if isinstance(material, torch.Tensor) else '?'}. "
                "Plan the form with FactorsForm.plan (it gives 'full' for dense material)."
            )
        n = material.tokens
        if n > self.tokens:  # keep only rows that count, if they fit
            c, lengths = material.compact()
            longest = int(lengths.max()) if lengths.numel() else 0
            if longest > self.tokens:
                fix = "Plan with tokens=" if self.requested_tokens is None else (
                    f"Raise the form request's own 'tokens' option ({self.requested_tokens}; "
                    "it wins over GradRecorder(..., tokens=N)) to")
                raise InputError(
                    f"form 'factors' was provisioned for {self.tokens} rows per datum, but a "
                    f"datum has {longest} contributing rows (a longer context, or a module "
                    f"called several times). {fix} at least the longest datum's rows per "
                    "step, or use form 'auto' or 'projection'."
                )
            return {"g": c.g[:, : self.tokens], "a": c.a[:, : self.tokens]}
        c = material.canonical()
        if n == self.tokens:
            return {"g": c.g, "a": c.a}
        pad = (0, 0, 0, self.tokens - n)  # zero rows after each datum's own
        return {"g": torch.nn.functional.pad(c.g, pad), "a": torch.nn.functional.pad(c.a, pad)}

    def decode(self, encoded: Mapping[str, torch.Tensor]) -> torch.Tensor:
        self.check(encoded)
        return torch.bmm(encoded["g"].transpose(1, 2), encoded["a"])  # (M, p, q)

    def inner(
        self,
        x: Mapping[str, torch.Tensor],
        y: Mapping[str, torch.Tensor],
        *,
        dtype: torch.dtype = torch.float64,
        method: str = "auto",
    ) -> torch.Tensor:
        self.check(x)
        self.check(y)
        return factored_inner(x["g"], x["a"], y["g"], y["a"], dtype=dtype, method=method)

    def sqnorms(
        self, x: Mapping[str, torch.Tensor], *, dtype: torch.dtype = torch.float64
    ) -> torch.Tensor:
        self.check(x)
        return factored_sqnorms(x["g"], x["a"], dtype=dtype)
