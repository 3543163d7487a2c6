"""Write the golden store of the current format version: ``tests/golden/vN.store``.

Run once per format version, with the gradlog that introduced it, and commit the result::

    python tests/golden/make_golden.py              # vN.store, float32
    python tests/golden/make_golden.py 2 bfloat16   # v2-bfloat16.store
    python tests/golden/make_golden.py 3 forms      # v3-forms.store: FORMS, hooks backend

Every later gradlog must read every golden store and return exactly the values recorded in
``vN.expected.json`` beside it (``tests/test_store_golden.py``). Never regenerate an existing
version: the point is that the bytes were written by the old code.

The run: a float64 two-layer MLP with a parameter name that needs path encoding, three
committed steps (one of them with two micro-batches, batch sizes 3/2/4/1), and the trailing
debris of a crash (an index part of an uncommitted step and a temporary), which readers must
ignore.

The ``forms`` variant (version 3) records each parameter in another form (:data:`FORMS`)
with the hooks backend, so that ``lin.weight`` is kept as exact factors.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

import gradlog
from gradlog.store.format import FORMAT_VERSION

HERE = Path(__file__).resolve().parent
CALLS = [(0, [0, 1, 2]), (0, [3, 4]), (2, [5, 6, 7, 8]), (3, [1])]  # (step, datum ids)
FORMS = {
    "lin.weight": "factors",
    "lin.bias": {"form": "topk", "k": 2},
    "out/head.weight": {"form": "projection", "dim": 4},
    "out/head.bias": "norm",
}


def _model() -> nn.Module:
    torch.manual_seed(7)
    model = nn.Sequential()
    model.add_module("lin", nn.Linear(3, 4))
    model.add_module("act", nn.Tanh())
    model.add_module("out/head", nn.Linear(4, 2))  # "/" needs percent-encoding
    return model.double()


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    return (
        torch.randn(9, 3, generator=gen, dtype=torch.float64),
        torch.randn(9, 2, generator=gen, dtype=torch.float64),
    )


def make(version: int = FORMAT_VERSION, variant: str = "", **recorder_kwargs: Any) -> Path:
    """Record the golden run into ``vN[-variant].store`` and write its ``.expected.json``."""
    stem = f"v{version}" + (f"-{variant}" if variant else "")
    path = HERE / f"{stem}.store"  # not *.gradlog: .gitignore drops those
    if path.exists():
        shutil.rmtree(path)
    model = _model()
    x, y = _data()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    recorder_kwargs.setdefault("dtype", "float32")
    recorder_kwargs.setdefault("backend", "loop")
    with gradlog.GradRecorder(
        model,
        path,
        check_every=1,
        metadata={"golden": version},
        **recorder_kwargs,
    ) as rec:
        prev = None
        for step, ids in CALLS:
            if prev is not None and step != prev:
                opt.step()
                opt.zero_grad()
            losses = ((model(x[ids]) - y[ids]) ** 2).sum(1)  # (B,)
            rec.backward(losses, datum_ids=ids, step=step, lr=0.05)
            prev = step
    # Crash debris: an index part of step 9 that was never committed, and a temporary.
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(path / "index/step-000000000003-000000.parquet")
    n = table.num_rows
    table = table.set_column(0, table.schema.field(0), pa.array([9] * n, pa.int64()))
    row = table.schema.get_field_index("row")
    table = table.set_column(row, table.schema.field(row), pa.array(range(10, 10 + n), pa.int64()))
    pq.write_table(table, path / "index/step-000000000009-000000.parquet")
    (path / "steps/.step-000000000009.parquet.tmp").write_bytes(b"partial")

    run = gradlog.open(path)
    expected = {
        "format_version": version,
        "steps": run.steps.drop_columns(["time_compute_s", "time_write_s"]).to_pylist(),
        "records": run.datums.to_pylist(),
        "grads": {name: _stored(run, name) for name in run.param_names},
        "params": run.params.to_pylist(),
        "config_hash": run.attrs["config_hash"],
    }
    (HERE / f"{stem}.expected.json").write_text(json.dumps(expected, indent=1) + "\n")
    return path


def _stored(run: Any, name: str) -> Any:
    """What ``run.grads`` returns (a projection's vectors; None for a ``norm`` form)."""
    import warnings

    if run.params.column("form").to_pylist()[run.param_names.index(name)] == "norm":
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "projected vectors, not gradients"
        return run.grads(name).tolist()


if __name__ == "__main__":
    # python tests/golden/make_golden.py [VERSION [DTYPE]]: DTYPE other than float32 makes the
    # variant store vN-DTYPE.store (version 2 added lossy dtypes).
    version = int(sys.argv[1]) if len(sys.argv) > 1 else FORMAT_VERSION
    variant = sys.argv[2] if len(sys.argv) > 2 else "float32"
    if variant == "forms":
        print(make(version, "forms", backend="hooks", form=FORMS))
    else:
        print(make(version, "" if variant == "float32" else variant, dtype=variant))
