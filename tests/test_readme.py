"""The README's Python example runs as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def test_thirty_second_example(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = README.read_text()
    match = re.search(r"## 30 seconds\n\n```python\n(.*?)```", text, re.S)
    assert match, "README lost its 30-second example"
    monkeypatch.chdir(tmp_path)
    code = compile(match.group(1), "README.md", "exec")
    for _ in range(2):  # runs again as written: the second run replaces the first
        namespace: dict[str, object] = {}
        exec(code, namespace)
    run = namespace["run"]
    assert run.steps.num_rows == 8 and run.datums.num_rows == 256  # type: ignore[attr-defined]
    assert run.grads("0.weight", datum=17).shape == (1, 64, 20)  # type: ignore[attr-defined]
