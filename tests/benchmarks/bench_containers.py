"""What taking a container's own parameters op by op saves: transformers' models from configs.

A module without a rule that holds raw parameters beside children with theirs (a layer
scale: ConvNeXt's ``layer_scale_parameter``, BEiT's ``lambda_1``/``lambda_2``, Mamba's
``A_log`` and ``D``) was re-run per datum whole with ``torch.func``; it now leaves those
parameters to op calls where every op on them is proved plainly batched
(``gradlog/backends/hooks/containers.py``). This script times a training step (forward,
``rec.backward``, ``batch_grad="sum"``, ``form="norm"``, ``durable=False``) of each model in
three variants, interleaved in each repetition (paired): a plain step on a copy, recorded
with containers op by op, and recorded with them re-run (``Containers.enter`` patched off,
as before). Table: medians (min-max) of recorded / plain, and how many modules each
variant re-ran per datum. Sizes are chosen so that no other dimension equals the batch
size (where one does, the container is re-run: a size coincidence the proof does not
settle). Usage::

    OMP_WAIT_POLICY=PASSIVE python tests/benchmarks/bench_containers.py --reps 7
    python tests/benchmarks/bench_containers.py --models mamba --reps 3
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import gradlog
from gradlog.backends.hooks import containers

B = 8


def build(kind: str) -> tuple[torch.nn.Module, torch.Tensor, str]:
    """A model from a config (random weights, training mode), its batch and input name."""
    import transformers as t

    torch.manual_seed(0)
    config: Any
    if kind == "convnext":  # (stages of 24, 12, 6, 3 positions a side: none of B's size)
        kw: dict[str, Any] = dict(num_channels=3, patch_size=4, hidden_sizes=[32, 64, 128, 256],
                                  depths=[2, 2, 4, 2], image_size=96, num_labels=10,
                                  layer_scale_init_value=0.1, drop_path_rate=0.0)
        config = t.ConvNextConfig(**kw)
        return (t.ConvNextForImageClassification(config).train(),
                torch.randn(B, 3, 96, 96), "pixel_values")
    if kind == "beit":
        kw = dict(image_size=32, patch_size=4, num_channels=3, hidden_size=128,
                  intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                  num_labels=10, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                  use_relative_position_bias=False, layer_scale_init_value=0.1,
                  drop_path_rate=0.0, use_mean_pooling=True, attn_implementation="sdpa")
        config = t.BeitConfig(**kw)
        return (t.BeitForImageClassification(config).train(), torch.randn(B, 3, 32, 32),
                "pixel_values")
    config = t.MambaConfig(vocab_size=256, hidden_size=64, state_size=16, num_hidden_layers=4,
                           expand=2, conv_kernel=4, use_mambapy=False)
    return t.MambaForCausalLM(config).train(), torch.randint(0, 256, (B, 64)), "input_ids"


def losses(model: torch.nn.Module, x: torch.Tensor, key: str) -> torch.Tensor:
    logits = model(**{key: x}).logits
    if key == "input_ids":  # (each sequence's mean next-token loss)
        return F.cross_entropy(logits[:, :-1].transpose(1, 2), x[:, 1:],
                               reduction="none").mean(1)
    return F.cross_entropy(logits, torch.arange(B) % 10, reduction="none")


def run(kind: str, reps: int) -> str:
    base, x, key = build(kind)
    plain = copy.deepcopy(base)
    models = {v: copy.deepcopy(base) for v in ("op by op", "re-run")}
    enter = containers.Containers.enter

    def off(self: Any, entry: Any) -> bool:
        return False

    def variant(name: str) -> None:  # (the patch is read in each forward)
        containers.Containers.enter = enter if name == "op by op" else off  # type: ignore[method-assign]

    ratios: dict[str, list[float]] = {v: [] for v in models}
    with tempfile.TemporaryDirectory() as d:
        recs = {}
        for v, model in models.items():
            recs[v] = gradlog.GradRecorder(model, Path(d) / v, form="norm", batch_grad="sum",
                                           durable=False, check_every=0).__enter__()

        def recorded(v: str) -> float:
            variant(v)
            t0 = time.perf_counter()
            recs[v].backward(losses(models[v], x, key))
            models[v].zero_grad()
            return time.perf_counter() - t0

        def plain_step() -> float:
            t0 = time.perf_counter()
            losses(plain, x, key).mean().backward()
            plain.zero_grad()
            return time.perf_counter() - t0

        for _ in range(2):  # (warm-up: the first step's datum check, replays)
            plain_step()
            for v in models:
                recorded(v)
        for _ in range(reps):
            p = plain_step()
            for v in models:
                ratios[v].append(recorded(v) / p)
        rerun = {v: len((recs[v].rules or {}).get("fallback", [])) for v in models}
        for rec in recs.values():
            rec.__exit__(None, None, None)
    containers.Containers.enter = enter  # type: ignore[method-assign]
    cells = [f"{statistics.median(r):.2f} ({min(r):.2f}-{max(r):.2f})" for r in ratios.values()]
    return f"| {kind} | {cells[0]} | {cells[1]} | {rerun['op by op']} / {rerun['re-run']} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="convnext,beit,mamba")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), B {B}, form norm, "
          f"batch_grad sum; {args.reps} paired reps, medians (min-max)")
    print("| model | recorded / plain, op by op | re-run per datum (before) | "
          "modules re-run, op by op / before |")
    print("|---|---|---|---|")
    for kind in args.models.split(","):
        print(run(kind, args.reps), flush=True)


if __name__ == "__main__":
    main()
