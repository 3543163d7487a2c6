"""The transformers Trainer callback records the loop oracle's per-datum gradients.

A tiny randomly initialised GPT-2 (2 layers, width 32, float64, no download, token ids built
directly) is trained by a ``GradlogTrainer`` with shuffling and gradient accumulation. The
parameters at the start of each optimizer step are kept by a test callback; the oracle
(gradlog.testing.oracle) then runs each recorded datum alone through a copy of the model at
those parameters, with its own next-token loss written out here. GPT-2 exercises
transformers' ``Conv1D``, tied embeddings and broadcast position ids. Tolerance: float64,
rtol 1e-9 (hooks and the oracle sum in different orders; observed ~1e-13).
"""

from __future__ import annotations

import copy
import logging
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import gradlog
from gradlog.errors import InputError
from gradlog.store.verify import verify
from gradlog.testing.oracle import naive_per_datum_grads

transformers = pytest.importorskip("transformers", reason="needs the hf extra (transformers)")
pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate")

from gradlog.integrations.transformers import (  # noqa: E402
    GradlogCallback,
    GradlogTrainer,
    IndexedDataset,
)

N_DATA, T, VOCAB = 12, 10, 40


@pytest.fixture(autouse=True)
def _quiet() -> None:
    transformers.logging.set_verbosity_error()
    logging.getLogger("accelerate").setLevel(logging.ERROR)


def _model(seed: int = 0) -> Any:
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=16,
        n_embd=32,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(config).double()


def _data(ragged: bool) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (N_DATA, T), generator=gen)
    items = []
    for i in range(N_DATA):
        labels = ids[i].clone()
        if ragged:  # a prompt without loss of 0..4 tokens, and one datum without any loss
            labels[: i % 5] = -100
            if i == 7:
                labels[:] = -100
        else:  # the first token is never a target; the Trainer's token count would include it
            labels[0] = -100
        items.append({"input_ids": ids[i], "labels": labels})
    return items


class _Snapshots(transformers.TrainerCallback):  # type: ignore[misc]
    """Parameters at the start of every optimizer step."""

    def __init__(self) -> None:
        self.at: dict[int, dict[str, torch.Tensor]] = {}

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        model = kwargs["model"]
        self.at[state.global_step] = {k: v.detach().clone() for k, v in model.state_dict().items()}


def _args(out: Path, **overrides: Any) -> Any:
    options: dict[str, Any] = dict(
        output_dir=str(out),
        per_device_train_batch_size=3,
        gradient_accumulation_steps=2,
        max_steps=3,
        learning_rate=0.05,
        lr_scheduler_type="linear",
        optim="sgd",
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        logging_strategy="no",
        seed=0,
        data_seed=0,
        disable_tqdm=True,
        remove_unused_columns=True,
    )
    options.update(overrides)
    return transformers.TrainingArguments(**options)


def _oracle_loss(model: Any, item: dict[str, torch.Tensor]) -> torch.Tensor:
    """Datum's own loss: mean next-token cross-entropy over its labelled tokens (0 if none)."""
    logits = model(input_ids=item["input_ids"][None]).logits[0]  # (T, V)
    targets = item["labels"][1:]  # (T-1,)
    keep = targets != -100
    per_token = F.cross_entropy(logits[:-1], targets.clamp_min(0), reduction="none")
    return (per_token * keep).sum() / keep.sum().clamp_min(1)


def _check_against_oracle(run: gradlog.Run, snaps: dict[int, Any], data: list[Any]) -> None:
    model = _model()
    for step in run.steps.column("step").to_pylist():
        model.load_state_dict(snaps[step])
        ids = run.records(step=step).column("datum_id").to_pylist()
        params = dict(model.named_parameters())
        expected = naive_per_datum_grads(
            lambda b, ids=ids: _oracle_loss(model, data[ids[b]]), params, len(ids)
        )
        for name in run.param_names:
            np.testing.assert_allclose(
                run.grads(name, step=step, dtype=np.float64),
                expected[name].numpy(),
                rtol=1e-9,
                atol=1e-13,
                err_msg=f"{name} at step {step}",
            )


@pytest.mark.parametrize(
    "checkpointing",
    [
        None,
        pytest.param({"use_reentrant": True}, marks=pytest.mark.slow),
        pytest.param({"use_reentrant": False}, marks=pytest.mark.slow),
    ],
)
def test_trainer_records_the_oracle_gradients(
    tmp_path: Path, checkpointing: dict[str, bool] | None
) -> None:
    """Also with the Trainer's gradient checkpointing (reentrant or not)."""
    data = _data(ragged=True)
    snaps = _Snapshots()
    model = _model()
    if checkpointing is not None:  # renamed in transformers 5 (the old name warns)
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=checkpointing)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing)
    trainer = GradlogTrainer(
        model=model,
        args=_args(tmp_path / "out"),
        train_dataset=IndexedDataset(data),
        callbacks=[GradlogCallback(tmp_path / "run.gradlog", dtype="float64"), snaps],
    )
    trainer.train()
    run = gradlog.open(tmp_path / "run.gradlog")
    assert run.steps.column("step").to_pylist() == [0, 1, 2]
    assert run.steps.column("n_micro").to_pylist() == [2, 2, 2]
    assert "transformer.wte.weight" in run.param_names  # tied with lm_head: recorded once
    ids = run.datums.column("datum_id").to_pylist()
    assert sorted(ids) != ids and len(set(ids)) == N_DATA  # shuffled, each datum once per epoch
    lrs = run.steps.column("lr").to_pylist()
    assert lrs[0] == pytest.approx(0.05) and lrs[0] > lrs[1] > lrs[2]  # the scheduler's rates
    _check_against_oracle(run, snaps.at, data)
    # weights: 1/(k B) over the k = 2 accumulated micro-batches of B = 3
    weights, steps = run.datums.column("weight").to_numpy(), run.datums.column("step").to_numpy()
    for step in set(steps.tolist()):
        assert weights[steps == step].sum() == pytest.approx(1.0)
    assert verify(tmp_path / "run.gradlog").ok


@pytest.mark.slow
def test_training_is_the_plain_trainers(tmp_path: Path) -> None:
    """With every target token labelled, gradlog's batch loss is the model's own token mean:
    the recorded run ends at the parameters of a plain Trainer run (within the float32
    rounding of the model's own loss)."""
    data = _data(ragged=False)
    plain = _model()
    transformers.Trainer(model=plain, args=_args(tmp_path / "a"), train_dataset=data).train()
    recorded = _model()
    GradlogTrainer(
        model=recorded,
        args=_args(tmp_path / "b"),
        train_dataset=IndexedDataset(data),
        callbacks=[GradlogCallback(tmp_path / "run.gradlog", dtype="float64")],
    ).train()
    for (name, a), b in zip(plain.named_parameters(), recorded.parameters()):
        # the model's own loss upcasts logits with .float(): float32 even for a float64 model
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-8, msg=lambda m, n=name: f"{n}: {m}")
    assert not torch.equal(
        plain.transformer.h[0].attn.c_attn.weight, _model().transformer.h[0].attn.c_attn.weight
    )  # it trained


def test_resume_from_checkpoint_continues_the_store(tmp_path: Path) -> None:
    """Interrupted after step 1 (checkpoint at step 2) and resumed: the store equals an
    uninterrupted run's, steps recorded after the checkpoint are not recorded twice."""
    data = _data(ragged=True)
    whole = tmp_path / "whole.gradlog"
    GradlogTrainer(
        model=_model(),
        args=_args(tmp_path / "w", max_steps=4),
        train_dataset=IndexedDataset(data),
        callbacks=[GradlogCallback(whole, dtype="float64")],
    ).train()
    parts = tmp_path / "parts.gradlog"
    first = _args(tmp_path / "p", max_steps=4, save_strategy="steps", save_steps=2)
    trainer = GradlogTrainer(
        model=_model(),
        args=first,
        train_dataset=IndexedDataset(data),
        callbacks=[GradlogCallback(parts, dtype="float64"), _StopAfter(3)],
    )
    trainer.train()  # steps 0, 1, 2 recorded; checkpoint-2 saved after step 1
    assert gradlog.open(parts).steps.column("step").to_pylist() == [0, 1, 2]
    GradlogTrainer(
        model=_model(),
        args=first,
        train_dataset=IndexedDataset(data),
        callbacks=[GradlogCallback(parts, dtype="float64")],
    ).train(resume_from_checkpoint=str(tmp_path / "p" / "checkpoint-2"))
    a, b = gradlog.open(whole), gradlog.open(parts)
    assert b.steps.column("step").to_pylist() == [0, 1, 2, 3]
    assert a.datums.column("datum_id").to_pylist() == b.datums.column("datum_id").to_pylist()
    for name in a.param_names:
        np.testing.assert_array_equal(b.grads(name), a.grads(name))  # same parameters


class _StopAfter(transformers.TrainerCallback):  # type: ignore[misc]
    def __init__(self, steps: int) -> None:
        self.steps = steps

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if state.global_step >= self.steps:
            control.should_training_stop = True
        return control


def test_missing_datum_ids_are_refused(tmp_path: Path) -> None:
    trainer = GradlogTrainer(
        model=_model(),
        args=_args(tmp_path / "out"),
        train_dataset=_data(ragged=False),
        callbacks=[GradlogCallback(tmp_path / "run.gradlog", dtype="float64")],
    )
    with pytest.raises(InputError, match="IndexedDataset"):
        trainer.train()
    without = GradlogTrainer(
        model=_model(), args=_args(tmp_path / "out2"), train_dataset=IndexedDataset(_data(False))
    )
    with pytest.raises(InputError, match="GradlogCallback"):
        without.train()
    copy.deepcopy(_args(tmp_path))  # the arguments stay plain data


def test_readme_example(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's transformers example runs as written and records what it says."""
    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    match = re.search(r"\*\*transformers\*\*.*?```python\n(.*?)```", text, re.S)
    assert match, "README lost its transformers example"
    monkeypatch.chdir(tmp_path)
    exec(compile(match.group(1), "README.md", "exec"), {})
    run = gradlog.open(tmp_path / "runs" / "gpt2.gradlog")
    assert run.steps.num_rows == 4 and run.datums.num_rows == 32
    assert all(name.startswith("transformer.h.1.") for name in run.param_names)


def test_a_plain_trainer_with_the_callback_is_refused(tmp_path: Path) -> None:
    trainer = transformers.Trainer(
        model=_model(),
        args=_args(tmp_path / "out"),
        train_dataset=_data(ragged=False),
        callbacks=[GradlogCallback(tmp_path / "run.gradlog")],
    )
    with pytest.raises(InputError, match="GradlogTrainer"):
        trainer.train()


# -- several processes (torchrun / accelerate launch: DDP) ------------------------------------

HF_WORKER = Path(__file__).with_name("hf_worker.py")


def _launch(store: Path, out: Path, *args: str) -> list[int]:
    """Two processes as ``torchrun --nproc-per-node 2`` starts them (gloo on CPU); their exit
    codes (logs printed, shown on failure)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = str(HF_WORKER.parent.parent)  # this checkout's gradlog, installed or not
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "PYTHONPATH": os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])}
        procs.append(subprocess.Popen(
            [sys.executable, str(HF_WORKER), str(store), str(out), *args],
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
    """Every rank's records equal the oracle's per-datum gradients at the parameters each
    step began with; the weights are 1/(ranks x accumulated micro-batches x B)."""
    from hf_worker import N_DATA as N
    from hf_worker import make_data, make_model

    assert verify(store).ok
    run = gradlog.open(store)
    assert run.attrs["backend"]["distributed"]["world_size"] == 2
    assert run.steps.column("step").to_pylist() == list(range(steps))
    assert run.steps.column("n_micro").to_pylist() == [4] * steps  # 2 ranks x 2 accumulated
    for step in range(steps):
        ids = run.records(step=step).column("datum_id").to_pylist()
        assert sorted(ids) == list(range(N))  # each rank its own half of the epoch
    np.testing.assert_allclose(run.datums.column("weight").to_numpy(), 1 / 12, rtol=1e-12)
    snaps = {}
    for step in range(steps):
        with np.load(out / f"params-{step}.npz") as f:
            snaps[step] = {k.replace("/", "."): torch.from_numpy(f[k]) for k in f.files}
    assert not torch.equal(snaps[0]["transformer.h.0.attn.c_attn.weight"],
                           snaps[steps - 1]["transformer.h.0.attn.c_attn.weight"])  # it trained
    model = make_model()
    data = make_data()
    for step in range(steps):
        model.load_state_dict(snaps[step])
        ids = run.records(step=step).column("datum_id").to_pylist()
        expected = naive_per_datum_grads(
            lambda b, ids=ids: _oracle_loss(model, data[ids[b]]), dict(model.named_parameters()),
            len(ids),
        )
        for name in run.param_names:
            np.testing.assert_allclose(run.grads(name, step=step, dtype=np.float64),
                                       expected[name].numpy(), rtol=1e-9, atol=1e-12,
                                       err_msg=f"{name} at step {step}")


@pytest.mark.slow  # ~30 s: two processes importing transformers
def test_trainer_on_two_processes_records_every_rank(tmp_path: Path) -> None:
    """DDP through the Trainer (accelerate), gradient accumulation 2: one store, every
    rank's records, each the oracle's gradient (the self-check runs at every step)."""
    sys.path.insert(0, str(HF_WORKER.parent))
    store, out = tmp_path / "run.gradlog", tmp_path / "out"
    assert _launch(store, out, "2") == [0, 0]
    _check_ranks_run(store, out, 2)


@pytest.mark.slow
def test_trainer_on_two_processes_resumes(tmp_path: Path) -> None:
    """Stopped after step 2 (checkpoint-2), resumed from it by a new launch: the store holds
    every step once."""
    sys.path.insert(0, str(HF_WORKER.parent))
    store, out = tmp_path / "run.gradlog", tmp_path / "out"
    assert _launch(store, out, "4", "2") == [0, 0]
    assert gradlog.open(store).steps.column("step").to_pylist() == [0, 1]
    assert _launch(store, out, "4", "-", "resume") == [0, 0]
    _check_ranks_run(store, out, 4)
