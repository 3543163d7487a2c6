"""Independent oracles for per-datum gradients, and the comparison every backend test makes.

:func:`naive_per_datum_grads` runs the model on a batch of one per datum; unlike the
``loop`` backend, which differentiates each datum's loss through the batch's shared graph,
it also catches a model that couples datums. :func:`backend_grads` runs one backend on a
forward; :func:`assert_like_loop` compares a backend with the ``loop`` backend on the same
forward, each forward started from the same global RNG state, so dropout draws the same
masks for both (the loop oracle then differentiates each datum through those masks).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["assert_like_loop", "backend_grads", "naive_per_datum_grads"]


def naive_per_datum_grads(
    datum_loss: Callable[[int], torch.Tensor],
    params: Mapping[str, nn.Parameter],
    batch_size: int,
) -> dict[str, torch.Tensor]:
    """Per-datum gradients ``(B, *shape)`` from one separate forward+backward per datum.

    Args:
        datum_loss: ``datum_loss(b)`` runs the model on datum ``b`` alone and returns its
            scalar loss.
        params: Parameters to differentiate, by name.
        batch_size: Number of datums B.
    """
    names = list(params)
    out = {n: torch.zeros((batch_size, *params[n].shape), dtype=params[n].dtype) for n in names}
    for b in range(batch_size):
        loss = datum_loss(b)
        grads = torch.autograd.grad(loss, [params[n] for n in names], allow_unused=True)
        for n, g in zip(names, grads):
            if g is not None:
                out[n][b] = g.detach()
    return out


def backend_grads(
    model: nn.Module,
    forward: Callable[..., torch.Tensor],
    backend: str = "hooks",
    reduction: str = "mean",
    *,
    batch: Any = None,
    params: str | Sequence[str] = "*",
    seed: int = 0,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor | None], dict[str, Any]]:
    """One backend's per-datum gradients of the losses ``(B,)`` of ``forward()``, or of
    ``forward(model, batch)`` when ``batch`` is given (the form ``backend="vmap"`` needs).

    The forward runs with the global RNG seeded by ``seed`` (forked: the caller's stream is
    left as it was), so two calls draw the same dropout masks.

    Returns:
        Dense per-datum gradients by parameter name, each parameter's ``.grad`` after the
        backward, and the backend's ``describe()``.
    """
    from gradlog.backends import BACKENDS
    from gradlog.grads import dense
    from gradlog.params import select_params

    chosen = select_params(model, [params] if isinstance(params, str) else list(params))
    be = BACKENDS[backend](model, chosen, batch_reduction=reduction, randomness="different")
    be.attach()
    try:
        model.zero_grad(set_to_none=True)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            if batch is None:
                losses = forward()  # (B,)
                got = be.backward(losses, be.reduce_batch(losses))
            else:
                _, got = be.step(forward, batch, lambda raw, mask: raw, None, lambda r: None)
        per = {n: dense(g) for n, g in got.items()}
        grads = {n: None if p.grad is None else p.grad.detach().clone()
                 for n, p in model.named_parameters()}
        return per, grads, be.describe()
    finally:
        be.detach()


def assert_like_loop(
    model: nn.Module,
    forward: Callable[..., torch.Tensor],
    *,
    batch: Any = None,
    backends: Iterable[str] = ("hooks",),
    reductions: Iterable[str] = ("mean", "sum"),
    params: str | Sequence[str] = "*",
    rtol: float | None = None,
    atol: float | None = None,
) -> dict[str, Any]:
    """Each backend's per-datum gradients and ``p.grad`` equal the ``loop`` oracle's
    (``forward`` and ``batch`` as :func:`backend_grads` takes them).

    Tolerances default to float rounding of the parameters' dtype (float64: 1e-9 relative,
    float32: 1e-4). Returns the last backend's ``describe()``.
    """
    dtype = next(iter(model.parameters())).dtype
    rtol = rtol if rtol is not None else (1e-9 if dtype == torch.float64 else 1e-4)
    atol = atol if atol is not None else (1e-12 if dtype == torch.float64 else 1e-6)
    described: dict[str, Any] = {}
    for reduction in reductions:
        want, want_grad, _ = backend_grads(model, forward, "loop", reduction, batch=batch,
                                           params=params)
        for backend in backends:
            got, got_grad, described = backend_grads(model, forward, backend, reduction,
                                                     batch=batch, params=params)
            if set(got) != set(want):
                raise AssertionError(f"{backend}: parameters {sorted(set(got) ^ set(want))} "
                                     "in one result only")
            for name in want:
                where = f"{backend} {name} ({reduction})"
                torch.testing.assert_close(got[name], want[name], rtol=rtol, atol=atol,
                                           msg=_prefixed(where))
            _each_to_its_own_scale(got, want, rtol, f"{backend} ({reduction})")
            for name, g in want_grad.items():
                mine = got_grad[name]
                if (g is None) != (mine is None):
                    raise AssertionError(f"{backend}: {name}.grad is {mine!r}, loop's {g!r}")
                if g is not None and mine is not None:
                    torch.testing.assert_close(mine, g, rtol=rtol, atol=atol,
                                               msg=_prefixed(f"{backend} {name}.grad"))
    return described


def _each_to_its_own_scale(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                           rtol: float, where: str) -> None:
    """Every parameter's per-datum gradients within ``rtol`` of its own largest entry, not
    only of ``atol``: a parameter whose gradients are 1e-8 of the model's (DeBERTa's
    relative positions) passes any absolute tolerance however wrong. Parameters whose
    gradients are below 1e-9 of the model's largest are rounding noise of a zero true
    gradient (a key bias under softmax) and are left to ``atol``."""
    scales = {n: float(w.detach().abs().max()) if w.numel() else 0.0 for n, w in want.items()}
    top = max(scales.values(), default=0.0)
    for name, w in want.items():
        if scales[name] > 1e-9 * top:
            off = float((got[name] - w).detach().abs().max())
            if off > rtol * 10 * scales[name]:
                raise AssertionError(f"{where} {name}: off by {off:.3g}, {off / scales[name]:.3g}"
                                     f" of its own largest entry ({scales[name]:.3g})")


def _prefixed(where: str) -> Callable[[str], str]:
    """An ``assert_close`` message that says which comparison failed."""
    return lambda message: f"{where}: {message}"
