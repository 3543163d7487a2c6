"""The store: writing runs (``writer``), reading them (``reader``), and the format rules."""

from gradlog.store.reader import Run
from gradlog.store.writer import ParamSpec, StoreWriter

__all__ = ["ParamSpec", "Run", "StoreWriter"]
