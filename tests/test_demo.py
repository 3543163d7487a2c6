"""The built-in demo (``gradlog train``): data recur over epochs, probes are recorded and are
the held-out windows' own gradients, the store stays small; and the picture ``gradlog plot``
draws of it, against numpy's own per-step quantiles."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import gradlog
from gradlog.analysis.plot import QUANTILES, norm_ranges, outliers, record_norms
from gradlog.demo import CharCorpus, CharGPT, GPTConfig, load_corpus
from gradlog.demo.train import TrainSummary, default_params, train_demo
from gradlog.errors import InputError

SMALL = {"steps": 6, "batch_size": 8, "seq_len": 16, "windows": 16, "probes": 2, "n_embd": 16}


@pytest.fixture(scope="module")
def summary(tmp_path_factory: pytest.TempPathFactory) -> TrainSummary:
    out = tmp_path_factory.mktemp("demo") / "demo.gradlog"
    return train_demo(out, **SMALL)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def demo(summary: TrainSummary) -> Path:
    return Path(summary.path)


def test_data_recur_and_probes_are_held_out(demo: Path) -> None:
    run = gradlog.open(demo)
    ids = run.datums.column("datum_id").to_numpy()
    # 16 windows, 8 a step, 6 steps: 3 epochs, every window at 3 steps
    assert sorted(set(ids.tolist())) == list(range(16))
    assert np.bincount(ids).tolist() == [3] * 16
    assert run.probe_ids == [0, 1]
    assert run.config["metadata"]["probe_windows"] == [16, 17]  # after the training windows
    assert run.probe_records(probe=0).num_rows == 6  # at every step
    assert run.param_names == ["head.weight", "blocks.1.mlp.fc.weight",
                               "blocks.1.mlp.proj.weight"]
    assert default_params(3) == ["head.weight", "blocks.2.mlp.*.weight"]


def test_probe_gradients_are_the_held_out_windows_own(demo: Path) -> None:
    """Oracle: replay the demo's SGD run by hand (same seed, same batches) and take each
    probe's gradient with float64 autograd at every step."""
    run = gradlog.open(demo)
    corpus = CharCorpus(load_corpus())
    torch.manual_seed(0)
    model = CharGPT(GPTConfig(vocab_size=corpus.vocab_size, block_size=16, n_embd=16))
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    probe_x = torch.stack([corpus.window(i, 16)[0] for i in (16, 17)])
    probe_y = torch.stack([corpus.window(i, 16)[1] for i in (16, 17)])
    wanted = dict(model.named_parameters())
    names = run.param_names
    for step, (x, y, ids) in enumerate(corpus.batches(8, 16, 6, 0, windows=16)):
        assert run.records(step=step).column("datum_id").to_pylist() == ids.tolist()
        ref = model.double()
        for k in range(2):
            loss = F.cross_entropy(ref(probe_x[k : k + 1]).transpose(1, 2),
                                   probe_y[k : k + 1]).squeeze()
            grads = torch.autograd.grad(loss, [wanted[n] for n in names])
            for name, g in zip(names, grads):
                got = run.probe_grads(name, probe=k, step=step)[0]
                np.testing.assert_allclose(got, g.float().numpy(), rtol=2e-4, atol=2e-6)
        model.float()
        F.cross_entropy(model(x).transpose(1, 2), y, reduction="none").mean(1).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def test_influence_answers_for_probe_0(demo: Path, summary: TrainSummary) -> None:
    found = gradlog.open(demo).influence(0, top=3).to_pylist()
    assert {r["kind"] for r in found} <= {"proponent", "opponent"} and found
    assert all(r["n_steps"] == 3 for r in found)  # each datum at 3 steps of the probe's 6
    assert summary.proponent == found[0]["datum_id"] and found[0]["kind"] == "proponent"
    corpus = CharCorpus(load_corpus())
    assert summary.windows[summary.proponent] == corpus.decode(
        corpus.window(summary.proponent, 16)[0])
    assert summary.probes == {k: corpus.decode(corpus.window(16 + k, 16)[0]) for k in (0, 1)}
    assert (summary.records, summary.datums, summary.steps) == (48, 16, 6)


def test_bad_windows_and_probes_are_refused(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="the corpus has"):
        train_demo(tmp_path / "a", seq_len=16, windows=10**6)
    with pytest.raises(InputError, match="probes >= 0"):
        train_demo(tmp_path / "b", seq_len=16, windows=8, probes=-1)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_norm_ranges_and_outliers_against_numpy(demo: Path) -> None:
    run = gradlog.open(demo)
    norms = record_norms(run)
    steps = run.datums.column("step").to_numpy()
    ids = run.datums.column("datum_id").to_numpy()
    ranges = norm_ranges(steps, norms)
    for i, s in enumerate(np.unique(steps)):
        mine = norms[steps == s]
        np.testing.assert_allclose(ranges.quantiles[i], np.quantile(mine, QUANTILES))
        assert (ranges.low[i], ranges.high[i], ranges.counts[i]) == (mine.min(), mine.max(),
                                                                    mine.size)
    # naive oracle: each datum's largest norm / its step's median, ranked
    ratio = {}
    for s, d, n in zip(steps, ids, norms):
        ratio[d] = max(ratio.get(d, 0.0), n / np.median(norms[steps == s]))
    want = sorted(ratio, key=lambda d: -ratio[d])[:4]
    got, ratios = outliers(steps, ids, norms, 4)
    assert got.tolist() == want
    np.testing.assert_allclose(ratios, [ratio[d] for d in want])


def test_plot_shows_ranges_loss_and_named_outliers(demo: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    run = gradlog.open(demo)
    fig = run.plot(tmp_path / "fig.png", datums=3)
    ax_range, ax_loss, ax_heat = fig.axes[:3]
    norms = record_norms(run)
    steps = run.datums.column("step").to_numpy()
    medians = [np.median(norms[steps == s]) for s in np.unique(steps)]
    median_line = [ln for ln in ax_range.lines if ln.get_label() == "median"]
    assert len(median_line) == 1
    np.testing.assert_allclose(median_line[0].get_ydata(), medians)
    named, _ = outliers(steps, run.datums.column("datum_id").to_numpy(), norms, 3)
    for ax in (ax_range, ax_loss):
        assert {t.get_text() for t in ax.texts} == {f"#{d}" for d in named.tolist()}
    losses = run.datums.column("loss").to_numpy()
    dots = ax_loss.collections[0].get_offsets()
    np.testing.assert_allclose(np.asarray(dots), np.column_stack([losses, norms]), rtol=1e-6)
    assert "rank correlation" in ax_loss.get_title()
    assert ax_heat.images
    from matplotlib.image import imread

    image = imread(tmp_path / "fig.png")
    assert image.shape[:2] == (500, 1200) and image.std() > 0


@pytest.mark.slow
def test_the_default_demo_as_a_new_user_runs_it(tmp_path: Path) -> None:
    """README command 1 from a fresh directory, then the three commands it suggests; the
    store within 50 MiB and 500 files; under 30 s of CPU time (wall time on a shared machine
    says little), and a second run replaces the first."""
    env = {**os.environ, "COLUMNS": "200"}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)

    def gradlog_cli(*args: str) -> str:
        done = subprocess.run([sys.executable, "-m", "gradlog", *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    text = gradlog_cli("train")
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (used.ru_utime - before.ru_utime) + (used.ru_stime - before.ru_stime)
    assert cpu < 30, f"the default demo took {cpu:.1f} s of CPU"
    store = tmp_path / "runs" / "demo.gradlog"
    files = [p for p in store.rglob("*") if p.is_file()]
    assert len(files) <= 500 and sum(p.stat().st_size for p in files) <= 50 * 2**20
    assert "step 32/32" in text  # plain progress lines: stdout is a pipe here
    for command in ("gradlog influence runs/demo.gradlog --probe 0",
                    "gradlog plot runs/demo.gradlog --out fig.png",
                    "gradlog info runs/demo.gradlog"):
        assert command in text
    run = gradlog.open(store)
    counts = np.bincount(run.datums.column("datum_id").to_numpy())
    assert counts.min() >= 4 and run.probe_ids
    influence = gradlog_cli("influence", "runs/demo.gradlog", "--probe", "0")
    assert "proponents" in influence and "opponents" in influence
    assert "wrote fig.png" in gradlog_cli("plot", "runs/demo.gradlog", "--out", "fig.png")
    assert gradlog.__version__ in gradlog_cli("--version")
    assert "replacing it" in gradlog_cli("train", "--steps", "2")
    assert [p.name for p in (tmp_path / "runs").iterdir()] == ["demo.gradlog"]
