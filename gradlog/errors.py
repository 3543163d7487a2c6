"""Errors raised by gradlog.

Every error derives from :class:`GradlogError` and also from the builtin it refines, so
``except ValueError`` keeps working for callers who do not know gradlog. Messages say what
happened, what was expected, and how to fix it.
"""

from __future__ import annotations

__all__ = [
    "BackendError",
    "ConfigError",
    "DoubleBackwardError",
    "FrozenParamError",
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
]


class GradlogError(Exception):
    """Base class of every gradlog error."""


class ConfigError(GradlogError, ValueError):
    """A recorder option has an invalid value."""


class InputError(GradlogError, ValueError):
    """Arguments of ``backward``/``step`` (losses, ids, mask, step) are malformed."""


class NonFiniteGradientWarning(UserWarning):
    """A datum's per-datum gradient holds NaN or inf though its loss is finite (stored as
    computed, flagged by its non-finite norm in the index), or a finite one overflowed the
    ``float16`` storage dtype (stored as inf, its norm exact). The message names the datum
    ids and parameters."""


class NonFiniteLossError(InputError):
    """A datum's loss is NaN or infinite; the step was refused, ``p.grad`` as before it."""


class ParamSelectionError(GradlogError, ValueError):
    """A ``params=`` pattern selects nothing, or selects something that cannot be recorded."""


class FrozenParamError(ParamSelectionError):
    """A recorded parameter has ``requires_grad=False`` when its gradient is due (frozen after
    the recorder selected it), so autograd computes no gradient for it."""


class BackendError(GradlogError, RuntimeError):
    """A backend cannot compute per-datum gradients for this model or call."""


class UnsupportedLayerError(BackendError):
    """A layer cannot give per-datum gradients (it couples data, e.g. BatchNorm in training)."""


class DoubleBackwardError(GradlogError, RuntimeError):
    """A backward with ``create_graph=True`` went through
    :func:`gradlog.memory.chunked_linear_loss`, whose chunk gradients have no graph."""


class GradientCheckError(GradlogError, RuntimeError):
    """The self-check ``sum_b w_b g_b == p.grad`` failed: per-datum gradients are wrong."""


class NotAStoreError(GradlogError, FileNotFoundError):
    """The path is not a gradlog store."""


class StoreExistsError(GradlogError, FileExistsError):
    """Recording would overwrite an existing store."""


class StoreFormatError(GradlogError, ValueError):
    """The store's metadata or layout does not follow schemas/FORMAT.md."""


class StoreVersionError(StoreFormatError):
    """The store was written by a newer format version than this gradlog reads."""


class StoreCorruptError(StoreFormatError):
    """Stored bytes are damaged: a checksum does not match, or a committed chunk is missing or
    truncated. Raised instead of ever returning wrong numbers; names the array and chunk."""


class StoreReplacedError(StoreFormatError):
    """The store was replaced by another run (``overwrite=True``) since it was opened: what
    was read from the old one would be mixed with the new one's arrays."""


class StoreLockedError(GradlogError, RuntimeError):
    """Another writer holds the store's lease (one writer per store at a time), or the writer
    lost its own lease; the message names the holder and how to proceed."""


class StoreResumeError(GradlogError, ValueError):
    """``resume=True`` cannot continue this store (another configuration, another model)."""


class StoreWriteError(GradlogError, OSError):
    """The background writer failed (disk full, permissions, ...); steps committed before the
    failure are intact. Raised on the recording thread at its next call or at exit."""


class SelectionError(GradlogError, LookupError):
    """A query names a parameter, step or datum that the run does not hold."""

    def __str__(self) -> str:  # LookupError would repr() the message
        return str(self.args[0]) if self.args else ""


class MissingLearningRateError(InputError):
    """The learning rate an analysis needs was not recorded (it is null in the index)."""


class MissingExtraError(GradlogError, ImportError):
    """An optional dependency of the feature asked for is not installed."""


class MemoryTooSmallError(GradlogError, ValueError):
    """``max_memory`` is below what reading one chunk of an array needs."""


class ReadTooLargeError(GradlogError, ValueError):
    """A read of every record (no step or datum selection) would load more than
    ``max_memory``: select records, read lazily, or raise ``max_memory``."""
