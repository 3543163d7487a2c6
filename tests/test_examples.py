"""The examples run as a new user would run them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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
    text = _run(str(EXAMPLES / "read_run.py"), str(out), cwd=tmp_path)
    assert "appears at steps" in text and "largest gradients" in text
