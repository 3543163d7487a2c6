"""The examples run as a new user would run them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _run(*args: str, cwd: Path) -> str:
    done = subprocess.run(
        [sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_record_then_read(tmp_path: Path) -> None:
    out = tmp_path / "example.gradlog"
    text = _run(
        str(EXAMPLES / "record_own_loop.py"), "--out", str(out), "--epochs", "1", cwd=tmp_path
    )
    assert "recorded 8 steps, 256 records" in text
    assert "(backend hooks)" in text  # the default backend, not the slow loop reference
    text = _run(str(EXAMPLES / "read_run.py"), str(out), cwd=tmp_path)
    assert "appears at steps" in text and "largest gradients" in text


@pytest.mark.slow
def test_influence(tmp_path: Path) -> None:
    out = tmp_path / "influence.gradlog"
    text = _run(str(EXAMPLES / "influence.py"), "--out", str(out), "--steps", "8", cwd=tmp_path)
    assert "proponent  #1" in text and "largest self-influence" in text
    assert "moved head.weight most" in text


@pytest.mark.slow
def test_sparse_backprop_explains_its_table(tmp_path: Path) -> None:
    text = _run(str(EXAMPLES / "sparse_backprop.py"), "--steps", "3", "--fractions", "0.05",
                "--no-plot", "--record", str(tmp_path / "sparse.gradlog"), cwd=tmp_path)
    assert "| median step ms |" in text
    assert "k = ceil(fraction x width) entries" in text and "of 48 (5%: 3)" in text
    assert "the LM head is left dense (--where no-head)" in text  # the default
    import gradlog

    settings = gradlog.open(tmp_path / "sparse.gradlog").attrs["backend"]["sparse_backprop"]
    linear = [f"blocks.{i}.{m}" for i in (0, 1)
              for m in ("attn.q", "attn.k", "attn.v", "attn.proj", "mlp.fc", "mlp.proj")]
    assert sorted(settings[0]["compact"]) == sorted(linear)  # the blocks' Linear layers only
