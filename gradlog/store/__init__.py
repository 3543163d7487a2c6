"""The store: writing runs (``writer``), reading them (``reader``), and the format rules."""

from gradlog.store.reader import StoreReader
from gradlog.store.writer import ParamSpec, StoreWriter

__all__ = ["ParamSpec", "StoreReader", "StoreWriter"]
