"""Optimizer-aware influence (#19) against brute force, and the many-probes matrix.

The oracle trains a float64 MLP with the real torch optimizer and, at every step, takes each
datum's and each probe's gradient with its own ``torch.autograd.grad`` and a deep copy of the
optimizer's state after the step, and computes ``P_t`` from it as torch's Adam does. The
momentum's share of a step's gradient is simulated (a unit impulse pushed through the
optimizer's recurrence for 3,000 steps), not taken from gradlog's closed form. Scores:
``sum_t w lr_t c <P_t g_t(d), g_t(z)>`` (:mod:`gradlog.analysis.optimizer`).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradlog
from gradlog.errors import InputError, SelectionError

N_DATA, N_PROBES, STEPS, BATCH = 24, 3, 6, 6


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1], reduction="none")


def _grad(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, np.ndarray]:
    names = [n for n, _ in model.named_parameters()]
    loss = F.cross_entropy(model(x[None]), y[None])
    grads = torch.autograd.grad(loss, list(model.parameters()))
    return {n: g.detach().reshape(-1).numpy().copy() for n, g in zip(names, grads)}


def _impulse(opt: str, hyper: dict[str, Any], n: int, last: int) -> float:
    """What a unit gradient entering the momentum at optimizer step ``n`` adds to the
    updates through step ``last`` (before ``lr`` and the preconditioner), by running the
    recurrence; Adam's momentum without its bias correction (the one-step form's share)."""
    total, m = 0.0, 0.0
    for s in range(1, last + 1):
        g = 1.0 if s == n else 0.0
        if opt == "adam":
            b1 = hyper["betas"][0]
            m = b1 * m + (1 - b1) * g
            update = m
        else:
            mu, damp, nest = hyper["momentum"], hyper["dampening"], hyper["nesterov"]
            if mu == 0:
                update = g
            else:
                m = g if s == 1 else mu * m + (1 - damp) * g
                update = g + mu * m if nest else m
        if s >= n:
            total += update
    return total


def _train(
    path: Path, make_opt: Callable[[list[nn.Parameter]], torch.optim.Optimizer], *,
    warmup: int = 0, schedule: Callable[[int], float] | None = None, **options: Any
) -> tuple[dict[int, float], list[dict[str, Any]]]:
    """Record a run, after ``warmup`` optimizer steps taken before recording starts, the
    rate following ``schedule`` (a ``LambdaLR`` factor) if given; returns the oracle's
    scores per (probe, datum) and the steps seen."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(N_DATA, 5, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (N_DATA,), generator=gen)
    px = torch.randn(N_PROBES, 5, generator=gen, dtype=torch.float64)
    py = torch.randint(0, 3, (N_PROBES,), generator=gen)
    opt = make_opt(list(model.parameters()))
    kind = "adam" if isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)) else (
        "sgd" if isinstance(opt, torch.optim.SGD) else "other")
    for _ in range(warmup):  # the optimizer's state predates the recorder
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    seen: list[dict[str, Any]] = [{"warmup": warmup}] if warmup else []
    sched = None if schedule is None else torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    with gradlog.GradRecorder(model, path, optimizer=opt, probes=(_loss, (px, py)),
                              dtype="float64", backend="loop", overwrite=True,
                              **options) as rec:
        for _t in range(STEPS):
            idx = torch.randperm(N_DATA, generator=gen)[:BATCH]
            data = {int(i): _grad(model, x[i], y[i]) for i in idx}
            probes = [_grad(model, px[k], py[k]) for k in range(N_PROBES)]
            rec.backward(F.cross_entropy(model(x[idx]), y[idx], reduction="none"), datum_ids=idx)
            opt.step()
            opt.zero_grad()
            state = copy.deepcopy(opt.state_dict())  # (its lr: the rate this step used)
            seen.append({"data": data, "probes": probes, "state": state, "kind": kind})
            if sched is not None:
                sched.step()
    return (_oracle(model, seen) if kind != "other" else {}), [s for s in seen if "data" in s]


def _oracle(model: nn.Module, seen: list[dict[str, Any]]) -> dict[int, Any]:
    names = [n for n, _ in model.named_parameters()]
    scores: dict[int, Any] = {}
    warmup = seen.pop(0)["warmup"] if seen and "warmup" in seen[0] else 0
    for t, s in enumerate(seen):
        state = s["state"]
        for k, name in enumerate(names):
            group = next(g for g in state["param_groups"] if k in g["params"])
            per = state["state"].get(k, {})
            if s["kind"] == "adam":
                n = int(per["step"])
                v = per["max_exp_avg_sq" if group["amsgrad"] else "exp_avg_sq"]
                v = v.double().reshape(-1).numpy()
                b2 = group["betas"][1]
                precond = 1.0 / (np.sqrt(v) / math.sqrt(1 - b2**n) + group["eps"])
            else:
                n, precond = warmup + t + 1, np.ones(1)
            c = _impulse(s["kind"], group, n, n + 3000)  # its whole share
            for d, g in s["data"].items():
                for p in range(N_PROBES):
                    term = group["lr"] * c * float(np.dot(precond * g[name], s["probes"][p][name]))
                    scores[(p, d)] = scores.get((p, d), 0.0) + term / BATCH  # weighted: w = 1/B
    return scores


OPTIMIZERS = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.05, betas=(0.8, 0.95)),
    "adamw-amsgrad": lambda ps: torch.optim.AdamW(ps, lr=0.05, weight_decay=0.1, amsgrad=True),
    "adam-groups": lambda ps: torch.optim.Adam([{"params": ps[:2], "lr": 0.02},
                                                {"params": ps[2:], "lr": 0.07}]),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.2),
    "sgd-nesterov": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.5, nesterov=True),
    "sgd-dampened": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.5),
    "sgd-groups": lambda ps: torch.optim.SGD([{"params": ps[:2], "lr": 0.02},
                                              {"params": ps[2:], "lr": 0.3}]),
}


@pytest.mark.parametrize("name", [*OPTIMIZERS, "sgd-dampened-warm", "adam-warm",
                                  "adam-sched", "sgd-momentum-sched"])
def test_optimizer_scores_equal_brute_force(tmp_path: Path, name: str) -> None:
    """``-warm``: the optimizer stepped before the recorder was created (SGD's first
    momentum step, undamped, is then not the recorder's first). ``-sched``: the rate decays
    every step (each step's own rate, not the first kept one's)."""
    path = tmp_path / "run.gradlog"
    base = name.removesuffix("-warm").removesuffix("-sched")
    want, _ = _train(path, OPTIMIZERS[base], warmup=2 if name.endswith("-warm") else 0,
                     schedule=(lambda t: 1 / (1 + t)) if name.endswith("-sched") else None)
    run = gradlog.open(path)
    for p in range(N_PROBES):
        table = run.influence(p, top=None, kind="optimizer", weighted=True)
        got = dict(zip(table.column("datum_id").to_pylist(), table.column("score").to_pylist()))
        ids = sorted(d for q, d in want if q == p)
        a = np.array([got[d] for d in ids])
        b = np.array([want[(p, d)] for d in ids])
        assert np.linalg.norm(a - b) <= 1e-6 * np.linalg.norm(b), name
        assert table.schema.metadata[b"score_kind"] == b"optimizer"
    # lr= overrides every step's rate: Adam's preconditioner does not depend on it
    if name == "adam":
        for scores in (lambda **kw: run.influence(0, top=None, kind="optimizer", weighted=True,
                                                  **kw).column("score").to_numpy(),
                       lambda **kw: run.influence_matrix(kind="optimizer", weighted=True,
                                                         **kw).scores):
            np.testing.assert_allclose(scores(lr=0.1), 2 * scores(), rtol=1e-12)  # lr 0.05
    # the default follows the recorded optimizer; the matrix agrees with one probe at a time
    default = run.influence(0, top=None, weighted=True)  # plain SGD: TracIn, the same score
    assert default.schema.metadata[b"score_kind"] == (
        b"tracin" if name == "sgd-groups" else b"optimizer")
    matrix = run.influence_matrix(kind="optimizer", weighted=True)
    for j, p in enumerate(matrix.probe_ids):
        one = run.influence(int(p), top=None, kind="optimizer", weighted=True)
        got = dict(zip(one.column("datum_id").to_pylist(), one.column("score").to_pylist()))
        col = np.array([got.get(int(d), 0.0) for d in matrix.datum_ids])
        np.testing.assert_allclose(matrix.scores[:, j], col, rtol=1e-9, atol=1e-12)


def test_adam_differs_from_tracin_and_cosine_is_normalised(tmp_path: Path) -> None:
    path = tmp_path / "run.gradlog"
    _, seen = _train(path, OPTIMIZERS["adam"])
    run = gradlog.open(path)
    tracin = run.influence(1, top=None, kind="tracin").column("score").to_numpy()
    adam = run.influence(1, top=None, kind="optimizer").column("score").to_numpy()
    assert not np.allclose(np.sort(tracin), np.sort(adam))
    cosine = run.influence(1, top=None, kind="cosine")
    # brute force: sum_t lr_t cos(g_t(d), g_t(z)) over all parameters
    want: dict[int, float] = {}
    for _t, s in enumerate(seen):
        lr = s["state"]["param_groups"][0]["lr"]
        z = np.concatenate(list(s["probes"][1].values()))
        for d, g in s["data"].items():
            v = np.concatenate(list(g.values()))
            want[d] = want.get(d, 0.0) + lr * v @ z / (np.linalg.norm(v) * np.linalg.norm(z))
    got = dict(zip(cosine.column("datum_id").to_pylist(), cosine.column("score").to_pylist()))
    for d, w in want.items():
        assert got[d] == pytest.approx(w, rel=1e-9, abs=1e-12)


def test_optimizer_kind_refused_without_state(tmp_path: Path) -> None:
    path = tmp_path / "run.gradlog"
    _train(path, OPTIMIZERS["adam"], optimizer_state="none")
    run = gradlog.open(path)
    with pytest.raises(InputError, match="kind='optimizer' needs the optimizer's state"):
        run.influence(0, kind="optimizer")
    assert run.influence(0, top=1).schema.metadata[b"score_kind"] == b"tracin"
    with pytest.raises(InputError, match="kind='bogus' is not one of"):
        run.influence(0, kind="bogus")
    # under FSDP2 (which keeps no optimizer state yet) the message names that cause alone
    run.attrs["backend"]["distributed"] = {"world_size": 2, "strategy": "fsdp2"}
    with pytest.raises(InputError, match="recorded under FSDP2") as refused:
        run.influence(0, kind="optimizer")
    assert "optimizer_state" not in str(refused.value)


def test_every_query_weights_each_parameter_by_its_own_group_rate(tmp_path: Path) -> None:
    """Param groups at different rates: a record keeps one rate (group 0's), so TracIn,
    cosine, the matrix, self-influence and movers take each parameter's own from the kept
    optimizer state (plain SGD: the optimizer kind's score is TracIn's)."""
    path = tmp_path / "run.gradlog"
    want, seen = _train(path, OPTIMIZERS["sgd-groups"])
    run = gradlog.open(path)
    rate = {"0.weight": 0.02, "0.bias": 0.02, "2.weight": 0.3, "2.bias": 0.3}
    for p in range(N_PROBES):
        ids = sorted(d for q, d in want if q == p)
        b = np.array([want[(p, d)] for d in ids])
        for kind in ("tracin", "optimizer"):
            table = run.influence(p, top=None, kind=kind, weighted=True)
            got = dict(zip(table.column("datum_id").to_pylist(), table.column("score").to_pylist()))
            np.testing.assert_allclose([got[d] for d in ids], b, rtol=1e-9, atol=1e-12)
        column = run.influence_matrix([p], kind="tracin", weighted=True)
        got = dict(zip(column.datum_ids.tolist(), column.scores[:, 0].tolist()))
        np.testing.assert_allclose([got[d] for d in ids], b, rtol=1e-9, atol=1e-12)
    # cosine: the rate-weighted products over the two gradients' norms
    cosine = run.influence(1, top=None, kind="cosine")
    expect: dict[int, float] = {}
    for s in seen:
        z = s["probes"][1]
        zn = np.sqrt(sum(float(v @ v) for v in z.values()))
        for d, g in s["data"].items():
            gn = np.sqrt(sum(float(v @ v) for v in g.values()))
            dot = sum(rate[n] * float(g[n] @ z[n]) for n in rate)
            expect[d] = expect.get(d, 0.0) + dot / (gn * zn)
    got = dict(zip(cosine.column("datum_id").to_pylist(), cosine.column("score").to_pylist()))
    for d, w in expect.items():
        assert got[d] == pytest.approx(w, rel=1e-9, abs=1e-12)
    # self-influence: sum_t lr_p w ||g_p||^2
    self_ = run.self_influence(weighted=True)
    expect = {}
    for s in seen:
        for d, g in s["data"].items():
            expect[d] = expect.get(d, 0.0) + sum(
                rate[n] * float(g[n] @ g[n]) for n in rate) / BATCH
    got = dict(zip(self_.column("datum_id").to_pylist(), self_.column("score").to_pylist()))
    for d, w in expect.items():
        assert got[d] == pytest.approx(w, rel=1e-9)
    # movers: plain SGD, every step recorded: the change it attributes is the actual one
    delta = {n: -sum(rate[n] * g[n] for s in seen for g in s["data"].values()) / BATCH
             for n in rate}
    moved = run.movers(top=None)
    norm = float(moved.schema.metadata[b"change_norm"])
    assert norm == pytest.approx(np.sqrt(sum(float(v @ v) for v in delta.values())), rel=1e-9)


def test_a_record_keeps_its_own_rate_where_the_groups_agree(tmp_path: Path) -> None:
    """``rec.backward(lr=)`` is kept when the recorded parameters share one group rate; a
    record's rate is that of the first group holding a recorded parameter (here group 1:
    group 0 trains a parameter that is not recorded); a step whose state file is damaged
    keeps the record's rate, with a warning."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))
    opt = torch.optim.SGD([{"params": model[0].parameters(), "lr": 1.0},
                           {"params": model[2].parameters(), "lr": 0.1}])
    x, y = torch.randn(8, 5), torch.randint(0, 3, (8,))
    for lr, path in ((None, tmp_path / "a.gradlog"), (0.5, tmp_path / "b.gradlog")):
        with gradlog.GradRecorder(model, path, optimizer=opt, params="2.*") as rec:
            for _ in range(2):
                rec.backward(F.cross_entropy(model(x), y, reduction="none"), lr=lr)
                opt.step()
                opt.zero_grad()
        run = gradlog.open(path)
        assert run.datums.column("lr").to_pylist() == [lr or 0.1] * 16
        sq = sum(run.datums.column(f"norm/{n}").to_numpy() ** 2 for n in run.param_names)
        score = run.self_influence(top=None, weighted=True).column("score").to_numpy()
        expect = np.bincount(run.datums.column("datum_id").to_numpy(), weights=sq / 8)
        np.testing.assert_allclose(np.sort(score), np.sort(expect * (lr or 0.1)), rtol=1e-9)
    # groups that differ, one step's state damaged: that step keeps the record's rate, said so
    path = tmp_path / "c.gradlog"
    _train(path, OPTIMIZERS["sgd-groups"])
    (path / "optimizer" / "step-000000000001.npz").write_bytes(b"not a zip")
    with pytest.warns(UserWarning, match=r"step\(s\) \[1\] have no readable optimizer state"):
        gradlog.open(path).influence(0, kind="tracin")


def test_stores_before_run_id_kept_group_0s_rate_and_are_corrected(tmp_path: Path) -> None:
    """Recorders before ``run_id`` stored group 0's rate in every record, also where group
    0 holds no recorded parameter: there the kept state's rate applies (a store of now,
    edited back to what such a recorder wrote)."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    opt = torch.optim.SGD([{"params": model[0].parameters(), "lr": 1.0},
                           {"params": model[2].parameters(), "lr": 0.01}])
    x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
    path = tmp_path / "r.gradlog"
    with gradlog.GradRecorder(model, path, params="2.*", optimizer=opt) as rec:
        for _ in range(2):
            rec.backward(F.cross_entropy(model(x), y, reduction="none"))
            opt.step()
            opt.zero_grad()
    want = gradlog.open(path).self_influence(weighted=True).column("score").to_numpy()
    meta = json.loads((path / "zarr.json").read_text())
    del meta["attributes"]["run_id"]
    (path / "zarr.json").write_text(json.dumps(meta))
    for part in [*path.glob("index/*.parquet"), *path.glob("steps/*.parquet")]:
        table = pq.read_table(part)
        at = table.schema.get_field_index("lr")
        lr = pa.array([1.0] * table.num_rows, table.schema.field(at).type)
        pq.write_table(table.set_column(at, table.schema.field(at), lr), part)
    old = gradlog.open(path)
    assert old.datums.column("lr").to_pylist() == [1.0] * 16
    got = old.self_influence(weighted=True).column("score").to_numpy()
    np.testing.assert_allclose(got, want, rtol=1e-12)


def test_parameters_another_optimizer_trains_are_named(tmp_path: Path) -> None:
    """Lightning with two optimizers passes the first: the others' parameters have no rate
    or state in the run; said when recording starts."""
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))
    opt = torch.optim.SGD(model[0].parameters(), lr=0.1)
    warned = pytest.warns(UserWarning, match=r"\['2.weight', '2.bias'\] are in none of the")
    with warned, gradlog.GradRecorder(model, tmp_path / "r.gradlog", optimizer=opt):
        pass


def test_group_rates_without_optimizer_state_warn(tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match="param groups with different learning rates"):
        _train(tmp_path / "run.gradlog", OPTIMIZERS["sgd-groups"], optimizer_state="none")


def test_repeated_probes_and_bad_rates_are_refused(tmp_path: Path) -> None:
    """A repeated probe id would leave its second column zero; a rate <= 0 flips or
    zeroes every score: both refused, in every query that takes them."""
    path = tmp_path / "run.gradlog"
    _train(path, OPTIMIZERS["sgd-momentum"])
    run = gradlog.open(path)
    with pytest.raises(InputError, match=r"names probe\(s\) \[0\] more than once"):
        run.influence_matrix([0, 1, 0])
    assert run.influence_matrix([1, 0]).scores.shape[1] == 2
    twice = ["0.weight", "2.weight", "0.weight"]  # would sum 0.weight's products twice
    for query in (lambda: run.influence(0, params=twice), lambda: run.movers(twice),
                  lambda: run.influence_matrix(params=twice),
                  lambda: run.similarity(twice), lambda: run.self_influence(params=twice)):
        with pytest.raises(SelectionError, match=r"params names \['0.weight'\] more than once"):
            query()
    for kind in ("tracin", "optimizer", "cosine"):
        for lr in (-1.0, 0, float("nan"), "0.1"):
            with pytest.raises(InputError, match="must be a finite positive number"):
                run.influence(0, kind=kind, lr=lr)
            with pytest.raises(InputError, match="must be a finite positive number"):
                run.influence_matrix(kind=kind, lr=lr)
    with pytest.raises(InputError, match="must be a finite positive number"):
        run.self_influence(lr=-0.1)


def test_unsupported_optimizer_warns(tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match="keeps no optimizer state for RMSprop"):
        _train(tmp_path / "run.gradlog", lambda ps: torch.optim.RMSprop(ps, lr=0.01))
    run = gradlog.open(tmp_path / "run.gradlog")
    assert run.influence(0, top=1).schema.metadata[b"score_kind"] == b"tracin"


@pytest.mark.slow
def test_projected_optimizer_scores_converge(tmp_path: Path) -> None:
    """Projected Adam-aware scores approach the full ones as the dimension grows."""
    torch.manual_seed(0)
    width = 48
    errors = {}
    for form in ("full", 32, 256, 2048):  # dense projections of 2,304 entries
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 3))
        gen = torch.Generator().manual_seed(1)
        x, y = torch.randn(64, width, generator=gen), torch.randint(0, 3, (64,), generator=gen)
        probes = (torch.randn(4, width, generator=gen), torch.randint(0, 3, (4,), generator=gen))
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        spec = "full" if form == "full" else {"form": "projection", "dim": form,
                                              "structure": "dense"}
        path = tmp_path / f"{form}.gradlog"
        with gradlog.GradRecorder(model, path, optimizer=opt, probes=(_loss, probes),
                                  params="0.weight", form=spec, optimizer_state="float32") as rec:
            for idx in torch.arange(64).split(16):
                rec.backward(F.cross_entropy(model(x[idx]), y[idx], reduction="none"),
                             datum_ids=idx)
                opt.step()
                opt.zero_grad()
        run = gradlog.open(path)
        with np.errstate(all="ignore"):
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                errors[form] = run.influence_matrix(kind="optimizer").scores
    full = errors.pop("full")
    rel = {d: np.linalg.norm(s - full) / np.linalg.norm(full) for d, s in errors.items()}
    # Johnson-Lindenstrauss: the error falls as 1/sqrt(dim) (x 0.125 from 32 to 2048; scores
    # are small against the norms' product, so the relative error starts above 1)
    assert rel[2048] < rel[256] < rel[32]
    assert rel[2048] < 0.3 * rel[32]


def test_state_files_follow_the_schema_and_bfloat16_is_close(tmp_path: Path) -> None:
    import jsonschema

    from gradlog.store.optimizer import optimizer_steps, read_optimizer_step
    from gradlog.store.schema import load_schema

    full, half = tmp_path / "f32.gradlog", tmp_path / "bf16.gradlog"
    _train(full, OPTIMIZERS["adamw-amsgrad"])
    _train(half, OPTIMIZERS["adamw-amsgrad"], optimizer_state="bfloat16")
    run = gradlog.open(half)
    assert optimizer_steps(run.path) == run.steps.column("step").to_pylist()
    schema = load_schema("optimizer")
    for step in optimizer_steps(run.path):
        state = read_optimizer_step(run.path, step)
        jsonschema.validate(state.meta, schema)
        assert state.meta["dtype"] == "bfloat16" and state.meta["kind"] == "adam"
    a = gradlog.open(full).influence_matrix(kind="optimizer").scores
    b = run.influence_matrix(kind="optimizer").scores
    assert np.linalg.norm(a - b) <= 1e-2 * np.linalg.norm(a)  # bfloat16: 2^-9 per entry
    assert not np.array_equal(a, b)


def test_matrix_over_forms_fixed_gradients_and_memory(tmp_path: Path) -> None:
    """The matrix of a factored store equals the full store's; given gradients give the
    columns of influence() with a dict probe; max_memory is honoured."""
    from gradlog.errors import MemoryTooSmallError

    runs = {}
    for form in ("full", "factors"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
        gen = torch.Generator().manual_seed(1)
        # 2 tokens per datum: factors (2 x (8 + 6) values) are smaller than full (48)
        x, y = torch.randn(32, 2, 6, generator=gen), torch.randint(0, 3, (32, 2), generator=gen)
        probes = (torch.randn(3, 2, 6, generator=gen), torch.randint(0, 3, (3, 2), generator=gen))

        def seq_loss(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
            return F.cross_entropy(m(b[0]).transpose(1, 2), b[1], reduction="none")  # (B, T)

        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        path = tmp_path / f"{form}.gradlog"
        with gradlog.GradRecorder(model, path, optimizer=opt, form=form,
                                  probes=(seq_loss, probes)) as rec:
            for idx in torch.arange(32).split(8):
                rec.backward(seq_loss(model, (x[idx], y[idx])), datum_ids=idx)
                opt.step()
                opt.zero_grad()
        runs[form] = gradlog.open(path)
    assert runs["factors"].form_name("0.weight") == "factors"
    for kind in ("tracin", "optimizer", "cosine"):
        a = runs["full"].influence_matrix(kind=kind).scores
        b = runs["factors"].influence_matrix(kind=kind).scores
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6 * np.abs(a).max())
    run = runs["full"]
    gen = torch.Generator().manual_seed(5)
    given = {n: torch.randn(2, *s, generator=gen, dtype=torch.float64)
             for n, s in zip(run.param_names, run.params.column("shape").to_pylist())}
    for kind in ("tracin", "optimizer"):
        matrix = run.influence_matrix(given, kind=kind)
        assert matrix.probe_ids.tolist() == [0, 1]
        for j in range(2):
            one = run.influence({n: g[j] for n, g in given.items()}, top=None, kind=kind)
            want = dict(zip(one.column("datum_id").to_pylist(), one.column("score").to_pylist()))
            got = matrix.scores[:, j]
            np.testing.assert_allclose(got, [want[int(d)] for d in matrix.datum_ids],
                                       rtol=1e-5, atol=1e-7 * np.abs(got).max())
    with pytest.raises(MemoryTooSmallError, match="max_memory"):
        run.influence_matrix(max_memory=1000)
    with pytest.raises(InputError, match="different numbers of probes"):
        run.influence_matrix({"0.weight": np.zeros((2, 8, 6)), "0.bias": np.zeros((3, 8))},
                             params=["0.weight", "0.bias"])
