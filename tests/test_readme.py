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


def test_command_1_and_what_it_suggests(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """README command 1 runs the built-in demo, and the README shows the commands it ends
    with, as it prints them."""
    from typer.testing import CliRunner

    from gradlog.cli.main import app

    text = README.read_text()
    setup = text[text.index("## Set-up"):text.index("## 30 seconds")]
    assert re.search(r"pip install -q -e '\.\[plot\]' && python3 -m gradlog train\n", setup)
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["train", "--steps", "2", "--batch-size", "4",
                                      "--seq-len", "16"], terminal_width=200)
    assert result.exit_code == 0, result.output
    suggested = re.findall(r"^  (gradlog \w+ runs/demo\.gradlog[^#]*?)\s+#", result.output, re.M)
    assert len(suggested) == 3
    for command in suggested:
        assert command in setup, command
