"""What do a model's own parameters cost to record? A ViT whose ``cls_token`` and ``pos_embed``
are the root module's own parameters, against the same parameters held by an embeddings
submodule.

The root's own parameters make it a ``torch.func`` fallback: the whole model is re-run per
datum for them. An embeddings submodule owning them is re-run per datum alone. (An op-by-op
capture of the root's own parameters was measured with this script and not kept: RESULTS.md.)
Paired repetitions (plain and recorded steps alternated), medians of the per-repetition
ratios. Usage::

    OMP_WAIT_POLICY=PASSIVE python tests/benchmarks/bench_root_params.py --reps 9
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import gradlog


class _Embeddings(nn.Module):
    def __init__(self, T: int, d: int) -> None:
        super().__init__()
        self.cls_token = nn.Parameter(torch.zeros(1, 1, d))
        self.pos_embed = nn.Parameter(torch.randn(1, T + 1, d) * 0.02)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.cls_token.expand(h.shape[0], -1, -1), h], 1) + self.pos_embed


class ViT(nn.Module):
    """Patches (B, T, 48) -> Linear -> [cls] + pos -> encoder layers -> head on cls."""

    def __init__(self, own: bool, T: int = 64, d: int = 128, layers: int = 4) -> None:
        super().__init__()
        self.patch = nn.Linear(48, d)
        if own:
            self.cls_token = nn.Parameter(torch.zeros(1, 1, d))
            self.pos_embed = nn.Parameter(torch.randn(1, T + 1, d) * 0.02)
        else:
            self.embeddings = _Embeddings(T, d)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True)
            for _ in range(layers))
        self.head = nn.Linear(d, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.patch(x)
        if hasattr(self, "embeddings"):
            h = self.embeddings(h)
        else:
            h = torch.cat([self.cls_token.expand(h.shape[0], -1, -1), h], 1) + self.pos_embed
        for block in self.blocks:
            h = block(h)
        return self.head(h[:, 0])  # type: ignore[no-any-return]


def measure(own: bool, reps: int, root: Path) -> tuple[float, float, list[str]]:
    torch.manual_seed(0)
    model = ViT(own)
    x, y = torch.randn(16, 64, 48), torch.randint(0, 10, (16,))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def plain() -> float:
        t0 = time.perf_counter()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - t0

    with gradlog.GradRecorder(model, root / f"{own}.gradlog", form="norm",
                              durable=False) as rec:
        def recorded() -> float:
            t0 = time.perf_counter()
            rec.backward(F.cross_entropy(model(x), y, reduction="none"))
            opt.step()
            opt.zero_grad()
            return time.perf_counter() - t0

        plain(), recorded()  # (warm-up: the first backward's checks)
        pairs = [(plain(), recorded()) if r % 2 == 0 else tuple(reversed((recorded(), plain())))
                 for r in range(reps)]
        fallback = rec._pipeline.backend.describe()["fallback"]  # type: ignore[union-attr]
    ratio = statistics.median(r / p for p, r in pairs)
    return statistics.median(p for p, _ in pairs), ratio, fallback


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"ViT (d 128, 4 layers, T 65, B 16), `norm`, CPU, {args.threads} thread(s), "
          f"{args.reps} paired repetitions; gradlog from {Path(gradlog.__file__).parent}")
    print("| cls_token, pos_embed held by | plain ms | recorded / plain | re-run per datum |")
    print("|---|---|---|---|")
    with tempfile.TemporaryDirectory() as d:
        for own in (True, False):
            plain, ratio, fallback = measure(own, args.reps, Path(d))
            where = "the root module" if own else "an embeddings submodule"
            print(f"| {where} | {1e3 * plain:.1f} | {ratio:.2f} | "
                  f"{', '.join(repr(f) for f in fallback) or 'nothing'} |", flush=True)


if __name__ == "__main__":
    main()
