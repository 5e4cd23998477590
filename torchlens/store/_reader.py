"""Reading an activation dataset back: a memory-mapped ``torch.utils.data.Dataset``.

The manifest is the only thing read up front; shard files are opened with safetensors'
``safe_open`` (which memory-maps them) the first time a record of theirs is asked for.
"""

from __future__ import annotations

import bisect
import pathlib
from collections.abc import Iterator
from typing import Any

import torch
from safetensors import safe_open
from torch.utils.data import Dataset

from ..errors import DatasetFormatError
from ._arrow import to_hf_dataset
from ._shards import file_sha256, read_manifest

__all__ = ["ActivationDataset"]


class ActivationDataset(Dataset):
    """A finished activation dataset on disk; item ``i`` is ``{column: tensor}`` of record ``i``.

    Records are in dataset order (row, then position). Columns: ``row`` (and, per token,
    ``position`` and ``token``) plus one per site or per value the job stored.

    Args:
        path: the job directory (``manifest.json`` and ``shard-*.safetensors``).
        verify: recompute every shard's sha256 against the manifest first.

    Raises:
        DatasetFormatError: no finished dataset at ``path``, a shard is missing, or a checksum differs.
    """

    def __init__(self, path: str | pathlib.Path, *, verify: bool = False) -> None:
        self.path = pathlib.Path(path)
        manifest = read_manifest(self.path)
        if manifest is None:
            raise DatasetFormatError(f"{self.path} holds no manifest.json: no activation dataset was written there",
                                     remedy="Check the path, or run tl.cache_activations(..., out=path) first.")
        if not manifest.get("complete"):
            raise DatasetFormatError(f"{self.path} holds an unfinished job ({len(manifest['shards'])} shard(s) so far)",
                                     remedy="Rerun the call that wrote it: it resumes and finishes the job.")
        self.manifest = manifest
        self._shards = sorted(manifest["shards"], key=lambda s: s["index"])
        self._starts = []
        total = 0
        for shard in self._shards:
            if not (self.path / shard["file"]).is_file():
                raise DatasetFormatError(f"{self.path} lacks {shard['file']}, listed in its manifest")
            self._starts.append(total)
            total += shard["records"]
        self._len = total
        self._open: dict[int, Any] = {}
        if verify:
            self.verify()

    @property
    def columns(self) -> dict[str, dict[str, Any]]:
        """``{name: {"dtype": "F32", "shape": [...]}}``: the per-record shape of each column."""
        return self.manifest["columns"]

    @property
    def num_shards(self) -> int:
        return len(self._shards)

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if isinstance(index, slice) or not hasattr(index, "__index__"):
            raise TypeError(f"index a record with an int, got {type(index).__name__}")
        i = index.__index__()
        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise IndexError(f"record {index} out of range for {self._len} records")
        k = bisect.bisect_right(self._starts, i) - 1
        local = i - self._starts[k]
        handle = self._handle(k)
        return {name: handle.get_slice(name)[local : local + 1][0] for name in self.columns}

    def _handle(self, k: int) -> Any:
        if k not in self._open:
            self._open[k] = safe_open(str(self.path / self._shards[k]["file"]), framework="pt")
        return self._open[k]

    def __getstate__(self) -> dict[str, Any]:  # DataLoader workers reopen shards themselves
        state = dict(self.__dict__)
        state["_open"] = {}
        return state

    def shard(self, k: int, columns: list[str] | None = None) -> dict[str, torch.Tensor]:
        """Every record of shard ``k`` (``columns`` only, if given), as whole tensors."""
        handle = self._handle(k)
        return {name: handle.get_tensor(name) for name in (columns or list(self.columns))}

    def iter_shards(self, columns: list[str] | None = None) -> Iterator[dict[str, torch.Tensor]]:
        """Shard after shard: memory stays at one shard, whatever the dataset's size."""
        for k in range(len(self._shards)):
            yield self.shard(k, columns)

    def tensor(self, name: str) -> torch.Tensor:
        """One column of the whole dataset, concatenated in memory (for datasets that fit)."""
        self._column(name)
        return torch.cat([s[name] for s in self.iter_shards([name])])

    def mean(self, name: str) -> torch.Tensor:
        """The mean record of a column over the whole dataset, accumulated shard by shard in float64."""
        self._column(name)
        total = None
        for s in self.iter_shards([name]):
            part = s[name].double().sum(0)
            total = part if total is None else total + part
        return (total / max(1, self._len)).to(torch.float32)

    def _column(self, name: str) -> None:
        if name not in self.columns:
            raise KeyError(f"no column {name!r}; the columns are {sorted(self.columns)}")

    def verify(self) -> None:
        """Recompute each shard's sha256 and compare it with the manifest.

        Raises:
            DatasetFormatError: a shard's bytes differ from what was committed.
        """
        for shard in self._shards:
            got = file_sha256(self.path / shard["file"])
            if got != shard["sha256"]:
                raise DatasetFormatError(f"{shard['file']} in {self.path} fails its checksum (sha256 {got[:12]}..., "
                                         f"manifest {shard['sha256'][:12]}...)", shard=shard["index"])

    def to_hf(self, cache_dir: str | pathlib.Path | None = None) -> Any:
        """A ``datasets.Dataset`` over the same records (needs ``torchlens[datasets]``).

        Each shard becomes one Arrow file under ``cache_dir`` (default ``<path>/arrow``), memory-mapped
        by ``datasets``: the conversion holds one shard in memory at a time. bfloat16 columns become
        float32 (Arrow has no bfloat16); trailing dimensions become nested fixed-size lists.

        Raises:
            OptionalDependencyError: ``datasets`` is not installed.
        """
        return to_hf_dataset(self, pathlib.Path(cache_dir) if cache_dir is not None else self.path / "arrow")

    def __repr__(self) -> str:
        cols = ", ".join(f"{k}{v['shape']}" for k, v in self.columns.items())
        return f"ActivationDataset({str(self.path)!r}, {self._len} records, {len(self._shards)} shards: {cols})"
