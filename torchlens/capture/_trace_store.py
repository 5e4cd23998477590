"""A trace whose op values live on disk: ``tl.trace(model, x, store=path)``.

Each recorded value is written into the open safetensors shard the moment the forward produces
it, straight from the model's own memory (a contiguous CPU tensor is never copied): one copy,
into the page cache, and nothing buffered in the process. That is what keeps the peak low: a
buffer of copies would be freed after each shard, and the C allocator keeps most of what is
freed that way (tens of MiB per shard, in our measurements). The shard's header is written into
room reserved at its start when the shard is full (``safetensors`` allows a header padded with
spaces). Ops keep a :class:`StoredValue`, which reads the tensor back, memory-mapped by
``safe_open``, each time it is asked for: the trace holds the graph, not the activations.

Fewer bytes, losslessly: a value an exactly reproducible op made from other values of the store
(``x * 0.5``, a residual ``a + b``: see ``_recompute``) is recomputed on read instead of written,
once the store has checked, while the forward runs, that the recompute gives it bit for bit.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import pathlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from safetensors import safe_open

from .._interrupts import HoldInterrupts
from ..core.records import Deferred, Ref
from ..core.tree import flatten, unflatten
from ..errors import InvalidArgumentError, TraceStoreWriteError
from ._recompute import MAX_RECOMPUTE_OPS, Recompute, bits_equal, candidate_args, run_recipe
from ._safetensors_format import ST_DTYPES, ST_NAMES, shard_name

__all__ = ["DEFAULT_BUDGET", "StoredValue", "TraceStore", "check_recompute", "read_back"]

DEFAULT_BUDGET = 256 * 2**20  # bytes of values per shard (a bigger value gets a shard of its own)
INDEX = "trace-store.json"
# Room for the header at the start of each shard; data starts 64-byte aligned right after it.
HEADER_ROOM = 2**18 - 8
ALIGN = 64


def _storable(t: torch.Tensor) -> bool:
    """Whether safetensors can hold ``t`` (dense, with real memory, of a dtype it names)."""
    return t.layout is torch.strided and not t.is_meta and t.dtype in ST_NAMES


def _malloc_trim() -> Any:
    """glibc's ``malloc_trim`` (None elsewhere: macOS, musl, Windows)."""
    try:
        return ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError, TypeError):
        return None


# A forward frees most of what it allocates, but glibc keeps freed chunks below its (adaptive)
# mmap threshold in the heap, resident: on GPT-2 small at 1 x 1024 that was 50-120 MB above a
# plain forward, varying run to run. A disk-backed trace exists to bound memory, so each time it
# finishes a shard it hands the freed pages back to the system (a few ms per 256 MB written).
_TRIM = _malloc_trim()


def check_recompute(recompute: Any) -> None:
    """Raise ``InvalidArgumentError`` unless ``recompute`` (``store_recompute=``) is a bool."""
    if not isinstance(recompute, bool):
        raise InvalidArgumentError(
            f"store_recompute= takes True or False, got {recompute!r}",
            remedy="Pass store_recompute=False to write every value to disk, or leave it out (True: values "
                   "reproducible bit for bit from other stored values are recomputed on read).")


class StoredValue(Deferred):
    """One op value in a :class:`TraceStore`: its tensors by name, its structure by spec."""

    __slots__ = ("store", "names", "spec", "others")

    def __init__(self, store: TraceStore, names: list[str | None], spec: Any, others: list[Any] | None) -> None:
        self.store = store
        self.names = names
        self.spec = spec
        self.others = others  # the non-tensor leaves (None, ints ...), in place; None: every leaf is a tensor

    def load(self) -> Any:
        """The value, read back from its shard (from the open shard's file while the forward runs)."""
        get, others = self.store.get, self.others
        if others is None:
            leaves = [get(name) for name in self.names]
        else:
            leaves = [get(name) if name is not None else other for name, other in zip(self.names, others)]
        return leaves[0] if self.spec is None else unflatten(leaves, self.spec)

    def __repr__(self) -> str:
        return f"StoredValue({self.names!r})"


class TraceStore:
    """The shard directory of one disk-backed trace.

    Args:
        path: a directory (created; it must be empty or not exist).
        budget: bytes of values per shard; the shard is finished (its header written) once it holds that many.
        recompute: recompute exactly reproducible values on read instead of writing them (see the
            module docstring); False writes every value.

    Raises:
        InvalidArgumentError: ``path`` exists and is not an empty directory, or ``recompute`` is not a bool.
    """

    def __init__(self, path: str | pathlib.Path, budget: int = DEFAULT_BUDGET, *, recompute: bool = True) -> None:
        check_recompute(recompute)
        self.path = pathlib.Path(path)
        if self.path.exists() and (not self.path.is_dir() or any(self.path.iterdir())):
            raise InvalidArgumentError(
                f"store={str(self.path)!r} exists and is not an empty directory",
                remedy="Pass a new (or empty) directory for the trace's shards.",
            )
        self._made_dir = not self.path.exists()  # ``abort`` removes a directory this store made
        self.path.mkdir(parents=True, exist_ok=True)
        self.budget = budget
        self._where: dict[str, int] = {}  # tensor name -> shard index (finished shards)
        self._files: dict[int, Any] = {}  # open (memory-mapped) finished shards
        self._shapes: dict[str, list[int]] = {}  # a 0-d tensor is stored as 1 element
        # name -> (the stored tensor it views, size, stride, storage offset)
        self._views: dict[str, tuple[str, list[int], list[int], int]] = {}
        self._bases: dict[int, tuple[str, int, Any]] = {}  # storage -> (name, version, weak tensor) stored whole
        self.recompute = recompute
        self._recipes: dict[str, Recompute] = {}  # name -> how to recompute it (nothing written)
        self._cost: dict[str, int] = {}  # name -> ops a read of it recomputes (absent: 0)
        # op index -> (weak tensor, its version, whether a read gives it back with the same strides,
        # its name): the values a later op's recipe may name, while the forward runs.
        self._made: dict[int, tuple[Any, int, bool, str]] = {}
        self.n_recomputed = 0
        self._since_trim = 0  # bytes written or checked by a recompute since memory was last handed back
        self.bytes_recomputed = 0  # bytes recomputed on read instead of written
        # The open shard: its file, its header entries so far, their JSON size, and its data size.
        self._file: Any = None
        self._header: dict[str, Any] = {}
        self._header_bytes = 0
        self._pos = 0
        self._pads = 0
        self.n_shards = 0
        self.bytes_written = 0

    def put(self, key: str, value: Any, op: Any = None) -> StoredValue:
        """Write ``value``'s tensors into the store under ``key``; return the handle that reads them back.

        ``op`` (the recorded op that produced ``value``, its arguments linked) lets the store keep
        a recipe instead of the bytes when the value is exactly reproducible from stored ones.
        """
        if type(value) is torch.Tensor and _storable(value):
            self._put_tensor(key, value, op)  # the common case, without flattening
            return StoredValue(self, [key], None, None)
        leaves, spec = flatten(value)
        names: list[str | None] = []
        others: list[Any] = []
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor) and _storable(leaf):
                name = key if spec is None else f"{key}/{i}"
                self._put_tensor(name, leaf)
                names.append(name)
                others.append(None)
            else:
                if isinstance(leaf, torch.Tensor) and not leaf.is_meta:
                    leaf = leaf.detach().clone()  # a dtype or layout safetensors cannot hold: kept in memory
                names.append(None)
                others.append(leaf)
        return StoredValue(self, names, spec, others)

    def _put_tensor(self, name: str, t: torch.Tensor, op: Any = None) -> None:
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
                if stored in self._cost:
                    self._cost[name] = self._cost[stored]
                self._note(op, t, version, True, name)
                return
        remade = self._recipe(name, t, op) if op is not None and self.recompute and version is not None else None
        if remade is None:
            # Written now, from the model's own memory when it is a contiguous CPU tensor: later
            # in-place changes cannot reach what is on disk, and no copy is ever buffered.
            data = t.detach()
            if data.device.type != "cpu":
                data = data.cpu()
            data = data.resolve_conj().resolve_neg().contiguous()
            self._shapes[name] = list(data.shape)
            self._write(name, data.reshape(-1) if data.dim() == 0 else data)
            same_strides = t.is_contiguous()  # read back contiguous
        else:
            same_strides = remade.stride() == t.stride()
        if key and version is not None and t.is_contiguous() and t.storage_offset() == 0 \
                and t.numel() * t.element_size() == t.untyped_storage().nbytes() and (remade is None or same_strides):
            # ``t`` covers its whole storage: later views of it are stored as views.
            self._bases[key] = (name, version, weakref.ref(t))
        self._note(op, t, version, same_strides, name)

    def _note(self, op: Any, t: torch.Tensor, version: int | None, same_strides: bool, name: str) -> None:
        """Remember the value op ``op`` produced, for the recipes of later ops that read it."""
        if op is not None and version is not None and self.recompute:
            self._made[op.index] = (weakref.ref(t), version, same_strides, name)

    def _recipe(self, name: str, t: torch.Tensor, op: Any) -> torch.Tensor | None:
        """Keep a recipe for ``t`` instead of its bytes when ``op`` recomputes it bit for bit from
        values of this store as a read gives them back; return the recomputed tensor (None: write it).

        Each argument must be the very tensor the store noted for its op, unchanged since (same
        version) and given back with the same strides (so the recompute here is the one a read
        runs), and the read may recompute at most ``MAX_RECOMPUTE_OPS`` ops in all.
        """
        if t.device.type != "cpu":
            return None  # a read recomputes on CPU: the check must run on the same device
        found = candidate_args(op)
        if found is None:
            return None
        fn_name, func, args, kwargs = found
        live: list[Any] = []
        spec: list[Any] = []
        cost = 1
        for a in args:
            if type(a) is not Ref:
                live.append(a)
                spec.append(a)
                continue
            made = self._made.get(a.index)
            if made is None:
                return None  # not a value of this store (an input it does not hold, a guard ...)
            weak, version, same_strides, arg_name = made
            x = weak()
            if x is None or not same_strides or x._version != version:
                return None
            cost += self._cost.get(arg_name, 0)
            live.append(x)
            spec.append((arg_name,))
        if cost > MAX_RECOMPUTE_OPS or (func is torch.Tensor.to and live[0].dtype != t.dtype):
            return None
        try:
            remade = run_recipe(func, live, kwargs)
        except (RuntimeError, TypeError, ValueError):  # the forward's own call succeeded; if this one
            return None  # does not (a changed global state), the bytes are written as before
        if not bits_equal(remade, t):
            return None
        self._recipes[name] = Recompute(fn_name, func, spec, kwargs)
        self._cost[name] = cost
        self.n_recomputed += 1
        size = t.numel() * t.element_size()
        self.bytes_recomputed += size
        # A recomputed value is not written, so shards fill more slowly, but its check allocated as
        # much as the value (freed at once): memory is handed back per budget of both together.
        self._since_trim += size
        if self._since_trim > self.budget:
            self._trim()
        return remade

    def _write(self, name: str, t: torch.Tensor) -> None:
        size = t.numel() * t.element_size()
        if self._file is not None and self._pos and (self._pos + size > self.budget
                                                     or self._header_bytes > HEADER_ROOM - 4096):
            self._finish_shard()
        if self._file is None:
            self._open_shard()
        pad = -self._pos % ALIGN
        try:
            if pad:  # safetensors allows no holes: the padding is a tensor of its own
                self._pads += 1
                self._entry(f"__pad__/{self._pads}", "U8", [pad], pad)
                self._file.write(bytes(pad))
            self._entry(name, ST_NAMES[t.dtype], list(t.shape), size)
            self._since_trim += size
            if size:
                self._file.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
        except OSError as exc:
            raise self._error(exc) from exc

    def _entry(self, name: str, dtype: str, shape: list[int], size: int) -> None:
        entry = {"dtype": dtype, "shape": shape, "data_offsets": [self._pos, self._pos + size]}
        self._header[name] = entry
        self._header_bytes += len(name) + len(json.dumps(entry, separators=(",", ":"))) + 8
        self._pos += size

    def _open_shard(self) -> None:
        try:
            self._file = open(self.path / shard_name(self.n_shards), "w+b")  # read back while open
            self._file.seek(8 + HEADER_ROOM)
        except OSError as exc:
            raise self._error(exc) from exc
        self._header = {"__metadata__": {"format": "pt", "written_by": "torchlens"}}
        self._header_bytes = 64
        self._pos = 0

    def _finish_shard(self) -> None:
        """Write the open shard's header into the room reserved for it and close the file."""
        raw = json.dumps(self._header, separators=(",", ":")).encode()
        if len(raw) > HEADER_ROOM:  # _header_bytes over-estimates it: a bug, never a corrupt shard
            raise TraceStoreWriteError(f"the header of {shard_name(self.n_shards)} outgrew its room",
                                       path=str(self.path))
        try:
            self._file.seek(0)
            self._file.write(HEADER_ROOM.to_bytes(8, "little") + raw + b" " * (HEADER_ROOM - len(raw)))
            self._file.close()
        except OSError as exc:
            raise self._error(exc) from exc
        index = self.n_shards
        for name in self._header:
            self._where[name] = index
        self.bytes_written += 8 + HEADER_ROOM + self._pos
        self.n_shards += 1
        self._file = None
        self._header = {}
        self._trim()

    def _trim(self) -> None:
        """Hand the memory the forward (and the recompute checks) freed back to the system."""
        self._since_trim = 0
        if _TRIM is not None:
            _TRIM(0)

    def _error(self, exc: OSError) -> TraceStoreWriteError:
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass
            self._file = None
        return TraceStoreWriteError(f"writing the trace store {str(self.path)!r} failed: {exc.strerror or exc}",
                                    path=str(self.path))

    def close(self) -> None:
        """Finish the open shard and write the index of names (the forward has finished)."""
        if self._file is not None:
            self._finish_shard()
        self._bases.clear()
        self._made.clear()
        index = {"shards": [shard_name(i) for i in range(self.n_shards)], "tensors": self._where,
                 "shapes": self._shapes, "views": self._views,
                 "recomputed": {name: r.to_json() for name, r in self._recipes.items()},
                 "recomputed_bytes": self.bytes_recomputed}
        try:
            (self.path / INDEX).write_text(json.dumps(index))
        except OSError as exc:
            raise self._error(exc) from exc

    def abort(self) -> None:
        """Take back what a capture that did not finish wrote (its forward raised, or Ctrl-C stopped
        it): every shard, finished or open, and the index; the directory is left as it was before
        (removed if the store made it), so no partial trace is left on disk and the same call can
        run again."""
        with HoldInterrupts():
            if self._file is not None:
                with contextlib.suppress(OSError):
                    self._file.close()
                self._file = None
            self._files.clear()
            self._bases.clear()
            self._made.clear()
            for name in [INDEX, *(shard_name(i) for i in range(self.n_shards + 1))]:
                with contextlib.suppress(OSError):
                    (self.path / name).unlink(missing_ok=True)
            if self._made_dir:
                with contextlib.suppress(OSError):
                    self.path.rmdir()  # only if empty: nothing but our files was ever in it

    def view_of(self, name: str) -> tuple[str, int] | None:
        """``(the stored tensor it views, its storage offset)`` for a value stored as a view (None: it is not)."""
        view = self._views.get(name)
        return None if view is None else (view[0], view[3])

    def get(self, name: str) -> torch.Tensor:
        """The stored tensor ``name`` (memory-mapped from a finished shard, read from the open one,
        or recomputed from stored ones by its recipe)."""
        t = self._get(name)
        seen = _ORIGINS[0]
        if seen is not None:
            seen[id(t)] = (weakref.ref(t), self, name)
        return t

    def _get(self, name: str) -> torch.Tensor:
        recipe = self._recipes.get(name)
        if recipe is not None:
            args = [self._get(a[0]) if type(a) is tuple else a for a in recipe.args]
            return run_recipe(recipe.func, args, recipe.kwargs)
        view = self._views.get(name)
        if view is not None:
            stored, size, stride, offset = view
            return self._get(stored).as_strided(size, stride, offset)
        index = self._where.get(name)
        if index is None:
            t = self._read_open(name)
        else:
            f = self._files.get(index)
            if f is None:
                f = self._files[index] = safe_open(str(self.path / shard_name(index)), framework="pt")
            t = f.get_tensor(name)
        shape = self._shapes[name]
        return t.reshape(shape) if list(t.shape) != shape else t

    def _read_open(self, name: str) -> torch.Tensor:
        """A tensor of the shard still being written (read during the forward, by an edit or a hook)."""
        entry = self._header[name]
        start, end = entry["data_offsets"]
        self._file.flush()
        data = bytearray(os.pread(self._file.fileno(), end - start, 8 + HEADER_ROOM + start))
        dtype = ST_DTYPES[entry["dtype"]]
        if not data:
            return torch.empty(entry["shape"], dtype=dtype)
        return torch.frombuffer(data, dtype=dtype).reshape(entry["shape"])



# While :func:`read_back` is open: id(tensor a store handed out) -> (a weak reference to it, the
# store, its name), so a writer that meets the tensor can read it again later instead of keeping
# it (``trace.save``). By id, the referent checked: tensors compare elementwise, not as keys.
_ORIGINS: list[dict[int, tuple[Any, TraceStore, str]] | None] = [None]


@contextlib.contextmanager
def read_back() -> Iterator[Callable[[torch.Tensor], tuple[TraceStore, str] | None]]:
    """Within ``with``: ``where(tensor)`` is ``(store, name)`` for a tensor a store read back meanwhile,
    so ``store.get(name)`` gives it again (None for any other tensor)."""
    outer = _ORIGINS[0]
    if outer is None:
        _ORIGINS[0] = {}
    seen = _ORIGINS[0]

    def where(t: torch.Tensor) -> tuple[TraceStore, str] | None:
        entry = seen.get(id(t))
        return entry[1:] if entry is not None and entry[0]() is t else None

    try:
        yield where
    finally:
        if outer is None:
            _ORIGINS[0] = None
