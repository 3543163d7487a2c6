"""Distributed recording (torch.distributed, DDP): two gloo ranks on CPU, spawned here as
processes (tests/ddp_worker.py), record what one process records on the same global batch."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import gradlog
from gradlog.distributed import detect
from gradlog.store.verify import verify

WORKER = Path(__file__).with_name("ddp_worker.py")
sys.path.insert(0, str(WORKER.parent))
# the workers import this checkout's gradlog, installed or not
_ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(
    [str(WORKER.parent.parent), *filter(None, [os.environ.get("PYTHONPATH")])])}
from ddp_worker import micro_batches, model_and_data  # noqa: E402

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available(), reason="torch.distributed is not available"
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_ranks(store: Path, steps: int, *extra: str, world: int = 2,
               logs: list[str] | None = None) -> list[int]:
    """Run every rank's process; returns their exit codes (logs shown on failure)."""
    port = _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(r), str(world), str(port), str(store), str(steps),
             *extra],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=_ENV,
        )
        for r in range(world)
    ]
    codes = []
    for r, p in enumerate(procs):
        try:
            out, _ = p.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
        codes.append(p.returncode)
        if logs is not None:
            logs.append(out.decode(errors="replace"))
        print(f"--- rank {r} (exit {p.returncode})\n{out.decode(errors='replace')[-3000:]}")
    return codes


def _single_process(path: Path, steps: int, rows: bool = False) -> gradlog.Run:
    """The oracle: one process, the whole global batch, plain SGD."""
    model, data = model_and_data(steps, rows=rows)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradlog.GradRecorder(model, path, check_every=1) as rec:
        for step, batch in enumerate(data):
            opt.zero_grad()
            for x, y, ids in micro_batches(step, *batch):
                losses = nn.functional.cross_entropy(model(x), y, reduction="none")
                rec.backward(losses, datum_ids=ids, step=step)
            opt.step()
    return gradlog.open(path)


def _assert_same_records(got: gradlog.Run, want: gradlog.Run) -> None:
    assert got.param_names == want.param_names  # no "module." prefix from DDP
    assert got.steps.column("step").to_pylist() == want.steps.column("step").to_pylist()
    for column in ("n_records", "tokens"):
        assert got.steps.column(column).to_pylist() == want.steps.column(column).to_pylist()
    np.testing.assert_allclose(
        np.asarray(got.steps.column("loss_mean")), np.asarray(want.steps.column("loss_mean")),
        rtol=1e-6,
    )
    for step in want.steps.column("step").to_pylist():
        a = got.records(step=step).sort_by("datum_id")
        b = want.records(step=step).sort_by("datum_id")
        assert a.column("datum_id").to_pylist() == b.column("datum_id").to_pylist()
        np.testing.assert_allclose(np.asarray(a.column("weight")), np.asarray(b.column("weight")),
                                   rtol=1e-12)
        np.testing.assert_allclose(np.asarray(a.column("loss")), np.asarray(b.column("loss")),
                                   rtol=1e-5)
        ids = a.column("datum_id").to_pylist()
        for name in want.param_names:
            column = f"norm/{name}"
            np.testing.assert_allclose(np.asarray(a.column(column)), np.asarray(b.column(column)),
                                       rtol=1e-5, atol=1e-7)
            order_a = np.argsort(np.asarray(got.records(step=step).column("datum_id")))
            order_b = np.argsort(np.asarray(want.records(step=step).column("datum_id")))
            ga = got.grads(name, step=step)[order_a]
            gb = want.grads(name, step=step)[order_b]
            np.testing.assert_allclose(ga, gb, rtol=1e-5, atol=1e-6, err_msg=f"{name} {ids}")
        # sum_b w_b g_b over both ranks' records is the full-batch gradient
        for name in want.param_names:
            w = np.asarray(a.column("weight"))
            total_a = np.tensordot(w, got.grads(name, step=step)[order_a], axes=1)
            total_b = np.tensordot(w, want.grads(name, step=step)[order_b], axes=1)
            np.testing.assert_allclose(total_a, total_b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("batch_grad", ["autograd", "sum"])
def test_two_ranks_record_what_one_process_records(tmp_path: Path, batch_grad: str) -> None:
    """With batch_grad="sum" the weight gradients reach DDP's all-reduce through autograd's
    accumulation as usual: the self-check (every step) compares the ranks' summed shares
    with the all-reduced p.grad."""
    store = tmp_path / "ddp.gradlog"
    assert _run_ranks(store, 3, "-", batch_grad) == [0, 0]
    report = verify(store)
    assert report.ok, [c.problems for c in report.checks]
    run = gradlog.open(store)
    assert run.attrs["backend"]["batch_grad"] == batch_grad
    assert run.attrs["backend"]["distributed"] == {"world_size": 2, "torch_backend": "gloo",
                                                "strategy": "ddp"}
    # each rank's call is one micro-batch of the step: rank r's m-th call is m * 2 + r;
    # step 1 accumulates two calls per rank (the first under DDP.no_sync())
    assert run.steps.column("n_micro").to_pylist() == [2, 4, 2]
    assert sorted(set(run.records(step=1).column("micro").to_pylist())) == [0, 1, 2, 3]
    _assert_same_records(run, _single_process(tmp_path / "one.gradlog", 3))


def test_flattened_rows_under_ddp_record_what_one_process_records(tmp_path: Path) -> None:
    """A Linear on the tokens flattened to (B*T, d) (OPT) is trusted once a datum check
    passed on its layout; under DDP no datum check ran, so it was refused. The check's own
    autograd.grad does not run DDP's reducer hooks: now it runs, and the records and
    p.grad are as one process's."""
    store = tmp_path / "ddp.gradlog"
    assert _run_ranks(store, 3, "-", "rows") == [0, 0]
    _assert_same_records(gradlog.open(store),
                         _single_process(tmp_path / "one.gradlog", 3, rows=True))


@pytest.mark.slow
def test_rank_crash_keeps_earlier_steps_and_resumes(tmp_path: Path) -> None:
    store = tmp_path / "ddp.gradlog"
    codes = _run_ranks(store, 4, "2")  # rank 1 dies inside step 2
    assert codes[1] == 3 and codes[0] != 0
    run = gradlog.open(store)
    assert run.steps.column("step").to_pylist() == [0, 1]  # step 2 was never committed
    assert verify(store).ok
    assert _run_ranks(store, 4, "-", "resume") == [0, 0]
    report = verify(store)
    assert report.ok, [c.problems for c in report.checks]
    _assert_same_records(gradlog.open(store), _single_process(tmp_path / "one.gradlog", 4))


def test_one_rank_process_group_records_like_one_process(tmp_path: Path) -> None:
    """distributed=True in a one-rank gloo group (in this process): the collectives, the row
    plan and counter-numbered ids run, and the store equals a plain recording."""
    import torch.distributed as dist

    from gradlog.errors import InputError

    store = tmp_path / "store"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0,
                            world_size=1)
    try:
        # compact forms: one plan through the collectives (world 1 here; two ranks in
        # tests/test_fsdp.py), the plan one process makes
        auto = {"form": {"0.weight": "topk", "*": "auto"}, "form_budget": 700}  # mixed
        for name, distributed, forms in (("ddp", True, {}), ("plain", False, {}),
                                         ("ddp-auto", True, auto), ("plain-auto", False, auto)):
            model, data = model_and_data(2)
            wrapped = nn.parallel.DistributedDataParallel(model) if distributed else model
            with gradlog.GradRecorder(wrapped, store / name, distributed=distributed,
                                      check_every=1, **forms) as rec:
                for x, y, _ in data:
                    rec.backward(nn.functional.cross_entropy(wrapped(x), y, reduction="none"))
        # vmap sets p.grad past DDP's averaging (the ranks trained apart); loop's
        # autograd.grad under FSDP2 missed the sharded parameters (every record was 0)
        try:
            from torch.distributed.fsdp import fully_shard
        except ImportError:  # torch < 2.6
            from torch.distributed._composable.fsdp import fully_shard

        from gradlog.errors import ConfigError

        sharded = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
        fully_shard(sharded)
        ddp = nn.parallel.DistributedDataParallel(nn.Linear(3, 2))
        for model, backend, wrapper in ((ddp, "vmap", "DistributedDataParallel"),
                                        (sharded, "vmap", "FSDP2"), (sharded, "loop", "FSDP2")):
            with pytest.raises(ConfigError, match=rf"backend='{backend}'.*under {wrapper}"):
                gradlog.GradRecorder(model, store / "refused", backend=backend).open()
        assert not (store / "refused").exists()
        # FSDP1 flattens parameters: refused by name, with the fix (FSDP1 refuses to be
        # built on CPU, so an uninitialised instance stands in for one inside a model)
        class StandIn(torch.distributed.fsdp.FullyShardedDataParallel):
            __init__ = nn.Module.__init__  # type: ignore[assignment]
            __getattr__ = nn.Module.__getattr__  # type: ignore[assignment]

        with pytest.raises(InputError, match=r"FSDP1.*fully_shard"):
            detect(nn.Sequential(nn.Linear(2, 1), StandIn()), None)
    finally:
        dist.destroy_process_group()
    got, want = gradlog.open(store / "ddp"), gradlog.open(store / "plain")
    assert got.attrs["backend"]["distributed"] == {"world_size": 1, "torch_backend": "gloo",
                                                "strategy": "ddp"}
    assert got.datums.equals(want.datums)  # counter ids, rows, weights, norms
    for name in want.param_names:
        np.testing.assert_array_equal(got.grads(name), want.grads(name))
    got, want = gradlog.open(store / "ddp-auto"), gradlog.open(store / "plain-auto")
    assert got.attrs["params"] == want.attrs["params"]  # the same plan
    assert len(set(want.params.column("form").to_pylist())) > 1  # a mixed plan
    assert got.datums.equals(want.datums)
    for name, form in zip(want.param_names, want.params.column("form").to_pylist()):
        if form not in ("norm", "projection"):
            np.testing.assert_array_equal(got.grads(name), want.grads(name))


def test_distributed_true_needs_a_process_group() -> None:
    from gradlog.errors import InputError

    with pytest.raises(InputError, match="init_process_group"):
        gradlog.GradRecorder(nn.Linear(2, 1), "unused.gradlog", distributed=True).open()


@pytest.mark.slow
def test_a_rank_that_cannot_join_fails_every_rank(tmp_path: Path) -> None:
    logs: list[str] = []
    codes = _run_ranks(tmp_path / "ddp.gradlog", 2, "-", "mismatch", logs=logs)
    assert codes[0] != 0 and codes[1] != 0  # nobody waits for the other
    assert "another rank could not join the store" in logs[0]
    assert "StoreResumeError" in logs[1] and "config_hash" in logs[1]


def test_where_the_datum_check_runs_under_torch_distributed() -> None:
    """Everywhere in one process; in a process group only for DDP without static_graph
    (whose first backward would have the check's autograd.grad run its all-reduce; FSDP
    and a bare model per rank are not checked)."""
    import torch.distributed as dist

    from gradlog.backends.hooks.datum_check import datum_check_possible

    model = nn.Linear(3, 2)
    assert datum_check_possible(model)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0,
                            world_size=1)
    try:
        assert datum_check_possible(nn.parallel.DistributedDataParallel(model))
        assert not datum_check_possible(
            nn.parallel.DistributedDataParallel(nn.Linear(3, 2), static_graph=True))
        assert not datum_check_possible(model)
    finally:
        dist.destroy_process_group()
