"""gradlog: record the gradient of every datum, at every training step.

Public API::

    with gradlog.GradRecorder(model, "runs/demo.gradlog") as rec:
        ...
        rec.backward(losses, datum_ids=idx)
    run = gradlog.open("runs/demo.gradlog")

Reading a store never imports torch (``gradlog info`` stays fast): the recorder is imported
on first use.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from gradlog._version import __version__
from gradlog.errors import (  # the public errors, as the README names them (gradlog.X)
    BackendError,
    ConfigError,
    DoubleBackwardError,
    FrozenParamError,
    GradientCheckError,
    GradlogError,
    InputError,
    MemoryTooSmallError,
    MissingExtraError,
    MissingLearningRateError,
    NonFiniteGradientWarning,
    NonFiniteLossError,
    NotAStoreError,
    ParamSelectionError,
    ReadTooLargeError,
    SelectionError,
    StoreCorruptError,
    StoreExistsError,
    StoreFormatError,
    StoreLockedError,
    StoreReplacedError,
    StoreResumeError,
    StoreVersionError,
    StoreWriteError,
    UnsupportedLayerError,
)
from gradlog.run import Run

if TYPE_CHECKING:
    from gradlog.config import RecorderConfig
    from gradlog.recorder import GradRecorder
    from gradlog.sparse import sparse_backprop

__all__ = [
    "BackendError",
    "ConfigError",
    "DoubleBackwardError",
    "FrozenParamError",
    "GradRecorder",
    "GradientCheckError",
    "GradlogError",
    "InputError",
    "MemoryTooSmallError",
    "MissingExtraError",
    "MissingLearningRateError",
    "NonFiniteGradientWarning",
    "NonFiniteLossError",
    "NotAStoreError",
    "ParamSelectionError",
    "ReadTooLargeError",
    "RecorderConfig",
    "Run",
    "SelectionError",
    "StoreCorruptError",
    "StoreExistsError",
    "StoreFormatError",
    "StoreLockedError",
    "StoreReplacedError",
    "StoreResumeError",
    "StoreVersionError",
    "StoreWriteError",
    "UnsupportedLayerError",
    "__version__",
    "open",
    "sparse_backprop",
]


def open(path: str | os.PathLike[str]) -> Run:
    """Open a recorded run for reading.

    Raises:
        NotAStoreError: ``path`` does not exist or is not a store.
        StoreFormatError: the store's metadata is malformed.
        StoreVersionError: the store was written by a newer gradlog.
    """
    return Run(path)


def __getattr__(name: str) -> Any:
    if name == "GradRecorder":
        from gradlog.recorder import GradRecorder

        return GradRecorder
    if name == "RecorderConfig":
        from gradlog.config import RecorderConfig

        return RecorderConfig
    if name == "sparse_backprop":
        from gradlog.sparse import sparse_backprop

        return sparse_backprop
    raise AttributeError(f"module 'gradlog' has no attribute {name!r}")
