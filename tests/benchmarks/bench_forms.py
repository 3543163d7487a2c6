"""Forms (``gradlog.forms``): bytes per step, cost from captured (A, G), projection accuracy.

Cases (float32):
- ``medium``: the medium GPT of ``../shared/PEERS.md`` (``gradlog.demo.CharGPT``, vocab 512,
  d 256, 4 layers, T 128, B 32). The inputs ``A`` and output gradients ``G`` of every
  ``nn.Linear`` are captured by this script's own hooks from one real forward and backward
  (per-token cross entropy averaged per datum, mean over the batch, so a datum's gradient is
  ``B * G_b^T A_b``).
- ``seed``: the issue's seed-shaped case, B 100, T 512, a 4-layer d 512 transformer (the same
  GPT, vocab 512). Costs depend on shapes only, so ``A`` and ``G`` are random with one block's
  Linear shapes (q, k, v, proj 512x512, fc 2048x512, mlp proj 512x2048) and the head's; the
  4 blocks are alike, so a step counts each block shape 4 times.

Tables:
1. **Bytes per step** of the whole model (every parameter) per plan: ``full``; ``auto`` (the
   smallest exact form per parameter); ``auto`` within 1% of full's bytes
   (``plan_forms(budget_per_step=...)``: projections where exact does not fit);
   ``projection`` dim 1024 for matrices (vectors full); ``topk`` 1%; ``norm``.
2. **Cost** per Linear shape: each form's ``encode_with_norms`` (what recording needs: the
   stored arrays and the exact norms) against ``full`` = the hooks rule's one ``baddbmm``
   ``G^T A`` plus its norms; and the sum over a step's Linear layers. Paired medians: every
   repetition times all forms in a rotated order, ratios within a repetition.
3. **Accuracy** of projected inner products on the medium GPT's real per-datum gradients:
   for each projected size, the RMS over pairs i != j of ``|est - exact| / (|g_i| |g_j|)``
   (the error in cosine units), the RMS relative error of squared norms, and the correlation
   of estimated with exact off-diagonal inner products; over 3 seeds; with the dense
   Johnson-Lindenstrauss prediction ``sqrt(1/r)`` beside.
4. **Factored vs materialised** inner products and norms (the choice ``prefer_factored``
   makes), medium shapes.
5. **End to end** (``--e2e``, stage 2): a recorded training step (``GradRecorder`` with the
   hooks backend, forward + ``rec.backward`` + SGD step + ``rec.flush()``: the writer's
   work included) against a plain step (forward + backward + SGD step) of an identical
   model copy without hooks; paired, every repetition times the plain step and then each
   form's recorded step, ratios within a repetition, medians. Bytes per step from the
   recorder's plan. The seed case runs with ``--e2e-seed-batch`` datums (default 4) on a
   CPU: every cost is linear in B, so the ratios are those of B 100.

Usage (on a shared machine keep OpenMP threads from spinning between ops)::

    OMP_WAIT_POLICY=PASSIVE python tests/benchmarks/bench_forms.py
    OMP_WAIT_POLICY=PASSIVE python tests/benchmarks/bench_forms.py --threads 1 --clock cpu \\
        --seed-reps 3 --append      # append the tables to tests/benchmarks/RESULTS.md
    OMP_WAIT_POLICY=PASSIVE python tests/benchmarks/bench_forms.py --threads 1 --clock cpu \\
        --e2e-only --e2e-reps 5     # section 5 alone
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gradlog.demo.model import CharGPT, GPTConfig
from gradlog.forms import (
    Form,
    FullForm,
    ParamInfo,
    ProjectionForm,
    bytes_table,
    make_form,
    plan_forms,
)
from gradlog.grads import Factors, factored_inner, factored_sqnorms

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}
clock = CLOCKS["wall"]
CASES: dict[str, dict[str, int]] = {
    "medium": {"vocab": 512, "d": 256, "layers": 4, "T": 128, "B": 32},
    "seed": {"vocab": 512, "d": 512, "layers": 4, "T": 512, "B": 100},
}
Captured = dict[str, Factors]


def build(case: str) -> tuple[nn.Module, dict[str, int]]:
    s = CASES[case]
    torch.manual_seed(0)
    cfg = GPTConfig(
        vocab_size=s["vocab"], block_size=s["T"], n_layer=s["layers"], n_head=4, n_embd=s["d"]
    )
    return CharGPT(cfg), s


def param_infos(model: nn.Module, tokens: int) -> dict[str, ParamInfo]:
    """What each parameter's rule provides: factors (Linear weights), rows (Embedding),
    dense (the rest)."""
    infos: dict[str, ParamInfo] = {}
    for mname, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            name = f"{mname}.{pname}" if mname else pname
            if isinstance(module, nn.Linear) and pname == "weight":
                infos[name] = ParamInfo(tuple(p.shape), "factors", tokens, name=name)
            elif isinstance(module, nn.Embedding):
                infos[name] = ParamInfo(tuple(p.shape), "rows", tokens, name=name)
            else:
                infos[name] = ParamInfo(tuple(p.shape), name=name)
    return infos


def capture(model: nn.Module, s: dict[str, int]) -> Captured:
    """(A, G) of every nn.Linear from one forward and backward; scale B (mean batch loss)."""
    B, T, V = s["B"], s["T"], s["vocab"]
    x = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(2))
    saved: dict[str, list[torch.Tensor]] = {}
    handles = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):

            def hook(mod: nn.Module, args: Any, out: torch.Tensor, name: str = name) -> None:
                saved[name] = [args[0].detach()]
                out.register_hook(lambda g, name=name: saved[name].append(g.detach()))

            handles.append(module.register_forward_hook(hook))
    logits = model(x)  # (B, T, V)
    losses = F.cross_entropy(logits.transpose(1, 2), y, reduction="none").mean(1)  # (B,)
    losses.mean().backward()
    for h in handles:
        h.remove()
    return {f"{n}.weight": Factors(g, a, scale=float(B)) for n, (a, g) in saved.items()}


def random_captures(s: dict[str, int]) -> dict[str, tuple[Factors, int]]:
    """One block's Linear shapes and the head, random (A, G); with their count per step."""
    B, T, d, V = s["B"], s["T"], s["d"], s["vocab"]
    gen = torch.Generator().manual_seed(3)
    shapes = {
        "attn.q/k/v/proj": ((d, d), 4 * s["layers"]),
        "mlp.fc": ((4 * d, d), s["layers"]),
        "mlp.proj": ((d, 4 * d), s["layers"]),
        "head": ((V, d), 1),
    }
    out = {}
    for name, ((p, q), count) in shapes.items():
        g = torch.randn((B, T, p), generator=gen) / math.sqrt(B * T)
        a = torch.randn((B, T, q), generator=gen)
        out[name] = (Factors(g, a, scale=float(B)), count)
    return out


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


# -- 1. bytes ------------------------------------------------------------------------------
def bytes_plans(infos: dict[str, ParamInfo], B: int) -> dict[str, dict[str, Form]]:
    full = {n: FullForm.plan(i) for n, i in infos.items()}
    full_step = sum(f.nbytes_per_record() for f in full.values()) * B
    matrices = {
        n: ({"form": "projection", "dim": 1024} if len(i.shape) >= 2 else "full")
        for n, i in infos.items()
    }
    return {
        "full": full,
        "auto (smallest exact)": plan_forms(infos, dict.fromkeys(infos, "auto")),
        "auto, budget 1% of full": plan_forms(
            infos, dict.fromkeys(infos, "auto"), budget_per_step=full_step // 100, batch_size=B
        ),
        "projection dim 1024 (matrices)": plan_forms(infos, matrices),
        "topk 1%": plan_forms(infos, {n: {"form": "topk", "fraction": 0.01} for n in infos}),
        "norm": plan_forms(infos, dict.fromkeys(infos, "norm")),
    }


def bytes_table_lines(case: str, infos: dict[str, ParamInfo], B: int, steps: int) -> list[str]:
    plans = bytes_plans(infos, B)
    full_step = bytes_table(plans["full"], batch_size=B)[-1]["bytes_per_step"]
    lines = [
        f"### Bytes per step: {case} (B {B}, all {len(infos)} parameters)",
        "",
        f"| plan | forms used | bytes per step | vs full | {steps:,} steps |",
        "|---|---|---|---|---|",
    ]
    for label, forms in plans.items():
        total = bytes_table(forms, batch_size=B)[-1]["bytes_per_step"]
        used: dict[str, int] = {}
        for f in forms.values():
            used[f.name] = used.get(f.name, 0) + 1
        kinds = ", ".join(f"{k} x{v}" for k, v in sorted(used.items()))
        lines.append(
            f"| {label} | {kinds} | {fmt_bytes(total)} | {total / full_step:.4f} | "
            f"{fmt_bytes(total * steps)} |"
        )
    return lines


# -- 2. cost -------------------------------------------------------------------------------
def full_rule(f: Factors) -> torch.Tensor:
    """What the hooks backend computes today (gradlog.rules.linear): one baddbmm."""
    B, _, p = f.g.shape
    out = torch.empty((B, p, f.a.shape[2]), dtype=f.g.dtype)
    return out.baddbmm_(f.g.transpose(1, 2), f.a, beta=0.0, alpha=f.scale)


def paired_medians(fns: dict[str, Callable[[], Any]], reps: int) -> dict[str, float]:
    """Median seconds of each function, every repetition running all in a rotated order."""
    names = list(fns)
    times: dict[str, list[float]] = {n: [] for n in names}
    for n in names:  # warm-up: caches of projection matrices, allocator
        fns[n]()
    for r in range(reps):
        for n in names[r % len(names) :] + names[: r % len(names)]:
            t0 = clock()
            fns[n]()
            times[n].append(clock() - t0)
    return {n: statistics.median(ts) for n, ts in times.items()}


def cost_forms(f: Factors, full_bytes: int, tokens: int) -> dict[str, Form]:
    info = ParamInfo(f.shape, "factors", tokens, name="w")
    return {
        "factors": make_form("factors", info),
        "projection 1%": make_form({"form": "auto", "budget": full_bytes // 100}, info),
        "projection 1024": make_form({"form": "projection", "dim": 1024}, info),
        "topk 1%": make_form({"form": "topk", "fraction": 0.01}, info),
        "norm": make_form("norm", info),
    }


def cost_lines(case: str, shapes: dict[str, tuple[Factors, int]], reps: int) -> list[str]:
    s = CASES[case]
    lines = [
        f"### Cost from captured (A, G): {case} (B {s['B']}, T {s['T']}, {reps} reps)",
        "",
        "Each cell: median ms of `encode_with_norms` (arrays + exact norms); in brackets "
        "the ratio to `full` = the rule's `baddbmm` plus norms of the result.",
        "",
    ]
    header: list[str] | None = None
    step_ms: dict[str, float] = {}
    for label, (f, count) in shapes.items():
        p, q = f.shape
        full_bytes = p * q * 4
        forms = cost_forms(f, full_bytes, s["T"])

        full = FullForm((p, q))
        fns: dict[str, Callable[[], Any]] = {
            "full (G^T A only)": lambda f=f: full_rule(f),
            "full": lambda f=f, full=full: full.encode_with_norms(f),
        }
        for name, form in forms.items():
            fns[name] = lambda form=form, f=f: form.encode_with_norms(f)
        med = paired_medians(fns, reps)
        if header is None:
            header = list(fns)
            lines += [
                "| Linear (p x q) x count | " + " | ".join(header) + " |",
                "|---|" + "---|" * len(header),
            ]
        base = med["full"]
        cells = [f"{med[n] * 1e3:.1f} ({med[n] / base:.2f})" for n in header]
        lines.append(f"| {label} {p}x{q} x{count} | " + " | ".join(cells) + " |")
        for n in header:
            step_ms[n] = step_ms.get(n, 0.0) + med[n] * 1e3 * count
        spec = forms["projection 1%"].spec()
        lines_note = f"{label}: projection 1% = {spec['form']} ranks {spec.get('ranks')}"
        print("  " + lines_note, flush=True)
    assert header is not None
    base = step_ms["full"]
    lines.append(
        "| **step (all Linear weights)** | "
        + " | ".join(f"**{step_ms[n]:.0f} ({step_ms[n] / base:.2f})**" for n in header)
        + " |"
    )
    return lines


# -- 3. accuracy ---------------------------------------------------------------------------
def accuracy_lines(captured: Captured, seeds: int) -> list[str]:
    layer = "blocks.1.mlp.fc.weight"
    f = captured[layer].canonical()
    p, q = f.shape
    B = f.batch_size
    exact = factored_inner(f.g, f.a, f.g, f.a)  # (B, B) float64, exact
    norms = exact.diagonal().sqrt()
    off = ~torch.eye(B, dtype=torch.bool)
    cos = (exact / torch.outer(norms, norms))[off]
    lines = [
        f"### Accuracy of projected inner products: medium GPT `{layer}` ({p}x{q}), "
        f"real per-datum gradients of B {B} datums, {seeds} seeds",
        "",
        f"Exact |cosine| between datums: median {cos.abs().median():.3f}, max "
        f"{cos.abs().max():.3f}.",
        "",
        "| projection | size r | bytes vs full | cosine error (RMS) | JL sqrt(1/r) | "
        "norm^2 rel. error (RMS) | corr(est, exact) |",
        "|---|---|---|---|---|---|---|",
    ]
    configs: list[tuple[str, dict[str, Any]]] = []
    for r in (8, 16, 32, 64, 128):
        configs.append((f"two-sided {r}x{r}", {"ranks": (r, r), "structure": "two_sided"}))
    for r in (64, 256, 1024):
        configs.append((f"dense {r}", {"ranks": (r,), "structure": "dense"}))
    for label, cfg in configs:
        errs, nerrs, corrs = [], [], []
        for seed in range(seeds):
            form = ProjectionForm((p, q), kind="rademacher", seed=seed, **cfg)
            est = form.inner(form.encode(f), form.encode(f))  # (B, B)
            errs.append(((est - exact) / torch.outer(norms, norms))[off])
            nerrs.append(est.diagonal() / exact.diagonal() - 1)
            corrs.append(float(torch.corrcoef(torch.stack([est[off], exact[off]]))[0, 1]))
        r = math.prod(cfg["ranks"])
        rms = float(torch.cat(errs).square().mean().sqrt())
        nrms = float(torch.cat(nerrs).square().mean().sqrt())
        lines.append(
            f"| {label} | {r} | {r / (p * q):.4f} | {rms:.4f} | "
            f"{math.sqrt(1 / r):.4f} | {nrms:.4f} | {statistics.mean(corrs):.4f} |"
        )
    return lines


# -- 3b. faithfulness on a trained run's recorded gradients (README table) ------------------
def faithful_lines(steps: int = 150, seeds: int = 3) -> list[str]:
    """Project recorded per-datum gradients of a small trained GPT at several dims.

    ``gradlog.demo`` CharGPT (d 128, 2 layers, T 64) trained ``steps`` AdamW steps on the demo
    corpus, B 32, recording ``blocks.1.mlp.*`` weights (form ``full``) every 50 steps; the
    last recorded step's 32 gradients are projected with the ``projection`` form's default
    structure at each ``dim`` (``seeds`` seeds) and compared with their exact inner products:
    relative error of norms, error of inner products in units of ``|g_i| |g_j|`` (i.e. of
    cosines), and the correlation of estimated with exact inner products over pairs.
    """
    import tempfile

    import torch.nn.functional as F

    import gradlog
    from gradlog.demo.data import CharCorpus, load_corpus
    from gradlog.demo.model import CharGPT, GPTConfig
    from gradlog.forms import make_form, project

    torch.manual_seed(0)
    corpus = CharCorpus(load_corpus())
    B, T = 32, 64
    cfg = GPTConfig(vocab_size=corpus.vocab_size, block_size=T, n_layer=2, n_head=4, n_embd=128)
    model = CharGPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    lines = [
        f"### Projection faithfulness: CharGPT d 128 trained {steps} steps, recorded "
        f"gradients of B {B} datums at the last recorded step, {seeds} seeds",
        "",
        "| param | dim | bytes vs full | norm rel. error (median / max) | inner-product error "
        "/ (|g_i||g_j|) (median) | corr(est, exact) |",
        "|---|---|---|---|---|---|",
    ]
    with tempfile.TemporaryDirectory() as root:
        path = f"{root}/f.gradlog"
        with gradlog.GradRecorder(
            model, path, params="blocks.1.mlp.*weight", optimizer=opt
        ) as rec:
            for step, (x, y, idx) in enumerate(corpus.batches(B, T, steps)):
                losses = F.cross_entropy(model(x).transpose(1, 2), y, reduction="none")
                if step % 50 == 0 or step == steps - 1:
                    rec.backward(losses, datum_ids=idx, step=step)
                else:
                    losses.mean().backward()
                opt.step()
                opt.zero_grad()
        run = gradlog.open(path)
        last = int(run.steps.column("step")[-1].as_py())
        for name in run.param_names:
            shape = tuple(run.grads(name, step=last).shape[1:])
            g = torch.from_numpy(run.grads(name, step=last)).double().reshape(B, -1)  # (B, n)
            exact = g @ g.T  # (B, B)
            norms = exact.diagonal().sqrt()
            off = ~torch.eye(B, dtype=torch.bool)
            for dim in (256, 1024, 4096, 16384):
                nerr, ierr, corr = [], [], []
                for seed in range(seeds):
                    request = {"form": "projection", "dim": dim, "seed": seed}
                    form = make_form(request, ParamInfo(shape, name=name))
                    pg = project(g.float().reshape(B, *shape), form.spec()).double().reshape(B, -1)
                    est = pg @ pg.T  # (B, B)
                    nerr.append((est.diagonal().sqrt() / norms - 1).abs())
                    ierr.append(((est - exact) / torch.outer(norms, norms))[off].abs())
                    corr.append(float(torch.corrcoef(torch.stack([est[off], exact[off]]))[0, 1]))
                n = torch.cat(nerr)
                lines.append(
                    f"| `{name}` {shape} | {dim} | {pg.shape[1] / g.shape[1]:.4f} | "
                    f"{n.median():.3f} / {n.max():.3f} | {torch.cat(ierr).median():.3f} | "
                    f"{statistics.mean(corr):.3f} |"
                )
    return lines


# -- 4. factored vs materialised -----------------------------------------------------------
def factored_lines(captured: Captured, reps: int) -> list[str]:
    lines = [
        "### Factored vs materialised comparisons (medium shapes, float64 results)",
        "",
        "| what | shape | tokens | factored ms | materialised ms | auto picks |",
        "|---|---|---|---|---|---|",
    ]
    from gradlog.grads import prefer_factored

    for layer in ("blocks.0.attn.q.weight", "blocks.0.mlp.fc.weight"):
        f0 = captured[layer].canonical()
        for n in (16, 128):
            g, a = f0.g[:, :n].contiguous(), f0.a[:, :n].contiguous()
            B, _, p = g.shape
            q = a.shape[2]
            for what, fn, pairs in (
                ("inner (B x B)", lambda m, g=g, a=a: factored_inner(g, a, g, a, method=m), None),
                ("norms (B)", lambda m, g=g, a=a: factored_sqnorms(g, a, method=m), B),
            ):
                med = paired_medians(
                    {m: lambda m=m, fn=fn: fn(m) for m in ("factored", "materialised")}, reps
                )
                pick = (
                    "factored" if prefer_factored(B, n, B, n, p, q, pairs=pairs) else "materialised"
                )
                lines.append(
                    f"| {what} | {p}x{q} | {n} | {med['factored'] * 1e3:.1f} | "
                    f"{med['materialised'] * 1e3:.1f} | {pick} |"
                )
    return lines


# -- 5. end to end ------------------------------------------------------------------------
E2E_FORMS: dict[str, tuple[str, Callable[[int], dict[str, Any]]]] = {
    "full": ("full", lambda full: {"form": "full"}),
    "auto": ("auto (smallest exact)", lambda full: {"form": "auto"}),
    "auto1": ("auto, budget 1% of full", lambda full: {"form": "auto", "form_budget": full // 100}),
    "proj1024": ("projection dim 1024", lambda full: {"form": {"form": "projection", "dim": 1024}}),
    "topk1": ("topk 1%", lambda full: {"form": {"form": "topk", "fraction": 0.01}}),
    "norm": ("norm", lambda full: {"form": "norm"}),
    "proj1024sum": (
        "projection dim 1024, batch_grad=sum",
        lambda full: {"form": {"form": "projection", "dim": 1024}, "batch_grad": "sum"},
    ),
    "normsum": ("norm, batch_grad=sum", lambda full: {"form": "norm", "batch_grad": "sum"}),
}
"""Table 5's recorder settings by key (``--e2e-forms``): (label, kwargs from full's bytes)."""


def e2e_lines(case: str, batch: int, reps: int, forms: list[str]) -> list[str]:
    """Recorded steps against plain steps, end to end (see the module doc, table 5)."""
    import copy
    import shutil
    import tempfile

    import gradlog

    model, s = build(case)
    T, V = s["T"], s["vocab"]
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, V, (batch, T), generator=gen)
    y = torch.randint(0, V, (batch, T), generator=gen)
    full = sum(p.numel() for p in model.parameters()) * 4 * batch  # float32 bytes per step

    def step(m: nn.Module, opt: torch.optim.Optimizer, rec: Any = None) -> float:
        t0 = clock()
        losses = F.cross_entropy(m(x).transpose(1, 2), y, reduction="none").mean(1)  # (B,)
        if rec is None:
            losses.mean().backward()
        else:
            rec.backward(losses)
        opt.step()
        opt.zero_grad()
        if rec is not None:
            rec.flush()
        return clock() - t0

    root = Path(tempfile.mkdtemp(prefix="bench_forms_"))
    runs: dict[str, tuple[Any, nn.Module, torch.optim.Optimizer]] = {}
    plain_opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: the copies stay equal
    try:
        for label in forms:
            m = copy.deepcopy(model)
            opt = torch.optim.SGD(m.parameters(), lr=0.0)
            rec = gradlog.GradRecorder(m, root / f"{len(runs)}.gradlog", check_every=0,
                                       durable=False, **E2E_FORMS[label][1](full))
            rec.open()
            runs[label] = (rec, m, opt)
        step(model, plain_opt)
        for rec, m, opt in runs.values():
            step(m, opt, rec)  # plans the forms
        ratios: dict[str, list[float]] = {label: [] for label in runs}
        plains = []
        for _ in range(reps):
            base = step(model, plain_opt)
            plains.append(base)
            for label, (rec, m, opt) in runs.items():
                ratios[label].append(step(m, opt, rec) / base)
        lines = [
            f"### End to end: {case} (B {batch}, T {T}, d {s['d']}, {s['layers']} layers, "
            f"{reps} reps; plain step {statistics.median(plains):.2f} s)",
            "",
            "| form | forms used | bytes per step | vs full | recorded / plain step |",
            "|---|---|---|---|---|",
        ]
        for label, (rec, _, _) in runs.items():
            used: dict[str, int] = {}
            for f in (rec.forms or {}).values():
                used[f.name] = used.get(f.name, 0) + 1
            kinds = ", ".join(f"{k} x{v}" for k, v in sorted(used.items()))
            per_step = rec.bytes_per_record * batch
            name = E2E_FORMS[label][0]
            lines.append(
                f"| {name} | {kinds} | {fmt_bytes(per_step)} | {per_step / full:.4f} | "
                f"**{statistics.median(ratios[label]):.3f}** "
                f"({min(ratios[label]):.3f}-{max(ratios[label]):.3f}) |"
            )
        return lines
    finally:
        for rec, _, _ in runs.values():
            rec.close()
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5, help="repetitions, medium case")
    parser.add_argument("--seed-reps", type=int, default=2, help="repetitions, seed case")
    parser.add_argument("--cases", default="medium,seed", help="comma-separated: medium,seed")
    parser.add_argument("--seeds", type=int, default=3, help="projection seeds for accuracy")
    parser.add_argument("--steps", type=int, default=50_000, help="planned steps (bytes)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument(
        "--clock",
        choices=list(CLOCKS),
        default="wall",
        help="wall: perf_counter; cpu: this process's CPU time (use --threads 1 on a busy box)",
    )
    parser.add_argument(
        "--faithful-only", action="store_true", help="table 3b alone (projection vs dim)"
    )
    parser.add_argument("--e2e", action="store_true", help="also table 5 (end to end)")
    parser.add_argument("--e2e-only", action="store_true", help="table 5 alone")
    parser.add_argument("--e2e-reps", type=int, default=5, help="repetitions, end to end")
    parser.add_argument("--e2e-seed-batch", type=int, default=4, help="B of the seed case")
    parser.add_argument(
        "--e2e-forms", default=",".join(E2E_FORMS), help="comma-separated labels of table 5"
    )
    parser.add_argument(
        "--append",
        nargs="?",
        const=str(RESULTS),
        default=None,
        help=f"append the tables to this markdown file (default {RESULTS.name})",
    )
    args = parser.parse_args()
    global clock
    clock = CLOCKS[args.clock]
    if args.threads:
        torch.set_num_threads(args.threads)
    cases = [c for c in args.cases.split(",") if c]

    lines: list[str] = []

    def emit(rows: list[str]) -> None:
        print("\n".join([*rows, ""]), flush=True)
        lines.extend([*rows, ""])

    if args.faithful_only:
        emit(faithful_lines(seeds=args.seeds))
        return
    captured: Captured = {}
    for case in [] if args.e2e_only else cases:
        model, s = build(case)
        emit(bytes_table_lines(case, param_infos(model, s["T"]), s["B"], args.steps))
        if case == "medium":
            captured = capture(model, s)
            layers = s["layers"]
            shapes = {  # one block's shapes (the blocks are alike) and the head
                "attn.q/k/v/proj": (captured["blocks.0.attn.q.weight"], 4 * layers),
                "mlp.fc": (captured["blocks.0.mlp.fc.weight"], layers),
                "mlp.proj": (captured["blocks.0.mlp.proj.weight"], layers),
                "head": (captured["head.weight"], 1),
            }
        else:
            shapes = random_captures(s)
        del model
        emit(cost_lines(case, shapes, args.reps if case == "medium" else args.seed_reps))
    if captured:
        emit(accuracy_lines(captured, args.seeds))
        emit(factored_lines(captured, args.reps))
    if args.e2e or args.e2e_only:
        forms = [f for f in args.e2e_forms.split(",") if f]
        for case in cases:
            batch = CASES[case]["B"] if case == "medium" else args.e2e_seed_batch
            emit(e2e_lines(case, batch, args.e2e_reps, forms))

    if args.append:
        cmd = " ".join(["python", "tests/benchmarks/bench_forms.py", *sys.argv[1:]])
        env = "OMP_WAIT_POLICY=PASSIVE " if os.environ.get("OMP_WAIT_POLICY") else ""
        header = [
            "",
            "## Forms (`bench_forms.py`)",
            "",
            f"{datetime.date.today().isoformat()}, torch {torch.__version__}, Python "
            f"{platform.python_version()}, {os.cpu_count()} cores, "
            f"{torch.get_num_threads()} intra-op threads, {args.clock} clock, no GPU lent "
            "to this task.",
            "",
            f"`{env}{cmd}`",
            "",
        ]
        with open(args.append, "a", encoding="utf-8") as fh:
            fh.write("\n".join(header + lines))


if __name__ == "__main__":
    main()
