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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gradlog.errors import GradlogError, InputError

__all__ = ["Distributed", "detect"]


@dataclass
class Distributed:
    """This process's place in a torch.distributed run, and the collectives gradlog needs."""

    rank: int
    world_size: int
    backend: str
    ddp: nn.Module | None  # the DistributedDataParallel wrapper, if the model is one

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
        """Whether this backward all-reduces ``p.grad`` (False inside ``DDP.no_sync()``)."""
        return bool(getattr(self.ddp, "require_backward_grad_sync", True))

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
        return {"world_size": self.world_size, "torch_backend": self.backend}


def detect(model: nn.Module, distributed: bool | None) -> Distributed | None:
    """The distributed context to record in: None for one process.

    ``distributed=None`` (auto) records distributed when torch.distributed is initialised
    with more than one rank and ``model`` is a ``DistributedDataParallel``; True requires an
    initialised process group; False records this process alone (every rank then needs its
    own store path).

    Raises:
        InputError: ``distributed=True`` without an initialised process group.
    """
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

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
    world = dist.get_world_size()
    if distributed is None and (ddp is None or world == 1):
        return None
    return Distributed(dist.get_rank(), world, str(dist.get_backend()), ddp)
