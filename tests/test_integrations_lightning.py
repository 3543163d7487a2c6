"""The Lightning callback records the loop oracle's per-datum gradients.

A small float64 LightningModule (MLP classifier, shuffled data, ``accumulate_grad_batches=2``,
a decaying learning rate) is trained by Lightning's own loop; a test callback keeps the
parameters at the start of every optimizer step, and the oracle (gradlog.testing.oracle) runs
each recorded datum alone at those parameters. Tolerance: float64, rtol 1e-10.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradlog
from gradlog.errors import InputError, NonFiniteLossError
from gradlog.store.verify import verify
from gradlog.testing.oracle import naive_per_datum_grads

L = pytest.importorskip("lightning.pytorch", reason="needs the lightning extra (lightning)")

from gradlog.integrations.lightning import GradlogCallback, recorded_loss  # noqa: E402

N_DATA, D_IN, N_CLASSES = 24, 5, 3


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    """Lightning's advice (few dataloader workers, no logger) is not what is tested."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module="lightning")
        warnings.filterwarnings("ignore", message=".*num_workers.*")
        yield


def _data() -> torch.utils.data.TensorDataset:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(N_DATA, D_IN, generator=gen, dtype=torch.float64)
    y = torch.randint(0, N_CLASSES, (N_DATA,), generator=gen)
    return torch.utils.data.TensorDataset(x, y, torch.arange(N_DATA))


class Classifier(L.LightningModule):  # type: ignore[misc]
    def __init__(self, record: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(D_IN, 8), nn.Tanh(), nn.Linear(8, N_CLASSES)).double()
        self.record = record

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)  # type: ignore[no-any-return]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, idx = batch
        losses = F.cross_entropy(self(x), y, reduction="none")  # (B,)
        if not self.record:
            return losses.mean()
        return recorded_loss(self, losses, datum_ids=idx)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.3)
        decay = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return [opt], [{"scheduler": decay, "interval": "step"}]

    def train_dataloader(self) -> Any:
        gen = torch.Generator().manual_seed(2)
        return torch.utils.data.DataLoader(_data(), batch_size=4, shuffle=True, generator=gen)


class _Snapshots(L.Callback):  # type: ignore[misc]
    def __init__(self) -> None:
        self.at: dict[int, dict[str, torch.Tensor]] = {}

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, idx: int) -> None:
        if trainer.global_step not in self.at:
            self.at[trainer.global_step] = {
                k: v.detach().clone() for k, v in module.state_dict().items()
            }


def _trainer(tmp_path: Path, callbacks: list[Any], **options: Any) -> Any:
    settings: dict[str, Any] = dict(
        accelerator="cpu",
        devices=1,
        max_steps=4,
        accumulate_grad_batches=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
    )
    settings.update(options)
    return L.Trainer(callbacks=callbacks, **settings)


def test_lightning_records_the_oracle_gradients(tmp_path: Path) -> None:
    snaps = _Snapshots()
    module = Classifier()
    store = tmp_path / "run.gradlog"
    _trainer(tmp_path, [GradlogCallback(store, dtype="float64"), snaps]).fit(module)
    run = gradlog.open(store)
    assert run.steps.column("step").to_pylist() == [0, 1, 2, 3]
    assert run.steps.column("n_micro").to_pylist() == [2, 2, 2, 2]
    assert run.steps.column("lr").to_pylist() == pytest.approx([0.3, 0.15, 0.075, 0.0375])
    ids = run.datums.column("datum_id").to_pylist()
    assert sorted(ids) != ids
    _check_against_oracle(run, snaps.at, range(4))
    # weights: 1/(k B) over the k accumulated micro-batches (the optimizer's gradient is the
    # mean over the step's records), not 1/B per micro-batch
    weights, steps = run.datums.column("weight").to_numpy(), run.datums.column("step").to_numpy()
    for step in range(4):
        assert weights[steps == step] == pytest.approx(np.full(8, 1 / 8))  # k 2, B 4


def _check_against_oracle(run: gradlog.Run, snaps: dict[int, Any], steps: Any) -> None:
    data = _data()
    oracle = Classifier()
    for step in steps:
        oracle.load_state_dict(snaps[step])
        rec_ids = run.records(step=step).column("datum_id").to_pylist()

        def loss(b: int, rec_ids: list[int] = rec_ids) -> torch.Tensor:
            x, y, _ = data[rec_ids[b]]
            return F.cross_entropy(oracle(x[None]), y[None])

        expected = naive_per_datum_grads(loss, dict(oracle.named_parameters()), len(rec_ids))
        for name in run.param_names:
            np.testing.assert_allclose(
                run.grads(name, step=step, dtype=np.float64),
                expected[name].numpy(),
                rtol=1e-10,
                atol=1e-14,
                err_msg=f"{name} at step {step}",
            )


class _DampenedMomentum(Classifier):
    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9, dampening=0.5)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_sgd_momentums_first_step_is_kept_as_first(tmp_path: Path, accumulate: int) -> None:
    """Without accumulation Lightning runs the step's backward inside ``step(closure)``,
    after the optimizer's pre-step hook: the first momentum step (undamped, ``count`` 1,
    which ``kind="optimizer"`` scores with the whole gradient) must still be seen."""
    store = tmp_path / "run.gradlog"
    _trainer(tmp_path, [GradlogCallback(store, dtype="float64")], max_steps=3,
             accumulate_grad_batches=accumulate).fit(_DampenedMomentum())
    from gradlog.store.optimizer import optimizer_steps, read_optimizer_step

    counts = [sorted({g["count"] for g in read_optimizer_step(store, s).meta["params"].values()})
              for s in optimizer_steps(store)]
    assert counts == [[1], [2], [3]]


class _SmallLossesFp16(L.LightningModule):  # type: ignore[misc]
    """Losses small enough that an fp16 backward needs its loss scale, and a trained
    tensor outside the module's parameters (a temperature given to the optimizer by hand)."""

    def __init__(self, record: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(D_IN, 32), nn.Tanh(), nn.Linear(32, N_CLASSES))
        self.temp = [torch.tensor(1.5, requires_grad=True)]  # not registered
        self.record = record

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, idx = batch
        losses = 1e-2 * F.cross_entropy(self.net(x.float()) * self.temp[0], y, reduction="none")
        return recorded_loss(self, losses, datum_ids=idx) if self.record else losses.mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD([*self.parameters(), *self.temp], lr=10.0)

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(_data(), batch_size=4)


class _Grads(L.Callback):  # type: ignore[misc]
    def __init__(self) -> None:
        self.seen: list[list[torch.Tensor]] = []

    def on_before_optimizer_step(self, trainer: Any, module: Any, optimizer: Any) -> None:
        self.seen.append([p.grad.clone() for p in [*module.parameters(), *module.temp]])


def test_fp16_loss_scale_and_tensors_outside_the_model_train_as_without(tmp_path: Path) -> None:
    """The recorded backward carries the trainer's whole scale (an fp16 GradScaler's, the
    accumulation's 1/k), as its own does: p.grad of every trained leaf is bitwise the one of
    the run without gradlog. (It ran unscaled, with p.grad rescaled around it: fp16
    gradients underflowed, and a tensor outside the model got k times its gradient.)"""
    from lightning.pytorch.plugins.precision import MixedPrecision

    def fit(record: bool, callbacks: list[Any]) -> _Grads:
        grads = _Grads()
        amp = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
        _trainer(tmp_path / str(record), [*callbacks, grads], max_steps=2,
                 plugins=[amp]).fit(_SmallLossesFp16(record))
        return grads

    recorded = fit(True, [GradlogCallback(tmp_path / "run.gradlog", params="net.*")])
    plain = fit(False, [])
    assert len(recorded.seen) == len(plain.seen) == 2
    for a, b in zip(recorded.seen, plain.seen):
        for x, y in zip(a, b):
            assert torch.equal(x, y)
    assert gradlog.open(tmp_path / "run.gradlog").steps.num_rows == 2


@pytest.mark.filterwarnings("ignore::gradlog.errors.NonFiniteGradientWarning")
def test_a_step_the_amp_scaler_skipped_is_named(tmp_path: Path) -> None:
    """A GradScaler starting far too high overflows and skips its first steps: their records
    hold non-finite gradients, and a warning names each step the scaler skipped."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    amp = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**40))
    store = tmp_path / "run.gradlog"
    with warnings.catch_warnings(record=True) as warned:  # (pytest.warns re-raises the rest)
        warnings.simplefilter("always")
        _trainer(tmp_path, [GradlogCallback(store)], max_steps=2, plugins=[amp]).fit(
            _SmallLossesFp16(True))
    skipped = {str(w.message).split("skipped step ")[1].split(" ")[0] for w in warned
               if "the AMP loss scaler skipped step" in str(w.message)}
    assert skipped == {"0", "1"}  # both steps overflowed (2**40 halves to 2**38 at most)
    assert gradlog.open(store).steps.num_rows == 2


def test_training_is_unchanged(tmp_path: Path) -> None:
    """Recording leaves Lightning's training as it was: the same final parameters."""
    plain = Classifier(record=False)
    _trainer(tmp_path / "a", []).fit(plain)
    recorded = Classifier()
    _trainer(tmp_path / "b", [GradlogCallback(tmp_path / "run.gradlog")]).fit(recorded)
    for (name, a), b in zip(plain.named_parameters(), recorded.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-15, msg=lambda m, n=name: f"{n}: {m}")


def test_resume_from_a_checkpoint(tmp_path: Path) -> None:
    """Stopped after step 2 with a checkpoint, resumed with ckpt_path: the store keeps steps
    0..2 and continues with the steps Lightning runs after the resume, each equal to the
    oracle at that step's parameters."""
    whole = tmp_path / "whole.gradlog"
    _trainer(tmp_path / "w", [GradlogCallback(whole, dtype="float64")]).fit(Classifier())
    parts = tmp_path / "parts.gradlog"
    first = _trainer(tmp_path / "p", [GradlogCallback(parts, dtype="float64")], max_steps=3)
    first.fit(Classifier())
    ckpt = tmp_path / "p.ckpt"
    first.save_checkpoint(ckpt)
    snaps = _Snapshots()
    second = _trainer(tmp_path / "p", [GradlogCallback(parts, dtype="float64"), snaps])
    second.fit(Classifier(), ckpt_path=str(ckpt))
    a, b = gradlog.open(whole), gradlog.open(parts)
    assert b.steps.column("step").to_pylist() == [0, 1, 2, 3]
    before = b.records(step=[0, 1, 2])
    assert before.column("datum_id").to_pylist() == (
        a.records(step=[0, 1, 2]).column("datum_id").to_pylist()
    )
    for name in a.param_names:
        np.testing.assert_array_equal(b.grads(name, step=[0, 1, 2]), a.grads(name, step=[0, 1, 2]))
    assert sorted(snaps.at) == [3]  # only the steps after the checkpoint ran again
    _check_against_oracle(b, snaps.at, [3])


def test_recorded_loss_needs_the_callback(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="GradlogCallback"):
        _trainer(tmp_path, []).fit(Classifier())


def test_readme_example(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's Lightning example runs as written and records what it says."""
    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    match = re.search(r"\*\*Lightning\*\*.*?```python\n(.*?)```", text, re.S)
    assert match, "README lost its Lightning example"
    monkeypatch.chdir(tmp_path)
    exec(compile(match.group(1), "README.md", "exec"), {})
    run = gradlog.open(tmp_path / "runs" / "pl.gradlog")
    assert run.steps.num_rows == 8 and run.datums.num_rows == 8 * 2 * 8
    assert sorted(set(run.datums.column("datum_id").to_pylist())) == list(range(64))


def test_a_module_without_recorded_loss_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="recorded_loss"):
        _trainer(tmp_path, [GradlogCallback(tmp_path / "run.gradlog")]).fit(
            Classifier(record=False)
        )


class _NanAtStep2(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, idx = batch
        losses = F.cross_entropy(self(x), y, reduction="none")
        if self.trainer.global_step == 2:
            losses = losses + float("nan")
        return recorded_loss(self, losses, datum_ids=idx)


def test_a_failing_step_leaves_the_committed_steps(tmp_path: Path) -> None:
    """A NaN loss is refused inside Lightning's backward; the error reaches the caller, the
    store keeps every complete step and verifies, and the model is left without hooks."""
    store = tmp_path / "run.gradlog"
    module = _NanAtStep2()
    with pytest.raises(NonFiniteLossError, match="NaN or infinite"):
        _trainer(tmp_path, [GradlogCallback(store)]).fit(module)
    run = gradlog.open(store)
    assert run.steps.column("step").to_pylist() == [0, 1]
    assert verify(store).ok
    assert all(not m._forward_hooks for m in module.modules())


# -- strategy="ddp": two processes, as torchrun starts them ------------------------------------

PL_WORKER = Path(__file__).with_name("lightning_worker.py")


def _launch(store: Path, out: Path, *args: str) -> list[int]:
    """Two processes with torchelastic's environment (Lightning then launches nothing); their
    exit codes (logs printed, shown on failure)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = str(PL_WORKER.parent.parent)  # this checkout's gradlog, installed or not
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0",
               "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "TORCHELASTIC_RUN_ID": "gradlog-test",
               "PYTHONPATH": os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])}
        procs.append(subprocess.Popen(
            [sys.executable, str(PL_WORKER), str(store), str(out), *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
        ))
    codes = []
    for rank, p in enumerate(procs):
        try:
            log, _ = p.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            p.kill()
            log, _ = p.communicate()
        codes.append(p.returncode)
        print(f"--- rank {rank} (exit {p.returncode})\n{log.decode(errors='replace')[-3000:]}")
    return codes


def _check_ranks_run(store: Path, out: Path, steps: int) -> None:
    """Both ranks' records in one store, each the oracle's gradient at its step's parameters,
    weighted 1/(ranks x accumulated micro-batches x B)."""
    sys.path.insert(0, str(PL_WORKER.parent))
    from lightning_worker import N_DATA as N
    from lightning_worker import make_data, make_net

    assert verify(store).ok
    run = gradlog.open(store)
    assert run.attrs["backend"]["distributed"] == {"world_size": 2, "torch_backend": "gloo",
                                                   "strategy": "ddp"}
    assert run.param_names == ["net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"]
    assert run.steps.column("step").to_pylist() == list(range(steps))
    assert run.steps.column("n_micro").to_pylist() == [4] * steps
    np.testing.assert_allclose(run.datums.column("weight").to_numpy(), 1 / 12, rtol=1e-12)
    data, net = make_data(), make_net()
    for step in range(steps):
        ids = run.records(step=step).column("datum_id").to_pylist()
        assert sorted(ids) == list(range(N))  # one epoch per step, split between the ranks
        with np.load(out / f"params-{step}.npz") as f:
            net.load_state_dict({k.replace("/", ".").removeprefix("net."): torch.from_numpy(f[k])
                                 for k in f.files})

        def loss(b: int, ids: list[int] = ids) -> torch.Tensor:
            x, y, _ = data[ids[b]]
            return F.cross_entropy(net(x[None]), y[None])

        expected = naive_per_datum_grads(loss, {f"net.{k}": v for k, v in net.named_parameters()},
                                         len(ids))
        for name in run.param_names:
            np.testing.assert_allclose(run.grads(name, step=step, dtype=np.float64),
                                       expected[name].numpy(), rtol=1e-10, atol=1e-14,
                                       err_msg=f"{name} at step {step}")


@pytest.mark.slow  # ~45 s: two processes importing Lightning
def test_ddp_strategy_on_two_processes_records_every_rank(tmp_path: Path) -> None:
    store, out = tmp_path / "run.gradlog", tmp_path / "out"
    assert _launch(store, out, "2") == [0, 0]
    _check_ranks_run(store, out, 2)


@pytest.mark.slow
def test_ddp_strategy_on_two_processes_resumes(tmp_path: Path) -> None:
    store, out = tmp_path / "run.gradlog", tmp_path / "out"
    assert _launch(store, out, "4", "2") == [0, 0]  # stopped after step 2 (checkpointed)
    assert gradlog.open(store).steps.column("step").to_pylist() == [0, 1]
    assert _launch(store, out, "4", "-", "resume") == [0, 0]
    _check_ranks_run(store, out, 4)
