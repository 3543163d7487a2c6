"""gradlog on CUDA, through its public API only: the ``gpu``-marked tests of the GPU suite.

- Per-datum gradients recorded on CUDA by every backend (hooks, hooks with
  ``batch_grad="sum"``, vmap, loop) over the model zoo equal a float64 CPU oracle (each
  datum's own forward and backward, :mod:`gradlog.testing.oracle`).
- The same under bf16 autocast, within a few bf16 epsilons.
- The recorded step issues no device synchronisation per layer: the synchronising CUDA calls
  of a steady-state step (``torch.cuda.set_sync_debug_mode``) are the same with 1 and 3
  blocks, for every form; and none at all (``"error"`` mode) around the hooked backward.
- Records leave the device through pinned host memory (the profiler's memcpy kinds).

The one test without the marker runs the suite's CPU mode on tiny shapes, so CI keeps
``tests/benchmarks/gpu_suite.py`` alive. ``python tests/benchmarks/gpu_suite.py`` runs these
tests and the CUDA benchmarks in one command.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import json
import sys
import threading
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradlog
from gradlog.testing import zoo
from gradlog.testing.llama import LlamaConfig, tiny_llama
from gradlog.testing.oracle import naive_per_datum_grads

pytestmark = [
    # torch.func: SDPA has no batching rule (vmap backend on the Llama); torch's, harmless
    pytest.mark.filterwarnings(
        "ignore:There is a performance drop because we have not yet implemented:UserWarning"),
    # torch warns once that set_sync_debug_mode is a prototype, from whichever test is first
    pytest.mark.filterwarnings("ignore:Synchronization debug mode is a prototype:UserWarning"),
]
CUDA = torch.device("cuda")
SUITE = Path(__file__).resolve().parent / "benchmarks" / "gpu_suite.py"

LossFn = Callable[[nn.Module, Any], torch.Tensor]
# name -> (model, batch, mask or None, loss_fn(model, batch) -> (B,) or (B, T) losses)
Case = tuple[nn.Module, tuple[torch.Tensor, ...], torch.Tensor | None, LossFn]


def _class_losses(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y, reduction="none")  # (B,)


def _token_losses(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return zoo.per_token_ce(model(x), y)  # (B, T)


def _case(name: str, dtype: torch.dtype) -> Case:
    """A zoo model on the CPU in ``dtype``, its batch, mask and loss function."""
    if name == "mlp":
        return zoo.mlp(dtype=dtype), zoo.mlp_batch(5, dtype=dtype), None, _class_losses
    if name in ("gpt", "gpt_tied"):
        model = zoo.tiny_gpt(n_layer=2, tie_weights=name == "gpt_tied", dtype=dtype)
        x, y, mask = zoo.gpt_batch(4, 8)
        return model, (x, y), mask, _token_losses
    if name == "llama":
        gen = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, 128, (3, 17), generator=gen)  # (B, T + 1)
        return tiny_llama(LlamaConfig(), dtype=dtype), (tokens[:, :-1], tokens[:, 1:]), None, \
            _token_losses
    raise ValueError(name)


MODELS = ["mlp", "gpt", "gpt_tied", "llama"]
# label -> GradRecorder options
BACKENDS: dict[str, dict[str, Any]] = {
    "hooks": {"backend": "hooks"},
    "hooks_sum": {"backend": "hooks", "batch_grad": "sum"},
    "vmap": {"backend": "vmap"},
    "loop": {"backend": "loop"},
}


def _to(batch: tuple[torch.Tensor, ...], device: torch.device) -> tuple[torch.Tensor, ...]:
    return tuple(t.to(device) for t in batch)


def _oracle(case: Case) -> dict[str, torch.Tensor]:
    """float64 CPU per-datum gradients, each datum's own forward and backward."""
    model, batch, mask, loss_fn = case
    model = copy.deepcopy(model).double()

    def datum_loss(b: int) -> torch.Tensor:
        one = tuple(t[b : b + 1] for t in batch)
        raw = loss_fn(model, one)  # (1,) or (1, T)
        if raw.dim() == 1:
            return raw[0]
        keep = torch.ones_like(raw, dtype=torch.bool) if mask is None else mask[b : b + 1]
        return raw[keep].mean()  # token_reduction="mean" over the datum's unmasked tokens

    batch = tuple(t.double() if t.is_floating_point() else t for t in batch)
    params = dict(model.named_parameters())
    return naive_per_datum_grads(datum_loss, params, batch[0].shape[0])


def _record_on_cuda(
    case: Case, path: Path, options: dict[str, Any], dtype: torch.dtype, autocast: bool = False
) -> tuple[gradlog.Run, nn.Module]:
    """One recorded step of ``case`` on CUDA; the store read back, and the CUDA model."""
    model, batch, mask, loss_fn = case
    model = copy.deepcopy(model).to(CUDA, dtype)
    storage = "float64" if dtype == torch.float64 else "float32"
    with gradlog.GradRecorder(model, path, dtype=storage, check_every=1, **options) as rec:
        cuda_mask = None if mask is None else mask.to(CUDA)
        with torch.autocast(CUDA.type, dtype=torch.bfloat16, enabled=autocast):
            rec.step(loss_fn, _to(batch, CUDA), step=0, mask=cuda_mask)
    return gradlog.open(path), model


def _relative_errors(ours: torch.Tensor, truth: torch.Tensor, floor: float) -> torch.Tensor:
    """Per datum ``|ours_b - truth_b| / max(|truth_b|, floor)``.

    ``floor`` (a fraction of the model's largest per-datum gradient) keeps parameters whose
    true gradient is 0 (a key bias under softmax) measured against the model's scale instead
    of their own rounding noise."""
    diff = (ours - truth).flatten(1).norm(dim=1)  # (B,)
    return diff / truth.flatten(1).norm(dim=1).clamp_min(floor)  # (B,)


def _floor(truth: dict[str, torch.Tensor]) -> float:
    """1% of the largest per-datum gradient norm of any parameter."""
    return max(float(g.flatten(1).norm(dim=1).max()) for g in truth.values()) * 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("model_name", MODELS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_cuda_records_equal_the_cpu_oracle(
    tmp_store: Path, model_name: str, backend: str, dtype: torch.dtype
) -> None:
    """Every backend on CUDA records each datum's own gradient; p.grad is their mean."""
    case = _case(model_name, dtype)
    truth = _oracle(case)
    run, cuda_model = _record_on_cuda(case, tmp_store, BACKENDS[backend], dtype)
    # float64: stored as float64 but read back as float32 (the reader's dtype), so float32
    # rounding; float32: the CUDA kernels' float32 rounding (TF32 is off by default)
    tol = 1e-6 if dtype == torch.float64 else 2e-4
    assert set(run.param_names) <= set(truth)
    assert run.param_names
    grads = dict(cuda_model.named_parameters())
    floor = _floor(truth)
    for name in run.param_names:
        ours = torch.from_numpy(run.grads(name, step=0)).double()  # (B, *shape)
        err = _relative_errors(ours, truth[name], floor)
        assert float(err.max()) < tol, f"{name}: per-datum relative errors {err.tolist()}"
        p_grad = grads[name].grad
        assert p_grad is not None and p_grad.device.type == CUDA.type
        mean = truth[name].mean(0)  # batch_reduction="mean"
        gap = float((p_grad.double().cpu() - mean).norm()) / max(float(mean.norm()), floor)
        assert gap < tol, f"{name}: p.grad differs from the oracle's mean by {gap:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("model_name", MODELS)
def test_bf16_autocast_records_match_the_oracle(
    tmp_store: Path, model_name: str, backend: str
) -> None:
    """float32 parameters, bf16 autocast forward and backward on CUDA: each datum's gradient
    within a few bf16 epsilons (2**-8 = 3.9e-3) of the float64 oracle, as the README states
    for CPU autocast (5e-3 to 1.2e-2 relative)."""
    case = _case(model_name, torch.float32)
    truth = _oracle(case)
    run, _ = _record_on_cuda(case, tmp_store, BACKENDS[backend], torch.float32, autocast=True)
    floor = _floor(truth)
    for name in run.param_names:
        ours = torch.from_numpy(run.grads(name, step=0)).double()  # (B, *shape)
        err = _relative_errors(ours, truth[name], floor)
        assert float(err.median()) < 1.5e-2, f"{name}: {err.tolist()}"
        assert float(err.max()) < 4e-2, f"{name}: {err.tolist()}"


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["full", "norm"])
@pytest.mark.parametrize("model_name", ["gpt", "llama"])
def test_autocast_matmuls_on_tensor_cores_equal_the_float32_ones(
    tmp_path: Path, model_name: str, form: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under bf16 autocast a Linear's per-datum matmul takes the 16-bit operands into a
    float32 result (torch >= 2.8): the same records and norms as the float32 matmul of the
    widened operands, to float32 rounding (the products are exact either way), and the path
    is really taken (not refused at the first call)."""
    from gradlog.grads.material import MixedMatmul

    case = _case(model_name, torch.float32)
    runs = {}
    for mixed in (True, False):
        if not mixed:
            monkeypatch.setattr(MixedMatmul, "devices", frozenset())
        runs[mixed], _ = _record_on_cuda(case, tmp_path / f"{mixed}.gradlog",
                                         {"form": form}, torch.float32, autocast=True)
    if hasattr(torch.ops.aten.bmm, "dtype_out"):
        assert MixedMatmul.available, "bmm with out_dtype was refused on this GPU"
    fast, slow = runs[True], runs[False]
    for name in fast.param_names:
        np.testing.assert_allclose(np.asarray(fast.norms(name).column("norm")),
                                   np.asarray(slow.norms(name).column("norm")),
                                   rtol=1e-5, atol=1e-9, err_msg=name)
        if form == "full":
            np.testing.assert_allclose(fast.grads(name, step=0), slow.grads(name, step=0),
                                       rtol=1e-4, atol=1e-6, err_msg=name)


class _LayerScaled(nn.Module):
    """A module without a rule (re-run per datum and checked against the batch's run)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.full((d, 1), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x) * self.gamma


@pytest.mark.gpu
@pytest.mark.parametrize("autocast", [False, True], ids=["float64", "bf16_autocast"])
def test_parametrized_weights_and_re_run_modules_on_cuda_equal_the_loop(autocast: bool) -> None:
    """weight_norm (wav2vec2's convolution), spectral_norm and orthogonal chained per datum,
    and a module re-run per datum under its check, on CUDA: as the loop backend on CUDA;
    spectral_norm's power iteration left as a plain step leaves it."""
    from torch.nn.utils.parametrizations import orthogonal, spectral_norm, weight_norm

    from gradlog.testing.oracle import backend_grads

    torch.manual_seed(0)
    dtype = torch.float32 if autocast else torch.float64
    model = nn.Sequential(nn.Conv1d(4, 6, 3, padding=1, groups=2), _LayerScaled(6),
                          nn.Flatten(), nn.Linear(30, 8), nn.GELU(), nn.Linear(8, 3))
    weight_norm(model[0], dim=2)
    spectral_norm(model[3])
    if not autocast:  # (under autocast: another test's, CPU)
        orthogonal(model[5])
    model = model.to(CUDA, dtype).train()
    x = torch.randn(4, 4, 5, device=CUDA, dtype=dtype)

    def losses() -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            return (model(x).float() ** 2).sum(1)

    start = copy.deepcopy(model.state_dict())
    want, _, _ = backend_grads(model, losses, "loop")
    after_loop = copy.deepcopy(model.state_dict())
    model.load_state_dict(start)
    got, _, described = backend_grads(model, losses)
    assert "1" in described["fallback"]
    for name in want:
        if autocast:
            torch.testing.assert_close(got[name], want[name], rtol=3e-2, atol=1e-3)
        else:
            torch.testing.assert_close(got[name], want[name], rtol=1e-9, atol=1e-12)
    for name, value in model.state_dict().items():
        assert torch.equal(value, after_loop[name]), name


class _KeptViewsAndHooks(nn.Module):
    """What the fifth session of 2026-11-27 made exact, on one ``device``: views of the
    embedding table kept on the module (from ``__init__``, and one made in each forward and
    read in the next), a tied head, a user's pre-hook on a Linear (the replay runs it for
    its state, its result is the call's input) and on a module re-run per datum."""

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        self.emb, self.lin = nn.Embedding(300, 8, **kw), nn.Linear(8, 8, **kw)
        self.scaled = _LayerScaled(8).to(device, dtype)  # (gamma (8, 1): over (T, 8))
        self.pos, self.parts = self.emb.weight[:16], [self.emb.weight[16:32:2]]
        self.last: torch.Tensor | None = None
        self.calls = 0

        def halve(module: nn.Module, args: tuple[Any, ...]) -> tuple[torch.Tensor]:
            self.calls += 1
            return (args[0] * 0.5,)

        self.lin.register_forward_pre_hook(halve)
        self.scaled.register_forward_pre_hook(lambda m, args: (args[0] + 1.0,))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        T = ids.shape[1]  # (8: the re-run module's gamma broadcasts over it)
        x = self.emb(ids) + self.pos[:T] + self.parts[0][:T]
        if self.last is not None:
            x = x + self.last[:T]
        self.last = self.emb.weight[40:56]  # (read by the next forward)
        h = self.scaled(torch.tanh(self.lin(x)))
        return F.linear(h, self.emb.weight)


@pytest.mark.gpu
def test_kept_views_and_replayed_pre_hooks_on_cuda_equal_the_loop() -> None:
    """Kept views, views carried between forwards, replayed pre-hooks and a re-run module
    on CUDA, three steps with the table updated in place between them: as the loop backend
    on CUDA (float64), each user pre-hook run once per forward as in a plain step."""
    from gradlog.backends import BACKENDS as _BACKENDS
    from gradlog.grads import dense
    from gradlog.params import select_params

    def run(name: str) -> tuple[list[dict[str, torch.Tensor]], int]:
        torch.manual_seed(0)
        model = _KeptViewsAndHooks(CUDA, torch.float64)
        gen = torch.Generator().manual_seed(3)
        be = _BACKENDS[name](model, select_params(model, ["*"]), batch_reduction="mean",
                             randomness="different")
        be.attach()
        out = []
        try:
            for _ in range(3):
                ids = torch.randint(0, 300, (3, 8), generator=gen).to(CUDA)
                model.zero_grad(set_to_none=True)
                losses = (model(ids) ** 2).sum((1, 2))
                got = be.backward(losses, be.reduce_batch(losses))
                out.append({n: dense(g).cpu() for n, g in got.items()})
                with torch.no_grad():
                    model.emb.weight.mul_(0.9)  # (as an optimizer step)
        finally:
            be.detach()
        return out, model.calls

    got, calls = run("hooks")
    want, _ = run("loop")
    assert calls == 3  # the user's pre-hook: once per forward
    for step, (ours, truth) in enumerate(zip(got, want, strict=True)):
        assert ours.keys() == truth.keys()
        for name in truth:
            torch.testing.assert_close(ours[name], truth[name], rtol=1e-9, atol=1e-12,
                                       msg=lambda m, s=step, n=name: f"step {s}, {n}: {m}")


@pytest.mark.gpu
@pytest.mark.parametrize("block", [None, 1 << 22])  # one block; several (a smaller scratch)
def test_one_pass_float64_norms_on_cuda_equal_the_naive_sums(
        block: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    import gradlog.grads.norms as norms
    from gradlog.grads import float64_sqnorms

    if block is not None:
        monkeypatch.setattr(norms, "DEVICE_SCRATCH_ELEMENTS", block)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3 * (1 << 20) + 5, generator=gen)
    want = x.double().square().sum(1)
    got = float64_sqnorms(x.to(CUDA)).cpu()
    torch.testing.assert_close(got, want, rtol=1e-13, atol=0)


# --- device synchronisation ---------------------------------------------------------------


@contextlib.contextmanager
def sync_calls() -> Iterator[list[str]]:
    """Record the synchronising CUDA calls of the training loop while the block runs.

    ``torch.cuda.set_sync_debug_mode("warn")`` warns at every call that waits for the device
    (``.item()``, ``.cpu()`` into pageable memory, ``nonzero``, ...); each is listed as
    ``"file:line <- caller <- caller"`` (innermost first). Calls on this thread and on
    autograd's device threads (where backward hooks run) count; calls on threads started from
    Python (the store writer waiting on its copy event) do not block the loop and are left out.
    """
    sites: list[str] = []
    main = threading.get_ident()
    here = Path(__file__).name

    def show(message: Any, category: Any, filename: str, lineno: int, *args: Any) -> None:
        thread = threading.current_thread()
        foreign = type(thread).__name__ == "_DummyThread"  # a thread torch started
        if "synchroniz" not in str(message) or (threading.get_ident() != main and not foreign):
            return
        frames = [f for f in traceback.extract_stack()[:-1][::-1]
                  if not f.filename.endswith(("warnings.py", "contextlib.py", here))]
        where = " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames[1:4])
        sites.append(f"{Path(filename).name}:{lineno} <- {where}")

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        warnings.showwarning = show
        try:
            yield sites
        finally:
            torch.cuda.set_sync_debug_mode(0)


def _gpt_on_cuda(n_layer: int) -> tuple[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor]:
    model = zoo.tiny_gpt(vocab=64, block_size=16, n_layer=n_layer, n_head=2, n_embd=32,
                         dtype=torch.float32).to(CUDA)
    x, y, mask = zoo.gpt_batch(4, 16, vocab=64)
    return model, x.to(CUDA), y.to(CUDA), mask.to(CUDA)


def steady_step_syncs(path: Path, n_layer: int, options: dict[str, Any]) -> list[str]:
    """Synchronising calls of the third recorded step (forward + ``rec.backward``), after two
    steps that plan the forms and run the first backward's datum check."""
    model, x, y, mask = _gpt_on_cuda(n_layer)
    with gradlog.GradRecorder(model, path, check_every=0, **options) as rec:
        for _ in range(2):
            rec.backward(zoo.per_token_ce(model(x), y), mask=mask)
            model.zero_grad(set_to_none=True)
        rec.flush()
        torch.cuda.synchronize()
        with sync_calls() as sites:
            rec.backward(zoo.per_token_ce(model(x), y), mask=mask)
        rec.flush()
    return sites


SYNC_FORMS: dict[str, dict[str, Any]] = {
    "full": {},
    "full_sum": {"batch_grad": "sum"},
    "auto": {"form": "auto"},
    "projection_sum": {"form": {"form": "projection", "dim": 64}, "batch_grad": "sum"},
    "topk": {"form": {"form": "topk", "fraction": 0.05}},
    "norm_sum": {"form": "norm", "batch_grad": "sum"},
}


@pytest.mark.gpu
@pytest.mark.parametrize("form", list(SYNC_FORMS))
def test_no_device_synchronisation_per_layer(tmp_path: Path, form: str) -> None:
    """A steady recorded step makes the same synchronising calls with 1 and 3 blocks: the
    per-record norms reach the host behind the writer's event, not by a blocking copy per
    parameter (found by this test on an H100: 20 -> 52 syncs for 1 -> 3 blocks before)."""
    one = steady_step_syncs(tmp_path / "a.gradlog", 1, SYNC_FORMS[form])
    three = steady_step_syncs(tmp_path / "b.gradlog", 3, SYNC_FORMS[form])
    extra = Counter(three) - Counter(one)
    assert not extra, f"synchronisations that grow with depth: {dict(extra)}; all: {three}"


@pytest.mark.gpu
@pytest.mark.parametrize("form", list(SYNC_FORMS))
def test_a_steady_step_waits_only_for_its_losses_then_once_encoded(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, form: str) -> None:
    """No synchronising call before the step is encoded: the backward, the exact norms and
    the encoding queue their work and the host goes on (on an H200 ~40 ms of GPT-2 small's
    ``norm`` step was host work between two waits). Then the losses' checks are read
    (``DeviceChecks.settle``: ``p.grad`` None before the backward, so they are read after it;
    read before it, the host waited out the forward, 60 ms of GPT-2 small's step on an
    H100), then the backward's (``Verdict.bad``). The CPU proxies are test_recorder.py's
    test_a_steady_step_waits_for_the_device_twice_and_late and test_late_loss_checks.py."""
    from gradlog.backends.hooks.checks import Verdict
    from gradlog.recording.encoding import FormEncoder

    model, x, y, mask = _gpt_on_cuda(3)
    marks: list[list[str]] = []
    bad, encode = Verdict.bad, FormEncoder.encode

    def marked_bad(self: Verdict) -> list[str]:
        if marks:
            marks[0].append("the checks read")
        return bad(self)

    def marked_encode(self: FormEncoder, *args: Any, **kwargs: Any) -> Any:
        out = encode(self, *args, **kwargs)
        if marks:
            marks[0].append("encoded")
        return out

    monkeypatch.setattr(Verdict, "bad", marked_bad)
    monkeypatch.setattr(FormEncoder, "encode", marked_encode)
    with gradlog.GradRecorder(model, tmp_path / "a.gradlog", check_every=0,
                              **SYNC_FORMS[form]) as rec:
        for _ in range(2):  # forms planned, first backward's datum check done
            rec.backward(zoo.per_token_ce(model(x), y), mask=mask)
            model.zero_grad(set_to_none=True)
        rec.flush()
        torch.cuda.synchronize()
        with sync_calls() as sites:
            marks.append(sites)
            rec.backward(zoo.per_token_ce(model(x), y), mask=mask)
        rec.flush()
    assert sites.count("the checks read") == 1 and sites.count("encoded") == 1, sites
    assert sites.index("encoded") == 0, f"waits before the step was encoded: {sites}"
    between = sites[1: sites.index("the checks read")]
    assert len(between) == 1 and between[0].startswith("losses.py:"), sites


@pytest.mark.gpu
def test_a_nan_loss_on_cuda_is_refused_after_the_backward_with_p_grad_as_before(
        tmp_path: Path) -> None:
    """On CUDA the losses' checks are read after the backward: a NaN loss is refused there,
    ``p.grad`` set back to None, nothing of the step stored, and the next batch records."""
    model, x, y, mask = _gpt_on_cuda(3)
    with gradlog.GradRecorder(model, tmp_path / "a.gradlog", check_every=0) as rec:
        rec.backward(zoo.per_token_ce(model(x), y), mask=mask, step=0)
        model.zero_grad(set_to_none=True)
        poison = torch.ones(x.shape[0], 1, device=CUDA)
        poison[1] = float("nan")
        with pytest.raises(gradlog.NonFiniteLossError, match="after the backward"):
            rec.backward(zoo.per_token_ce(model(x), y) * poison, mask=mask, step=1)
        assert all(p.grad is None for p in model.parameters())
        rec.backward(zoo.per_token_ce(model(x), y), mask=mask, step=1)
    steps = gradlog.open(tmp_path / "a.gradlog").steps.column("step").to_pylist()
    assert sorted(set(steps)) == [0, 1]


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["full", "full_sum", "projection_sum", "norm_sum"])
def test_the_hooked_backward_never_synchronises(tmp_path: Path, form: str) -> None:
    """``set_sync_debug_mode("error")`` from the losses' gradient to the token embedding's
    output gradient: the whole backward through the blocks, with gradlog's hooks and rules,
    never waits for the device. (After it the losses' checks are read and the losses reach
    the host.)"""
    model, x, y, mask = _gpt_on_cuda(3)
    seen: list[str] = []

    def start(grad: torch.Tensor) -> None:
        torch.cuda.set_sync_debug_mode("error")
        seen.append("start")

    def end(grad: torch.Tensor) -> None:
        torch.cuda.set_sync_debug_mode(0)
        seen.append("end")

    def watch_embedding(module: nn.Module, args: Any, out: torch.Tensor) -> None:
        out.register_hook(end)

    with gradlog.GradRecorder(model, tmp_path / "a.gradlog", check_every=0,
                              **SYNC_FORMS[form]) as rec:
        for step in range(3):
            rec.flush()
            torch.cuda.synchronize()
            steady = step == 2  # forms planned, first backward's datum check done
            if steady:
                handle = model.tok_emb.register_forward_hook(watch_embedding)
            losses = zoo.per_token_ce(model(x), y)  # (B, T)
            if steady:
                handle.remove()
                losses.register_hook(start)
            try:
                rec.backward(losses, mask=mask)
            finally:
                torch.cuda.set_sync_debug_mode(0)
            model.zero_grad(set_to_none=True)
    assert seen == ["start", "end"]


def _device_to_host_copies(trace: Path) -> dict[str, int]:
    """Bytes per device-to-host memcpy kind in a profiler trace."""
    events = json.loads(trace.read_text())["traceEvents"]
    kinds: dict[str, int] = {}
    for e in events:
        name = e.get("name", "")
        if name.startswith("Memcpy DtoH"):
            kinds[name] = kinds.get(name, 0) + int(e.get("args", {}).get("bytes", 0))
    return kinds


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore:.*Profiler clears events:UserWarning")
def test_records_are_staged_through_pinned_memory(tmp_path: Path) -> None:
    """Every large device-to-host copy of a recorded step lands in pinned memory (so it runs
    asynchronously); pageable copies are a few scalars at most (losses, ids)."""
    model, x, y, mask = _gpt_on_cuda(2)
    payload = 4 * x.shape[0] * sum(p.numel() for p in model.parameters())  # float32 records
    trace = tmp_path / "trace.json"
    with gradlog.GradRecorder(model, tmp_path / "a.gradlog", check_every=0) as rec:
        rec.backward(zoo.per_token_ce(model(x), y), mask=mask)
        rec.flush()
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            rec.backward(zoo.per_token_ce(model(x), y), mask=mask)
            rec.flush()
            torch.cuda.synchronize()
    prof.export_chrome_trace(str(trace))
    kinds = _device_to_host_copies(trace)
    pinned = kinds.get("Memcpy DtoH (Device -> Pinned)", 0)
    pageable = sum(v for k, v in kinds.items() if "Pinned" not in k)
    assert pinned >= payload, f"{kinds}, payload {payload} bytes"
    assert pageable <= max(4096, payload // 1000), f"{kinds}, payload {payload} bytes"


@pytest.mark.gpu
def test_chunked_head_under_autocast_adds_each_chunks_16_bit_product() -> None:
    """On CUDA under bf16 autocast the chunked head's weight gradient is the sum of each
    chunk's own 16-bit product (autograd's, chunk by chunk, summed in float64), added in place,
    its bias gradient the float32 sum of the chunks' logit gradients; and a GPU chunk holds at
    least ``GPU_MIN_ROWS`` rows by default."""
    from gradlog.memory import GPU_MIN_ROWS, chunked_linear_loss

    g = torch.Generator().manual_seed(0)
    N, d, V, rows = 96, 64, 1000, 32
    head = nn.Linear(d, V).to(CUDA)
    x = torch.randn(N, d, generator=g).to(CUDA).requires_grad_()
    y = torch.randint(0, V, (N,), generator=g).to(CUDA)
    up = torch.randn(N, generator=g).to(CUDA)

    def ce(xc: torch.Tensor, lin: nn.Module, yc: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(lin(xc).float(), yc, reduction="none")

    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = chunked_linear_loss(x, head, y, ce, chunk_size=rows, reduction="none")
    (out * up).sum().backward()
    want = [torch.zeros(N, d, dtype=torch.float64, device=CUDA),
            torch.zeros(V, d, dtype=torch.float64, device=CUDA),
            torch.zeros(V, dtype=torch.float64, device=CUDA)]
    for s in range(0, N, rows):
        xc = x.detach()[s : s + rows].clone().requires_grad_()
        w, b = (t.detach().clone().requires_grad_() for t in (head.weight, head.bias))
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = F.linear(xc, w, b)  # (rows, V) bf16
            losses = F.cross_entropy(logits.float(), y[s : s + rows], reduction="none")
        gx, gw, gl = torch.autograd.grad(losses, [xc, w, logits], up[s : s + rows])
        want[0][s : s + rows] = gx.double()
        want[1] += gw.double()
        want[2] += gl.double().sum(0)  # the bias rows, summed in float32 by the head
    got = [x.grad, head.weight.grad, head.bias.grad]
    for have, ref, name in zip(got, want, ["x", "weight", "bias"]):
        assert have is not None and have.dtype == torch.float32, name
        torch.testing.assert_close(have.double(), ref, rtol=1e-5, atol=1e-6, msg=name)
    seen: list[int] = []

    def spy(xc: torch.Tensor, lin: nn.Module, yc: torch.Tensor) -> torch.Tensor:
        seen.append(xc.shape[0])
        return ce(xc, lin, yc)

    wide = nn.Linear(d, 16384).to(CUDA)  # the 16 MiB budget alone: 256 rows a chunk
    big = torch.randn(2 * GPU_MIN_ROWS + 5, d, device=CUDA)
    with torch.no_grad():
        chunked_linear_loss(big, wide, torch.zeros(big.shape[0], dtype=torch.long,
                                                   device=CUDA), spy, reduction="none")
    assert seen == [GPU_MIN_ROWS, GPU_MIN_ROWS, 5]


# --- the suite's CPU mode -----------------------------------------------------------------


def test_gpu_offline_script_parses_and_says_how_to_use_it() -> None:
    """``gpu_offline.sh`` (the suite in a lease without a package index) stays valid bash and
    answers a wrong mode with its usage."""
    import subprocess

    script = SUITE.parent / "gpu_offline.sh"
    assert subprocess.run(["bash", "-n", str(script)], check=False).returncode == 0
    done = subprocess.run(["bash", str(script), "nonsense"], capture_output=True, text=True,
                          check=False)
    assert done.returncode == 2 and "usage" in done.stdout


def test_gpu_suite_cpu_mode_runs(tmp_path: Path) -> None:
    """``gpu_suite.py --cpu`` (tiny shapes, three forms, no pytest run) prints every table,
    the profile's and the floor's too (every Linear call of the tiny GPT, 2 layers of 6 and
    its head; the Llama's 2 of 7, its chunked head left out)."""
    spec = importlib.util.spec_from_file_location("gpu_suite", SUITE)
    assert spec is not None and spec.loader is not None
    suite = importlib.util.module_from_spec(spec)
    out = tmp_path / "results.md"
    sys.modules["gpu_suite"] = suite  # its dataclasses look their module up
    try:
        spec.loader.exec_module(suite)
        suite.main(["--cpu", "--no-tests", "--forms", "full,projection,norm", "--out", str(out),
                    "--workdir", str(tmp_path)])
    finally:
        del sys.modules["gpu_suite"]
    text = out.read_text()
    for title in ("## Compute: GPT", "## Compute: Llama", "## Writer", "## Chunked head",
                  "## The device's floor", "| GPT tiny | 13 |", "| Llama tiny | 14 |",
                  "## Where the time goes: GPT tiny, norm", "## Where the time goes: Llama tiny, "
                  "projection"):
        assert title in text, text
    assert "| `aten::" in text, text  # the profile tables hold operations
    assert "error" not in text.lower(), text


def _load_benchmark(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, SUITE.parent / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # (dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def test_gpu_idle_charges_each_idle_gap_to_the_stage_that_ended_it() -> None:
    """``gpu_idle.Analysis`` on a hand-made trace: two kernels launched inside an ``encode``
    mark on the main thread, one from the autograd thread outside any mark; the gaps before
    them, the busy time (overlapping kernels counted once) and a blocking copy by stage."""
    idle = _load_benchmark("gpu_idle")

    def span(cat: str, name: str, ts: float, dur: float, tid: int = 1,
             corr: int | None = None) -> dict[str, Any]:
        e = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid}
        if corr is not None:
            e["args"] = {"correlation": corr}
        return e

    events = [
        span("user_annotation", "outer", 0, 100),
        span("user_annotation", "encode", 10, 30),
        span("cuda_runtime", "cudaLaunchKernel", 5, 1, corr=1),  # outer
        span("cuda_runtime", "cudaLaunchKernel", 20, 1, corr=2),  # encode
        span("cuda_runtime", "cudaLaunchKernel", 50, 1, tid=2, corr=3),  # no mark there
        span("cuda_runtime", "cudaMemcpy", 30, 8, corr=9),  # a blocking copy in encode
        span("kernel", "k1", 6, 10, tid=7, corr=1),  # busy 6-16
        span("kernel", "k2", 22, 4, tid=7, corr=2),  # gap 16-22 (6) -> encode; busy 22-26
        span("kernel", "k2b", 24, 4, tid=8, corr=2),  # overlaps: busy to 28
        span("kernel", "k3", 60, 10, tid=7, corr=3),  # gap 28-60 (32) -> no stage
    ]
    found = idle.Analysis(events, 2, ["outer", "encode"])  # 2 steps: halves
    assert found.idle == {"encode": 3.0e-3, idle.OTHER: 16.0e-3}
    assert found.busy == pytest.approx((10 + 6 + 10) / 2e3)
    assert found.gaps == 2 and found.span == pytest.approx(64 / 2e3)
    assert found.host["encode"] == pytest.approx(30 / 2e3)
    assert dict(found.waits) == {("encode", "cudaMemcpy"): [pytest.approx(8 / 2e3), 0.5]}


def test_gpu_idle_cpu_mode_runs(tmp_path: Path) -> None:
    """``gpu_idle.py --cpu`` (tiny shapes, no kernels: the host columns) prints its tables."""
    sys.modules.pop("gpu_suite", None)
    idle = _load_benchmark("gpu_idle")
    out = tmp_path / "idle.md"
    try:
        idle.main(["--cpu", "--reps", "1", "--block", "1", "--shapes", "gpt", "--modes", "sum",
                   "--out", str(out), "--workdir", str(tmp_path)])
    finally:
        sys.modules.pop("gpu_idle", None)
        sys.modules.pop("gpu_suite", None)
    text = out.read_text()
    for title in ("### GPT tiny: `norm` in both modes", "| sum |", "| autograd |",
                  "### GPT tiny: `norm`, batch_grad='sum'", "| encoding: forms and exact norms |"):
        assert title in text, text
