"""Optional dependencies of analyses (dask, xarray, matplotlib), imported when asked for."""

from __future__ import annotations

import importlib
from typing import Any

from gradlog.errors import MissingExtraError

__all__ = ["require_extra"]


def require_extra(module: str, extra: str, feature: str) -> Any:
    """``module``, imported; an optional dependency (``pip install 'gradlog[extra]'``).

    Raises:
        MissingExtraError: it is not installed (the message names the extra).
    """
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingExtraError(
            f"{feature} needs {module.split('.')[0]}, which is not installed: "
            f"pip install 'gradlog[{extra}]'"
        ) from None
