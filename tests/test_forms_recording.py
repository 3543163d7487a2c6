"""Forms end to end: recorder -> store -> ``gradlog info`` / ``verify`` -> queries.

Every form is recorded on the same seeded run as the same run recorded ``full`` (the oracle,
float64): exact forms must give back its gradients (rtol 1e-10), ``topk`` its largest entries,
``projection`` the stored projection of its gradients, and every form its exact norms.
(The math of each form alone is tested in ``tests/test_forms.py``.)
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import gradlog
from gradlog import errors
from gradlog.analysis.influence import record_influence
from gradlog.cli.main import app
from gradlog.forms import ProjectionForm, form_from_spec
from gradlog.store.verify import verify
from gradlog.testing.schemas import validate_store
from gradlog.testing.zoo import gpt_batch, per_token_ce, tiny_gpt

B, T, STEPS = 4, 4, 2
TOPK = {"form": "topk", "k": 5}
PROJECTION = {"form": "projection", "dim": 16}
FORMS: list[Any] = [
    "factors",
    "auto",
    TOPK,
    PROJECTION,
    "norm",
    {"blocks.*.attn.*": PROJECTION, "*.weight": "factors", "*": "full"},
]
IDS = ["factors", "auto", "topk", "projection", "norm", "globs"]


def _model() -> torch.nn.Module:
    # d=16, T=4: factors of a 16x16 attention weight (4 x 32) are smaller than it (256)
    return tiny_gpt(n_embd=16, n_head=2, block_size=T, vocab=11, seed=3)


def _record(
    path: Path,
    form: Any = "full",
    *,
    backend: str = "hooks",
    steps: int = STEPS,
    lengths: list[int] | None = None,
    **kwargs: Any,
) -> torch.nn.Module:
    """Train ``steps`` SGD steps of the tiny GPT, recording with ``form``; returns the model."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kwargs.setdefault("dtype", "float64")
    with gradlog.GradRecorder(
        model, path, form=form, backend=backend, check_every=1, optimizer=opt, **kwargs
    ) as rec:
        for step in range(steps):
            t = T if lengths is None else lengths[step]
            x, y, mask = gpt_batch(B, t, vocab=11, seed=step)
            if backend == "vmap":
                rec.step(lambda m, b: per_token_ce(m(b[0]), b[1]), (x, y), mask=mask)
            else:
                rec.backward(per_token_ce(model(x), y), mask=mask)
            opt.step()
            opt.zero_grad()
    return model


@pytest.fixture(scope="module")
def oracle(tmp_path_factory: pytest.TempPathFactory) -> gradlog.Run:
    """The same run recorded full."""
    path = tmp_path_factory.mktemp("forms") / "full.gradlog"
    _record(path)
    return gradlog.open(path)


def _forms(run: gradlog.Run) -> dict[str, str]:
    return dict(zip(run.param_names, run.params.column("form").to_pylist()))


def _grads(run: gradlog.Run, name: str) -> np.ndarray:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a projection's "projected vectors" note
        return np.asarray(run.grads(name, dtype=np.float64))


def test_records_decoding_to_another_shape_than_the_spec_are_refused(tmp_store: Path) -> None:
    """A spec whose shape disagrees with its factors (an edited or foreign store) decoded
    (4, 64) as (64, 4) in silence; now refused, naming the parameter."""
    _record(tmp_store, {"*mlp.fc.weight": "factors", "*": "norm"}, steps=1)
    root = tmp_store / "zarr.json"
    meta = json.loads(root.read_text())
    name = next(n for n in meta["attributes"]["params"] if n.endswith("mlp.fc.weight"))
    spec = meta["attributes"]["params"][name]
    assert spec["form"] == "factors" and spec["shape"][0] != spec["shape"][1]
    spec["shape"] = spec["shape"][::-1]
    root.write_text(json.dumps(meta))
    with pytest.raises(errors.StoreFormatError, match=rf"{name}.*decode to"):
        gradlog.open(tmp_store).grads(name)


@pytest.mark.parametrize("form", FORMS, ids=IDS)
def test_every_form_round_trips_against_the_full_run(
    form: Any, oracle: gradlog.Run, tmp_store: Path
) -> None:
    model = _record(tmp_store, form)
    run = gradlog.open(tmp_store)
    validate_store(tmp_store)
    assert verify(tmp_store).ok
    # training is untouched: the parameters equal the full run's, bitwise
    reference = _model()
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(STEPS):
        x, y, mask = gpt_batch(B, T, vocab=11, seed=step)
        losses = per_token_ce(reference(x), y)
        ((losses * mask).sum(1) / mask.sum(1)).mean().backward()
        opt.step()
        opt.zero_grad()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), name
    forms = _forms(run)
    for name in run.param_names:
        full = _grads(oracle, name)  # (records, *shape)
        norms = run.norms(name).column("norm").to_numpy()
        np.testing.assert_allclose(
            norms,
            oracle.norms(name).column("norm").to_numpy(),
            rtol=1e-10,
            atol=1e-300,
            err_msg=name,
        )
        kind = forms[name]
        if kind == "norm":
            with pytest.raises(errors.SelectionError, match=r"run\.norms"):
                run.grads(name)
            continue
        if kind == "projection":
            with pytest.warns(UserWarning, match="projected vectors"):
                got = np.asarray(run.grads(name, dtype=np.float64))
            want = run.project(name, full)
            np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12, err_msg=name)
            continue
        got = _grads(run, name)
        if kind == "topk":
            flat, kept = full.reshape(len(full), -1), got.reshape(len(got), -1)
            k = run.form(name).k
            for f, g in zip(flat, kept):
                top = np.sort(np.abs(f))[::-1][:k]
                assert np.count_nonzero(g) <= k
                np.testing.assert_allclose(np.sort(np.abs(g))[::-1][:k], top, rtol=1e-12)
                np.testing.assert_array_equal(g[g != 0], f[g != 0])
            continue
        np.testing.assert_allclose(got, full, rtol=1e-10, atol=1e-14, err_msg=name)


def test_hooks_keeps_factors_and_the_plan_is_printed(
    tmp_store: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("INFO", logger="gradlog"):
        _record(tmp_store, {"*.weight": "factors", "*": "full"})
    run = gradlog.open(tmp_store)
    forms = _forms(run)
    assert forms["blocks.0.attn.q.weight"] == "factors"
    assert forms["tok_emb.weight"] == "rows"  # an Embedding's exact factored form
    assert forms["ln_f.weight"] == "full"  # a LayerNorm hands over dense gradients
    assert "blocks.0.attn.q.weight     factors" in caplog.text
    assert "(total)" in caplog.text
    spec = run.attrs["params"]["blocks.0.attn.q.weight"]
    assert spec["form_spec"] == {"form": "factors", "shape": [16, 16], "tokens": T}
    assert spec["arrays"]["g"] == {
        "path": "grads/blocks.0.attn.q.weight/g",
        "shape": [T, 16],
        "kind": "float",
    }


@pytest.mark.parametrize("form", ["factors", TOPK, PROJECTION, "norm"], ids=str)
def test_gradlog_info_shows_form_and_bytes_per_record(form: Any, tmp_store: Path) -> None:
    _record(tmp_store, form, steps=1)
    result = CliRunner().invoke(app, ["info", str(tmp_store), "--json"])
    assert result.exit_code == 0, result.output
    params = {p["name"]: p for p in json.loads(result.output)["params"]}
    run = gradlog.open(tmp_store)
    for name, spec in run.attrs["params"].items():
        planned = form_from_spec(spec["form_spec"])
        assert params[name]["form"] == planned.name
        assert params[name]["bytes_per_record"] == planned.nbytes_per_record(8)  # float64
    text = CliRunner().invoke(app, ["info", str(tmp_store)])
    assert text.exit_code == 0 and "bytes/record" in text.output


def test_queries_in_factored_space_equal_the_full_run(oracle: gradlog.Run, tmp_store: Path) -> None:
    _record(tmp_store, "auto")
    run = gradlog.open(tmp_store)
    assert "factors" in _forms(run).values() and "rows" in _forms(run).values()
    np.testing.assert_allclose(run.similarity(), oracle.similarity(), rtol=1e-10, atol=1e-16)
    np.testing.assert_allclose(
        run.similarity(kind="cosine"), oracle.similarity(kind="cosine"), rtol=1e-10, atol=1e-14
    )
    ours = run.self_influence().column("score").to_numpy()
    theirs = oracle.self_influence().column("score").to_numpy()
    np.testing.assert_allclose(ours, theirs, rtol=1e-10)


def test_factored_dot_products_equal_materialised_ones_float32(tmp_path: Path) -> None:
    _record(tmp_path / "f.gradlog", "factors", dtype="float32")
    _record(tmp_path / "d.gradlog", dtype="float32")
    run, full = gradlog.open(tmp_path / "f.gradlog"), gradlog.open(tmp_path / "d.gradlog")
    name = "blocks.0.mlp.fc.weight"
    rows = run.datums.column("row").to_numpy()
    form = run.form(name)
    assert form.name == "factors"
    stored = run.read_form_arrays(name, rows)
    dense = torch.from_numpy(full.grads(name)).double().reshape(len(rows), -1)
    np.testing.assert_allclose(
        form.inner(stored, stored).numpy(), (dense @ dense.T).numpy(), rtol=1e-6, atol=1e-12
    )


def test_projected_queries_estimate_the_exact_ones(oracle: gradlog.Run, tmp_store: Path) -> None:
    """Similarities of projected records are the inner products of the stored projections
    (nothing materialised), a user gradient is projected alike, and results say they are
    estimates."""
    _record(tmp_store, {"form": "projection", "dim": 64})
    run = gradlog.open(tmp_store)
    names = run.param_names
    with pytest.warns(UserWarning, match="estimates"):
        sim = run.similarity()
    proj = np.concatenate([_grads(run, n).reshape(run.datums.num_rows, -1) for n in names], 1)
    np.testing.assert_allclose(sim, proj @ proj.T, rtol=1e-9, atol=1e-14)
    # influence of a user gradient: projected with the stored projection first
    probe = {n: _grads(oracle, n)[0] for n in names}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        records, scores = record_influence(run, probe)
    assert records.column("row").to_pylist() == run.datums.column("row").to_pylist()
    want = sum(
        run.datums.column("lr").to_numpy()
        * np.einsum(
            "rk,k->r",
            _grads(run, n).reshape(len(proj), -1),
            np.asarray(run.project(n, probe[n])).reshape(-1),
        )
        for n in names
    )
    np.testing.assert_allclose(scores, want, rtol=1e-9, atol=1e-15)
    exact = sum(
        run.datums.column("lr").to_numpy()
        * np.einsum("rk,k->r", _grads(oracle, n).reshape(len(proj), -1), probe[n].reshape(-1))
        for n in names
    )
    assert np.corrcoef(scores, exact)[0, 1] > 0.9  # an estimate of the exact scores


@pytest.mark.slow
@pytest.mark.parametrize("dim", [64, 256, 768])  # (the weight has 1024 elements: 1024 is full)
def test_projected_inner_products_are_unbiased_with_jl_error(
    dim: int, oracle: gradlog.Run, tmp_path: Path
) -> None:
    """Over independent seeds the projected inner products average to the exact ones, with a
    spread within the Johnson-Lindenstrauss bound ``sqrt(2 / r) |x| |y|`` per seed."""
    name = "blocks.0.mlp.fc.weight"
    exact = _grads(oracle, name).reshape(oracle.datums.num_rows, -1)
    gram = exact @ exact.T
    scale = np.outer(np.linalg.norm(exact, axis=1), np.linalg.norm(exact, axis=1))
    estimates = []
    for seed in range(8):
        path = tmp_path / f"s{seed}.gradlog"
        _record(
            path,
            {name: {"form": "projection", "dim": dim, "structure": "dense"}},
            projection_seed=seed + 1,
        )
        assert gradlog.open(path).form_name(name) == "projection"
        p = _grads(gradlog.open(path), name)
        estimates.append(p @ p.T)
    est = np.stack(estimates)
    bound = np.sqrt(2 / dim) * scale
    assert np.all(np.abs(est - gram) <= 4 * bound)
    assert np.all(np.abs(est.mean(0) - gram) <= 4 * bound / np.sqrt(len(est)))


@pytest.mark.parametrize("backend", ["loop", "vmap"])
@pytest.mark.parametrize("form", [TOPK, PROJECTION, "norm", "auto"], ids=str)
def test_dense_backends_encode_every_form_like_hooks(
    backend: str, form: Any, tmp_path: Path
) -> None:
    """Loop and vmap hand over dense gradients; the forms encode them to what hooks stores
    from its factors (projections computed another way: equal to float rounding)."""
    _record(tmp_path / "h.gradlog", form)
    _record(tmp_path / "d.gradlog", form, backend=backend)
    ours, theirs = gradlog.open(tmp_path / "d.gradlog"), gradlog.open(tmp_path / "h.gradlog")
    for name in ours.param_names:
        np.testing.assert_allclose(
            ours.norms(name).column("norm").to_numpy(),
            theirs.norms(name).column("norm").to_numpy(),
            rtol=1e-9,
            atol=1e-15,
        )  # key biases: rounding noise, analytically 0
        kind = _forms(ours)[name]
        if kind == "norm":
            continue
        if form == "auto":  # dense material: auto's smallest exact form is full
            assert kind == "full"
        else:
            assert kind == _forms(theirs)[name]
        if kind != "topk":  # ties among equal magnitudes may pick other entries
            np.testing.assert_allclose(
                _grads(ours, name), _grads(theirs, name), rtol=1e-9, atol=1e-12, err_msg=name
            )


def test_auto_with_a_budget_fits_it_and_is_never_larger_than_full(tmp_store: Path) -> None:
    budget = 4000 * B  # bytes per step: far below full (~50 KB per record)
    _record(tmp_store, "auto", form_budget=budget, steps=1)
    run = gradlog.open(tmp_store)
    total = 0
    for spec in run.attrs["params"].values():
        form = form_from_spec(spec["form_spec"])
        assert form.nbytes_per_record(8) <= spec["numel"] * 8
        total += form.nbytes_per_record(8)
    assert total * B <= budget
    assert "projection" in _forms(run).values()


def test_more_tokens_than_planned_are_refused_with_the_fix(tmp_store: Path) -> None:
    with pytest.raises(errors.InputError, match="tokens="):
        _record(tmp_store, "factors", lengths=[2, 4], overwrite=True)
    assert gradlog.open(tmp_store).steps.num_rows == 1  # the first step stays committed
    _record(tmp_store, "factors", lengths=[2, 4], tokens=4, overwrite=True)
    run = gradlog.open(tmp_store)
    assert run.form("blocks.0.attn.q.weight").tokens == 4
    assert run.steps.num_rows == 2


def test_resume_keeps_the_stored_forms(tmp_store: Path) -> None:
    _record(tmp_store, PROJECTION, steps=1)
    before = gradlog.open(tmp_store).attrs["params"]
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradlog.GradRecorder(
        model,
        tmp_store,
        form=PROJECTION,
        resume=True,
        dtype="float64",
        backend="hooks",
        optimizer=opt,
        check_every=1,
    ) as rec:
        x, y, mask = gpt_batch(B, T, vocab=11, seed=5)
        rec.backward(per_token_ce(model(x), y), mask=mask)
    run = gradlog.open(tmp_store)
    assert run.attrs["params"] == before
    assert run.steps.num_rows == 2 and verify(tmp_store).ok


def test_the_projected_size_warns_beyond_the_free_space(tmp_store: Path) -> None:
    with pytest.warns(UserWarning, match="free"):
        _record(tmp_store, steps=1, planned_steps=10**15)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"form": "sparse"}, "not one of"),
        ({"form": {"*": {"form": "projection", "dims": 3}}}, "dims"),
        ({"form": 3}, "form name"),
        ({"form": {}}, "names no parameter"),
        ({"form_budget": -1}, "form_budget"),
        ({"projection_seed": -2}, "projection_seed"),
        ({"tokens": 0}, "tokens"),
    ],
)
def test_bad_form_options_are_refused_at_construction(
    kwargs: dict[str, Any], match: str, tmp_store: Path
) -> None:
    with pytest.raises((errors.ConfigError, errors.InputError), match=match):
        gradlog.GradRecorder(_model(), tmp_store, **kwargs)
    assert not tmp_store.exists()


def test_first_matching_glob_wins_and_seeds_reach_projections(tmp_store: Path) -> None:
    from gradlog.config import RecorderConfig

    config = RecorderConfig(form={"blocks.*": "norm", "*.weight": PROJECTION}, projection_seed=7)
    assert config.request_for("blocks.0.attn.q.weight") == "norm"
    assert config.request_for("head.weight") == {**PROJECTION, "seed": 7}
    assert config.request_for("ln_f.bias") == "full"
    assert RecorderConfig().to_json() == {
        k: v
        for k, v in config.to_json().items()
        if k not in ("form", "form_budget", "projection_seed")
    }  # runs without forms hash as before forms existed
    _record(tmp_store, {"*": PROJECTION}, projection_seed=7, steps=1)
    spec = gradlog.open(tmp_store).attrs["params"]["head.weight"]["form_spec"]
    assert (
        ProjectionForm.from_spec(spec).seed
        == ProjectionForm.plan(
            gradlog.forms.ParamInfo((11, 16), name="head.weight"), dim=16, seed=7
        ).seed
    )


def test_tied_embedding_and_head_is_densified(tmp_store: Path) -> None:
    """A parameter that gets sparse rows (embedding) and factors (head) is added up dense."""
    model = tiny_gpt(n_embd=16, n_head=2, block_size=T, vocab=11, seed=3, tie_weights=True)
    with gradlog.GradRecorder(model, tmp_store, form="auto", dtype="float64", check_every=1) as rec:
        x, y, mask = gpt_batch(B, T, vocab=11, seed=0)
        rec.backward(per_token_ce(model(x), y), mask=mask)
    run = gradlog.open(tmp_store)
    assert _forms(run)["tok_emb.weight"] == "full"
    assert verify(tmp_store).ok


def test_probe_influence_projects_the_probes_alike(tmp_store: Path) -> None:
    """Probes are stored full; for a projected parameter influence projects them with the
    stored projection: the score is lr * <projected record, projected probe>."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    px, py, _ = gpt_batch(3, T, vocab=11, seed=9)
    form = {"blocks.*": PROJECTION, "*": "full"}
    with gradlog.GradRecorder(
        model,
        tmp_store,
        form=form,
        optimizer=opt,
        dtype="float64",
        probes=(lambda m, b: per_token_ce(m(b[0]), b[1]), (px, py)),
    ) as rec:
        for step in range(STEPS):
            x, y, mask = gpt_batch(B, T, vocab=11, seed=step)
            rec.backward(per_token_ce(model(x), y), mask=mask)
            opt.step()
            opt.zero_grad()
    run = gradlog.open(tmp_store)
    with pytest.warns(UserWarning, match="estimates"):
        records, scores = record_influence(run, 0)
    want = np.zeros(records.num_rows)
    steps = records.column("step").to_numpy()
    lr = records.column("lr").to_numpy()
    for name in run.param_names:
        ours = _grads(run, name).reshape(records.num_rows, -1)
        for i, step in enumerate(steps):
            probe = run.probe_grads(name, probe=0, step=int(step), dtype=np.float64)[0]
            theirs = run.project(name, probe) if _forms(run)[name] == "projection" else probe
            want[i] += lr[i] * float(ours[i] @ np.asarray(theirs).reshape(-1))
    np.testing.assert_allclose(scores, want, rtol=1e-9, atol=1e-15)


@pytest.mark.parametrize("form", [f for f in FORMS if f != "norm"], ids=[
    i for i, f in zip(IDS, FORMS) if f != "norm"])
def test_xarray_and_dask_read_every_form_as_grads_does(tmp_path: Path, form: Any) -> None:
    pytest.importorskip("xarray")
    pytest.importorskip("dask")
    _record(tmp_path / "f.gradlog", form, steps=3)
    run = gradlog.open(tmp_path / "f.gradlog")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # projections say what they return
        for name in run.param_names:
            want = run.grads(name, dtype=np.float64)
            lazy = run.to_dask(name)
            assert lazy.chunks[0] == (B, B, B)  # one chunk per step's backward call
            np.testing.assert_array_equal(lazy.compute(), want)
            part = run.to_dask(name, step=[0, 2], datum=None).compute()
            np.testing.assert_array_equal(part, run.grads(name, step=[0, 2], dtype=np.float64))
            arr = run.to_xarray(name, step=[1, 2])
            axes = gradlog.analysis.param_axes(run, name)
            assert arr.dims == ("record", *axes) and len(axes) == want.ndim - 1
            if run.form(name).name == "projection":
                assert axes == tuple(f"proj_{i}" for i in range(want.ndim - 1))
            assert arr.attrs["form"] == run.form(name).name
            np.testing.assert_array_equal(arr.values, run.grads(name, step=[1, 2]))


def test_xarray_and_dask_of_a_norm_parameter_point_to_norms(tmp_path: Path) -> None:
    pytest.importorskip("xarray")
    pytest.importorskip("dask")
    _record(tmp_path / "n.gradlog", "norm")
    run = gradlog.open(tmp_path / "n.gradlog")
    name = run.param_names[0]
    for read in (run.to_dask, run.to_xarray, lambda p: run.to_xarray(p, lazy=True)):
        with pytest.raises(errors.SelectionError, match=r"run\.norms"):
            read(name)


def test_to_dask_of_a_projection_warns_once(tmp_path: Path) -> None:
    pytest.importorskip("dask")
    _record(tmp_path / "p.gradlog", PROJECTION)
    run = gradlog.open(tmp_path / "p.gradlog")
    name = next(n for n in run.param_names if run.form(n).name == "projection")
    with pytest.warns(UserWarning, match="projected vectors"):
        lazy = run.to_dask(name)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # computing the chunks warns no more
        lazy.compute()


@pytest.mark.parametrize("form", ["norm", "factors", {"form": "projection", "dim": 256}])
def test_norms_stay_exact_when_a_datums_tokens_cancel(tmp_path: Path, form: Any) -> None:
    """The ghost norm sums N^2 products of per-token terms: in float32 a datum whose token
    contributions nearly cancel lost most digits (1-8% off); its Gram matrices are float64."""
    torch.manual_seed(0)
    B, T, D = 4, 64, 512
    lin = torch.nn.Linear(D, D, bias=False)
    c = torch.randn(D)
    x = torch.randn(B, T, D)
    x[:, T // 2 :] = -x[:, : T // 2] + 1e-3 * torch.randn(B, T // 2, D)  # (B, T, D)
    with gradlog.GradRecorder(lin, tmp_path / "r.gradlog", form=form, tokens=T,
                              token_reduction="sum") as rec:
        rec.backward((lin(x) * c).sum(-1))  # (B, T): datum b's gradient c (sum_t x_bt)^T
    got = np.array(gradlog.open(tmp_path / "r.gradlog").norms("weight")
                   .column("norm").to_pylist())
    want = np.array([np.linalg.norm(np.outer(c.double(), x[b].double().sum(0)))
                     for b in range(B)])
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_a_projection_keeps_small_parameters_whole_and_takes_any_length(tmp_path: Path) -> None:
    """A projection by ``dim`` keeps a parameter of at most ``dim`` elements as ``full``
    (exact), and never plans token-provisioned factors, which a longer batch than the
    first would overflow: every length records, each record against the loop backend."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    loop = torch.nn.Sequential(*(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)))
    loop.load_state_dict(model.state_dict())
    batches = [torch.randn(4, T_, 16, generator=torch.Generator().manual_seed(T_))
               for T_ in (2, 9)]  # 2 tokens: factors (2 x 32) would fit in dim 128; 9 not
    runs = {}
    for name, m, kwargs in (("proj", model, {"form": {"form": "projection", "dim": 128}}),
                            ("loop", loop, {"backend": "loop"})):
        path = tmp_path / f"{name}.gradlog"
        with gradlog.GradRecorder(m, path, **kwargs) as rec:
            for x in batches:
                rec.backward(m(x).square().sum((1, 2)))
                m.zero_grad()
        runs[name] = gradlog.open(path)
    proj, oracle = runs["proj"], runs["loop"]
    assert _forms(proj) == {"0.weight": "projection", "0.bias": "full", "2.weight": "full",
                            "2.bias": "full"}
    for name in proj.param_names:
        want = np.asarray(oracle.grads(name, dtype=np.float64))
        if name == "0.weight":
            with pytest.warns(UserWarning, match="projected vectors"):
                got = np.asarray(proj.grads(name, dtype=np.float64))
            want = np.asarray(proj.project(name, torch.from_numpy(want)))
        else:
            got = np.asarray(proj.grads(name, dtype=np.float64))
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max(),
                                   err_msg=name)


class _WithEmptyLayer(torch.nn.Module):
    """A Linear layer with no outputs beside an ordinary one (a pruned head, a zero-width
    adapter): its records are empty in every form, and their norms 0."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(6, 4)
        self.z = torch.nn.Linear(6, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x).tanh().sum(1) + self.z(x).sum(1)  # (B,)


@pytest.mark.parametrize("backend", ["hooks", "loop"])
@pytest.mark.parametrize("form", ["full", "norm", {"form": "projection", "dim": 8},
                                  {"form": "topk", "k": 2}, "factors", "auto"])
def test_a_zero_size_parameter_is_recorded_empty_in_every_form(tmp_path: Path, backend: str,
                                                               form: Any) -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (zero-element init; form sizes against full's)
        model = _WithEmptyLayer()
        with gradlog.GradRecorder(model, tmp_path / "r.gradlog", form=form, backend=backend,
                                  check_every=1) as rec:
            for _ in range(2):
                rec.backward(model(x))
                model.zero_grad()
    run = gradlog.open(tmp_path / "r.gradlog")
    for name in ("z.weight", "z.bias"):
        norms = run.norms(name).column("norm").to_numpy()
        assert len(norms) == 6 and (norms == 0).all()
    want = torch.func.vmap(torch.func.grad(
        lambda p, xb: torch.func.functional_call(model, p, (xb[None],)).sum()),
        in_dims=(None, 0))(dict(model.named_parameters()), x)["a.weight"]
    got = run.norms("a.weight", step=1).column("norm").to_numpy()
    np.testing.assert_allclose(got, want.detach().reshape(3, -1).double().norm(dim=1), rtol=1e-5)
    if form != "norm":  # read back: nothing was written for it, and nothing is missing
        assert run.grads("z.weight").shape == (6, 0, 6)
        assert run.trajectory("z.bias", 4).grads.shape == (1, 0)  # (datum 4: step 1)
        stats = run.stats("z.weight")
        assert stats["norm"] == stats["record_norm_min"] == stats["record_norm_max"] == 0.0
    if form in ("full", "factors"):
        pair = {"a": {"step": 0}, "b": {"step": 1}}
        np.testing.assert_allclose(run.similarity(["z.weight", "a.weight"], **pair),
                                   run.similarity(["a.weight"], **pair), rtol=1e-12)
        run.export(tmp_path / "e.npz", format="npz")
