"""Record per-datum gradients from your own training loop.

A small classifier on synthetic data, trained with an ordinary PyTorch loop. The only change
to the loop: ``rec.backward(losses, ...)`` replaces ``loss.backward()``, with per-datum losses
(``reduction="none"``) and each datum's index in the dataset.

    python examples/record_own_loop.py --out runs/example.gradlog
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import gradlog


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/example.gradlog")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument(
        "--backend", default="auto",
        help="auto (the default: per-datum gradients from the ordinary backward), vmap, or "
        "loop (one backward per datum: the slow reference)",
    )
    args = parser.parse_args()

    torch.manual_seed(0)
    n, d, classes = 256, 20, 4
    x = torch.randn(n, d)
    y = (x[:, :classes].argmax(1) + (torch.rand(n) < 0.1).long()) % classes  # 10% noisy labels
    data = TensorDataset(x, y, torch.arange(n))  # the third column: each datum's id
    loader = DataLoader(data, batch_size=32, shuffle=True)

    model = nn.Sequential(nn.Linear(d, 64), nn.ReLU(), nn.Linear(64, classes))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    with gradlog.GradRecorder(
        model, args.out, backend=args.backend, optimizer=opt, overwrite=True
    ) as rec:
        for epoch in range(args.epochs):
            for xb, yb, idx in loader:
                losses = F.cross_entropy(model(xb), yb, reduction="none")  # (B,)
                rec.backward(losses, datum_ids=idx)  # instead of losses.mean().backward()
                opt.step()
                opt.zero_grad()
            print(f"epoch {epoch}: last batch loss {losses.mean():.3f}")

    run = gradlog.open(args.out)
    print(f"recorded {run.steps.num_rows} steps, {run.datums.num_rows} records into {args.out} "
          f"(backend {run.attrs['backend']['name']})")


if __name__ == "__main__":
    main()
