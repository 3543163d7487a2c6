"""The store a recording writes: its writer (under torch.distributed rank 0 creates or
resumes the store, and holds its writer lease, before the other ranks join), root attributes
and parameter specs."""

from __future__ import annotations

import datetime
import os
import uuid
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from gradlog._version import __version__
from gradlog.config import RecorderConfig, RecordingOptions
from gradlog.distributed import Distributed
from gradlog.errors import GradlogError
from gradlog.store import format as fmt
from gradlog.store.writer import ParamSpec, StoreWriter

__all__ = ["open_writer", "param_specs", "root_attrs"]


def param_specs(params: Mapping[str, torch.Tensor], dtype: str) -> dict[str, ParamSpec]:
    """Each recorded parameter's spec (its form is set when planned)."""
    return {
        name: ParamSpec(
            name=name,
            shape=tuple(p.shape),
            dtype=dtype,
            param_dtype=str(p.dtype).removeprefix("torch."),
        )
        for name, p in params.items()
    }


def root_attrs(model: nn.Module, config: RecorderConfig) -> dict[str, Any]:
    """The run's root attributes (FORMAT.md): format, versions, model, configuration."""
    n_params = sum(p.numel() for p in model.parameters())
    return {
        "format": fmt.FORMAT_NAME,
        "format_version": fmt.FORMAT_VERSION,
        "gradlog_version": __version__,
        "torch_version": torch.__version__.split("+")[0],
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "run_id": uuid.uuid4().hex,  # tells this run from one that replaces it in the second
        "model": {"class": type(model).__name__, "n_parameters": n_params},
        "config": config.to_json(),
        "config_hash": config.hash(),
    }


def open_writer(
    path: str | os.PathLike[str],
    attrs: dict[str, Any],
    specs: dict[str, ParamSpec],
    config: RecorderConfig,
    options: RecordingOptions,
    dist: Distributed | None,
) -> StoreWriter:
    """The store writer; under torch.distributed rank 0 creates (or resumes) the store
    before the other ranks join it."""

    def make() -> StoreWriter:
        return StoreWriter(
            path,
            attrs=attrs,
            specs=specs,
            overwrite=options.overwrite,
            resume=options.resume,
            queue_bytes=options.queue_bytes,
            durable=options.durable,
            compression=config.compression,
            rank=0 if dist is None else dist.rank,
            world_size=1 if dist is None else dist.world_size,
            break_lease=options.break_lease,
        )

    if dist is None:
        return make()
    writer = None
    if dist.rank == 0:
        try:
            writer = make()
        except BaseException as e:
            dist.agree(e)
            raise
    dist.agree(None)
    try:
        if dist.rank > 0:
            writer = make()
    except BaseException as e:
        dist.all_ok(e)
        raise
    try:  # every rank joined before any writes (rank 0 cleaned a resumed store)
        dist.all_ok(None)
    except GradlogError:
        if writer is not None:
            writer.close()
        raise
    assert writer is not None
    return writer
