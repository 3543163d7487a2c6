"""One process of the Lightning ``strategy="ddp"`` test (tests/test_integrations_lightning.py),
run as ``torchrun`` runs it (RANK, LOCAL_RANK, GROUP_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT in the environment: Lightning takes them as torchelastic's and starts
no processes of its own).

Usage: python lightning_worker.py STORE OUT MAX_STEPS [STOP_AFTER|-] [resume]
Trains a float64 MLP classifier (``accumulate_grad_batches=2``, batch 3 per rank, shuffled by
Lightning's DistributedSampler) on 2 CPU processes, recording with the GradlogCallback; a
checkpoint ``OUT/last.ckpt`` is saved after every step, and rank 0 keeps the parameters at the
start of each optimizer step in ``OUT/params-S.npz`` (numpy, no pickle). STOP_AFTER stops the
run after that many steps (an interrupted run); ``resume`` resumes from ``OUT/last.ckpt``.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

N_DATA, D_IN, N_CLASSES = 12, 5, 3


def make_data() -> torch.utils.data.TensorDataset:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(N_DATA, D_IN, generator=gen, dtype=torch.float64)
    y = torch.randint(0, N_CLASSES, (N_DATA,), generator=gen)
    return torch.utils.data.TensorDataset(x, y, torch.arange(N_DATA))


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D_IN, 8), nn.Tanh(), nn.Linear(8, N_CLASSES)).double()


def main() -> None:
    import lightning.pytorch as L

    from gradlog.integrations.lightning import GradlogCallback, recorded_loss

    store, out, max_steps = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    stop_after = int(sys.argv[4]) if len(sys.argv) > 4 and sys.argv[4] != "-" else None
    resume = sys.argv[5:6] == ["resume"]
    warnings.filterwarnings("ignore")
    out.mkdir(parents=True, exist_ok=True)

    class Classifier(L.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.net = make_net()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y, idx = batch
            losses = F.cross_entropy(self.net(x), y, reduction="none")  # (B,)
            return recorded_loss(self, losses, datum_ids=idx)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.3)

        def train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(make_data(), batch_size=3, shuffle=True)

    class Steps(L.Callback):  # type: ignore[misc]
        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, i: int) -> None:
            step = trainer.global_step
            if trainer.is_global_zero and not (out / f"params-{step}.npz").exists():
                np.savez(out / f"params-{step}.npz", **{
                    k.replace(".", "/"): v.detach().numpy()
                    for k, v in module.state_dict().items()})

        def on_train_batch_end(self, trainer: Any, module: Any, *args: Any) -> None:
            if stop_after is not None and trainer.global_step >= stop_after:
                trainer.should_stop = True

    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_steps=max_steps,
        accumulate_grad_batches=2, logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=str(out),
        callbacks=[GradlogCallback(store, dtype="float64", check_every=1), Steps(),
                   L.callbacks.ModelCheckpoint(dirpath=str(out), save_last=True,
                                               every_n_train_steps=1)],
    )
    trainer.fit(Classifier(), ckpt_path=str(out / "last.ckpt") if resume else None)


if __name__ == "__main__":
    main()
