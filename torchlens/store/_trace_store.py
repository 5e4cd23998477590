"""A trace whose op values live on disk: ``tl.trace(model, x, store=path)``.

Each recorded value is copied into a small in-memory buffer as the forward produces it; when
the buffer reaches its budget it is written out as one safetensors shard (the same writer as
activation datasets, ``_shards.write_shard``) and dropped. Ops keep a :class:`StoredValue`,
which reads the tensor back, memory-mapped by ``safe_open``, each time it is asked for: the
trace holds the graph, not the activations.
"""

from __future__ import annotations

import json
import pathlib
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from safetensors import safe_open

from ..core.records import Deferred
from ..core.tree import flatten, unflatten
from ..errors import InvalidArgumentError
from ._shards import shard_name, write_shard

__all__ = ["DEFAULT_BUDGET", "StoredValue", "TraceStore"]

DEFAULT_BUDGET = 32 * 2**20  # bytes buffered before a shard is written (two shards at most in memory)
INDEX = "trace-store.json"


class StoredValue(Deferred):
    """One op value in a :class:`TraceStore`: its tensors by name, its structure by spec."""

    __slots__ = ("store", "names", "spec", "others")

    def __init__(self, store: TraceStore, names: list[str | None], spec: Any, others: list[Any]) -> None:
        self.store = store
        self.names = names
        self.spec = spec
        self.others = others  # the non-tensor leaves (None, ints ...), in place

    def load(self) -> Any:
        """The value, read back from its shard (or from the buffer while the forward runs)."""
        leaves = [self.store.get(name) if name is not None else other for name, other in zip(self.names, self.others)]
        return leaves[0] if self.spec is None else unflatten(leaves, self.spec)

    def __repr__(self) -> str:
        return f"StoredValue({self.names!r})"


class TraceStore:
    """The shard directory of one disk-backed trace.

    Args:
        path: a directory (created; it must be empty or not exist).
        budget: bytes of values buffered in memory before they are written as a shard.

    Raises:
        InvalidArgumentError: ``path`` exists and is not an empty directory.
    """

    def __init__(self, path: str | pathlib.Path, budget: int = DEFAULT_BUDGET) -> None:
        self.path = pathlib.Path(path)
        if self.path.exists() and (not self.path.is_dir() or any(self.path.iterdir())):
            raise InvalidArgumentError(
                f"store={str(self.path)!r} exists and is not an empty directory",
                remedy="Pass a new (or empty) directory for the trace's shards.",
            )
        self.path.mkdir(parents=True, exist_ok=True)
        self.budget = budget
        self._buffer: dict[str, list[torch.Tensor]] = {}
        self._buffered = 0
        self._where: dict[str, int] = {}  # tensor name -> shard index
        self._files: dict[int, Any] = {}  # open (memory-mapped) shards
        self._shapes: dict[str, list[int]] = {}  # a 0-d tensor is stored as 1 element
        # name -> (the stored tensor it views, size, stride, storage offset)
        self._views: dict[str, tuple[str, list[int], list[int], int]] = {}
        self._bases: dict[int, tuple[str, int, Any]] = {}  # storage -> (name, version, weak tensor) stored whole
        # One writer thread: file I/O releases the GIL, so shards are written while the forward runs.
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torchlens-store")
        self._pending: tuple[int, dict[str, list[torch.Tensor]], Future] | None = None
        self.n_shards = 0
        self.bytes_written = 0

    def put(self, key: str, value: Any) -> StoredValue:
        """Copy ``value``'s tensors into the store under ``key``; return the handle that reads them back."""
        leaves, spec = flatten(value)
        names: list[str | None] = []
        others: list[Any] = []
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor) and not leaf.is_meta and leaf.layout is torch.strided:
                name = key if spec is None else f"{key}/{i}"
                self._put_tensor(name, leaf)
                names.append(name)
                others.append(None)
            else:
                names.append(None)
                others.append(leaf)
        if self._buffered >= self.budget:
            self.flush()
        return StoredValue(self, names, spec, others)

    def _put_tensor(self, name: str, t: torch.Tensor) -> None:
        try:
            key = t.untyped_storage().data_ptr()
            version = t._version
        except (RuntimeError, NotImplementedError):  # no storage or no version counter: always copy
            key, version = 0, None
        base = self._bases.get(key) if key else None
        if base is not None and version is not None:
            stored, stored_version, alive = base
            if stored_version == version and alive() is not None:
                # A view of a tensor stored whole and unchanged since: store where it looks, not its bytes.
                self._views[name] = (stored, list(t.shape), list(t.stride()), t.storage_offset())
                return
        copy = t.detach().cpu().contiguous()
        if copy.numel() * copy.element_size() >= self.budget:
            # A value bigger than the buffer (the logits) is written now, from the model's own memory
            # when it is contiguous: no second copy of it exists at any time.
            self._shapes[name] = list(copy.shape)
            self._write_now(name, copy.reshape(-1) if copy.dim() == 0 else copy)
            self._remember_base(name, t, key, version)
            return
        if copy.data_ptr() == t.data_ptr():  # still the model's memory: later in-place ops would show
            copy = copy.clone()
        self._shapes[name] = list(copy.shape)
        self._buffer[name] = [copy.reshape(-1) if copy.dim() == 0 else copy]
        self._buffered += copy.numel() * copy.element_size()
        self._remember_base(name, t, key, version)

    def _remember_base(self, name: str, t: torch.Tensor, key: int, version: int | None) -> None:
        """Note that ``t``, stored whole as ``name``, covers its storage: later views of it are stored as views."""
        if key and version is not None and t.is_contiguous() and t.storage_offset() == 0 \
                and t.numel() * t.element_size() == t.untyped_storage().nbytes():
            self._bases[key] = (name, version, weakref.ref(t))

    def _write_now(self, name: str, t: torch.Tensor) -> None:
        self._wait()
        index = self.n_shards
        self.n_shards += 1
        info = write_shard(self.path, index, {name: [t]}, durable=False)
        self._where[name] = index
        self.bytes_written += info["bytes"]

    def flush(self) -> None:
        """Hand the buffered values to the writer thread as one shard (one shard in flight at most)."""
        if not self._buffer:
            return
        self._wait()
        index, columns = self.n_shards, self._buffer
        self.n_shards += 1
        self._pending = (index, columns, self._writer.submit(write_shard, self.path, index, columns,
                                                                    durable=False))
        self._buffer = {}
        self._buffered = 0

    def _wait(self) -> None:
        if self._pending is None:
            return
        index, columns, future = self._pending
        info = future.result()  # re-raises ShardWriteError (disk full ...) here
        for name in columns:
            self._where[name] = index
        self.bytes_written += info["bytes"]
        self._pending = None

    def close(self) -> None:
        """Write what is left and the index of names to shards (the forward has finished)."""
        self.flush()
        self._wait()
        self._writer.shutdown()
        self._bases.clear()
        index = {"shards": [shard_name(i) for i in range(self.n_shards)], "tensors": self._where,
                 "shapes": self._shapes, "views": self._views}
        (self.path / INDEX).write_text(json.dumps(index))

    def get(self, name: str) -> torch.Tensor:
        view = self._views.get(name)
        if view is not None:
            stored, size, stride, offset = view
            return self.get(stored).as_strided(size, stride, offset)
        buffered = self._buffer.get(name)
        if buffered is None and self._pending is not None and name in self._pending[1]:
            buffered = self._pending[1][name]
        if buffered is not None:
            t = buffered[0]
        else:
            index = self._where[name]
            f = self._files.get(index)
            if f is None:
                f = self._files[index] = safe_open(str(self.path / shard_name(index)), framework="pt")
            t = f.get_tensor(name)
        shape = self._shapes[name]
        return t.reshape(shape) if list(t.shape) != shape else t
