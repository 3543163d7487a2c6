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


def test_cli_synopsis_lists_every_option_of_every_command() -> None:
    """The README's CLI synopsis against the oracle of the commands' own parameters (what
    `gradlog CMD --help` lists): every option of every command is in that command's lines,
    and every option the lines name exists."""
    import typer

    from gradlog.cli.main import app

    text = README.read_text()
    section = text[text.index("## CLI\n"):]
    block = section[section.index("```\n") + 4:section.index("\n```", section.index("```\n"))]
    lines: dict[str, str] = {}  # command -> its synopsis lines (continuations joined)
    name = ""
    for line in block.splitlines():
        found = re.match(r"gradlog (\w+) ", line)
        if found:
            name = found.group(1)
        if name and (found or line.startswith(" ")):
            lines[name] = lines.get(name, "") + " " + line.split("  #")[0]
    shared = {"--storage-option", "--help", "-h"}  # said once, under the block
    command = typer.main.get_command(app)
    for cmd_name, cmd in command.commands.items():  # type: ignore[attr-defined]
        assert cmd_name in lines, f"README's CLI synopsis lacks `gradlog {cmd_name}`"
        named = set(re.findall(r"(?<![\w-])(--[a-z][\w-]*|-[a-z])\b", lines[cmd_name]))
        options = {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)
                   if o.startswith("-")}
        missing = [p.opts[0] for p in cmd.params  # each option by one of its names (-p)
                   if any(o.startswith("-") for o in p.opts)
                   and not (set(p.opts) & (named | shared))]
        assert not missing, f"README's `gradlog {cmd_name}` lacks {sorted(missing)}"
        unknown = named - options - shared
        assert not unknown, f"README's `gradlog {cmd_name}` names {sorted(unknown)}, not options"
