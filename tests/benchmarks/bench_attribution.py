"""Attribution quality: the linear datamodeling score (LDS) of gradlog's influence scores.

What is measured (TRAK, Park et al. 2023, arXiv 2303.14186).

- **Task** (shipped with gradlog): next-character prediction on the bundled corpus
  (Shakespeare's Sonnets, :mod:`gradlog.demo.data`). A datum is a window of ``--context + 32``
  characters; its loss is the mean cross-entropy of its 32 next-character predictions. The
  model is a character n-gram MLP (embedding 16 -> ``--context`` characters concatenated ->
  Linear 64 -> tanh -> Linear vocab), trained with AdamW (lr ``--lr``, weight decay 0.01,
  batches of ``--batch``, ``--epochs`` epochs) on ``--n-train`` windows of the first 80% of
  the text; ``--n-probes`` probes are windows of the last 20%.
- **Scores**: one training run on all the data is recorded with ``GradRecorder`` (probes at
  every step, the optimizer's state kept), once per form: ``full`` and random projections of
  the weights to ``--dims`` dimensions each (biases ``full``). For each form and score kind
  (``tracin``, ``optimizer``: AdamW-aware, ``cosine``), ``run.influence_matrix`` gives
  ``tau(z, d)`` for every probe ``z`` and training datum ``d``, and its wall time.
- **Ground truth**: ``--subsets`` random halves ``S`` of the training data; on each, the
  same recipe (same epochs and batch size) is retrained with ``--seeds`` seeds (seed: the
  initialisation and the data order), and the probe's loss averaged over the seeds.
- **LDS**: per probe, the Spearman correlation across subsets between the predicted effect
  ``sum_{d in S} tau(z, d)`` (positive: lowers the loss) and the probe's negated mean loss;
  averaged over probes. 95% confidence interval: percentile bootstrap (``--boot`` resamples
  of subsets and probes together).

Usage::

    python tests/benchmarks/bench_attribution.py            # ~3-6 min on 2 cores
    python tests/benchmarks/bench_attribution.py --subsets 32 --seeds 2 --dims 64
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import gradlog
from gradlog.demo.data import CharCorpus, load_corpus

KINDS = ("tracin", "optimizer", "cosine")


class NGram(nn.Module):
    """Predicts each character from the ``context`` before it."""

    def __init__(self, vocab: int, context: int) -> None:
        super().__init__()
        self.context = context
        self.emb = nn.Embedding(vocab, 16)
        self.fc1 = nn.Linear(16 * context, 64)
        self.fc2 = nn.Linear(64, vocab)

    def forward(self, windows: torch.Tensor) -> torch.Tensor:
        """``(B, context + T)`` characters -> ``(B, T)`` per-token losses."""
        ctx = windows.unfold(1, self.context + 1, 1)  # (B, T, context + 1)
        x = self.emb(ctx[..., :-1]).flatten(2)  # (B, T, 16 context)
        logits = self.fc2(torch.tanh(self.fc1(x)))  # (B, T, vocab)
        return F.cross_entropy(logits.transpose(1, 2), ctx[..., -1], reduction="none")


def make_data(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor, int]:
    corpus = CharCorpus(load_corpus())
    data = corpus.data
    size = args.context + 32
    cut = int(0.8 * data.numel())
    train = data[: cut - cut % size].reshape(-1, size)
    held = data[cut: cut + (data.numel() - cut) // size * size].reshape(-1, size)
    gen = torch.Generator().manual_seed(0)
    train = train[torch.randperm(train.shape[0], generator=gen)[: args.n_train]]
    probes = held[torch.randperm(held.shape[0], generator=gen)[: args.n_probes]]
    return train, probes, corpus.vocab_size


def train(
    args: argparse.Namespace, data: torch.Tensor, ids: np.ndarray, seed: int, vocab: int,
    record: Any = None,
) -> nn.Module:
    """The recipe: AdamW, ``--epochs`` epochs of ``--batch`` over ``data[ids]``."""
    torch.manual_seed(seed)
    model = NGram(vocab, args.context)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    gen = torch.Generator().manual_seed(1000 + seed)
    rec = record(model, opt) if record is not None else None
    try:
        for _ in range(args.epochs):
            order = torch.as_tensor(ids)[torch.randperm(len(ids), generator=gen)]
            for idx in order.split(args.batch):
                losses = model(data[idx])  # (B, T)
                if rec is not None:
                    rec.backward(losses, datum_ids=idx)
                else:
                    losses.mean().backward()
                opt.step()
                opt.zero_grad()
    finally:
        if rec is not None:
            rec.close()
    return model


def spearman_rows(pred: np.ndarray, actual: np.ndarray) -> np.ndarray:
    """Spearman correlation of each row pair (subsets along axis 1)."""
    def ranks(a: np.ndarray) -> np.ndarray:
        return np.argsort(np.argsort(a, axis=1), axis=1).astype(np.float64)

    rp, ra = ranks(pred), ranks(actual)
    rp -= rp.mean(axis=1, keepdims=True)
    ra -= ra.mean(axis=1, keepdims=True)
    denom = np.sqrt((rp**2).sum(axis=1) * (ra**2).sum(axis=1))
    return np.divide((rp * ra).sum(axis=1), denom, out=np.zeros(len(rp)), where=denom > 0)


def lds(pred: np.ndarray, actual: np.ndarray, resamples: list[tuple[np.ndarray, np.ndarray]]
        ) -> tuple[float, np.ndarray]:
    """LDS (mean over probes) and its value on each bootstrap resample (probe and subset
    indices; the same resamples for every score, so differences are paired); ``pred`` and
    ``actual`` are ``(probes, subsets)``."""
    value = float(spearman_rows(pred, actual).mean())
    samples = np.array([spearman_rows(pred[np.ix_(ps, ss)], actual[np.ix_(ps, ss)]).mean()
                        for ps, ss in resamples])
    return value, samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-train", type=int, default=256)
    parser.add_argument("--n-probes", type=int, default=32)
    parser.add_argument("--context", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--subsets", type=int, default=48)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--dims", type=lambda v: [int(d) for d in v.split(",")], default=[64, 512])
    parser.add_argument("--boot", type=int, default=1000)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    warnings.simplefilter("ignore")  # projection estimates warn, by design
    torch.set_num_threads(1)

    data, probes, vocab = make_data(args)
    all_ids = np.arange(data.shape[0])

    def probe_losses(model: nn.Module) -> np.ndarray:
        with torch.no_grad():
            return model(probes).mean(dim=1).double().numpy()  # (P,)

    # ground truth: retrain on random halves
    t0 = time.perf_counter()
    rng = np.random.default_rng(0)
    masks = np.zeros((args.subsets, data.shape[0]), dtype=bool)
    actual = np.zeros((args.n_probes, args.subsets))
    for j in range(args.subsets):
        subset = np.sort(rng.choice(all_ids, size=data.shape[0] // 2, replace=False))
        masks[j, subset] = True
        losses = [probe_losses(train(args, data, subset, 1 + s, vocab)) for s in range(args.seeds)]
        actual[:, j] = -np.mean(losses, axis=0)  # a higher value: the subset helped the probe
    t_truth = time.perf_counter() - t0
    base_loss = float(probe_losses(train(args, data, all_ids, 0, vocab)).mean())

    def probe_fn(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        return model(batch)  # (P, T)

    root = Path(tempfile.mkdtemp(prefix="bench_attribution-", dir=args.dir))
    forms: dict[str, Any] = {"full": "full"}
    for dim in args.dims:
        forms[f"projection {dim}"] = {"*.weight": {"form": "projection", "dim": dim},
                                      "*": "full"}
    rows = []
    boot_rng = np.random.default_rng(1)
    resamples = [(boot_rng.integers(0, args.n_probes, args.n_probes),
                  boot_rng.integers(0, args.subsets, args.subsets)) for _ in range(args.boot)]
    for label, form in forms.items():
        path = root / f"{label.replace(' ', '-')}.gradlog"

        def record(model: nn.Module, opt: torch.optim.Optimizer, form: Any = form,
                   path: Path = path) -> gradlog.GradRecorder:
            rec = gradlog.GradRecorder(model, path, optimizer=opt, form=form,
                                       probes=(probe_fn, probes), overwrite=True)
            return rec.__enter__()

        t = time.perf_counter()
        train(args, data, all_ids, 0, vocab, record=record)
        t_record = time.perf_counter() - t
        run = gradlog.open(path)
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        base: np.ndarray | None = None
        for kind in KINDS:
            t = time.perf_counter()
            matrix = run.influence_matrix(kind=kind)
            t_score = time.perf_counter() - t
            tau = np.zeros((data.shape[0], args.n_probes))
            tau[matrix.datum_ids] = matrix.scores  # datum id = index in data
            pred = (masks.astype(np.float64) @ tau).T  # (probes, subsets)
            value, samples = lds(pred, actual, resamples)
            lo, hi = np.percentile(samples, [2.5, 97.5])
            if kind == "tracin":  # KINDS starts with it: the others are compared with it
                base, base_value, diff = samples, value, ""
            else:
                assert base is not None
                d_lo, d_hi = np.percentile(samples - base, [2.5, 97.5])  # paired resamples
                diff = f"{value - base_value:+.3f} [{d_lo:+.3f}, {d_hi:+.3f}]"
            rows.append((label, kind, value, lo, hi, diff, t_score, t_record, size))

    print(f"# bench_attribution  {datetime.datetime.now().isoformat(timespec='seconds')}  "
          f"{platform.node()}  {os.cpu_count()} CPUs  gradlog {gradlog.__version__}  "
          f"torch {torch.__version__}")
    n_steps = args.epochs * -(-data.shape[0] // args.batch)
    print(f"task: char {args.context}-gram MLP on the bundled corpus, {data.shape[0]} training "
          f"windows, {args.n_probes} held-out probes, AdamW lr {args.lr}, {args.epochs} epochs "
          f"of batch {args.batch} ({n_steps} steps); probe loss after full training "
          f"{base_loss:.3f}")
    print(f"ground truth: {args.subsets} random halves x {args.seeds} seeds "
          f"({args.subsets * args.seeds} retrainings, {t_truth:.0f} s); LDS = mean over probes "
          f"of Spearman(sum_(d in S) tau, -loss); 95% CI: {args.boot} bootstrap resamples of "
          "subsets and probes")
    print()
    print("| form | kind | LDS | 95% CI | vs tracin (paired 95% CI) | scoring (s) | "
          "recording (s) | store |")
    print("|---|---|---:|---|---|---:|---:|---:|")
    for label, kind, value, lo, hi, diff, t_score, t_record, size in rows:
        print(f"| {label} | {kind} | {value:.3f} | [{lo:.3f}, {hi:.3f}] | {diff} | "
              f"{t_score:.2f} | {t_record:.1f} | {size / 2**20:.1f} MiB |")


if __name__ == "__main__":
    main()
