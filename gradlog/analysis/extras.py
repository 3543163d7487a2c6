"""Optional dependencies of analyses (dask, xarray, matplotlib), imported when asked for."""

from __future__ import annotations

import importlib
from typing import Any

from gradlog.errors import MissingExtraError

__all__ = ["require_extra"]


_PACKAGES = {"plot": "matplotlib", "xarray": "xarray", "dask": "'dask[array]' distributed"}
"""What each extra of pyproject.toml installs (PyPI's ``gradlog`` is another project: a
message never says ``pip install 'gradlog[extra]'``)."""


def require_extra(module: str, extra: str, feature: str) -> Any:
    """``module``, imported; an optional dependency (an extra of pyproject.toml).

    Raises:
        MissingExtraError: it is not installed (the message names the extra).
    """
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingExtraError(
            f"{feature} needs {module.split('.')[0]}, which is not installed: pip install "
            f"{_PACKAGES.get(extra, module.split('.')[0])} (or, in gradlog's folder, "
            f"pip install -e '.[{extra}]')"
        ) from None
