"""Per-datum results of one backward, added up per recorded parameter.

Each hooked call's rule returns, per recorded parameter, dense per-datum gradients ``(n, *p)``,
sparse rows (:class:`~gradlog.grads.Rows`) or, for parameters whose form is not ``full``,
factors (:class:`~gradlog.grads.Factors`). A module called several times (reuse, tied weights)
contributes once per call: :class:`Accumulator` adds dense parts into one buffer per parameter
and keeps factors and rows as they are, merged into one material per parameter at the end.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch
from torch import nn

from gradlog._torch_private import view_base
from gradlog.backends.hooks.calls import Entry
from gradlog.backends.hooks.pool import BufferPool
from gradlog.errors import BackendError
from gradlog.grads import Factors, Rows
from gradlog.rules.base import Capture, RuleResult

__all__ = ["Accumulator"]


class Accumulator:
    """The per-datum gradients of one backward, by recorded parameter name.

    Args:
        params: The recorded parameters, by name.
        pool: Where dense buffers come from.
        batch_size: B, the datums of the backward.
        keep_material: Parameters whose form is not ``full``: their factors and rows are
            kept as they are (:meth:`merge_materials`), never densified.
        dense_when_fused: Those of them whose fused calls hand dense records (:meth:`factored`).
    """

    def __init__(self, params: Mapping[str, nn.Parameter], pool: BufferPool, batch_size: int,
                 keep_material: frozenset[str],
                 dense_when_fused: frozenset[str] = frozenset()) -> None:
        self.params = params
        self.pool = pool
        self.batch_size = batch_size
        self.keep_material = keep_material
        self.dense_when_fused = dense_when_fused
        self.acc: dict[str, torch.Tensor] = {}  # dense (B, *p.shape) per parameter
        self.material: dict[str, list[Factors | Rows]] = {}  # see _keep
        self.covered: set[str] = set()  # parameters some call contributed to

    def factored(self, entry: Entry, fused: bool = False) -> frozenset[str]:
        """Attributes of the entry whose rule may hand over factors (their form is not
        ``full``, and ``fused``, not one whose dense records give the weight gradient:
        ``dense_when_fused``; chunked heads never: their calls cover slices of the batch)."""
        if not self.keep_material:
            return frozenset()
        dense = self.dense_when_fused if fused else frozenset()
        return frozenset(a for a, n in entry.names.items()
                         if n in self.keep_material and n not in dense)

    def add(self, entry: Entry, result: RuleResult, cap: Capture,
            rows: slice | None = None) -> None:
        """Add a rule's result into the per-datum accumulators: all B datums, or ``rows``
        (the datums a chunk of rows covers, ``cap.batch_size`` of them)."""
        B = self.batch_size
        n = cap.batch_size
        first = 0 if rows is None else rows.start
        for attr, value in result.items():
            name = entry.names.get(attr)
            if name is None:
                raise BackendError(f"rule {entry.rule.name!r} returned {attr!r}, which is not "
                                   f"among the parameters it was asked for: {sorted(entry.names)}")
            p = self.params[name]
            acc = self.acc.get(name)
            if self._keep(name, value, n):
                continue
            if isinstance(value, Rows):
                index, values = value.index, value.values
                if index.dim() != 2 or index.shape[0] != n or p.dim() == 0 or tuple(
                        values.shape) != (*index.shape, *p.shape[1:]):
                    raise BackendError(
                        f"rule {entry.rule.name!r} returned rows of shape {tuple(values.shape)} "
                        f"at indices {tuple(index.shape)} for {name!r} {tuple(p.shape)}; "
                        f"expected indices (B={n}, N) and rows (B, N, *{tuple(p.shape[1:])})."
                    )
                if acc is None:
                    acc = self._zeros(name, p)
                V = p.shape[0]
                datum = torch.arange(first, first + n, device=index.device).unsqueeze(1)  # (n, 1)
                # index -1 is padding (Rows' contract): add a zero into the datum's row 0 instead
                # of into the previous datum's last row; where, not a product, as padding may
                # hold NaN
                pad = index < 0  # (n, N)
                flat = (index.clamp(min=0) + datum * V).reshape(-1)  # (n*N,) rows of (B*V, -1)
                kept = values.reshape(flat.numel(), -1).to(p.dtype)  # (n*N, D)
                kept = torch.where(pad.reshape(-1, 1), torch.zeros((), dtype=p.dtype,
                                                                   device=kept.device), kept)
                acc.view(B * V, -1).index_add_(0, flat, kept, alpha=value.scale)
            else:
                if tuple(value.shape) != (n, *p.shape):
                    raise BackendError(
                        f"rule {entry.rule.name!r} returned per-datum gradients of shape "
                        f"{tuple(value.shape)} for {name!r}; expected {(n, *p.shape)} (batch "
                        f"dimension B={n} first). A shared, unbatched input was taken for a "
                        "datum; please report this with the model."
                    )
                if value.dtype != p.dtype:
                    value = value.to(p.dtype)
                if rows is not None:  # a chunk's datums only
                    if acc is None:
                        acc = self._zeros(name, p)
                    acc[rows].add_(value)
                elif acc is None:
                    if not value.is_contiguous() or _shares_memory(value, cap):
                        # never alias autograd's tensors: later calls add into this one
                        value = value.clone(memory_format=torch.contiguous_format)
                    self.acc[name] = value
                else:
                    acc.add_(value)
        missing = sorted(set(entry.names) - set(result))
        if missing:  # (counted as covered, they would read as zeros that nothing checks)
            raise BackendError(
                f"rule {entry.rule.name!r} of {entry.label} returned no per-datum gradients "
                f"for {missing}, which it was asked for; please report this with the model "
                "(backend='loop' records it meanwhile).")
        self.covered.update(entry.names.values())

    def _zeros(self, name: str, p: nn.Parameter) -> torch.Tensor:
        """A zeroed ``(B, *p.shape)`` accumulator for ``name``, from the pool."""
        acc = self.pool.empty((self.batch_size, *p.shape), p.dtype, p.device).zero_()
        self.acc[name] = acc
        return acc

    def _keep(self, name: str, value: Any, n: int) -> bool:
        """Keep factors or sparse rows of a parameter whose form is not ``full`` as they
        are (merged by :meth:`merge_materials`); False: add ``value`` densely."""
        if name not in self.keep_material:
            if isinstance(value, Factors):
                raise BackendError(f"internal: factors of {name!r}, whose form is full.")
            return False
        if isinstance(value, Rows):
            p = self.params[name]
            if value.index.dim() != 2 or value.index.shape[0] != n or tuple(
                    value.values.shape) != (*value.index.shape, *p.shape[1:]):
                return False  # the dense path reports the shapes
            value = Rows(value.index, value.values.to(p.dtype), int(p.shape[0]), value.scale)
        elif not isinstance(value, Factors):
            return False
        if n != self.batch_size:
            raise BackendError(
                f"internal: material of {n} datums for {name!r} (B={self.batch_size}).")
        self.material.setdefault(name, []).append(value)
        return True

    def merge_materials(self) -> dict[str, Factors | Rows | torch.Tensor]:
        """One material per parameter kept as factors or rows: several calls (reuse)
        concatenate along the token axis; a parameter that also got dense parts (a tied
        embedding and head) or both kinds is densified and added up."""
        out: dict[str, Factors | Rows | torch.Tensor] = {}
        for name, parts in self.material.items():
            kinds = {type(m) for m in parts}
            if name in self.acc or len(kinds) > 1:
                acc = self.acc.get(name)
                for m in parts:
                    acc = m.dense() if acc is None else acc.add_(m.dense())
                if acc is None:
                    raise BackendError(f"internal: no material kept for {name!r}.")
                out[name] = self.acc[name] = acc
            elif len(parts) == 1:
                out[name] = parts[0]
            elif kinds == {Factors}:
                factors = cast(list[Factors], parts)
                kept = {(f.scale, f.narrow) for f in factors}  # one each: kept, masks zeroed
                scale, narrow = kept.pop() if len(kept) == 1 else (1.0, None)
                fs = [Factors(*f.held, f.mask, f.scale / scale, f.narrow).canonical()
                      for f in factors]  # (16-bit factors stay so, with one scale and dtype)
                pairs = [f.held if narrow is not None else (f.g, f.a) for f in fs]
                out[name] = Factors(torch.cat([g for g, _ in pairs], 1),
                                    torch.cat([a for _, a in pairs], 1), None, scale, narrow)
            else:
                rs = [cast(Rows, m) for m in parts]
                values = [r.values * r.scale if r.scale != 1.0 else r.values for r in rs]
                out[name] = Rows(torch.cat([r.index for r in rs], 1), torch.cat(values, 1),
                                 rs[0].num_rows)
            self.covered.add(name)
        return out


def _shares_memory(value: torch.Tensor, cap: Capture) -> bool:
    """Whether ``value`` is a captured tensor or a view of one (a rule returned it as is)."""
    base = view_base(value)
    base = value if base is None else base
    tensors = [t for t in (*cap.grads, *cap.args, *cap.kwargs.values())
               if isinstance(t, torch.Tensor)]
    return any(base is t or base is view_base(t) for t in tensors)
