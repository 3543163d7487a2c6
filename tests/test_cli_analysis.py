"""The analysis commands through typer's CliRunner: ls, show, norms, influence, export, plot.

Each command's numbers are compared with the library call it wraps (itself tested against
brute force in test_analysis.py); errors must be one line, exit code 1, no traceback.
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from typer.testing import CliRunner

import gradlog
from gradlog.cli.main import app

runner = CliRunner()


def _record(path: Path, *, probes: bool = True, lr: bool = True) -> Path:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(24, 4, generator=gen), torch.randint(0, 3, (24,), generator=gen)
    px, py = torch.randn(2, 4, generator=gen), torch.randint(0, 3, (2,), generator=gen)

    def loss_fn(m: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(m(batch[0]), batch[1], reduction="none")

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradlog.GradRecorder(
        model,
        path,
        optimizer=opt if lr else None,
        probes=(loss_fn, (px, py)) if probes else None,
        probe_ids=[5, 8] if probes else None,
    ) as rec:
        for _ in range(2):
            for idx in torch.arange(24).split(6):
                rec.backward(loss_fn(model, (x[idx], y[idx])), datum_ids=idx)
                opt.step()
                opt.zero_grad()
    return path


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _record(tmp_path_factory.mktemp("cli") / "run.gradlog")


def _ok(*args: str) -> str:
    result = runner.invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return result.output


def _text(*args: str) -> str:
    return " ".join(_ok(*args).split())  # rich wraps long lines and titles


def _error(*args: str) -> str:
    result = runner.invoke(app, list(args))
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output and "error:" in result.output
    return " ".join(result.output.split())  # rich wraps long lines


def test_ls(store: Path) -> None:
    text = _ok("ls", str(store))
    for word in ("0.weight", "2.bias", "5x4", "8 committed steps", "48 records", "probes: 2"):
        assert word in " ".join(text.split())
    data = json.loads(_ok("ls", str(store), "--json"))
    assert [p["name"] for p in data["params"]] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert [s["step"] for s in data["steps"]] == list(range(8))
    assert data["probe_ids"] == [5, 8] and data["steps"][0]["lr"] == 0.1


def test_ls_long_runs_are_elided(tmp_path: Path) -> None:
    path = tmp_path / "long.gradlog"
    model = nn.Linear(2, 1)
    with gradlog.GradRecorder(model, path) as rec:
        for _ in range(25):
            rec.backward(model(torch.randn(2, 2)).sum(1))
    assert "--all" in _ok("ls", str(path))
    assert "   24 " in _ok("ls", str(path), "--all") and "probes" not in _ok("ls", str(path))


def test_show(store: Path) -> None:
    run = gradlog.open(store)
    text = _ok("show", str(store), "-p", "0.weight", "--step", "3")
    assert "6x5x4" in text and "gradients at step 3" in text
    stats = json.loads(_ok("show", str(store), "-p", "0.weight", "-s", "3", "--json"))[0]
    g = run.grads("0.weight", step=3).astype(np.float64)
    assert stats["norm"] == pytest.approx(np.linalg.norm(g), rel=1e-9)
    assert stats["std"] == pytest.approx(g.std(), rel=1e-9) and stats["max"] == g.max()
    every = json.loads(_ok("show", str(store), "--datum", "3,4", "--step", "0:6", "--json"))
    assert [s["param"] for s in every] == run.param_names
    assert every[0]["n_records"] == run.records(slice(0, 6), [3, 4]).num_rows


def test_show_errors_list_what_exists(store: Path) -> None:
    assert "parameter '0.wieght' is not recorded" in _error("show", str(store), "-p", "0.wieght")
    assert "Did you mean: 0.weight" in _error("show", str(store), "-p", "0.wieght")
    text = _error("show", str(store), "--step", "12")
    assert "step 12 is not a committed step" in text and "Nearest steps: 3, 4, 5, 6, 7" in text
    text = _error("show", str(store), "--datum", "99")
    assert "datum 99 has no record" in text and "Nearest datum ids:" in text
    assert "is not a selection" in _error("show", str(store), "--step", "two")


def test_datum_ranges(store: Path, tmp_path: Path) -> None:
    """--datum A:B selects datum ids A..B-1, as --step A:B selects steps."""
    run = gradlog.open(store)
    shown = json.loads(_ok("show", str(store), "-p", "0.weight", "--datum", "1:3", "--json"))[0]
    assert shown == run.stats("0.weight", datum=slice(1, 3))
    assert shown["n_records"] == run.records(datum=[1, 2]).num_rows > 0
    rows = json.loads(_ok("norms", str(store), "-p", "2.bias", "-d", "20:", "--json"))
    assert rows == run.norms("2.bias", datum=slice(20, None)).to_pylist()
    assert {r["datum_id"] for r in rows} == {20, 21, 22, 23}
    _ok("export", str(store), "--out", str(tmp_path / "r.npz"), "-d", ":2", "-s", "0:4")
    with np.load(tmp_path / "r.npz") as z:
        assert sorted(set(z["datum_id"].tolist())) == [0, 1] and z["step"].max() < 4
    assert "is not a selection" in _error("show", str(store), "--datum", "1:x")
    assert "is not a selection" in _error("norms", str(store), "--datum", "1.5")


def test_norms(store: Path, tmp_path: Path) -> None:
    run = gradlog.open(store)
    text = _text("norms", str(store), "--limit", "3")
    assert "largest of 192 per-record gradient norms" in text and "(189 more" in text
    rows = json.loads(_ok("norms", str(store), "-p", "2.bias", "--step", "1", "--json"))
    want = run.norms("2.bias", step=1).to_pylist()
    assert rows == want
    _ok("norms", str(store), "--out", str(tmp_path / "n.parquet"))
    assert pq.read_table(tmp_path / "n.parquet").num_rows == 4 * run.datums.num_rows
    out = json.loads(
        _ok("norms", str(store), "-p", "0.bias", "--out", str(tmp_path / "n.csv"), "--json")
    )
    table = pcsv.read_csv(tmp_path / "n.csv")
    assert out["rows"] == table.num_rows == run.datums.num_rows
    assert table.column_names == ["step", "datum_id", "row", "param", "norm"]
    assert "must end in .parquet or .csv" in _error("norms", str(store), "--out", "n.txt")
    assert "is not recorded" in _error("norms", str(store), "-p", "nope")


def test_influence(store: Path) -> None:
    run = gradlog.open(store)
    text = _ok("influence", str(store), "--probe", "8", "--top", "3")
    assert "proponents" in text and "opponents" in text
    data = json.loads(_ok("influence", str(store), "--probe", "8", "--top", "3", "--json"))
    assert data["rows"] == run.influence(8, top=3).to_pylist()
    weighted = json.loads(
        _ok("influence", str(store), "--probe", "5", "--weighted", "-p", "2.weight", "--json")
    )
    assert weighted["rows"] == run.influence(5, weighted=True, params="2.weight").to_pylist()
    selfish = json.loads(_ok("influence", str(store), "--self", "--top", "4", "--json"))
    assert selfish["rows"] == run.self_influence(top=4).to_pylist()
    assert "self-influence" in _ok("influence", str(store), "--self")


def test_influence_errors(store: Path, tmp_path: Path) -> None:
    text = _error("influence", str(store), "--probe", "6")
    assert "probe 6 is not recorded" in text and "Nearest probe ids: 5, 8" in text
    assert "recorded probes: 5, 8" in _error("influence", str(store))
    assert "exactly one of" in _error("influence", str(store), "--probe", "5", "--self")
    bare = _record(tmp_path / "bare.gradlog", probes=False, lr=False)
    assert "holds no probe: recorded without" in _error("influence", str(bare), "--probe", "0")
    text = _error("influence", str(bare), "--self")
    assert "recorded without one (lr is null)" in text and "optimizer=" in text
    assert "datum_id" in _ok("influence", str(bare), "--self", "--lr", "0.1", "--json")
    assert "too small" in _error("influence", str(store), "--probe", "5", "--max-memory", "1kB")


def test_influence_many_probes(store: Path, tmp_path: Path) -> None:
    """--probes: the datums x probes matrix equals one probe at a time, in every format."""
    run = gradlog.open(store)
    out = tmp_path / "m.parquet"
    text = _text("influence", str(store), "--probes", "all", "--kind", "cosine", "--out", str(out))
    assert "wrote 24 datums x 2 probes (cosine)" in text
    table = pq.read_table(out)
    assert table.column_names == ["datum_id", "probe_5", "probe_8"]
    assert table.schema.metadata[b"score_kind"] == b"cosine"
    for p in (5, 8):
        one = run.influence(p, top=None, kind="cosine")
        want = dict(zip(one.column("datum_id").to_pylist(), one.column("score").to_pylist()))
        got = dict(zip(table.column("datum_id").to_pylist(),
                       table.column(f"probe_{p}").to_pylist()))
        assert got.keys() == want.keys()
        for d, w in want.items():
            assert got[d] == pytest.approx(w, rel=1e-5, abs=1e-9)  # float32 products
    csv = tmp_path / "m.csv"
    _ok("influence", str(store), "--probes", "8", "--out", str(csv))
    assert pcsv.read_csv(csv).column_names == ["datum_id", "probe_8"]
    data = json.loads(_ok("influence", str(store), "--probes", "5:9", "--json"))
    assert data["probe_ids"] == [5, 8] and data["kind"] == "tracin"  # plain SGD: tracin
    assert len(data["scores"]) == 24 and len(data["scores"][0]) == 2
    assert "top datum per probe" in _text("influence", str(store), "--probes", "5,8")
    npz = np.load(_out_npz(store, tmp_path))
    assert npz["scores"].shape == (24, 2) and str(npz["kind"]) == "tracin"
    assert "exactly one of" in _error("influence", str(store), "--probes", "all", "--probe", "5")
    assert "no recorded probe id in that range (recorded: 5, 8)" in _error(
        "influence", str(store), "--probes", "10:20")
    assert "names probe(s) [5] more than once" in _error(
        "influence", str(store), "--probes", "5,8,5")
    assert "name the file .parquet" in _error("influence", str(store), "--probes", "all",
                                             "--out", str(tmp_path / "m.txt"))
    bare = _record(tmp_path / "bare.gradlog", lr=False)  # no optimizer: no optimizer state
    assert "--kind 'optimizer' needs" in _error("influence", str(bare), "--probe", "5", "--kind",
                                             "optimizer", "--lr", "0.1")


def _summary_rows(text: str) -> dict[int, list[str]]:
    """The --probes summary table's rows: probe -> [proponent, score, opponent, score]."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.split("│")[1:-1]]
        if len(cells) == 5 and cells[0].isdigit():
            rows[int(cells[0])] = cells[1:]
    return rows


def test_influence_summary_opponents_have_negative_scores(
    store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--probes' summary names a probe's opponent only when some datum's score is negative,
    and its proponent only when one is positive, as --probe's two tables do."""
    run = gradlog.open(store)
    rows = _summary_rows(_ok("influence", str(store), "--probes", "all"))
    for p in (5, 8):  # this store's probes have both
        one = run.influence(p, top=1).to_pylist()
        want = {r["kind"]: (str(r["datum_id"]), r["score"]) for r in one}
        assert rows[p][0] == want["proponent"][0] and float(rows[p][1]) > 0
        assert rows[p][2] == want["opponent"][0] and float(rows[p][3]) < 0
    # a probe every datum helped, and one every datum hurt
    from dataclasses import replace

    from gradlog.run import Run

    matrix = run.influence_matrix([5, 8])
    scores = np.stack([np.abs(matrix.scores[:, 0]) + 1, -np.abs(matrix.scores[:, 1]) - 1], 1)
    monkeypatch.setattr(Run, "influence_matrix", lambda *_, **__: replace(matrix, scores=scores))
    rows = _summary_rows(_ok("influence", str(store), "--probes", "all"))
    assert rows[5][2:] == ["none", "-"] and float(rows[5][1]) >= 1.0
    assert rows[8][:2] == ["none", "-"] and float(rows[8][3]) <= -1.0


def test_influence_out_writes_the_ranking(store: Path, tmp_path: Path) -> None:
    """--out with --probe or --self writes the ranking shown, in each format of --probes."""
    run = gradlog.open(store)
    want = run.influence(5, top=3)
    for name in ("p.csv", "p.parquet", "p.npz"):
        out = tmp_path / name
        assert f"wrote 6 datums ranked for probe 5 (tracin) to {out}" in _text(
            "influence", str(store), "--probe", "5", "--top", "3", "--out", str(out))
        if name.endswith(".npz"):
            with np.load(out) as z:
                got = {k: z[k].tolist() for k in want.column_names}
                assert str(z["score_kind"]) == "tracin"
        else:
            got = (pcsv.read_csv(out) if name.endswith(".csv") else pq.read_table(out)).to_pydict()
        assert got == want.to_pydict()
    selfish = json.loads(_ok("influence", str(store), "--self", "--top", "4", "--out",
                             str(tmp_path / "s.csv"), "--json"))
    assert selfish["out"] == str(tmp_path / "s.csv") and "rows" not in selfish
    assert pcsv.read_csv(tmp_path / "s.csv").to_pydict() == run.self_influence(top=4).to_pydict()
    assert "name the file .parquet, .csv or .npz" in _error(
        "influence", str(store), "--self", "--out", str(tmp_path / "s.txt"))


def _out_npz(store: Path, tmp_path: Path) -> Path:
    out = tmp_path / "m.npz"
    _ok("influence", str(store), "--probes", "all", "--out", str(out))
    return out


def test_export(store: Path, tmp_path: Path) -> None:
    run = gradlog.open(store)
    summary = json.loads(
        _ok("export", str(store), "--out", str(tmp_path / "e.npz"), "-s", "2:5", "--json")
    )
    assert summary["records"] == 18 and summary["format"] == "npz"
    with np.load(tmp_path / "e.npz") as z:
        assert np.array_equal(z["grads/0.weight"], run.grads("0.weight", step=slice(2, 5)))
    text = _ok(
        "export",
        str(store),
        "--out",
        str(tmp_path / "e.data"),
        "--format",
        "parquet",
        "-p",
        "2.bias",
    )
    assert "wrote 48 records x 1 parameters" in text
    table = pq.read_table(tmp_path / "e.data")
    assert table.column_names[-1] == "grads/2.bias" and table.num_rows == 48
    # the CLI's flags, not the library's format= argument
    text = _error("export", str(store), "--out", "e.h5")
    assert "--out e.h5 names no export format" in text and "--format parquet|npz" in text
    assert "format=" not in text
    text = _error("export", str(store), "--out", "e.npz", "--format", "h5")
    assert "--format h5 is not one of parquet, npz" in text and "format=" not in text
    assert "datum 77 has no record" in _error(
        "export", str(store), "--out", str(tmp_path / "x.npz"), "-d", "77"
    )


def test_norm_form_parameters(tmp_path: Path) -> None:
    """A parameter recorded with form 'norm' keeps no gradient: commands that read gradients
    skip it by default and say so; naming it with -p says which option to change."""
    torch.manual_seed(0)
    path = tmp_path / "forms.gradlog"
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    x, y = torch.randn(12, 4), torch.randint(0, 3, (12,))
    probe = (lambda m, b: F.cross_entropy(m(b[0]), b[1], reduction="none"), (x[:2], y[:2]))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradlog.GradRecorder(
        model, path, form={"0.bias": "norm"}, optimizer=opt, probes=probe
    ) as rec:
        for idx in torch.arange(12).split(4):
            rec.backward(F.cross_entropy(model(x[idx]), y[idx], reduction="none"), datum_ids=idx)
            opt.step()
            opt.zero_grad()
    run = gradlog.open(path)
    kept = ["0.weight", "2.weight", "2.bias"]
    for args in (["show"], ["export", "--out", str(tmp_path / "e.npz")], ["influence", "--probe",
                                                                          "0"]):
        result = runner.invoke(app, [args[0], str(path), *args[1:], "--json"])
        assert result.exit_code == 0, result.output
        assert "skipping 0.bias" in " ".join(result.stderr.split())
        data = json.loads(result.stdout)
        if args[0] == "show":
            assert [r["param"] for r in data] == kept
        elif args[0] == "export":
            assert data["params"] == kept
        else:
            assert data["rows"] == run.influence(0, params=kept).to_pylist()
    for args in (["show"], ["export", "--out", str(tmp_path / "e.npz")], ["influence", "--probe",
                                                                          "0"]):
        text = _error(args[0], str(path), *args[1:], "-p", "0.bias")
        assert "form 'norm'" in text and "-p/--param" in text and "params=" not in text
    assert "0.bias" in _ok("norms", str(path), "-p", "0.bias")  # norms are kept
    assert "skipping" not in _ok("influence", str(path), "--self")  # from the norms


def _png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR"
    width, height = struct.unpack(">II", head[16:24])
    return width, height


def test_plot_writes_a_png_of_the_size_asked(store: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "figs" / "norms.png"
    text = _ok(
        "plot", str(store), "--out", str(out), "--width", "900", "--height", "400", "--datums", "3"
    )
    assert "wrote" in text and _png_size(out) == (900, 400)
    from matplotlib.image import imread

    image = imread(out)  # opens as an image
    assert image.shape[:2] == (400, 900) and image.std() > 0
    _ok("plot", str(store), "--out", str(tmp_path / "one.png"), "-p", "0.bias")
    assert _png_size(tmp_path / "one.png") == (1200, 500)
    # no extension (matplotlib would write figure.png), or one that is not an image
    for name in ("bare", "notes.txt"):
        text = _error("plot", str(store), "--out", str(tmp_path / name))
        assert "ending in .png, .svg, .pdf" in text
        assert not list(tmp_path.glob(name.split(".")[0] + "*"))  # nothing written


def test_plot_without_matplotlib(
    store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    text = _error("plot", str(store), "--out", str(tmp_path / "f.png"))
    assert "pip install matplotlib" in text and "'.[plot]'" in text  # gradlog's extra


@pytest.mark.parametrize(
    "command",
    [
        ["ls"],
        ["show"],
        ["norms"],
        ["influence", "--self"],
        ["export", "--out", "x.npz"],
        ["plot", "--out", "x.png"],
    ],
)
def test_commands_on_a_path_that_is_not_a_store(command: list[str], tmp_path: Path) -> None:
    args: list[Any] = [command[0], str(tmp_path / "missing.gradlog"), *command[1:]]
    assert "does not exist" in _error(*args)


@pytest.mark.parametrize(
    ("command", "option", "value"),
    [("show", "--step", "-3:"), ("show", "--step", ":-1"), ("norms", "--datum", "1,-2"),
     ("norms", "--step", "-1"), ("export", "--datum", "-4:"), ("influence", "--probes", "-1:")],
)
def test_negative_selections_are_refused_not_counted_from_the_end(
    store: Path, tmp_path: Path, command: str, option: str, value: str
) -> None:
    """`--step=-3:` printed "gradients at step -3:" over every step; ids are >= 0."""
    extra = {"export": ["--out", str(tmp_path / "e.npz")], "influence": []}.get(command, [])
    text = _error(command, str(store), f"{option}={value}", *extra)
    assert f"{option} '{value}'" in text and "not positions" in text, text
    assert "does not count from the end" in text and "gradlog " in text  # where to look
    assert "run." not in text  # the CLI's words, not the Python API's
    assert not (tmp_path / "e.npz").exists()
    probe = runner.invoke(app, ["influence", str(store), "--probe=-1"])
    assert probe.exit_code == 2 and "--probe" in probe.output  # click's range check


def test_cli_messages_name_the_options_not_the_python_keywords(store: Path) -> None:
    for lr in ("0", "-1", "nan", "inf"):
        text = _error("influence", str(store), "--probe", "5", f"--lr={lr}")
        assert "--lr" in text and "omit --lr to use the recorded ones" in text, text
        assert "None" not in text and "lr=" not in text
    text = _error("influence", str(store), "--probe", "5", "--max-memory", "1kB")
    assert "Pass --max-memory >=" in text and "max_memory" not in text, text
    text = _error("show", str(store), "--max-memory", "lots")
    assert "--max-memory 'lots' is not a size" in text and "max_memory" not in text, text
    text = _error("influence", str(store), "--probe", "5", "--kind", "bogus")
    assert "--kind 'bogus' is not one of" in text, text
    # the Python API's own messages keep its keywords
    run = gradlog.open(store)
    with pytest.raises(gradlog.InputError, match=r"or None to use the recorded ones"):
        run.influence(5, lr=0)
    with pytest.raises(gradlog.InputError, match=r"max_memory='lots'"):
        run.stats("0.bias", max_memory="lots")
