"""What do the rules found by what a module looks like save? transformers' models from configs.

transformers' experts classes (``gradlog/rules/experts.py``), RMSNorm and LayerNorm classes
(``rms_norm_like``, ``layer_norm_like`` in ``gradlog/rules/layer_norm.py``: ``--model cohere``,
``--model nemotron``) share no base class; without those
rules they are re-run per datum by the ``torch.func`` fallback. This script times a training
step (forward, ``rec.backward``, SGD step, ``rec.flush()``) of a Mixtral or Llama built from
a config with random weights (float32, or ``--dtype bfloat16`` weights), in these variants:

- ``plain``: no recorder;
- ``rule``: recorded, with the rules;
- ``re-run``: recorded, the rules taken out of the registry (what those modules cost before);

for each form and experts implementation asked, variants alternated within each repetition
(paired), medians of the per-repetition ratios to ``plain``. Usage::

    OMP_WAIT_POLICY=PASSIVE python tests/benchmarks/bench_hf_rules.py --reps 7 --steps 3
    python tests/benchmarks/bench_hf_rules.py --model llama --impl eager
    python tests/benchmarks/bench_hf_rules.py --dtype bfloat16 --shape wide --form norm
    python tests/benchmarks/bench_hf_rules.py --shape tiny --reps 2 --steps 1   # (smoke)
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

import gradlog
from gradlog.rules import base
from gradlog.rules.replay import _SEEN

SHAPES: dict[str, dict[str, int]] = {
    # (d 64, 4 experts, B 8, T 32: the shape CHANGELOG quoted for the re-run, 3.4x)
    "small": dict(hidden=64, inner=128, layers=2, experts=4, k=2, B=8, T=32),
    "wide": dict(hidden=128, inner=256, layers=2, experts=8, k=2, B=8, T=64),
    "tiny": dict(hidden=16, inner=32, layers=1, experts=4, k=2, B=3, T=5),
}


def build(shape: dict[str, int], impl: str, kind: str = "mixtral",
          dtype: torch.dtype = torch.float32) -> tuple[torch.nn.Module, torch.Tensor]:
    import transformers

    common = dict(vocab_size=256, hidden_size=shape["hidden"],
                  intermediate_size=shape["inner"], num_hidden_layers=shape["layers"],
                  num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=max(64, shape["T"]))
    if kind == "mixtral":
        cfg = transformers.MixtralConfig(**common, num_local_experts=shape["experts"],
                                         num_experts_per_tok=shape["k"])
        cfg._experts_implementation = impl
    elif kind == "cohere":
        cfg = transformers.CohereConfig(**common, use_qk_norm=False)
    elif kind == "nemotron":
        cfg = transformers.NemotronConfig(**common, head_dim=shape["hidden"] // 4)
    else:
        cfg = transformers.LlamaConfig(**common)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = {"mixtral": transformers.MixtralForCausalLM, "cohere": transformers.CohereForCausalLM,
             "nemotron": transformers.NemotronForCausalLM}.get(
                 kind, transformers.LlamaForCausalLM)(cfg).to(dtype).train()
    ids = torch.randint(0, 256, (shape["B"], shape["T"]),
                        generator=torch.Generator().manual_seed(1))
    return model, ids


def losses(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids).logits[:, :-1].float()  # (B, T-1, V)
    return F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none").mean(1)


@contextlib.contextmanager
def without_matched_rules() -> Iterator[None]:
    """The registry without the rules found by ``accepts`` alone: those modules get the
    per-datum re-run."""
    kept = list(base.MATCHED)
    base.MATCHED[:] = []
    try:
        yield
    finally:
        base.MATCHED[:] = kept


def variant(name: str, kind: str, shape: dict[str, int], impl: str, form: str,
            tmp: Path, dtype: torch.dtype) -> Callable[[int], float]:
    model, ids = build(shape, impl, kind, dtype)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    if name == "plain":
        def plain(steps: int) -> float:
            t0 = time.perf_counter()
            for _ in range(steps):
                losses(model, ids).mean().backward()
                opt.step()
                opt.zero_grad()
            return (time.perf_counter() - t0) / steps
        return plain
    with without_matched_rules() if name == "re-run" else contextlib.nullcontext():
        rec = gradlog.GradRecorder(model, tmp / f"{name}-{impl}-{form}.gradlog", form=form,
                                   overwrite=True, durable=False)
        rec.open()  # (hooks and rules are planned here)
    backend = rec._pipeline.backend  # type: ignore[union-attr]  (which rule each module got)
    used = {m["rule"] for m in backend.describe()["modules"]
            if m["module"].endswith(("experts", "layernorm"))}
    norms = {"cohere": "layer_norm_like", "nemotron": "layer_norm_like"}.get(kind, "rms_norm_like")
    if used != ({"experts", norms} - ({"experts"} if kind != "mixtral" else set())
                if name == "rule" else {"torch.func"}):
        raise SystemExit(f"{name}: the experts and norms got {used}")

    def recorded(steps: int) -> float:
        t0 = time.perf_counter()
        for _ in range(steps):
            rec.backward(losses(model, ids))
            opt.step()
            opt.zero_grad()
        rec.flush()
        seconds = (time.perf_counter() - t0) / steps
        replayed = [v for m in model.modules() for v in _SEEN.get(m, {}).values()]
        if name == "rule" and not all(replayed):  # (the replay runs in the first backward)
            raise SystemExit("rule: a module failed its replay and was re-run per datum")
        return seconds

    return recorded


def run(kind: str, shape_name: str, impl: str, form: str, reps: int,
        steps: int, dtype: torch.dtype) -> list[str]:
    shape = SHAPES[shape_name]
    names = ["plain", "rule", "re-run"]
    rows = []
    with tempfile.TemporaryDirectory(dir="/dev/shm" if Path("/dev/shm").is_dir() else None) as d:
        variants = {n: variant(n, kind, shape, impl, form, Path(d), dtype) for n in names}
        for fn in variants.values():
            fn(1)  # warm-up (the first backward's datum check, the replay, allocations)
        times: dict[str, list[float]] = {n: [] for n in names}
        for rep in range(reps):
            for n in (names if rep % 2 == 0 else names[::-1]):
                times[n].append(variants[n](steps))
    plain = times["plain"]
    for n in names:
        ratio = statistics.median(t / p for t, p in zip(times[n], plain))
        rows.append(f"| {kind} {shape_name} | {impl} | {form} | {n} | "
                    f"{1e3 * statistics.median(times[n]):.1f} | {ratio:.2f} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["mixtral", "llama", "cohere", "nemotron"],
                        default="mixtral",
                        help="cohere, nemotron: their LayerNorm classes (layer_norm_like)")
    parser.add_argument("--shape", choices=list(SHAPES), nargs="+", default=["small", "wide"])
    parser.add_argument("--impl", nargs="+", default=["eager", "grouped_mm"],
                        help="transformers' experts implementations")
    parser.add_argument("--form", nargs="+", default=["norm", "full"])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--steps", type=int, default=3, help="steps per timed repetition")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="the weights' dtype")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    print(f"{args.dtype} {args.model} from a config, CPU, {args.threads} thread(s), "
          f"{args.reps} paired repetitions of {args.steps} steps; medians. Shapes: "
          + "; ".join(f"{s} {SHAPES[s]}" for s in args.shape))
    if args.model == "llama":
        args.impl = ["-"]  # (no experts)
    print("| model, shape | experts impl | form | variant | ms/step | x plain |")
    print("|---|---|---|---|---|---|")
    for s in args.shape:
        for impl in args.impl:
            for form in args.form:
                for row in run(args.model, s, impl, form, args.reps, args.steps, dtype):
                    print(row, flush=True)


if __name__ == "__main__":
    main()
