"""The ``gradlog`` command through typer's CliRunner: exit codes and messages."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

import gradlog
from gradlog.cli._render import human_bytes
from gradlog.cli.main import app
from gradlog.store.format import FORMAT_VERSION

runner = CliRunner()
SMALL = ["--steps", "3", "--batch-size", "4", "--seq-len", "16"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("cli") / "demo.gradlog"
    result = runner.invoke(app, ["train", *SMALL, "--out", str(out)])
    assert result.exit_code == 0, result.output
    return out


def test_train_prints_a_summary(tmp_path: Path) -> None:
    out = tmp_path / "r.gradlog"
    result = runner.invoke(app, ["train", *SMALL, "--out", str(out), "--backend", "loop"])
    assert result.exit_code == 0, result.output
    for text in ("steps recorded", "records", "bytes on disk", "x plain", "per step"):
        assert text in result.output
    run = gradlog.open(out)
    assert run.steps.num_rows == 3 and run.datums.num_rows == 12
    text = " ".join(result.output.replace("│", " ").split())  # the summary table's cells
    assert "12 (12 datums, at 1 step each on average)" in text  # each datum once: "1 step"
    # the header says what its bytes are: the batch's records and the probes, full gradients
    four = 4 * 4 * sum(run.params.column("numel").to_pylist())  # 4 full float32 gradients
    assert f"{human_bytes(2 * four)} per step (4 records: {human_bytes(four)}; 4 probes, kept " \
        f"in full: {human_bytes(four)}), {human_bytes(3 * 2 * four)} for the run before " \
        "compression" in text


def test_train_store_reads_back(trained: Path) -> None:
    run = gradlog.open(trained)
    assert run.config["backend"] == "auto" and run.attrs["backend"]["name"] == "hooks"
    assert run.steps.column("step").to_pylist() == [0, 1, 2]
    g = run.grads("head.weight", step=1)
    assert g.shape[0] == 4 and np.isfinite(g).all() and np.abs(g).sum() > 0
    # datum ids are windows of the corpus: stable identifiers within the run
    assert all(i >= 0 for i in run.datums.column("datum_id").to_pylist())


def test_train_params_and_every(tmp_path: Path) -> None:
    out = tmp_path / "r.gradlog"
    result = runner.invoke(
        app, ["train", *SMALL, "--out", str(out), "-p", "blocks.*.mlp.*", "--every", "2"]
    )
    assert result.exit_code == 0, result.output
    run = gradlog.open(out)
    assert run.steps.column("step").to_pylist() == [0, 2]
    assert all(".mlp." in n for n in run.param_names)


def test_train_forms_and_batch_grad(tmp_path: Path) -> None:
    out = tmp_path / "r.gradlog"
    form = '{"blocks.*.weight": {"form": "projection", "dim": 16}, "*": "full"}'
    result = runner.invoke(
        app, ["train", *SMALL, "--out", str(out), "--form", form, "--batch-grad", "sum"]
    )
    assert result.exit_code == 0, result.output
    assert "forms and bytes per step" in result.output and "projection" in result.output
    run = gradlog.open(out)
    assert run.attrs["backend"]["batch_grad"] == "sum"
    assert run.form("blocks.1.mlp.fc.weight").name == "projection"
    assert run.form("head.weight").name == "full"
    info = runner.invoke(app, ["info", str(out)])
    assert info.exit_code == 0 and "batch_grad=sum" in info.output and "form=" in info.output
    bad = runner.invoke(app, ["train", *SMALL, "--out", str(tmp_path / "b"), "--form", "{x"])
    assert bad.exit_code == 1 and "not valid JSON" in bad.output
    few = runner.invoke(app, ["train", "--steps", "1", "--windows", "3", "--batch-size", "4",
                              "--out", str(tmp_path / "few")])  # refused before the store
    assert few.exit_code == 1 and "--batch-size <= --windows" in " ".join(few.output.split())
    assert not (tmp_path / "few").exists()
    # the library's notice on projected statistics: one "note:" line, not Python's warning
    shown = runner.invoke(app, ["show", str(out), "-p", "blocks.1.mlp.fc.weight"])
    assert shown.exit_code == 0, shown.output
    assert "note: parameter 'blocks.1.mlp.fc.weight' was recorded as a random projection" in (
        " ".join(shown.output.split()))
    assert "UserWarning" not in shown.output


def test_info(trained: Path) -> None:
    result = runner.invoke(app, ["info", str(trained)])
    assert result.exit_code == 0, result.output
    expected = (f"gradlog v{FORMAT_VERSION}", "CharGPT", "head.weight", "records", "bytes on disk")
    for text in expected:
        assert text in result.output
    assert "batch_grad=" not in result.output  # options at their defaults are not listed


def test_info_json(trained: Path) -> None:
    result = runner.invoke(app, ["info", str(trained), "--json"])
    assert result.exit_code == 0, result.output
    info = json.loads(result.output)
    assert info["format_version"] == FORMAT_VERSION
    assert info["steps"] == 3 and info["records"] == 12
    assert {p["name"] for p in info["params"]} == set(gradlog.open(trained).param_names)


def test_info_on_a_path_that_is_not_a_store(tmp_path: Path) -> None:
    result = runner.invoke(app, ["info", str(tmp_path)])
    assert result.exit_code == 1
    assert "not a gradlog store" in result.output and "Traceback" not in result.output


def test_train_refuses_to_overwrite(trained: Path) -> None:
    result = runner.invoke(app, ["train", *SMALL, "--out", str(trained)])
    assert result.exit_code == 1
    text = " ".join(result.output.split())
    assert "already holds a gradlog run. Pass --overwrite to replace it" in text
    # what the CLI offers: not the library's keywords, nor a --resume it does not have
    assert "resume" not in text and "overwrite=True" not in text
    assert gradlog.open(trained).steps.num_rows == 3  # the existing run is intact


def test_train_bad_params_pattern(tmp_path: Path) -> None:
    result = runner.invoke(app, ["train", *SMALL, "--out", str(tmp_path / "r"), "-p", "nope*"])
    assert result.exit_code == 1
    assert "matches no parameter" in result.output


def test_train_again_replaces_the_demo_with_a_notice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # README command 1 run twice: one demo store, replaced with a notice, never a second copy
    monkeypatch.chdir(tmp_path)
    first = runner.invoke(app, ["train", *SMALL])
    assert first.exit_code == 0 and "replacing" not in first.output
    again = runner.invoke(app, ["train", "--steps", "2", "--batch-size", "4", "--seq-len", "16"])
    assert again.exit_code == 0, again.output
    assert "runs/demo.gradlog holds an earlier run: replacing it" in again.output
    assert [p.name for p in (tmp_path / "runs").iterdir()] == ["demo.gradlog"]
    assert gradlog.open(tmp_path / "runs" / "demo.gradlog").steps.num_rows == 2  # replaced


def test_train_overwrite_replaces_the_default_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert runner.invoke(app, ["train", *SMALL, "--name", "t"]).exit_code == 0
    result = runner.invoke(app, ["train", "--steps", "2", "--batch-size", "4", "--seq-len", "16",
                                 "--name", "t", "--overwrite"])
    assert result.exit_code == 0, result.output
    assert [p.name for p in (tmp_path / "runs").iterdir()] == ["t.gradlog"]
    assert gradlog.open(tmp_path / "runs" / "t.gradlog").steps.num_rows == 2  # replaced


def test_train_overwrite_never_deletes_a_directory_that_is_not_a_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    keep = tmp_path / "runs" / "t.gradlog" / "notes.txt"
    keep.parent.mkdir(parents=True)
    keep.write_text("mine")
    result = runner.invoke(app, ["train", *SMALL, "--name", "t", "--overwrite"])
    assert result.exit_code == 1 and "not a gradlog store" in result.output
    assert "Traceback" not in result.output
    assert keep.read_text() == "mine"


@pytest.mark.parametrize("bad", [
    ["--backend", "foo"], ["--dtype", "foo"], ["--batch-size", "100"], ["-p", "nothing.*"],
])
def test_train_refused_options_never_announce_a_replacement(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bad: list[str]
) -> None:
    # the earlier run is kept when an option is refused, so no notice says it is replaced
    monkeypatch.chdir(tmp_path)
    assert runner.invoke(app, ["train", *SMALL, "--name", "keep"]).exit_code == 0
    result = runner.invoke(app, ["train", *SMALL, "--name", "keep", *bad])
    assert result.exit_code == 1 and "error:" in result.output
    assert "replacing" not in result.output, result.output
    assert gradlog.open(tmp_path / "runs" / "keep.gradlog").steps.num_rows == 3


def test_train_windows_0_trains_on_every_window_but_the_probes(tmp_path: Path) -> None:
    from gradlog.demo import CharCorpus, load_corpus

    out = tmp_path / "r.gradlog"
    result = runner.invoke(app, ["train", "--windows", "0", "--steps", "1", "--batch-size", "2",
                                 "--seq-len", "256", "--probes", "2", "--out", str(out)])
    assert result.exit_code == 0, result.output
    available = CharCorpus(load_corpus()).dataset(256)
    meta = gradlog.open(out).config["metadata"]
    assert meta["windows"] == available - 2  # the probes are the last two windows
    assert meta["probe_windows"] == [available - 2, available - 1]


def test_train_form_norm_summarises_without_influence(tmp_path: Path) -> None:
    """Form 'norm' keeps no training gradient: the run is good, its summary skips influence
    on the probes and says why, and the header's bytes are the probes' (kept in full)."""
    out = tmp_path / "r.gradlog"
    result = runner.invoke(app, ["train", *SMALL, "--form", "norm", "--out", str(out)])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "no influence on the probes: every parameter was recorded with form 'norm'" in text
    assert f"gradlog influence {out} --self" in text and "--probe 0" not in text
    run = gradlog.open(out)
    four = 4 * 4 * sum(run.params.column("numel").to_pylist())  # 4 full float32 gradients
    assert "the records' forms are planned at the first step; the 4 probes are kept in full: " \
        f"{human_bytes(four)} per step" in text
    assert f"{human_bytes(four)} per step (4 records: 0 B; 4 probes, kept in full: " \
        f"{human_bytes(four)}), {human_bytes(3 * four)} for the run before compression" in text
    assert run.steps.num_rows == 3 and set(run.params.column("form").to_pylist()) == {"norm"}


def test_train_interrupted_says_what_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C in the training loop: one line on stderr naming the steps kept, exit code 130."""
    from gradlog.recorder import GradRecorder

    step = GradRecorder.step

    def interrupted(self: GradRecorder, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("step") == 2:
            raise KeyboardInterrupt
        return step(self, *args, **kwargs)

    monkeypatch.setattr(GradRecorder, "step", interrupted)
    out = tmp_path / "r.gradlog"
    result = runner.invoke(app, ["train", "--steps", "4", "--batch-size", "4", "--seq-len", "16",
                                 "--out", str(out)])
    assert result.exit_code == 130, result.output
    said = " ".join(result.stderr.split())
    assert f"interrupted at step 2: steps 0..1 are kept in {out} (gradlog verify {out}" in said
    assert "Traceback" not in result.output
    assert gradlog.open(out).steps.column("step").to_pylist() == [0, 1]
    assert runner.invoke(app, ["verify", str(out)]).exit_code == 0


def test_verify_a_directory_that_is_not_a_store(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    for path in (tmp_path, tmp_path / "file"):
        result = runner.invoke(app, ["verify", str(path)])
        assert result.exit_code == 1  # as gradlog info on it
        lines = result.output.strip().splitlines()
        text = " ".join(result.output.split())
        assert f"error: {path} is not a gradlog store" in text and "FAIL" not in text
        assert len(" ".join(lines).split("error:")) == 2  # one error, no check listed
    assert "not a gradlog store" in runner.invoke(app, ["info", str(tmp_path)]).output


def test_parameter_names_are_never_cut_short(
    trained: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At 80 columns, blocks.1.mlp.fc.weight and blocks.1.mlp.proj.weight are not both
    shown as blocks.1.m…: the other columns fold instead."""
    from gradlog.cli._render import console

    monkeypatch.setattr(console, "_width", 80)
    for command in (["show"], ["info"], ["ls"], ["norms", "-p", "blocks.1.mlp.proj.weight"]):
        result = runner.invoke(app, [command[0], str(trained), *command[1:]])
        assert result.exit_code == 0, result.output
        assert "…" not in result.output, (command, result.output)
        assert "blocks.1.mlp.proj.weight" in result.output, (command, result.output)
        if command[0] != "norms":
            assert "blocks.1.mlp.fc.weight" in result.output, (command, result.output)


@pytest.mark.parametrize("every", [1, 2, 3])
def test_train_timings_are_measured_for_any_every(tmp_path: Path, every: int) -> None:
    steps = str(2 * every + 1)
    result = runner.invoke(app, ["train", "--steps", steps, "--batch-size", "2", "--seq-len",
                                 "16", "--every", str(every), "--out", str(tmp_path / "r")])
    assert result.exit_code == 0, result.output
    assert "nan ms" not in result.output and "nanx" not in result.output
    assert "not measured" not in result.output and "x plain" in result.output


def test_train_timings_too_few_steps_say_so(tmp_path: Path) -> None:
    result = runner.invoke(app, ["train", "--steps", "1", "--batch-size", "2", "--seq-len", "16",
                                 "--out", str(tmp_path / "r")])
    assert result.exit_code == 0, result.output
    assert "nan ms" not in result.output and "nanx" not in result.output
    assert "not measured (needs at least 2 steps)" in result.output


def test_export_refuses_a_format_contradicting_the_extension(
    trained: Path, tmp_path: Path
) -> None:
    out = tmp_path / "e.npz"
    result = runner.invoke(app, ["export", str(trained), "--out", str(out), "--format", "parquet"])
    assert result.exit_code == 1
    assert "--format parquet" in result.output and ".npz" in result.output
    assert "Traceback" not in result.output and not out.exists()
    # an agreeing --format, or any --format for an extension that names none, still works
    for name, fmt in (("a.npz", "npz"), ("a.bin", "parquet")):
        ok = runner.invoke(app, ["export", str(trained), "--out", str(tmp_path / name),
                                 "--format", fmt])
        assert ok.exit_code == 0, ok.output


def test_train_help_lists_the_registries() -> None:
    from gradlog.backends import BACKENDS
    from gradlog.backends.hooks import BATCH_GRADS
    from gradlog.forms import FORMS
    from gradlog.store.dtypes import STORAGE_DTYPE_NAMES

    result = runner.invoke(app, ["train", "--help"])
    assert result.exit_code == 0, result.output
    assert "{" + "forms}" not in result.output  # every placeholder filled
    for name in (*FORMS, *BACKENDS, *BATCH_GRADS, *STORAGE_DTYPE_NAMES):
        assert name in result.output


def test_reading_a_store_does_not_import_torch() -> None:
    # `gradlog info` stays fast: the store, the reader and the CLI import torch lazily
    store = str(Path(__file__).parent / "golden" / "v3-forms.store")
    code = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from gradlog.cli.main import app\n"
        f"for command in (['--help'], ['info', {store!r}], ['ls', {store!r}]):\n"
        "    result = CliRunner().invoke(app, command)\n"
        "    assert result.exit_code == 0, result.output\n"
        "    assert 'torch' not in sys.modules, command\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_public_errors_are_top_level() -> None:
    from gradlog import errors

    for name in errors.__all__:
        assert getattr(gradlog, name) is getattr(errors, name)
        assert name in gradlog.__all__
    assert issubclass(gradlog.NonFiniteLossError, gradlog.InputError)


def test_stored_names_are_shown_literally(tmp_path: Path) -> None:
    """Module keys that look like rich markup are printed as recorded, never styled or
    parsed (a crash, or ``[red]head.weight`` shown as a red ``head.weight`` that ``-p`` would
    not find)."""
    import torch
    from torch import nn

    model = nn.Sequential()
    model.add_module("[red]head", nn.Linear(3, 2))
    model.add_module("emb[/]", nn.Linear(2, 1))
    out = tmp_path / "[bold]run.gradlog"
    with gradlog.GradRecorder(model, out) as rec:
        x = torch.randn(4, 3)
        rec.backward(model(x).square().sum(1), step=0)
    for command in (["info"], ["ls"], ["show", "--step", "0"], ["norms"]):
        result = runner.invoke(app, [*command, str(out)], terminal_width=200)
        assert result.exit_code == 0, (command, result.output)
        assert "[red]head.weight" in result.output, (command, result.output)
        if command != ["info"]:
            assert "emb[/].weight" in result.output, (command, result.output)
    result = runner.invoke(app, ["info", str(out)], terminal_width=200)
    assert "[bold]run.gradlog" in result.output


def test_version_and_short_help() -> None:
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.strip() == f"gradlog {gradlog.__version__}"
    assert runner.invoke(app, ["-V"]).output == result.output
    for command in (["-h"], ["info", "-h"], ["train", "-h"]):
        result = runner.invoke(app, command)
        assert result.exit_code == 0 and "Usage:" in result.output, (command, result.output)


@pytest.mark.parametrize("command", ["show", "norms"])
def test_an_empty_selection_is_an_error(trained: Path, command: str) -> None:
    result = runner.invoke(app, [command, str(trained), "--step", "2:1"])
    assert result.exit_code == 1
    assert "--step 2:1 selects no record" in result.output and "steps 0..2" in result.output
    assert runner.invoke(app, [command, str(trained), "--step", "1:2"]).exit_code == 0


def test_train_progress_is_plain_lines_off_a_terminal(tmp_path: Path) -> None:
    # CliRunner's stdout is no terminal, as a CI log's: progress comes as lines, not a bar
    result = runner.invoke(app, ["train", "--steps", "16", "--batch-size", "2", "--seq-len",
                                 "16", "--out", str(tmp_path / "r")])
    assert result.exit_code == 0, result.output
    lines = [line.split() for line in result.output.splitlines()
             if re.match(r"step \d+/16 ", line)]
    done = [int(words[1].split("/")[0]) for words in lines]
    assert {1, 2, 4, 8, 16} <= set(done) and done == sorted(done)  # every 8th of the run
    assert all(words[2] == "loss" and float(words[3]) > 0 for words in lines)


def test_train_progress_is_a_bar_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    from rich.console import Console

    from gradlog.cli import record

    screen = io.StringIO()
    monkeypatch.setattr(record, "console", Console(file=screen, force_terminal=True))
    with record._Progress(4) as progress:
        assert progress.bar is not None
        for step in range(4):
            progress.advance(step, 1.0)
    assert "step 1/4" not in screen.getvalue()


@pytest.mark.slow
def test_train_progress_lines_arrive_as_it_goes(tmp_path: Path) -> None:
    """Through a real pipe: the first progress line is readable while training goes on."""
    import time

    with subprocess.Popen(
        [sys.executable, "-m", "gradlog", "train", "--steps", "12", "--batch-size", "2",
         "--seq-len", "16", "--out", str(tmp_path / "r")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    ) as proc:
        assert proc.stdout is not None
        first = next(line for line in proc.stdout if line.startswith("step "))
        seen = time.perf_counter()
        rest = proc.stdout.read()
    assert proc.returncode == 0 and "step 12/12" in rest and first.startswith("step 1/12")
    assert time.perf_counter() - seen > 0.1  # not all written at exit


def test_storage_options_are_parsed_as_fsspec_parses_its_variables(tmp_path: Path) -> None:
    from gradlog.cli._args import storage_options
    from gradlog.errors import InputError

    assert storage_options(["endpoint_url=http://h:9000", "anon=true", "n=5",
                            'client_kwargs={"region_name": "eu-west-1"}', "k=a=b"]) == {
        "endpoint_url": "http://h:9000", "anon": True, "n": 5,
        "client_kwargs": {"region_name": "eu-west-1"}, "k": "a=b"}
    with pytest.raises(InputError, match="not KEY=VALUE"):
        storage_options(["endpoint_url"])
    local = runner.invoke(app, ["info", str(tmp_path), "--storage-option", "anon=true"])
    assert local.exit_code == 1 and "is a local path" in local.output


@pytest.fixture
def s3_server(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A bucket on a moto S3 server on loopback that only options can reach: fsspec's
    configuration and the AWS environment are left empty."""
    pytest.importorskip("s3fs", reason="S3 tests need s3fs: pip install -e '.[s3]'")
    moto_server = pytest.importorskip("moto.server", reason="pip install 'moto[server]'")
    import socket

    import boto3
    import fsspec

    for var in [v for v in os.environ if v.startswith(("AWS_", "FSSPEC_"))]:
        monkeypatch.delenv(var)
    monkeypatch.setattr(fsspec.config, "conf", {})
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                 aws_access_key_id="testing", aws_secret_access_key="testing"
                 ).create_bucket(Bucket="cli-tests")
    try:
        yield endpoint
    finally:
        server.stop()


def test_storage_options_on_every_command(s3_server: str, tmp_path: Path) -> None:
    from gradlog.store.fs import store_path

    options = {"endpoint_url": s3_server, "key": "testing", "secret": "testing"}
    flags = [arg for k, v in options.items() for arg in ("--storage-option", f"{k}={v}")]
    url = "s3://cli-tests/runs/demo.gradlog"
    result = runner.invoke(app, ["train", *SMALL, "--out", url, *flags])
    assert result.exit_code == 0, result.output
    assert "recording none (--probes 0)" in result.output
    assert f"gradlog info {url} --storage-option endpoint_url={s3_server}" in result.output
    # the oracle: the same run recorded into a local directory
    local = tmp_path / "local.gradlog"
    assert runner.invoke(app, ["train", *SMALL, "--probes", "0", "--out", str(local)]
                         ).exit_code == 0
    remote, want = gradlog.open(store_path(url, options)), gradlog.open(local)
    assert remote.datums.drop_columns(["loss"]).equals(want.datums.drop_columns(["loss"]))
    np.testing.assert_allclose(remote.grads("head.weight"), want.grads("head.weight"),
                               rtol=1e-5, atol=1e-7)
    for command in (["info"], ["ls"], ["show", "--step", "1"], ["norms"],
                    ["influence", "--self"], ["export", "--out", str(tmp_path / "e.npz")],
                    ["plot", "--out", str(tmp_path / "f.png")], ["verify"]):
        done = runner.invoke(app, [command[0], url, *command[1:], *flags])
        assert done.exit_code == 0, (command, done.output)
    assert "intact" in done.output


def test_storage_access_errors_are_one_line_and_bugs_keep_their_traceback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An object store's client refusing access (no credentials) is the user's to fix: one
    line, exit 1. Anything else unexpected is a bug and keeps its traceback."""
    import gradlog.cli.inspection as inspection

    no_credentials = type("NoCredentialsError", (Exception,), {"__module__": "botocore.exceptions"})

    def refused(*_: Any) -> Any:
        raise no_credentials("Unable to locate credentials")

    monkeypatch.setattr(inspection, "open_run", refused)
    result = runner.invoke(app, ["info", "s3://bucket/run.gradlog"])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "refused access (NoCredentialsError: Unable to locate credentials)" in " ".join(
        result.output.split())

    def bug(*_: Any) -> Any:
        raise KeyError("internal")

    monkeypatch.setattr(inspection, "open_run", bug)
    result = runner.invoke(app, ["info", "run.gradlog"])
    assert isinstance(result.exception, KeyError)


def test_train_messages_name_its_options(tmp_path: Path) -> None:
    """The demo's checks spoke of block_size=, which train does not take (--seq-len)."""
    out = tmp_path / "r.gradlog"
    result = runner.invoke(app, ["train", "--out", str(out), "--seq-len", "100000"])
    text = " ".join(result.output.split())
    assert result.exit_code == 1 and "--seq-len 100000 is too long" in text, text
    assert "use a smaller --seq-len" in text and "block_size" not in text
    result = runner.invoke(app, ["train", "--out", str(out), "--windows", "100000"])
    text = " ".join(result.output.split())
    assert "fewer --windows or --probes, or a shorter --seq-len" in text, text
    for option, name in (("--batch-grad", "batch_grad"), ("--backend", "backend"),
                         ("--dtype", "dtype")):
        result = runner.invoke(app, ["train", "--out", str(out), option, "bogus"])
        text = " ".join(result.output.split())
        assert result.exit_code == 1 and f"{option} 'bogus'" in text, text
        assert f"{name}=" not in text
    assert not out.exists()
