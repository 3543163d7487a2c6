"""Per-datum gradients through ``torch.nn.utils.parametrize``: a module whose ``weight`` a
parametrization computes from other parameters (``parametrizations.weight_norm``'s
``original0``/``original1``, ``orthogonal``'s ``original``).

The module's rule (or the ``torch.func`` fallback) gives each datum's gradient of the
tensor the parametrization computes, ``dW_b``. The parametrization is a function of
parameters alone, so the chain is linear per datum: each datum's gradients of its parameters
are the parametrization's vector-Jacobian product at ``dW_b``, ``vmap``ed over the batch.

gradlog evaluates parametrizations again (a rule reading ``module.weight``, a re-run, the
chain) in eval mode only (:func:`evaluating`): ``spectral_norm`` then uses the power
iteration its forward ran in this step (its buffers as that forward left them) instead of
running another. Evaluated so, a parametrization must give the tensor its forward made
(kept by :class:`States`' hooks), and leave its buffers alone (changed in place or
reassigned: put back, and refused); the state must be the one each call used: one
evaluated again between a call and its backward, or twice within a call with its state
changing between, is refused.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.func import functional_call, vjp, vmap
from torch.nn.utils import parametrize

from gradlog._torch_private import (
    is_functorch_wrapped,
    parametrize_cache_suspended,
    tensor_version,
)
from gradlog.errors import BackendError, UnsupportedLayerError
from gradlog.grads.material import dense
from gradlog.rules.base import RuleResult

__all__ = ["Chain", "States", "chains_of", "check_state", "evaluating", "mode_refusal",
           "plists_in", "stateful", "through"]


@dataclass(frozen=True)
class Chain:
    """One parametrized tensor of a module and its recorded parameters.

    Attributes:
        attr: The tensor the parametrization computes (``"weight"``), the attribute the
            module's rule is asked for.
        plist: Its ``ParametrizationList`` (``module.parametrizations[attr]``).
        paths: Name within ``plist`` (``"original0"``, ``"0.scale"``) -> attribute path from
            the module (``"parametrizations.weight.original0"``), for the recorded ones.
    """

    attr: str
    plist: nn.Module
    paths: dict[str, str]


def chains_of(module: nn.Module, recorded: Mapping[int, str]) -> list[Chain]:
    """The module's parametrized tensors with recorded parameters."""
    if not parametrize.is_parametrized(module):
        return []
    plists: Any = module.parametrizations
    chains = []
    for attr, plist in plists.items():
        paths = {n: f"parametrizations.{attr}.{n}" for n, p in plist.named_parameters()
                 if id(p) in recorded}
        if paths:
            chains.append(Chain(attr, plist, paths))
    return chains


def plists_in(module: nn.Module) -> tuple[nn.Module, ...]:
    """Every ``ParametrizationList`` in ``module``'s subtree (a rule reading ``weight``, or a
    re-run of the module, evaluates them)."""
    return tuple(m for m in module.modules() if isinstance(m, parametrize.ParametrizationList))


_QUIET = [0]  # > 0 while gradlog evaluates parametrizations (States records none of it)


_NOTHING = contextlib.nullcontext()


def evaluating(plists: tuple[nn.Module, ...], cache: bool = True,
               made: Mapping[int, torch.Tensor] | None = None,
               autocast: torch.dtype | None = None) -> contextlib.AbstractContextManager[None]:
    """:func:`_evaluating`, or nothing to do without parametrizations (every call of a
    model without them: no generator a call)."""
    return _evaluating(plists, cache, made, autocast) if plists else _NOTHING


@contextlib.contextmanager
def _evaluating(plists: tuple[nn.Module, ...], cache: bool = True,
                made: Mapping[int, torch.Tensor] | None = None,
                autocast: torch.dtype | None = None) -> Iterator[None]:
    """While gradlog evaluates parametrizations again (a rule reading ``module.weight``, a
    re-run, the chain): in eval mode, and their buffers left as the forward left them: put
    back and refused if not (gradlog must not change training). ``cache``: each computed
    once (``parametrize.cached``); else a user's cache is suspended: a re-run per datum
    must differentiate each datum's evaluation. ``made``: the tensor each parametrization
    (by id) made in the forward (:class:`States`): evaluated again, it must give it, or
    the per-datum gradients would be of another function (one that computes otherwise in
    training mode, state that changed since); ``autocast``: the dtype the forward's autocast
    ran in (it is evaluated again so, to compare like with like)."""
    modes = [(m, m.training) for plist in plists for m in plist.modules()]
    kept = [(_label(plist, n), b, tensor_version(b), b.detach().clone(), *_owner(plist, n))
            for plist in plists for n, b in plist.named_buffers()]
    for plist in plists:
        plist.eval()
    _QUIET[0] += 1
    try:
        _check_reproduces(plists, made or {}, autocast)
        with parametrize.cached() if cache else parametrize_cache_suspended():
            yield
    finally:
        _QUIET[0] -= 1
        for m, training in modes:
            m.training = training
        changed = []
        with torch.no_grad():
            for n, b, version, was, owner, leaf in kept:
                if getattr(owner, leaf) is not b:  # reassigned: the forward's put back
                    setattr(owner, leaf, b)
                    changed.append(n)
                elif tensor_version(b) != version:
                    b.copy_(was)
                    changed.append(n)
        if changed:  # (in place of any error the change caused: torch.func's, say)
            raise UnsupportedLayerError(
                f"a parametrization changed its buffers {changed} when gradlog evaluated it "
                "again (in eval mode) for per-datum gradients; they are put back, and gradlog "
                "refuses rather than change training. Use backend='loop', or record the "
                "plain weight (torch.nn.utils.parametrize.remove_parametrizations)."
            )


def _owner(plist: nn.Module, buffer: str) -> tuple[nn.Module, str]:
    owner, _, leaf = buffer.rpartition(".")
    return plist.get_submodule(owner), leaf


def _check_reproduces(plists: tuple[nn.Module, ...], made: Mapping[int, torch.Tensor],
                      autocast: torch.dtype | None) -> None:
    """Refuse parametrizations that, evaluated again now (eval mode, the forward's
    autocast), do not give the tensor they made in the forward."""
    for plist in plists:
        then = made.get(id(plist))
        if then is None:
            continue
        with torch.no_grad(), torch.autocast(then.device.type, dtype=autocast,
                                             enabled=autocast is not None):
            now = plist()
        wide = then.dtype if torch.finfo(then.dtype).bits > 16 else torch.float32
        tol = 64 * torch.finfo(wide).eps * float(then.abs().amax()) if then.numel() else 0.0
        if now.shape != then.shape or float((now.to(wide) - then.to(wide)).abs().amax()) > tol:
            names = [type(m).__name__ for m in plist.children()]
            raise UnsupportedLayerError(
                f"the parametrization {names}, evaluated again for per-datum gradients "
                "(in eval mode, so as not to change its state), does "
                "not give the weight the forward used: it computes otherwise in training "
                "mode, or its state or parameters changed since the forward. Put it in eval "
                "mode, keep its state between the forward and the backward, or use "
                "backend='loop'."
            )


def stateful(plists: tuple[nn.Module, ...]) -> tuple[nn.Module, ...]:
    """The parametrizations holding buffers (state the forward may change)."""
    return tuple(p for p in plists if next(p.buffers(), None) is not None)


def mode_refusal(plists: tuple[nn.Module, ...]) -> str | None:
    """Why parametrizations computing differently in training mode than in the eval mode
    gradlog evaluates them in cannot be chained (a dropout or batch norm inside), or None."""
    found = sorted({type(m).__name__ for p in plists if p.training for m in p.modules()
                    if isinstance(m, (nn.modules.dropout._DropoutNd,
                                      nn.modules.batchnorm._BatchNorm)) and m.training})
    if not found:
        return None
    return (f"its parametrization holds {found}, in training mode: gradlog evaluates "
            "parametrizations again in eval mode (so as not to change their state), where "
            "these compute something else than the forward did. Put them in eval mode, or "
            "use backend='loop'.")


@dataclass(frozen=True)
class Stamp:
    """The state of a call's stateful parametrizations as the call left it."""

    versions: tuple[tuple[nn.Module, str, torch.Tensor, int], ...]  # (owner, name, buffer,
    # its version)
    refusal: str | None = None


class States:
    """Which state of its stateful parametrizations each captured call used. The chain and a
    re-run evaluate them as they are at the backward: the state the call's forward left, if
    nothing evaluated them since (in training mode, spectral_norm steps its power iteration
    at each evaluation) and the call evaluated them once."""

    def __init__(self) -> None:
        self.evaluations: dict[int, int] = {}  # id(plist) -> evaluations so far
        self.made: dict[int, torch.Tensor] = {}  # id(plist) -> what it last made (forward)
        self.open: dict[int, list[tuple[tuple[int, int], ...]]] = {}  # id(entry) -> per
        # stateful parametrization, (evaluations, buffer versions' sum) when its call began
        self.pending: dict[int, Stamp] = {}  # id(entry) -> its call's, until captured

    def watch(self, plists: Iterable[nn.Module]) -> list[Any]:
        """Count each parametrization's evaluations and keep what it made; returns the
        hooks' handles."""
        unique = {id(p): p for p in plists}
        return [p.register_forward_hook(functools.partial(self._evaluated, key))
                for key, p in unique.items()]

    def _evaluated(self, key: int, module: nn.Module, args: Any, output: Any) -> None:
        if _QUIET[0]:
            return
        self.evaluations[key] = self.evaluations.get(key, 0) + 1
        if isinstance(output, torch.Tensor) and not is_functorch_wrapped(output):
            self.made[key] = output.detach()

    def enter(self, entry: Any) -> None:
        """A call of the entry's module starts."""
        if entry.stateful:
            self.open.setdefault(id(entry), []).append(self._now(entry))

    def _now(self, entry: Any) -> tuple[tuple[int, int], ...]:
        return tuple((self.evaluations.get(id(p), 0), sum(tensor_version(b) for b in p.buffers()))
                     for p in entry.stateful)

    def leave(self, entry: Any) -> None:
        """The call returned: its stamp, refused if it evaluated a parametrization twice
        with its state changing between."""
        if not entry.stateful or not self.open.get(id(entry)):
            return
        before, now = self.open[id(entry)].pop(), self._now(entry)
        versions = tuple((*_owner(p, n), b, tensor_version(b)) for p in entry.stateful
                         for n, b in p.named_buffers())
        twice = [type(p[0]).__name__ for p, (n, v), (m, w) in zip(entry.stateful, before, now)
                 if m - n > 1 and w != v]  # (evaluated twice, its state changed)
        self.pending[id(entry)] = Stamp(versions, None if not twice else (
            f"its forward evaluated the parametrization(s) {twice} more than once, and they "
            "keep state that each evaluation changes (spectral_norm's power iteration): "
            "gradlog cannot tell which state each use of the weight saw. Read the weight "
            "once per call (or inside torch.nn.utils.parametrize.cached()), or use "
            "backend='loop'."))

    def stamp(self, entry: Any) -> Stamp | None:
        """The stamp of the entry's call that just returned (None: no stateful ones)."""
        return self.pending.pop(id(entry), None) if entry.stateful else None


def check_state(stamp: Stamp | None) -> None:
    """Refuse a call whose stateful parametrizations were evaluated again since."""
    if stamp is not None and any(getattr(owner, leaf) is not b or tensor_version(b) != v
                                 for owner, leaf, b, v in stamp.versions):
        raise UnsupportedLayerError(
            "the state of its parametrization (spectral_norm's power iteration) changed "
            "between this call and its backward: it was evaluated again in training mode (a "
            "second forward of the layer before this backward, or a read of the weight), "
            "so the per-datum gradients would be taken at another state than the call's. "
            "Run each forward's backward before the next, read the weight inside "
            "torch.nn.utils.parametrize.cached() or in eval mode, or use backend='loop'."
        )


def _label(plist: nn.Module, buffer: str) -> str:
    """``"_SpectralNorm._u"`` for the buffer ``"0._u"`` of a ``ParametrizationList``."""
    owner, _, leaf = buffer.rpartition(".")
    return f"{type(plist.get_submodule(owner)).__name__}.{leaf}" if owner else buffer


def through(chains: tuple[Chain, ...], result: RuleResult) -> RuleResult:
    """``result`` with each chain's tensor replaced by its recorded parameters' per-datum
    gradients ``(B, *shape)``."""
    out = dict(result)
    for chain in chains:
        if chain.attr not in out:
            continue
        d_tensor = dense(out.pop(chain.attr))  # (B, *tensor)
        out.update(_pull_back(chain, d_tensor))
    return out


def _pull_back(chain: Chain, d_tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each datum's vector-Jacobian product of the parametrization at its ``dW_b``."""
    every = {n: p.detach() for n, p in chain.plist.named_parameters()}
    names = list(chain.paths)

    def evaluate(*values: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = functional_call(chain.plist, {**every, **dict(zip(names, values))},
                                            ())
        return out

    with torch.autocast(d_tensor.device.type, enabled=False), torch.enable_grad():
        found = vjp(evaluate, *(every[n] for n in names))
        tensor, pull = found[0], found[1]
        if tuple(d_tensor.shape[1:]) != tuple(tensor.shape):
            raise BackendError(
                f"the per-datum gradients of the parametrized {chain.attr!r} have shape "
                f"{tuple(d_tensor.shape)}; the parametrization computes {tuple(tensor.shape)}"
            )
        d_tensor = d_tensor.to(tensor.dtype)
        try:
            with warnings.catch_warnings():
                # functorch loops where an op has no batching rule (weight_norm's backward):
                # still exact
                warnings.filterwarnings("ignore", message="There is a performance drop")
                grads = vmap(pull)(d_tensor)
        except RuntimeError:  # an op of the parametrization vmap cannot batch at all
            rows = [pull(d_tensor[b]) for b in range(d_tensor.shape[0])]
            grads = tuple(torch.stack(g) for g in zip(*rows))
    return {chain.paths[n]: g for n, g in zip(names, grads)}

