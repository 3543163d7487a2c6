"""Read a recorded run back, notebook style.

    gradlog train --out runs/demo.gradlog        # or examples/record_own_loop.py
    python examples/read_run.py runs/demo.gradlog
"""

from __future__ import annotations

import sys

import numpy as np
import pyarrow.compute as pc

import gradlog

path = sys.argv[1] if len(sys.argv) > 1 else "runs/demo.gradlog"
run = gradlog.open(path)
print(run)

# What was recorded: parameters (pyarrow tables convert with .to_pandas() if pandas is there).
print(run.params.select(["name", "shape", "form"]).to_pylist()[:3], "...")
steps = run.steps.column("step").to_pylist()
print(f"steps {steps[0]}..{steps[-1]}, {run.datums.num_rows} records")

# All per-datum gradients of one parameter at one step: (B, *shape), float32.
param = run.param_names[-1]
g = run.grads(param, step=steps[-1])
per_datum_norms = np.linalg.norm(g.reshape(len(g), -1), axis=1)
print(f"{param} at step {steps[-1]}: {g.shape}, per-datum norms {per_datum_norms.round(3)}")

# The weights tie the records to the optimizer's gradient: sum_b w_b g_b == p.grad.
records = run.records(step=steps[-1])
w = records.column("weight").to_numpy()
print("batch gradient norm:", float(np.linalg.norm(np.tensordot(w, g, axes=1))))

# One datum across training: every step where it appeared.
datum = int(pc.mode(run.datums.column("datum_id"))[0]["mode"])
trajectory = run.grads(param, datum=datum)
print(f"datum {datum} appears at steps {run.records(datum=datum).column('step').to_pylist()}")
over_time = np.linalg.norm(trajectory.reshape(len(trajectory), -1), axis=1)
print(f"its gradient norm over time: {over_time.round(3)}")

# Exact norms of every record, for every parameter, without reading the gradients.
norms = run.norms(param)
top = norms.sort_by([("norm", "descending")]).slice(0, 3).to_pylist()
print("largest gradients of", param, [(r["step"], r["datum_id"], round(r["norm"], 3)) for r in top])
