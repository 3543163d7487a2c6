"""A container's own parameters op by op, rather than a re-run of the container per datum.

A module without a rule that holds raw parameters of its own beside children with theirs (a
layer scale: BEiT's ``lambda_1 * attention_output``, ConvNeXt's ``layer_scale_parameter *
x``, FocalNet's ``gamma_1``) was re-run per datum whole (``torch.func``) for those few
parameters: its children's work again, per datum, and refused where the re-run cannot
reproduce the batch's random draws (SDPA's attention dropout inside it).

Such an entry is ``deferrable`` (:func:`.calls.plan_entries`). While its forward runs, its
own parameters do not count as covered, so :class:`.operations.OpCapture` (pushed for the
call when it is not watching the forward already) captures each op on them as a call of an
op rule, noted as the container call's ``inner`` calls. Before the backward
(:meth:`Containers.settle`), the container's calls leave its parameters to those op calls,
and are not re-run, only where the graph proves it (:func:`_by_ops`): every use of each own
parameter leads only to the op calls' outputs (a piece of ``unbind``, an in-place write would
go uncomputed); each op's batched argument is made from the call's own inputs (a buffer or
positions of B rows would pass for the batch); no other dimension has the batch's size (a
permuted ``(T, B, d)`` with T == B); no op is shared with another container. Else (a
``cls_token`` expanded over the batch and concatenated) the op calls are dropped and the
container is re-run as before: a correct fallback, never a refusal of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from gradlog._torch_private import gradient_accumulator, in_autograd_backward, storage_key
from gradlog._tree import flatten
from gradlog.backends.hooks.calls import TAG, Call, Entry
from gradlog.backends.hooks.graph import GraphSurvey
from gradlog.backends.hooks.layout import COPYING_OPS
from gradlog.backends.hooks.operations import OpCapture

__all__ = ["Containers"]


class Containers:
    """The running calls of deferrable entries and their op calls (module doc).

    Args:
        ops: The backend's op capture (None: nothing is deferred).
        capturing: Whether calls are captured now (not while rules run, nor without grad).
    """

    def __init__(self, ops: OpCapture | None, capturing: Callable[[], bool]) -> None:
        self.ops = ops
        self.capturing = capturing
        self.frames: list[tuple[Entry, list[Call], bool]] = []  # (entry, op calls, pushed)
        self.by_ops: set[str] = set()  # entries whose last settled call went op by op

    def enter(self, entry: Entry) -> bool:
        """A deferrable entry's forward starts (False: not deferred; its parameters are then
        covered as any module's)."""
        ops = self.ops
        if (not entry.deferrable or ops is None or not self.capturing()
                or in_autograd_backward()):  # (a reentrant checkpoint's recompute: after settle)
            return False
        pushed = not ops.watching
        if pushed:  # (watched for this call only; watching also pauses it in the hooks)
            ops.__enter__()
            ops.watching = True
        self.frames.append((entry, [], pushed))
        for key in entry.param_ids:
            ops.deferred[key] = ops.deferred.get(key, 0) + 1
        return True

    def leave(self, entry: Entry) -> list[Call] | None:
        """Its forward returned (or raised): its op calls (None: it was not deferred)."""
        if not self.frames or self.frames[-1][0] is not entry:
            return None
        _, inner, pushed = self.frames.pop()
        ops = self.ops
        if ops is not None:  # (enter pushed a frame only with one)
            for key in entry.param_ids:
                ops.deferred[key] -= 1
            if pushed:
                ops.watching = False
                ops.__exit__(None, None, None)
        return inner

    def note(self, call: Call) -> None:
        """An op call captured now: each running container's whose parameters it takes (an
        op of two nested containers' parameters is both's: they are then re-run, :meth:`settle`)."""
        mine = set(call.entry.param_ids)
        for entry, inner, _ in self.frames:
            if mine & set(entry.param_ids):
                inner.append(call)

    def settle(self, live: list[Call], B: int, graph: GraphSurvey) -> None:
        """Before the backward: each container's calls either leave its parameters to their
        op calls (they are released) or are re-run (the op calls are released). All are
        decided before any is released (the proofs read calls' inputs and tags)."""
        calls: dict[int, list[Call]] = {}  # by entry: a module called twice, together
        for call in live:
            if call.inner is not None and not call.done:
                calls.setdefault(id(call.entry), []).append(call)
        owners: dict[int, set[int]] = {}  # op call -> the containers (entries) noting it
        for key, group in calls.items():
            for call in group:
                for op in call.inner or []:
                    owners.setdefault(id(op), set()).add(key)
        joint = {key for keys in owners.values() if len(keys) > 1 for key in keys}
        decided = [(group, key not in joint and _by_ops(group, B, graph))
                   for key, group in calls.items()]
        for group, plain in decided:
            for call in group:
                for released in ([call] if plain else call.inner or []):
                    released.release(untag=True)
                call.inner = None
            (self.by_ops.add if plain else self.by_ops.discard)(group[0].entry.name)


def _by_ops(calls: list[Call], B: int, graph: GraphSurvey) -> bool:
    """Whether the op calls can take a container's parameters in these calls of it: each
    own parameter taken by an op in each call, each op plainly batched on a tensor made from
    its call's batched inputs (:func:`_from_inputs`), and every use of each parameter in
    the graph one of theirs (:func:`_only_theirs`)."""
    ops: set[int] = set()
    for call in calls:
        inner = call.inner or []
        taken = {id(p) for op in inner for p in op.entry.params}
        if not inner or not set(call.entry.param_ids) <= taken:
            return False
        batched = [t for t in flatten((call.args, call.kwargs))[0]
                   if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == B]
        inputs = {storage_key(t) for t in batched} | {
            id(t.grad_fn) for t in batched if t.grad_fn is not None}
        if not all(_plainly_batched(op, B) and _from_inputs(op, inputs, B) for op in inner):
            return False
        ops |= {id(op) for op in inner}
    return _only_theirs(calls[0].entry.params, ops, {id(call) for call in calls}, graph)


def _plainly_batched(op: Call, B: int) -> bool:
    """An op call, not a copy, whose output has the batch first, and no other dimension of
    its size (a container may permute or transpose its input: ``(T, B, d)`` with T == B,
    ``(d, B)`` with d == B would pass for batch first), as one of its arguments other than
    its parameters has it (``gamma * x``, ``x + bias``)."""
    shape = tuple(op.out_shape)
    if (op.done or op.refusal is not None or op.entry.op in COPYING_OPS or not shape
            or shape[0] != B or shape.count(B) > 1 or op.args is None):
        return False
    own = {storage_key(p) for p in op.entry.params}
    return any(isinstance(t, torch.Tensor) and storage_key(t) not in own
               and t.dim() == len(shape) and t.shape[0] == B
               for t in flatten((op.args, op.kwargs))[0])


def _from_inputs(op: Call, inputs: set[Any], B: int) -> bool:
    """Whether an argument of the op with the batch first, other than its parameters, is
    one of the container call's batched inputs (``inputs``: their storages and the nodes
    that made them), or made from them: through the graph to one of those nodes, or to
    the output of a call (a child's) one of whose batched arguments is, and so on. A table
    made from buffers or parameters whose length happens to be B is not (it would pass for
    batched: read by datum, wrong where no datum check runs)."""
    own = {storage_key(p) for p in op.entry.params}
    shape = tuple(op.out_shape)
    tensors = [t for t in flatten((op.args, op.kwargs))[0]
               if isinstance(t, torch.Tensor) and storage_key(t) not in own
               and t.dim() == len(shape) and t.shape[0] == B]
    seen: set[int] = set()
    held: list[Any] = []  # (nodes alive while their ids are keys)
    while tensors:
        t = tensors.pop()
        if storage_key(t) in inputs:
            return True
        nodes: list[Any] = [t.grad_fn] if t.grad_fn is not None else []
        while nodes:
            node = nodes.pop()
            if id(node) in seen or len(seen) > _WALK:
                continue
            if id(node) in inputs:
                return True
            seen.add(id(node))
            held.append(node)
            tags = node.metadata.get(TAG)
            if tags:  # a call's output: on to its batched arguments
                tensors += [a for _, c in tags if c.args is not None
                            for a in flatten((c.args, c.kwargs))[0]
                            if isinstance(a, torch.Tensor) and a.dim() and a.shape[0] == B]
                continue
            nodes += [child for child, _ in node.next_functions if child is not None]
    return False


def _only_theirs(params: tuple[torch.nn.Parameter, ...], ops: set[int], own: set[int],
                 graph: GraphSurvey) -> bool:
    """Whether every use of each parameter in the graph leads, through nodes of no call
    (its views and functions of it alone), only to the outputs of the op calls ``ops`` (an
    output also the container call's own, ``own``, is theirs: ``return h * gamma``): a
    use op capture did not see (a piece of ``p.split()``, a tuple's, an in-place write)
    would otherwise go uncomputed, and a large parameter's missing share can escape the
    spot and datum checks' few entries."""
    memo: dict[int, bool] = {}
    held: list[Any] = []

    def theirs(node: Any, depth: int) -> bool:
        key = id(node)
        if key not in memo:
            memo[key] = False  # (while it is decided)
            held.append(node)
            tags = node.metadata.get(TAG)
            if tags:
                memo[key] = any(id(c) in ops for _, c in tags) and all(
                    id(c) in ops or id(c) in own for _, c in tags)
            elif depth < _WALK:
                users = graph.parents(node)
                memo[key] = bool(users) and all(theirs(n, depth + 1) for n, _ in users)
        return memo[key]

    for p in params:
        node = gradient_accumulator(p)
        users = graph.parents(node) if node is not None else []
        if not users or not all(theirs(n, 0) for n, _ in users):
            return False
    return True


_WALK = 1024
"""Nodes a provenance walk visits at most (past them: not proved, the container re-run)."""
