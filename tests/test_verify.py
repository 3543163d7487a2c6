"""``gradlog verify`` and reads of damaged stores: every damage is found, named, never returned.

Each test records a small run, damages one thing the way a disk, a crash or a person would,
and checks that ``verify`` fails the right check with a message naming the place, that reads
raise :class:`StoreCorruptError` (never wrong numbers), and that the CLI exits 1.
"""

from __future__ import annotations

import json
import shutil
import struct
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch import nn
from typer.testing import CliRunner

import gradlog
from gradlog import errors
from gradlog.cli.main import app
from gradlog.store.verify import verify

GOLDEN = Path(__file__).resolve().parent / "golden"
runner = CliRunner()


def _record(
    path: Path, *, dtype: str = "float32", steps: int = 3, batch: int = 4, probes: bool = False
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    x, y = torch.randn(steps * batch, 3), torch.randn(steps * batch, 2)
    extra: dict[str, Any] = {}
    if probes:  # two probes, ids 7 and 9: one probe chunk per step and parameter
        extra = {"probes": (_probe_loss, (torch.randn(2, 3), torch.randn(2, 2))),
                 "probe_ids": [7, 9]}
    with gradlog.GradRecorder(model, path, backend="loop", dtype=dtype, **extra) as rec:
        for s in range(steps):
            xb, yb = x[s * batch : (s + 1) * batch], y[s * batch : (s + 1) * batch]
            rec.backward(((model(xb) - yb) ** 2).sum(1), step=s)


def _probe_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return ((model(batch[0]) - batch[1]) ** 2).sum(1)


def _shard(path: Path, param: str = "0.weight", shard: int = 1) -> Path:
    ndim = 2 if param.endswith("weight") else 1
    return path / "grads" / param / ".".join(["c", str(shard)] + ["0"] * ndim)


def _flip(file: Path, where: float = 0.5) -> None:
    data = bytearray(file.read_bytes())
    data[int(len(data) * where)] ^= 0x10
    file.write_bytes(bytes(data))


def _cli(path: Path) -> Any:
    return runner.invoke(app, ["verify", str(path)])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "bitround9"])
def test_an_intact_store_verifies(tmp_store: Path, dtype: str) -> None:
    _record(tmp_store, dtype=dtype)
    report = verify(tmp_store)
    assert report.ok, [c.problems for c in report.checks]
    assert [c.name for c in report.checks] == [
        "root",
        "commit log",
        "index",
        "arrays",
        "checksums",
        "schemas",
        "probes",
        "optimizer",
    ]
    assert report.check("commit log").summary == "3 committed steps (0..2)"
    assert report.check("probes").summary == "no probes"
    assert report.check("optimizer").summary == "no optimizer state"
    assert report.check("checksums").summary.startswith("12 chunk files read")  # 4 params x 3
    result = _cli(tmp_store)
    assert result.exit_code == 0, result.output
    assert "intact" in result.output and "FAIL" not in result.output


@pytest.mark.parametrize("golden", sorted(GOLDEN.glob("v*.store")), ids=lambda p: p.name)
def test_golden_stores_verify_with_their_crash_debris_as_notes(
    golden: Path, tmp_path: Path
) -> None:
    copy = tmp_path / golden.name
    shutil.copytree(golden, copy)
    report = verify(copy)
    assert report.ok, [c.problems for c in report.checks]
    assert any("uncommitted index/step-000000000009-000000.parquet" in n for n in report.notes)
    assert any("temporary steps/.step-000000000009.parquet.tmp" in n for n in report.notes)


@pytest.mark.parametrize("where", [0.0, 0.3, 0.99])  # first chunk, middle, the shard index
def test_a_flipped_byte_in_a_chunk_is_detected_by_read_and_verify(
    tmp_store: Path, where: float
) -> None:
    _record(tmp_store)
    before = gradlog.open(tmp_store).grads("0.weight", step=0)
    _flip(_shard(tmp_store), where)
    run = gradlog.open(tmp_store)
    with pytest.raises(errors.StoreCorruptError, match=r"0\.weight.*c\.1\.0\.0") as info:
        run.grads("0.weight", step=1)
    assert "checksum" in str(info.value)
    assert isinstance(info.value, ValueError)  # what zarr's own checksum error was
    with pytest.raises(errors.StoreCorruptError):
        run.grads("0.weight")  # a read spanning the damaged shard
    np.testing.assert_array_equal(run.grads("0.weight", step=0), before)  # others still read
    report = verify(tmp_store)
    assert not report.ok
    [problem] = report.check("checksums").problems
    assert "grads/0.weight" in problem and "c.1.0.0" in problem
    assert report.check("index").ok and report.check("commit log").ok
    result = _cli(tmp_store)
    assert result.exit_code == 1
    assert "FAIL checksums" in result.output and "c.1.0.0" in result.output


def test_a_flipped_byte_in_a_version_1_chunk_is_detected(tmp_path: Path) -> None:
    copy = tmp_path / "v1.store"
    shutil.copytree(GOLDEN / "v1.store", copy)
    _flip(copy / "grads/lin.weight/c/1/0/0")
    with pytest.raises(errors.StoreCorruptError, match=r"lin\.weight.*chunk c/1/0/0.*checksum"):
        gradlog.open(copy).grads("lin.weight")
    report = verify(copy)
    assert not report.ok and "c/1/0/0" in report.check("checksums").problems[0]
    (copy / "grads/lin.weight/c/1/0/0").unlink()  # zarr would read zeros: gradlog refuses
    with pytest.raises(errors.StoreCorruptError, match="missing"):
        gradlog.open(copy).grads("lin.weight", step=2)


def test_a_missing_or_truncated_shard_is_detected(tmp_store: Path) -> None:
    _record(tmp_store)
    shard = _shard(tmp_store, "2.bias", 2)
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(errors.StoreCorruptError, match=r"2\.bias"):
        gradlog.open(tmp_store).grads("2.bias", step=2)
    shard.unlink()
    with pytest.raises(errors.StoreCorruptError, match="missing"):
        gradlog.open(tmp_store).grads("2.bias", step=2)
    assert "missing" in verify(tmp_store).check("checksums").problems[0]


@pytest.mark.parametrize("dtype", ["float32", "float16", "bitround9"])
def test_shards_swapped_between_steps_are_detected(tmp_store: Path, dtype: str) -> None:
    """Two intact shards swapped (or one copied in from another store) pass their checksums;
    their records' norms do not match the index's exact ones."""
    _record(tmp_store, dtype=dtype)
    assert verify(tmp_store).ok
    a, b = _shard(tmp_store, "0.weight", 0), _shard(tmp_store, "0.weight", 2)
    data_a, data_b = a.read_bytes(), b.read_bytes()
    a.write_bytes(data_b)
    b.write_bytes(data_a)
    report = verify(tmp_store)
    problems = report.check("checksums").problems
    assert not report.ok and len(problems) == 2, problems
    assert "grads/0.weight" in problems[0] and "rows 0..3" in problems[0]
    assert "do not have the norm the index gives them" in problems[0]
    result = _cli(tmp_store)
    assert result.exit_code == 1 and "norm the index gives" in result.output
    # reads refuse them too (scans stream and leave them to verify)
    with pytest.raises(errors.StoreCorruptError, match=r"rows \[0, 1, 2, 3\] do not have the"):
        gradlog.open(tmp_store).grads("0.weight", step=0)
    assert gradlog.open(tmp_store).grads("0.weight", step=1).shape == (4, 4, 3)  # intact


def test_a_missing_array_is_a_clear_error(tmp_store: Path) -> None:
    _record(tmp_store)
    shutil.rmtree(tmp_store / "grads/0.bias")
    with pytest.raises(errors.StoreCorruptError, match=r"grads/0\.bias of parameter '0\.bias'"):
        gradlog.open(tmp_store).grads("0.bias")
    np.asarray(gradlog.open(tmp_store).grads("0.weight"))  # the other arrays read
    report = verify(tmp_store)
    assert not report.check("arrays").ok and not report.ok


def test_a_lost_index_part_of_a_committed_step_is_detected(tmp_store: Path) -> None:
    _record(tmp_store)
    (tmp_store / "index/step-000000000001-000000.parquet").unlink()
    problems = verify(tmp_store).check("index").problems
    assert any("step 1 misses its index part for micro-batch 0" in p for p in problems)


def test_edited_index_values_are_detected(tmp_store: Path) -> None:
    _record(tmp_store)
    part = tmp_store / "index/step-000000000002-000000.parquet"
    table = pq.read_table(part)
    i = table.schema.get_field_index("weight")
    pq.write_table(table.set_column(i, "weight", pa.array([-1.0] * table.num_rows)), part)
    report = verify(tmp_store)
    assert any("weight -1.0" in p for p in report.check("index").problems)
    assert any("weight" in p for p in report.check("schemas").problems)


def test_damaged_commit_marker_and_root_are_detected(tmp_store: Path) -> None:
    _record(tmp_store)
    (tmp_store / "steps/step-000000000001.parquet").write_bytes(b"PAR1 garbage")
    assert "does not read" in verify(tmp_store).check("commit log").problems[0]
    meta = json.loads((tmp_store / "zarr.json").read_text())
    meta["attributes"]["config"]["every"] = 5
    (tmp_store / "zarr.json").write_text(json.dumps(meta))
    assert "config_hash" in verify(tmp_store).check("root").problems[0]
    (tmp_store / "zarr.json").write_text("{not json")
    report = verify(tmp_store)
    assert "not valid JSON" in report.check("root").problems[0]
    assert report.check("checksums").skipped and not report.ok
    result = _cli(tmp_store)
    assert result.exit_code == 1 and "not valid JSON" in result.output


def test_verify_without_jsonschema_does_structural_checks(
    tmp_store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _record(tmp_store)
    monkeypatch.setitem(sys.modules, "jsonschema", None)  # import jsonschema -> ImportError
    report = verify(tmp_store)
    assert report.ok and "structural checks only" in report.check("schemas").summary
    meta = json.loads((tmp_store / "zarr.json").read_text())
    meta["attributes"]["surprise"] = 1
    (tmp_store / "zarr.json").write_text(json.dumps(meta))
    assert verify(tmp_store).check("schemas").problems == ["unknown root attributes ['surprise']."]


def test_verify_json_output_and_a_path_that_is_no_store(tmp_path: Path) -> None:
    result = runner.invoke(app, ["verify", str(tmp_path / "nope"), "--json"])
    assert result.exit_code == 1
    out = json.loads(result.output)
    assert out["ok"] is False and "does not exist" in out["checks"][0]["problems"][0]
    result = runner.invoke(app, ["verify", str(tmp_path / "nope")])  # one line, not DAMAGED
    assert result.exit_code == 1 and "DAMAGED" not in result.output
    assert "does not exist" in result.output and len(result.output.strip().splitlines()) <= 2
    result = runner.invoke(app, ["unlock", str(tmp_path)])  # no store: nothing was unlocked
    assert result.exit_code == 1 and "is not a gradlog store" in " ".join(result.output.split())


def test_an_index_part_lacking_a_column_is_refused_by_read_and_verify(tmp_store: Path) -> None:
    _record(tmp_store)
    part = tmp_store / "index/step-000000000001-000000.parquet"
    pq.write_table(pq.read_table(part).drop_columns(["weight"]), part)
    with pytest.raises(errors.StoreFormatError, match=r"\['weight'\] are missing"):
        _ = gradlog.open(tmp_store).datums
    problems = verify(tmp_store).check("index").problems
    assert "index/step-000000000001-000000.parquet lacks column(s) ['weight']." in problems


@pytest.mark.parametrize("rows", [[0, 1, 2, 3], [9, 10, 11, 12]], ids=["another step's", "off"])
def test_an_index_part_pointing_at_other_rows_is_refused_by_read_and_verify(
    tmp_store: Path, rows: list[int]
) -> None:
    """A valid parquet part whose rows were rewritten would read other records' gradients:
    rows are each one record's, and a step's begin at its first_row."""
    _record(tmp_store)
    part = tmp_store / "index/step-000000000002-000000.parquet"
    table = pq.read_table(part)
    at = table.schema.get_field_index("row")
    pq.write_table(table.set_column(at, table.schema.field(at), pa.array(rows, pa.int64())), part)
    with pytest.raises(errors.StoreCorruptError, match="damaged"):
        _ = gradlog.open(tmp_store).grads("0.weight", step=2)
    assert not verify(tmp_store).ok


# -- probes -----------------------------------------------------------------------------------
def _probe_part(path: Path, step: int) -> Path:
    return path / f"probes/index/step-{step:012d}.parquet"


def _edit_probe_part(path: Path, step: int, edit: Any) -> None:
    part = _probe_part(path, step)
    table = pq.read_table(part)
    rows = table.to_pylist()
    edit(rows)
    pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), part)


def test_an_intact_store_with_probes_verifies(tmp_store: Path) -> None:
    _record(tmp_store, probes=True)
    report = verify(tmp_store)
    assert report.ok, [c.problems for c in report.checks]
    assert report.check("probes").summary.startswith(
        "6 probe records of 3 steps (2 probes), 12 chunks read"
    )
    assert _cli(tmp_store).exit_code == 0


def test_a_flipped_byte_in_a_probe_chunk_is_detected_by_read_and_verify(tmp_store: Path) -> None:
    _record(tmp_store, probes=True)
    _flip(tmp_store / "probes/grads/2.weight/c/1/0/0")
    run = gradlog.open(tmp_store)
    with pytest.raises(errors.StoreCorruptError, match="checksum"):
        run.probe_grads("2.weight", step=1)
    report = verify(tmp_store)
    assert not report.ok
    [problem] = report.check("probes").problems
    assert "probes/grads/2.weight" in problem and "c/1/0/0" in problem and "checksum" in problem
    assert report.check("checksums").ok  # the training records are intact
    result = _cli(tmp_store)
    assert result.exit_code == 1 and "FAIL probes" in result.output


def _lose_part(path: Path) -> None:
    _probe_part(path, 1).unlink()


def _reorder(rows: list[dict[str, Any]]) -> None:
    rows[0]["probe_id"], rows[1]["probe_id"] = rows[1]["probe_id"], rows[0]["probe_id"]


def _edit(field: str, value: Any) -> Any:
    def edit(rows: list[dict[str, Any]]) -> None:
        rows[1][field] = value
    return edit


PROBE_DAMAGE = {
    "a lost probe part": (_lose_part, "probe rows [2, 3] are in no committed probe part"),
    "another step inside": (
        lambda p: _edit_probe_part(p, 1, _edit("step", 2)),
        "probes/index/step-000000000001.parquet holds steps [1, 2], its name says 1",
    ),
    "probe ids out of order": (
        lambda p: _edit_probe_part(p, 1, _reorder),
        "holds probe ids [9, 7], not probe_ids [7, 9] in order",
    ),
    "a negative norm": (
        lambda p: _edit_probe_part(p, 2, _edit("norm/0.bias", -1.0)),
        "probe 9 at step 2: a non-finite loss or a negative or non-finite norm",
    ),
    "a non-finite loss": (
        lambda p: _edit_probe_part(p, 0, _edit("loss", float("nan"))),
        "probe 9 at step 0: a non-finite loss or a negative or non-finite norm",
    ),
    "an unreadable part": (
        lambda p: _probe_part(p, 2).write_bytes(b"PAR1 garbage"),
        "probes/index/step-000000000002.parquet does not read",
    ),
    "a part lacking a column": (
        lambda p: pq.write_table(pq.read_table(_probe_part(p, 2)).drop_columns(["loss"]),
                                 _probe_part(p, 2)),
        "probes/index/step-000000000002.parquet lacks column(s) ['loss']",
    ),
    "a lost probe array": (
        lambda p: shutil.rmtree(p / "probes/grads/0.bias"),
        "probe array probes/grads/0.bias of '0.bias' is missing",
    ),
    "a short probe array": (
        lambda p: _resize_probe_array(p, "0.weight", 4),
        "probe array probes/grads/0.weight declares 4 rows; committed probe rows reach 5",
    ),
    "a lost probes group": (
        lambda p: (p / "probes/zarr.json").unlink(),
        "probes/zarr.json is missing",
    ),
}


def _resize_probe_array(path: Path, param: str, rows: int) -> None:
    meta_file = path / "probes/grads" / param / "zarr.json"
    meta = json.loads(meta_file.read_text())
    meta["shape"][0] = rows
    meta_file.write_text(json.dumps(meta))


@pytest.mark.parametrize("damage", list(PROBE_DAMAGE), ids=list(PROBE_DAMAGE))
def test_damaged_probes_are_detected(tmp_store: Path, damage: str) -> None:
    _record(tmp_store, probes=True)
    do, expected = PROBE_DAMAGE[damage]
    do(tmp_store)
    _assert_only_failing(tmp_store, "probes", expected)


def _assert_only_failing(path: Path, check: str, expected: str) -> None:
    """``verify`` fails check ``check`` alone, with a problem that contains ``expected``."""
    report = verify(path)
    problems = report.check(check).problems
    assert any(expected in p for p in problems), problems
    assert not report.ok
    assert all(c.ok for c in report.checks if c.name != check)


def test_uncommitted_probe_parts_are_notes_and_a_step_may_lack_probes(tmp_store: Path) -> None:
    _record(tmp_store, probes=True)
    (tmp_store / "steps/step-000000000002.parquet").unlink()  # a crash before step 2 commits
    (tmp_store / "probes/index/.step-000000000003.parquet.tmp").write_bytes(b"partial")
    report = verify(tmp_store)
    assert report.ok, [c.problems for c in report.checks]
    assert "uncommitted probes/index/step-000000000002.parquet (ignored by readers)" in report.notes
    assert any("temporary probes/index/.step-000000000003" in n for n in report.notes)
    _probe_part(tmp_store, 1).unlink()  # the last committed step without probes: allowed
    assert verify(tmp_store).ok


# -- optimizer state (FORMAT.md section 14) ---------------------------------------------------
def _record_adam(path: Path, steps: int = 3) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with gradlog.GradRecorder(model, path, backend="loop", optimizer=opt) as rec:
        for s in range(steps):
            x, y = torch.randn(4, 3), torch.randn(4, 2)
            rec.backward(((model(x) - y) ** 2).sum(1), step=s)
            opt.step()
            opt.zero_grad()


def _optimizer_file(path: Path, step: int) -> Path:
    return path / "optimizer" / f"step-{step:012d}.npz"


def _rewrite_npz(file: Path, edit: Any) -> None:
    """Rewrite ``file`` with ``edit(members)`` applied: a well-formed file with wrong content."""
    with np.load(file, allow_pickle=False) as npz:
        members = {k: npz[k] for k in npz.files}
    edit(members)
    with open(file, "wb") as f:
        np.savez(f, **members)


def _edit_meta(members: dict[str, np.ndarray], change: Any) -> None:
    meta = json.loads(str(members["meta"][()]))
    change(meta)
    members["meta"] = np.array(json.dumps(meta))


def _flip_precond(file: Path) -> None:
    """Flip a bit in the last byte of member ``precond/2.weight``'s float32 data."""
    import zipfile

    with zipfile.ZipFile(file) as z:
        info = z.getinfo("precond/2.weight.npy")
    data = bytearray(file.read_bytes())
    at = info.header_offset  # a local file header: 30 bytes, the name, the extra field
    name_len, extra_len = struct.unpack("<HH", data[at + 26 : at + 30])
    end = at + 30 + name_len + extra_len + info.compress_size
    data[end - 1] ^= 0x10
    file.write_bytes(bytes(data))


OPTIMIZER_DAMAGE = {
    "a flipped byte in a preconditioner": (
        lambda p: _flip_precond(_optimizer_file(p, 1)),
        "optimizer/step-000000000001.npz: the preconditioner of '2.weight' is damaged",
    ),
    "a truncated file": (
        lambda p: _optimizer_file(p, 2).write_bytes(_optimizer_file(p, 2).read_bytes()[:100]),
        "optimizer/step-000000000002.npz: the optimizer state of step 2 cannot be read",
    ),
    "a lost preconditioner": (
        lambda p: _rewrite_npz(_optimizer_file(p, 0), lambda m: m.pop("precond/0.bias")),
        "optimizer/step-000000000000.npz lacks the preconditioner of '0.bias'",
    ),
    "a short preconditioner": (
        lambda p: _rewrite_npz(_optimizer_file(p, 1),
                               lambda m: m.update({"precond/0.weight": m["precond/0.weight"][:5]})),
        "the preconditioner of '0.weight' has shape (5,), the parameter 12 entries",
    ),
    "a negative preconditioner": (
        lambda p: _rewrite_npz(_optimizer_file(p, 1),
                               lambda m: m.update({"precond/2.bias": -m["precond/2.bias"]})),
        "the preconditioner of '2.bias' holds negative or non-finite entries",
    ),
    "a parameter the store does not record": (
        lambda p: _rewrite_npz(_optimizer_file(p, 2), lambda m: _edit_meta(
            m, lambda meta: meta["params"].update({"9.weight": None}))),
        "meta names parameters the store does not record: ['9.weight']",
    ),
    "an unknown kind": (
        lambda p: _rewrite_npz(_optimizer_file(p, 2), lambda m: _edit_meta(
            m, lambda meta: meta.update({"kind": "lion"}))),
        "optimizer/step-000000000002.npz: meta",
    ),
}


def test_an_intact_store_with_optimizer_state_verifies(tmp_store: Path) -> None:
    _record_adam(tmp_store)
    report = verify(tmp_store)
    assert report.ok, [c.problems for c in report.checks]
    assert report.check("optimizer").summary == (
        "3 optimizer state files read (78 preconditioner values), zip crc32 verified")
    assert verify(_stored_without_optimizer(tmp_store)).check("optimizer").summary == (
        "no optimizer state")


def _stored_without_optimizer(path: Path) -> Path:
    shutil.rmtree(path / "optimizer")
    return path


@pytest.mark.parametrize("damage", list(OPTIMIZER_DAMAGE), ids=list(OPTIMIZER_DAMAGE))
def test_damaged_optimizer_state_is_detected(tmp_store: Path, damage: str) -> None:
    _record_adam(tmp_store)
    do, expected = OPTIMIZER_DAMAGE[damage]
    do(tmp_store)
    _assert_only_failing(tmp_store, "optimizer", expected)
    assert _cli(tmp_store).exit_code == 1


def test_optimizer_state_of_uncommitted_steps_and_missing_files_are_notes(
    tmp_store: Path,
) -> None:
    _record_adam(tmp_store)
    (tmp_store / "steps/step-000000000002.parquet").unlink()  # a crash before step 2 commits
    (tmp_store / "optimizer/.step-000000000003.npz.tmp").write_bytes(b"partial")
    _optimizer_file(tmp_store, 1).unlink()  # a step stepped without optimizer=
    report = verify(tmp_store)
    assert report.ok, [c.problems for c in report.checks]
    assert "uncommitted optimizer/step-000000000002.npz (ignored by readers)" in report.notes
    assert any("temporary optimizer/.step-000000000003.npz.tmp" in n for n in report.notes)
    assert any("committed step(s) 1 have no optimizer state" in n for n in report.notes)
    assert report.check("optimizer").summary.startswith("1 optimizer state files read")
