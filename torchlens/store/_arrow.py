"""Activation shards to a Hugging Face ``datasets.Dataset``, one Arrow file per shard."""

from __future__ import annotations

import pathlib
from typing import Any

import torch

from ..errors import OptionalDependencyError

__all__ = ["to_hf_dataset"]


def _column(t: torch.Tensor) -> Any:
    import pyarrow as pa  # optional heavy dependency (with datasets, in the torchlens[datasets] extra)

    if t.dtype == torch.bfloat16:
        t = t.float()
    flat = pa.array(t.reshape(-1).numpy())
    for size in reversed(t.shape[1:]):
        flat = pa.FixedSizeListArray.from_arrays(flat, int(size))
    return flat


def to_hf_dataset(source: Any, cache_dir: pathlib.Path) -> Any:
    """Write each shard of ``source`` (an ActivationDataset) as an Arrow file; concatenate them.

    Raises:
        OptionalDependencyError: ``datasets`` (and its ``pyarrow``) is not installed.
    """
    try:
        import datasets  # optional heavy dependency: the torchlens[datasets] extra
        import pyarrow as pa  # optional heavy dependency, installed with datasets
    except ImportError:
        raise OptionalDependencyError("converting to a datasets.Dataset needs the 'datasets' package",
                                      remedy="pip install 'torchlens[datasets]'.") from None
    cache_dir.mkdir(parents=True, exist_ok=True)
    parts = []
    for k, shard in enumerate(source.iter_shards()):
        table = pa.table({name: _column(t) for name, t in shard.items()})
        path = cache_dir / f"shard-{k:05d}.arrow"
        tmp = path.with_name(path.name + ".partial")
        with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
        tmp.replace(path)
        parts.append(datasets.Dataset.from_file(str(path)))
    return datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]
