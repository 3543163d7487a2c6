"""Recording under torch.distributed (DDP): what the ranks agree on, through torch's own
collectives (no cluster code of gradlog's own).

Every rank records its own batch into the one store (``gradlog.store.ranks`` commits the
steps). Per backward call the ranks exchange their batch sizes (one ``all_gather`` of an
int64), so that each knows the rows of every rank (disjoint, in rank order) and the global
datum ids of counter-numbered batches; a step's micro-batch ``m`` of rank ``r`` is stored as
micro-batch ``m * world_size + r``.

Gradients: DDP leaves in ``p.grad`` the mean over ranks of each rank's gradient, so the weight
of a record is its single-process weight divided by ``world_size``; then ``sum_b w_b g_b`` over
every rank's records of a step equals ``p.grad``. A rank holds only its own ``g_b``: the
self-check sums the weighted gradients over ranks (one ``all_reduce`` on checked steps only)
and compares with ``p.grad``; inside ``DDP.no_sync()`` (no all-reduce) a rank compares its own
share, times ``world_size``, with its local ``p.grad``.

FSDP2 (``fully_shard``). Parameters are sharded (DTensor) between uses; FSDP2 all-gathers a
layer's parameters for its forward and again for its backward, and the hooks backend computes
each datum's gradient from that layer's captured inputs and output gradients while it is
unsharded: per-datum gradients have the parameter's full shape, under the user's own names
(FSDP2 renames nothing), and nothing of them crosses ranks. ``p.grad`` is the sharded mean
over ranks (reduce-scatter), so weights are as under DDP; the self-check gathers the shards
of ``p.grad`` (``DTensor.full_tensor``) on checked steps only. Inside
``set_requires_gradient_sync(False)`` FSDP2 leaves ``p.grad`` untouched and accumulates
unsharded: the self-check carries the step's weighted sums to the micro-batch that reduces.
FSDP1 (``FullyShardedDataParallel``) flattens parameters into ``FlatParameter`` shards whose
views are replaced in place; it is refused, naming FSDP2 and DDP.

Compact forms. Forms are planned at the first recorded batch from its token counts and the
records of a step: the ranks agree on the most tokens of any rank and on the step's records
(every rank's batch), rank 0 plans, and the plan's JSON specs reach the other ranks by one
broadcast (:meth:`Distributed.share_json`), so seeds, dimensions and ``auto``'s choices are
the same on every rank and equal one process's plan for the same global batch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gradlog._torch_private import fsdp_reduces_grads
from gradlog.errors import ConfigError, GradlogError, InputError

__all__ = ["Distributed", "check_backend", "dense", "detect", "fsdp2_module_class"]


def fsdp2_module_class() -> type | None:
    """FSDP2's ``FSDPModule`` (``torch.distributed.fsdp`` since torch 2.6,
    ``torch.distributed._composable.fsdp`` in 2.4-2.5), or None where it is missing."""
    try:
        from torch.distributed.fsdp import FSDPModule

        return FSDPModule
    except ImportError:
        pass
    try:
        import torch.distributed._composable.fsdp as old

        return getattr(old, "FSDPModule", None)
    except ImportError:
        return None


def dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a plain tensor: a DTensor (an FSDP2 ``p.grad``) gathered whole from its
    shards (a collective: every rank calls it for the same tensors in the same order)."""
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) else t


@dataclass
class Distributed:
    """This process's place in a torch.distributed run, and the collectives gradlog needs."""

    rank: int
    world_size: int
    backend: str
    ddp: nn.Module | None  # the DistributedDataParallel wrapper, if the model is one
    fsdp: nn.Module | None = None  # the model, when FSDP2 (fully_shard) shards it

    @property
    def strategy(self) -> str:
        """``"ddp"``, ``"fsdp2"``, or ``"process_group"`` (a model neither wraps)."""
        return "ddp" if self.ddp is not None else "fsdp2" if self.fsdp is not None else (
            "process_group")

    @property
    def _device(self) -> torch.device:
        if self.backend == "nccl":  # NCCL moves CUDA tensors only
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def batch_sizes(self, batch: int) -> list[int]:
        """Every rank's batch size for this backward call, in rank order."""
        import torch.distributed as dist

        mine = torch.tensor([batch], dtype=torch.int64, device=self._device)
        out = [torch.zeros_like(mine) for _ in range(self.world_size)]
        dist.all_gather(out, mine)
        return [int(t.item()) for t in out]

    def syncing(self) -> bool:
        """Whether this backward reduces ``p.grad`` over ranks (False inside
        ``DDP.no_sync()`` or FSDP2's ``set_requires_gradient_sync(False)``)."""
        if self.fsdp is not None:
            reduces = fsdp_reduces_grads(self.fsdp)
            return True if reduces is None else reduces
        return bool(getattr(self.ddp, "require_backward_grad_sync", True))

    def max_over_ranks(self, value: int) -> int:
        """The largest of every rank's ``value`` (one ``all_reduce`` of an int64)."""
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.int64, device=self._device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def share_json(self, obj: Any) -> Any:
        """Rank 0's ``obj`` (JSON-serialisable) on every rank: two broadcasts (its length,
        then its UTF-8 bytes); nothing is pickled. Other ranks pass None."""
        import torch.distributed as dist

        data = json.dumps(obj, sort_keys=True).encode() if self.rank == 0 else b""
        size = torch.tensor([len(data)], dtype=torch.int64, device=self._device)
        dist.broadcast(size, src=0)
        buf = torch.zeros(int(size.item()), dtype=torch.uint8, device=self._device)
        if self.rank == 0:
            buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        dist.broadcast(buf, src=0)
        return json.loads(bytes(buf.cpu().tolist()).decode())

    def sum_over_ranks(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Elementwise sums over ranks of ``tensors`` (one all_reduce of their concatenation)."""
        import torch.distributed as dist

        flat = torch.cat([t.reshape(-1).double() for t in tensors]).to(self._device)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        out = []
        offset = 0
        for t in tensors:
            out.append(flat[offset : offset + t.numel()].reshape(t.shape).to(t.device))
            offset += t.numel()
        return out

    def agree(self, error: BaseException | None) -> None:
        """Rank 0 tells the others whether it opened the store; they raise if it did not,
        instead of waiting for a store that never comes."""
        import torch.distributed as dist

        flag = torch.tensor([0 if error is None else 1], dtype=torch.int64, device=self._device)
        dist.broadcast(flag, src=0)
        if self.rank > 0 and int(flag.item()):
            raise GradlogError(
                f"rank {self.rank}: rank 0 could not open the store (see rank 0's error); "
                "nothing was recorded."
            )

    def all_ok(self, error: BaseException | None) -> None:
        """A barrier that also tells every rank whether every rank joined the store; ranks
        whose own join worked raise when another's failed, instead of waiting for it."""
        import torch.distributed as dist

        flag = torch.tensor([0 if error is None else 1], dtype=torch.int64, device=self._device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if error is None and int(flag.item()):
            raise GradlogError(
                f"rank {self.rank}: another rank could not join the store (see its error); "
                "nothing was recorded."
            )

    def describe(self) -> dict[str, Any]:
        """Facts stored in the root attributes' ``backend`` object."""
        return {"world_size": self.world_size, "torch_backend": self.backend,
                "strategy": self.strategy}


def detect(model: nn.Module, distributed: bool | None) -> Distributed | None:
    """The distributed context to record in: None for one process.

    ``distributed=None`` (auto) records distributed when torch.distributed is initialised
    with more than one rank and ``model`` is a ``DistributedDataParallel`` or sharded by
    FSDP2 (``fully_shard``); True requires an initialised process group; False records
    this process alone (every rank then needs its own store path).

    Raises:
        InputError: ``distributed=True`` without an initialised process group, or a model
            under FSDP1 (``FullyShardedDataParallel``).
    """
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    _refuse_fsdp1(model)
    ready = dist.is_available() and dist.is_initialized()
    if distributed is False:
        return None
    if not ready:
        if distributed:
            raise InputError(
                "distributed=True but torch.distributed is not initialised: call "
                "torch.distributed.init_process_group(...) before opening the recorder."
            )
        return None
    ddp = model if isinstance(model, DistributedDataParallel) else None
    fsdp_cls = fsdp2_module_class()
    sharded = fsdp_cls is not None and any(isinstance(m, fsdp_cls) for m in model.modules())
    fsdp = model if sharded and ddp is None else None
    world = dist.get_world_size()
    if distributed is None and ((ddp is None and fsdp is None) or world == 1):
        return None
    return Distributed(dist.get_rank(), world, str(dist.get_backend()), ddp, fsdp)


def check_backend(model: nn.Module, backend: str) -> None:
    """Refuse a backend that cannot train ``model`` as its parallel wrapper does.

    vmap sets ``p.grad`` itself, past DDP's averaging over ranks (each rank would step on
    its own gradient: the ranks train apart) and past FSDP2's reduce-scatter; the loop
    backend's ``autograd.grad`` reaches FSDP2's unsharded parameters, not the sharded ones
    it records (every record would be 0). The hooks backend works inside one backward.

    Raises:
        ConfigError: such a backend for such a model.
    """
    from torch.nn.parallel import DistributedDataParallel

    if backend not in ("vmap", "loop"):
        return
    fsdp_cls = fsdp2_module_class()
    if fsdp_cls is not None and any(isinstance(m, fsdp_cls) for m in model.modules()):
        wrapper = "FSDP2 (fully_shard)"
    elif isinstance(model, DistributedDataParallel) and backend == "vmap":
        wrapper = "DistributedDataParallel"
    else:
        return
    raise ConfigError(
        f"backend={backend!r} cannot record a model under {wrapper}: "
        + ("it sets p.grad itself, past the wrapper's reduction over ranks (the ranks would "
           "train apart)" if backend == "vmap" else
           "its autograd.grad reaches the gathered parameters, not the sharded ones it "
           "records")
        + ". Use the default backend ('auto', the hooks backend), which records inside the "
        "wrapper's own backward" + (", or 'loop' under DDP." if wrapper.startswith("Dist")
                                    else ".")
    )


def _refuse_fsdp1(model: nn.Module) -> None:
    """FSDP1 keeps parameters as views of flattened shards (``FlatParameter``) that it
    swaps in place, and prefixes names with ``_fsdp_wrapped_module.``: not recorded.

    Raises:
        InputError: ``model`` is or holds a ``FullyShardedDataParallel``.
    """
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # torch built without distributed
        return
    if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        raise InputError(
            "the model is wrapped in FullyShardedDataParallel (FSDP1), which gradlog does not "
            "record: its parameters are views into flattened shards that it swaps in place. "
            "Shard the model with FSDP2 instead (torch.distributed.fsdp.fully_shard on each "
            "block, then on the model; accelerate: fsdp_version 2; Lightning: "
            "ModelParallelStrategy), or train it with DistributedDataParallel."
        )
