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
(:meth:`Containers.settle`), a container call whose own parameters every one of its op calls
takes as plainly batched ops (an op that is not a copy, of a tensor with the batch first
beside the parameter, and no other of its size: ``gamma * x``) leaves them to those calls
and is not re-run; else (a ``cls_token`` expanded over the batch and concatenated, a
parameter no op took, a permuted ``(T, B, d)`` with T == B) its op calls are dropped and it
is re-run as before.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from gradlog._torch_private import storage_key
from gradlog._tree import flatten
from gradlog.backends.hooks.calls import Call, Entry
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
        if not entry.deferrable or ops is None or not self.capturing():
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
        """An op call captured now: the innermost running container's, if it takes its
        parameters."""
        mine = set(call.entry.param_ids)
        for entry, inner, _ in reversed(self.frames):
            if mine & set(entry.param_ids):
                inner.append(call)
                return

    def settle(self, live: list[Call], B: int) -> None:
        """Before the backward: each container call either leaves its parameters to its op
        calls (it is released) or is re-run (they are released)."""
        for call in live:
            if call.inner is None or call.done:
                continue
            taken = {id(p) for op in call.inner for p in op.entry.params}
            plain = bool(call.inner) and set(call.entry.param_ids) <= taken and all(
                _plainly_batched(op, B) for op in call.inner)
            for released in ([call] if plain else call.inner):
                released.release(untag=True)
            (self.by_ops.add if plain else self.by_ops.discard)(call.entry.name)
            call.inner = None


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
