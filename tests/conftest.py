"""Shared fixtures: a fresh store path, a seeded torch RNG, and auto-skip of GPU tests."""

from __future__ import annotations

from pathlib import Path

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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip tests marked ``gpu`` on machines without CUDA."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
