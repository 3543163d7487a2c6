"""Shared fixtures: a fresh store path, a seeded torch RNG, a call counter, and auto-skip of
GPU tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch


@pytest.fixture
def tmp_store(tmp_path: Path) -> Path:
    """A path for a new store, not yet created."""
    return tmp_path / "run.gradlog"


@pytest.fixture(autouse=True)
def _seed_torch() -> None:
    """Every test starts from the same torch RNG state."""
    torch.manual_seed(0)


@pytest.fixture
def calls_to(monkeypatch: pytest.MonkeyPatch) -> Callable[[Any, str], list[int]]:
    """``calls_to(owner, name)``: a list that grows by one at each call of ``owner.name``
    (patched for the test; e.g. how often a rule fell back to the per-datum re-run)."""

    def patch(owner: Any, name: str) -> list[int]:
        calls: list[int] = []
        original = getattr(owner, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            calls.append(1)
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, counted)
        return calls

    return patch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip tests marked ``gpu`` on machines without CUDA."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
