"""``projection``: a random projection of each per-datum gradient, from stored seeds.

Two structures:

- ``two_sided`` (matrices; the default for parameters of >= 2 dimensions, viewed as
  ``(p, q)`` with ``p = shape[0]``): ``P0^T W P1`` with ``P0`` (p, r0), ``P1`` (q, r1),
  stored as ``proj`` (records, r0, r1). From factors it is ``(g P0)^T (a P1)``: ``N (p r0 +
  q r1 + r0 r1)`` per datum, never forming the ``p q`` gradient (LoGra); from sparse rows
  ``P0[index]^T (values P1)``; from dense gradients ``P0^T (W P1)``.
- ``dense`` (vectors; the default for 1-D parameters): ``P^T vec(W)`` with ``P`` (numel, r),
  stored as ``proj`` (records, r). ``P`` is generated in blocks of ``block`` rows, each from
  its own seed, so a huge parameter never needs the whole ``(numel, r)`` matrix in memory
  (it is cached whole up to :data:`CACHE_ELEMENTS`, else streamed block by block).

**Scaling (unbiasedness).** Entries of a ``(n, r)`` matrix are ``N(0, 1/r)`` (``gaussian``)
or ``+-1/sqrt(r)`` (``rademacher``), so ``E[P P^T] = I`` and ``E[<P^T u, P^T v>] = <u, v>``:
inner products and squared norms in projected space are unbiased estimates of the gradients'.
For ``two_sided``, ``P0`` and ``P1`` are independent and each scaled by its own r, so
``E[<P0^T X P1, P0^T Y P1>] = <X, Y>``. The error of a dense projection shrinks as
``1/sqrt(r)`` (Johnson-Lindenstrauss; for Gaussian entries ``Var = (|u|^2 |v|^2 + <u,v>^2)
/ r``, Rademacher is slightly smaller). A two-sided projection of a low-rank gradient (one
token: ``g a^T``) errs as a product of two sketches, ``~ sqrt(1/r0 + 1/r1)``: at the same
stored size ``r0 r1`` it is noisier than a dense projection but far cheaper to compute.

**Generator (version 1): the same seeds give the same matrices on every machine.**
Everything is generated on the CPU with ``torch.Generator`` (Mersenne Twister) and rounded
to float32 last, whatever the device and dtype the matrices are used in:

- ``derive_seed(seed, *path)``: splitmix64 of ``seed`` then, for each element of ``path``,
  splitmix64 of (state XOR element), all modulo 2^64; the result shifted right by one bit
  (a 63-bit seed). ``param_seed(seed, name)`` = ``derive_seed(seed, h)`` with ``h`` the first
  8 bytes (little endian) of the sha256 of the UTF-8 name.
- ``random_matrix(n, r, kind, s)``: ``gen = torch.Generator("cpu").manual_seed(s)``; for
  ``gaussian`` ``torch.randn((n, r), generator=gen, dtype=torch.float64)``, for
  ``rademacher`` ``2 * torch.randint(0, 2, (n, r), generator=gen) - 1`` (int64); times
  ``1 / sqrt(r)`` in float64; rounded to float32. Gaussians are drawn in float64 because
  torch's float32 ``randn`` takes a vectorised path on AVX2 CPUs (approximate log/cos) and a
  scalar one elsewhere, which differ in the last bits; the float64 path is scalar everywhere.
  Rademacher signs are integer draws: bit-exact on every machine.
- ``two_sided``: ``P0 = random_matrix(p, r0, kind, derive_seed(seed, 0))``,
  ``P1 = random_matrix(q, r1, kind, derive_seed(seed, 1))``.
- ``dense``: ``P`` is the rows of blocks ``random_matrix(min(block, numel - i block), r,
  kind, derive_seed(seed, 2, i))`` for ``i = 0, 1, ...`` stacked in order.

The spec stores ``structure``, ``kind``, ``seed`` (already derived per parameter),
``ranks`` (``[r0, r1]`` or ``[r]``), ``block`` and ``generator`` (1); :func:`project`
applies the same projection to any gradient the user computes (a test example's).
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

import torch

from gradlog.errors import ConfigError, InputError, StoreFormatError
from gradlog.forms.base import (
    ArraySpec,
    Encoded,
    Form,
    ParamInfo,
    as_batch,
    check_options,
    spec_fields,
)
from gradlog.grads import Factors, Material, Rows, chunks, dense_sqnorms, ghost_cost, material_shape

__all__ = [
    "CACHE_ELEMENTS",
    "GENERATOR_VERSION",
    "KINDS",
    "STRUCTURES",
    "ProjectionForm",
    "balanced_ranks",
    "derive_seed",
    "param_seed",
    "project",
    "random_matrix",
]

KINDS = ("rademacher", "gaussian")
"""Entry distributions; ``rademacher`` (the default) is bit-exact everywhere and cheaper."""

STRUCTURES = ("two_sided", "dense")
"""``two_sided``: ``P0^T W P1`` of the matrix view; ``dense``: ``P^T vec(W)``."""

GENERATOR_VERSION = 1
"""Version of the recipe in the module doc; specs of another version are refused."""

CACHE_ELEMENTS = 1 << 24
"""A dense projection matrix up to this many elements (64 MiB in float32) is generated once
and kept; a larger one is regenerated block by block at every call."""

DEFAULT_DIM = 1024
"""Projected size when neither ``dim`` nor ``ranks`` is given (capped at the parameter's)."""

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def derive_seed(seed: int, *path: int) -> int:
    """A 63-bit seed for the stream ``path`` of ``seed`` (splitmix64; see the module doc)."""
    state = _splitmix64(seed & _MASK64)
    for element in path:
        state = _splitmix64(state ^ (element & _MASK64))
    return state >> 1


def param_seed(seed: int, name: str) -> int:
    """The seed of parameter ``name`` in a run with base seed ``seed``: independent
    projections for different parameters, the same for the same name and seed."""
    digest = hashlib.sha256(name.encode("utf-8")).digest()
    return derive_seed(seed, int.from_bytes(digest[:8], "little"))


def random_matrix(rows: int, cols: int, kind: str, seed: int) -> torch.Tensor:
    """The ``(rows, cols)`` float32 CPU matrix of ``kind`` with entries of variance
    ``1/cols`` drawn from ``seed`` (the recipe in the module doc)."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed)
    if kind == "gaussian":
        m = torch.randn((rows, cols), generator=gen, dtype=torch.float64)  # (rows, cols)
    elif kind == "rademacher":
        bits = torch.randint(0, 2, (rows, cols), generator=gen, dtype=torch.int64)
        m = (2 * bits - 1).to(torch.float64)  # (rows, cols)
    else:
        raise ConfigError(f"projection kind={kind!r} is not one of {list(KINDS)}.")
    return m.mul_(1.0 / math.sqrt(cols)).to(torch.float32)


def balanced_ranks(dim: int, p: int, q: int) -> tuple[int, int]:
    """``(r0, r1)`` with ``r0 r1 <= dim``, ``r0 <= p``, ``r1 <= q``, as equal as the dims
    allow (the error of a two-sided projection of a low-rank gradient goes as
    ``1/r0 + 1/r1``, least for equal ranks at a given product)."""
    r0 = max(1, min(p, math.isqrt(max(1, dim))))
    r1 = max(1, min(q, dim // r0))
    r0 = max(1, min(p, dim // r1))  # give back what q did not take
    return r0, r1


def _matrix_view(shape: tuple[int, ...]) -> tuple[int, int]:
    return shape[0], math.prod(shape[1:])


class ProjectionForm(Form):
    """A random projection with stored seeds (see the module doc).

    Args:
        shape: The parameter's shape.
        structure: ``"two_sided"`` (needs >= 2 dimensions) or ``"dense"``.
        kind: ``"rademacher"`` or ``"gaussian"``.
        seed: The parameter's seed (already derived from the run's, :func:`param_seed`).
        ranks: ``(r0, r1)`` for two_sided, ``(r,)`` for dense.
        block: Rows per generated block of a dense projection's matrix.
    """

    name: ClassVar[str] = "projection"
    exact: ClassVar[bool] = False

    def __init__(
        self,
        shape: tuple[int, ...],
        *,
        structure: str,
        kind: str,
        seed: int,
        ranks: tuple[int, ...],
        block: int = 0,
    ) -> None:
        super().__init__(shape)
        if structure not in STRUCTURES:
            raise ConfigError(
                f"projection structure={structure!r} is not one of {list(STRUCTURES)}."
            )
        if kind not in KINDS:
            raise ConfigError(f"projection kind={kind!r} is not one of {list(KINDS)}.")
        want = 2 if structure == "two_sided" else 1
        if len(ranks) != want or any(int(r) < 1 for r in ranks):
            raise ConfigError(
                f"a {structure} projection needs {want} rank(s) >= 1, got {list(ranks)}."
            )
        if structure == "two_sided" and len(self.shape) < 2:
            raise ConfigError(
                f"a two_sided projection needs a parameter of >= 2 dimensions, got shape "
                f"{self.shape}; use structure='dense'."
            )
        if not 0 <= seed < 2**64:
            raise ConfigError(f"projection seed {seed} must be in [0, 2**64).")
        self.structure = structure
        self.kind = kind
        self.seed = int(seed)
        self.ranks = tuple(int(r) for r in ranks)
        self.block = int(block) if structure == "dense" else 0
        if structure == "dense" and self.block < 1:
            self.block = max(1, (1 << 22) // self.ranks[0])
        self._cache: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, ...]] = {}
        self.stacks: dict[tuple[Any, ...], Any] = {}  # (gradlog.forms.grouped's, per group)

    @property
    def out_shape(self) -> tuple[int, ...]:
        """Shape of one projected record: ``(r0, r1)`` or ``(r,)``."""
        return self.ranks

    @property
    def dim(self) -> int:
        """Projected size per record."""
        return math.prod(self.ranks)

    # -- construction -----------------------------------------------------------------------
    @classmethod
    def plan(cls, info: ParamInfo, **options: Any) -> ProjectionForm:
        """Options: ``dim`` (projected size; default :data:`DEFAULT_DIM`, at most the
        parameter's size, where :func:`~gradlog.forms.make_form` plans ``full``
        instead; two-sided ranks from :func:`balanced_ranks`) or ``ranks``
        (``[r0, r1]`` or ``[r]``, taken as given), ``kind`` (default ``"rademacher"``),
        ``seed`` (the run's base seed, default 0; mixed with the parameter's name),
        ``structure`` (default ``two_sided`` for >= 2 dimensions, else ``dense``), ``block``
        (rows per generated block of a dense projection's matrix, an integer >= 1)."""
        check_options(cls.name, options, ("dim", "ranks", "kind", "seed", "structure", "block"))
        shape = info.shape
        who = f"parameter {info.name!r}" if info.name else "a parameter"
        structure = options.get("structure") or ("two_sided" if len(shape) >= 2 else "dense")
        if structure not in STRUCTURES:
            raise ConfigError(
                f"projection structure={structure!r} is not one of {list(STRUCTURES)}."
            )
        if structure == "two_sided" and len(shape) < 2:
            raise ConfigError(
                f"projection two_sided needs a parameter with >= 2 dimensions, but {who} has "
                f"shape {shape}; use structure='dense', or leave structure out (two_sided for "
                "matrices, dense for vectors)."
            )
        dim, ranks = options.get("dim"), options.get("ranks")
        if dim is not None and ranks is not None:
            raise ConfigError("projection takes dim= or ranks=, not both.")
        if ranks is not None:
            if not isinstance(ranks, (list, tuple)) or not all(
                isinstance(r, int) and not isinstance(r, bool) and r >= 1 for r in ranks
            ):
                raise ConfigError(
                    f"projection ranks={ranks!r} must be a list of integers >= 1: [r0, r1] "
                    "(two_sided) or [r] (dense)."
                )
            want = 2 if structure == "two_sided" else 1
            if len(ranks) != want:
                takes = "[r0, r1]" if want == 2 else "[r]"
                dense = ", or structure='dense' for [r]" if len(ranks) == 1 else ""
                raise ConfigError(
                    f"projection ranks={list(ranks)} does not fit {who} of shape {shape}: its "
                    f"{structure} projection takes {want} rank(s), {takes}. Use dim= instead "
                    f"(it fits every shape){dense}."
                )
        block = options.get("block")
        if block is not None and (not isinstance(block, int) or isinstance(block, bool)
                                  or block < 1):
            raise ConfigError(
                f"projection block={block!r} must be an integer >= 1 (rows per generated block "
                "of a dense projection's matrix); leave it out for the default."
            )
        if ranks is None:
            if dim is None:
                dim = DEFAULT_DIM
            if not isinstance(dim, int) or isinstance(dim, bool) or dim < 1:
                raise ConfigError(f"projection dim={dim!r} must be an integer >= 1.")
            if structure == "two_sided" and len(shape) >= 2:
                ranks = balanced_ranks(min(dim, info.numel), *_matrix_view(shape))
            else:
                ranks = (max(1, min(dim, info.numel)),)
        seed = options.get("seed", 0)
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise ConfigError(f"projection seed={seed!r} must be a non-negative integer.")
        return cls(
            shape,
            structure=structure,
            kind=options.get("kind", "rademacher"),
            seed=param_seed(seed, info.name),
            ranks=tuple(ranks),
            block=block or 0,
        )

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> ProjectionForm:
        f = spec_fields(
            spec,
            cls.name,
            {"structure": str, "kind": str, "seed": int, "ranks": list, "generator": int},
        )
        if f["generator"] != GENERATOR_VERSION:
            raise StoreFormatError(
                f"projection generator version {f['generator']} is not known to this gradlog "
                f"(it knows {GENERATOR_VERSION}); upgrade gradlog: pip install -U gradlog."
            )
        block = spec.get("block", 0)
        if f["structure"] == "dense" and not (isinstance(block, int) and block >= 1):
            raise StoreFormatError(
                f"dense projection spec has block {block!r}; expected an integer >= 1 (the rows "
                "of each generated block of the matrix, part of what defines it)."
            )
        try:
            return cls(
                f["shape"],
                structure=f["structure"],
                kind=f["kind"],
                seed=f["seed"],
                ranks=tuple(f["ranks"]),
                block=int(block),
            )
        except (ConfigError, TypeError, ValueError) as e:
            raise StoreFormatError(f"projection spec {dict(spec)!r} is invalid: {e}") from None

    def spec(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "form": self.name,
            "shape": list(self.shape),
            "structure": self.structure,
            "kind": self.kind,
            "seed": self.seed,
            "ranks": list(self.ranks),
            "generator": GENERATOR_VERSION,
        }
        if self.structure == "dense":
            out["block"] = self.block
        return out

    def arrays(self) -> dict[str, ArraySpec]:
        return {"proj": ArraySpec(self.out_shape)}

    # -- matrices ---------------------------------------------------------------------------
    def matrices(
        self, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
    ) -> tuple[torch.Tensor, ...]:
        """``(P0, P1)`` for two_sided; ``(P,)`` for dense if it is cached whole, else ``()``
        (use :meth:`blocks`). Generated once per device and dtype."""
        key = (torch.device(device), dtype)
        if key not in self._cache:
            if self.structure == "two_sided":
                p, q = _matrix_view(self.shape)
                r0, r1 = self.ranks
                mats: tuple[torch.Tensor, ...] = (
                    random_matrix(p, r0, self.kind, derive_seed(self.seed, 0)),
                    random_matrix(q, r1, self.kind, derive_seed(self.seed, 1)),
                )
            elif self.numel * self.ranks[0] <= CACHE_ELEMENTS:
                mats = (torch.cat([b for _, b in self._blocks()]),)
            else:
                mats = ()
            self._cache[key] = tuple(m.to(device=key[0], dtype=dtype) for m in mats)
        return self._cache[key]

    def share_matrices(self, device: torch.device, dtype: torch.dtype,
                       mats: tuple[torch.Tensor, ...]) -> None:
        """Use ``mats`` (the same values: views into a group's stacked matrices,
        :mod:`gradlog.forms.grouped`) as this form's matrices on ``device`` in ``dtype``."""
        self._cache[(torch.device(device), dtype)] = mats

    def _blocks(self) -> Iterator[tuple[int, torch.Tensor]]:
        for i, start in enumerate(range(0, self.numel, self.block)):
            rows = min(self.block, self.numel - start)
            yield start, random_matrix(rows, self.ranks[0], self.kind, derive_seed(self.seed, 2, i))

    def blocks(self) -> Iterator[tuple[int, torch.Tensor]]:
        """A dense projection's matrix as ``(first row, block)`` pairs, each generated when
        reached (CPU, float32); their rows stacked in order are ``P``."""
        if self.structure != "dense":
            raise InputError("blocks() is for dense projections; use matrices().")
        return self._blocks()

    # -- data -------------------------------------------------------------------------------
    def _encode(self, material: Material) -> Encoded:
        return {"proj": self._project(material)}

    def project(self, grad: torch.Tensor | Factors | Rows) -> torch.Tensor:
        """The projection of gradients computed elsewhere: one ``(*shape)`` -> ``out_shape``,
        or a batch ``(K, *shape)`` (or factors, rows) -> ``(K, *out_shape)``."""
        if isinstance(grad, torch.Tensor) and tuple(grad.shape) == self.shape:
            return self._project(grad.unsqueeze(0))[0]
        if isinstance(grad, torch.Tensor):
            grad = as_batch(grad, self.shape)
        elif material_shape(grad) != self.shape:
            raise InputError(
                f"gradients of shape {material_shape(grad)} do not match this "
                f"projection's parameter shape {self.shape}."
            )
        return self._project(grad)

    def _project(self, material: Material) -> torch.Tensor:
        if self.structure == "two_sided":
            if isinstance(material, Factors):
                return self._two_sided_factors(material)
            if isinstance(material, Rows):
                return self._two_sided_rows(material)
            return self._two_sided_dense(material)
        if isinstance(material, torch.Tensor):
            return self._dense(material.reshape(material.shape[0], -1))
        return torch.cat([self._dense(d.reshape(-1, self.numel)) for _, d in chunks(material)])

    def _encode_with_norms(
        self, material: Material, dtype: torch.dtype
    ) -> tuple[Encoded, torch.Tensor]:
        """Exact norms of factors need the gradients themselves unless the (blocked) ghost
        norm is cheaper; when they are formed anyway (a datum chunk at a time), the
        projection is taken from them too: ``p q r1`` per datum on top of ``N p q``,
        instead of the ghost norm plus ``N (p r0 + q r1)`` (:meth:`factored_is_cheaper`)."""
        if isinstance(material, Factors) and (
            self.structure == "dense" or not self.factored_is_cheaper(material)
        ):
            projected, norms = [], []
            for _, d in chunks(material):
                norms.append(dense_sqnorms(d.reshape(d.shape[0], -1), dtype))  # (b,)
                projected.append(self._project(d))  # (b, *out_shape)
            return {"proj": torch.cat(projected)}, torch.cat(norms)
        return super()._encode_with_norms(material, dtype)

    def factored_is_cheaper(self, f: Factors) -> bool:
        """Multiply-adds per datum of the two ways to get a two-sided projection and the
        exact norm from factors: the blocked ghost norm plus ``(g P0)^T (a P1)``, or the
        gradient (``N p q``, a batched matmul) projected in the cheaper order. Both are
        batched matmuls that ran at the same speed per multiply-add at the seed case's
        shapes (N 512, d 512: tests/benchmarks/RESULTS.md, "Forms")."""
        n = f.tokens
        p, q = f.shape
        r0, r1 = self.ranks
        factored = ghost_cost(n, p, q) + n * (p * r0 + q * r1) + n * r0 * r1
        dense = n * p * q + min(p * q * r1 + p * r1 * r0, r0 * p * q + r0 * q * r1)
        return factored <= dense

    @staticmethod
    def compute_dtype(dtype: torch.dtype) -> torch.dtype:
        """The dtype projections of gradients in ``dtype`` are computed in."""
        if dtype in (torch.float32, torch.float64):  # (promote_types is a dispatcher call)
            return dtype
        return torch.promote_types(dtype, torch.float32)

    def _two_sided_factors(self, f: Factors) -> torch.Tensor:
        g, a = f.held  # (16-bit factors widened by the cast below, not kept widened)
        dt = self.compute_dtype(f.dtype)
        p0, p1 = self.matrices(g.device, dt)
        gp = g.to(dt) @ p0  # (B, N, r0)
        ap = a.to(dt) @ p1  # (B, N, r1)
        if f.mask is not None:  # drop rows after projecting: N r, not N (p + q), elements
            drop = ~f.mask.unsqueeze(-1)  # (B, N, 1)
            gp = gp.masked_fill(drop, 0.0)  # (B, N, r0)
            ap = ap.masked_fill(drop, 0.0)  # (B, N, r1)
        out = torch.bmm(gp.transpose(1, 2), ap)  # (B, r0, r1)
        return out.mul_(f.scale) if f.scale != 1.0 else out

    def _two_sided_rows(self, r: Rows) -> torch.Tensor:
        dt = self.compute_dtype(r.values.dtype)
        p0, p1 = self.matrices(r.values.device, dt)
        valid = (r.index >= 0).unsqueeze(-1)  # (B, N, 1)
        left = p0[r.index.clamp(min=0)] * valid  # (B, N, r0): P0's rows of the used indices
        vals = r.values.to(dt).reshape(*r.index.shape, -1)  # (B, N, D)
        right = (vals @ p1).masked_fill(~valid, 0.0)  # (B, N, r1)
        out = torch.bmm(left.transpose(1, 2), right)  # (B, r0, r1)
        return out.mul_(r.scale) if r.scale != 1.0 else out

    def _two_sided_dense(self, g: torch.Tensor) -> torch.Tensor:
        dt = self.compute_dtype(g.dtype)
        p0, p1 = self.matrices(g.device, dt)
        p, q = _matrix_view(self.shape)
        r0, r1 = self.ranks
        w = g.to(dt).reshape(-1, p, q)  # (B, p, q)
        B = w.shape[0]
        # the cheaper order; P broadcast over the batch without copying w (an einsum
        # contracting w's middle axis permuted it: 2x slower measured). The mm and bmm that
        # matmul would pick, spelt out: 6 dispatcher calls, not its 11 (a launch each on a GPU)
        left = p0.T.expand(B, r0, p)  # (B, r0, p)
        if p * q * r1 + p * r1 * r0 <= r0 * p * q + r0 * q * r1:
            wp = torch.mm(w.reshape(B * p, q), p1).view(B, p, r1)  # (B, p, r1)
            return torch.bmm(left, wp)  # (B, r0, r1)
        pw = torch.bmm(left, w)  # (B, r0, q)
        return torch.mm(pw.view(B * r0, q), p1).view(B, r0, r1)  # (B, r0, r1)

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (B, numel) times ``P`` (numel, r)."""
        dt = self.compute_dtype(x.dtype)
        x = x.to(dt)
        mats = self.matrices(x.device, dt)
        if mats:
            return x @ mats[0]  # (B, r)
        out = x.new_zeros((x.shape[0], self.ranks[0]))  # (B, r)
        for start, block in self._blocks():
            b = block.to(device=x.device, dtype=dt)  # (rows, r)
            out.addmm_(x[:, start : start + b.shape[0]], b)  # (B, r)
        return out

    def _inner(self, x: Encoded, y: Encoded, dtype: torch.dtype) -> torch.Tensor:
        """Inner products of projected records: unbiased estimates of the gradients'."""
        return _flat(x, dtype) @ _flat(y, dtype).T  # (M, K)

    def _sqnorms(self, x: Encoded, dtype: torch.dtype) -> torch.Tensor:
        px = _flat(x, dtype)  # (M, r)
        return torch.einsum("mr,mr->m", px, px)  # (M,)

    def _inner_dense(self, x: Encoded, other: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Projects ``other`` (K, *shape) with the same matrices, then as :meth:`inner`."""
        return self._inner(x, {"proj": self._project(other)}, dtype)


def _flat(x: Encoded, dtype: torch.dtype) -> torch.Tensor:
    return x["proj"].reshape(x["proj"].shape[0], -1).to(dtype)  # (M, r)


@functools.lru_cache(maxsize=32)
def _form_of(spec_json: str) -> ProjectionForm:
    return ProjectionForm.from_spec(json.loads(spec_json))


def project(
    grad: torch.Tensor | Factors | Rows, spec: Mapping[str, Any] | ProjectionForm
) -> torch.Tensor:
    """Apply a stored projection to gradients the user computed (a test example's).

    For a two-sided spec a matrix gradient ``W`` becomes ``P0^T W P1`` (for ``nn.Linear``:
    ``P_out^T W P_in``); for a dense spec ``P^T vec(W)``. The result lies in the same space
    as the stored records, so ``<project(w, spec), stored>`` estimates ``<w, g>``.

    Args:
        grad: One gradient ``(*shape)`` or a batch ``(K, *shape)``, or factors / rows.
        spec: The parameter's stored form spec (``{"form": "projection", ...}``) or the form.

    Returns:
        ``out_shape`` for one gradient, ``(K, *out_shape)`` for a batch.

    Raises:
        InputError: the spec is not a projection's, or shapes do not match.
    """
    if isinstance(spec, ProjectionForm):
        return spec.project(grad)
    if spec.get("form") != ProjectionForm.name:
        raise InputError(
            f"project() needs a projection's spec, got form {spec.get('form')!r}: that "
            "parameter keeps its gradients, so compare with them directly."
        )
    return _form_of(json.dumps(dict(spec), sort_keys=True)).project(grad)
