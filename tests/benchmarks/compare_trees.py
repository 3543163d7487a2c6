"""Before/after: one benchmark run against two source trees, alternately, in one session.

A refactor must not make anything slower. This runs a benchmark script of ``tests/benchmarks/``
with the package of an older revision (checked out into a temporary git worktree) and with the
working tree, taking turns (base, head, base, head, ...) so both see the same machine state,
then prints, for every table row the two share, the chosen column's median over rounds side
by side with their ratio. Each tree runs its own copy of the script.

Usage::

    python tests/benchmarks/compare_trees.py --base caf6898 --rounds 2 \\
        bench_compute.py -- --sizes small --reps 9 --threads 1 --clock cpu --no-memory
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _tables(text: str) -> dict[tuple[str, str], list[str]]:
    """(table header, first cell) -> cells, for every markdown table row of ``text``."""
    rows: dict[tuple[str, str], list[str]] = {}
    header = ""
    for line in text.splitlines():
        if not line.startswith("|"):
            header = ""
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if set("".join(cells)) <= set("-: "):
            continue
        if not header:
            header = " | ".join(cells)
            continue
        rows[(header, cells[0])] = cells
    return rows


def _number(cell: str) -> float | None:
    match = re.search(r"-?\d+(?:\.\d+)?(?:e-?\d+)?", cell)
    return float(match.group()) if match else None


def _run(tree: Path, script: str, args: list[str]) -> str:
    env = dict(os.environ, PYTHONPATH=str(tree), PYTHONUNBUFFERED="1")
    done = subprocess.run(
        [sys.executable, str(tree / "tests" / "benchmarks" / script), *args],
        cwd=tree, env=env, capture_output=True, text=True, check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"{script} failed in {tree} ({done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="git revision of the 'before' tree")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each tree, alternating")
    parser.add_argument("--column", type=int, default=1, help="table column to compare (0: name)")
    parser.add_argument("script", help="benchmark script under tests/benchmarks/")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="after --: the script's options")
    opts = parser.parse_args()
    args = opts.args[1:] if opts.args[:1] == ["--"] else opts.args
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(base), opts.base],
                       cwd=ROOT, check=True)
        try:
            values: dict[str, dict[tuple[str, str], list[float]]] = {
                "base": defaultdict(list), "head": defaultdict(list)}
            for round_ in range(opts.rounds):
                for name, tree in (("base", base), ("head", ROOT)):
                    out = _run(tree, opts.script, args)
                    print(f"--- round {round_ + 1}, {name} ---\n{out}", file=sys.stderr)
                    for key, cells in _tables(out).items():
                        if len(cells) > opts.column and (v := _number(cells[opts.column])):
                            values[name][key].append(v)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT,
                           check=False)
    print(f"`{opts.script} {' '.join(args)}`: column {opts.column}, median of {opts.rounds} "
          f"alternating runs per tree (base = {opts.base}, head = working tree)\n")
    print("| table | row | base | head | head / base |\n|---|---|---|---|---|")
    for key in values["base"]:
        if key not in values["head"]:
            continue
        b, h = statistics.median(values["base"][key]), statistics.median(values["head"][key])
        table = key[0].split(" | ")[opts.column] if " | " in key[0] else key[0]
        print(f"| {table} | {key[1]} | {b:.3g} | {h:.3g} | {h / b:.2f} |")


if __name__ == "__main__":
    main()
