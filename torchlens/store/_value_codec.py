"""Values in a save: JSON for structure, tensors by name in the tensor file.

:func:`encode` turns arguments and outputs (tensors, dtypes, slices, tuples, dicts,
``ModelOutput``-like records ...) into tagged JSON; :class:`Decoder` turns that back,
checking every field and which tensors were used. Nothing is pickled: a value that
cannot be stored safely is refused, or kept as an :class:`Opaque` marker.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..core.records import Ref
from ..errors import NotPortableError
from ._load_checks import MAX_DEPTH, MAX_DIM, check_int, fail
from ._safetensors import ST_NAMES, storable

__all__ = ["Decoder", "LazyTensor", "Opaque", "SavedRecord", "TensorTable", "encode"]


class SavedRecord(dict):
    """A structured output (``ModelOutput``...) loaded back: a dict with attribute access."""

    type_name = "dict"

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, int):
            return list(self.values())[key]
        return super().__getitem__(key)

    def to_tuple(self) -> tuple:
        return tuple(self.values())


def _record_flatten(d: SavedRecord) -> tuple[list[Any], Any]:
    return list(d.values()), (d.type_name, list(d.keys()))


def _record_unflatten(values: Any, context: Any) -> SavedRecord:
    rec = SavedRecord(zip(context[1], values))
    rec.type_name = context[0]
    return rec


# the serialized name is where the class first lived; kept so serialized tree specs stay readable
pytree.register_pytree_node(SavedRecord, _record_flatten, _record_unflatten,
                            serialized_type_name="torchlens.persist.SavedRecord")


class Opaque:
    """Stands in for a value that was not stored (an object TorchLens cannot save safely)."""

    def __init__(self, type_name: str) -> None:
        self.type_name = type_name

    def __repr__(self) -> str:
        return f"<not saved: {self.type_name}>"


class LazyTensor:
    """A tensor to write that is read only when its bytes are written (``load()``), so a table of
    values kept on disk does not hold them all: ``dtype`` and ``shape`` fill the file's header."""

    __slots__ = ("load", "dtype", "shape")

    def __init__(self, load: Callable[[], torch.Tensor], dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        self.load, self.dtype, self.shape = load, dtype, shape


class TensorTable:
    """Tensors to write, deduplicated by identity so shared tensors load back shared.

    With ``views``, a tensor that views the whole storage of a tensor already in the table
    (``x.view(...)``, ``x.transpose(...)``, a ``split`` part ...) is not written again: it is
    listed in ``views`` (``{"of": name, "size", "stride", "offset"}``) and rebuilt on load as that
    view, sharing the memory again.
    """

    def __init__(self, views: bool = False) -> None:
        self.tensors: dict[str, torch.Tensor | LazyTensor] = {}
        self._ids: dict[Any, str] = {}
        self.views: dict[str, dict[str, Any]] | None = {} if views else None
        self._wholes: dict[tuple[int, str], tuple[str, torch.Tensor]] = {}  # (storage, device) -> whole tensor
        self._kept: list[torch.Tensor] = []  # the views listed (their ids name them in ``_ids``)

    def put_lazy(self, key: Any, t: torch.Tensor, load: Callable[[], torch.Tensor], stem: str) -> str:
        """Like :meth:`put` for ``t``, a value read back from disk: the table keeps ``load`` (which
        reads it again when the file is written) instead of ``t``; ``key`` names it for dedup."""
        name = self._ids.get(key)
        if name is not None:
            return name
        _storable_check(t)
        name = self._fresh(stem)
        self.tensors[name] = LazyTensor(load, t.dtype, tuple(t.shape))
        self._ids[key] = name
        return name

    def put(self, t: torch.Tensor, stem: str) -> str:
        name = self._ids.get(id(t))
        if name is not None:
            return name
        _storable_check(t)
        name = self._fresh(stem)
        self._ids[id(t)] = name
        if self.views is not None:
            view = self._view_of(t)
            if view is not None:
                self.views[name] = view
                self._kept.append(t)
                return name
            self._note_whole(name, t)
        self.tensors[name] = t
        return name

    def put_lazy_view(self, key: Any, t: torch.Tensor, base_key: Any, offset: int, stem: str) -> str | None:
        """List ``t`` (named ``key``, as in :meth:`put_lazy`) as a view of the lazily listed tensor
        ``base_key`` at ``offset`` (its shape and strides ``t``'s), if that tensor is in the table
        and ``t`` fits in it (None: list ``t`` itself)."""
        name = self._ids.get(key)
        if name is not None:
            return name
        base = self._ids.get(base_key)
        whole = self.tensors.get(base) if base is not None else None
        if self.views is None or type(whole) is not LazyTensor or whole.dtype != t.dtype or t.is_conj() \
                or t.is_neg() or (t.numel() and offset + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
                                  >= math.prod(whole.shape)):
            return None
        name = self._fresh(stem)
        self.views[name] = {"of": base, "size": list(t.shape), "stride": list(t.stride()), "offset": offset}
        self._ids[key] = name
        return name

    def _fresh(self, stem: str) -> str:
        taken = len(self.tensors) + len(self.views or ())
        return stem if stem not in self.tensors and stem not in (self.views or ()) else f"{stem}#{taken}"

    def _view_of(self, t: torch.Tensor) -> dict[str, Any] | None:
        """How ``t`` views a whole tensor of the table (None: it does not)."""
        storage = t.untyped_storage()
        found = self._wholes.get((storage.data_ptr(), str(t.device))) if storage.nbytes() else None
        if found is None or t.is_conj() or t.is_neg():
            return None
        name, whole = found
        if whole.dtype != t.dtype or whole.untyped_storage().nbytes() != storage.nbytes():
            return None
        return {"of": name, "size": list(t.shape), "stride": list(t.stride()), "offset": t.storage_offset()}

    def _note_whole(self, name: str, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        if storage.nbytes() and storage.nbytes() == t.numel() * t.element_size() and t.storage_offset() == 0 \
                and t.is_contiguous() and not t.is_conj() and not t.is_neg():
            self._wholes.setdefault((storage.data_ptr(), str(t.device)), (name, t))


def _storable_check(t: torch.Tensor) -> None:
    if t.layout is not torch.strided or t.is_meta or t.is_quantized or t.dtype not in ST_NAMES:
        storable(t)


_TAGS = ("float", "complex", "tensor", "ref", "dtype", "device", "layout", "memory_format", "size", "slice",
         "ellipsis", "tuple", "list", "dict", "record", "opaque")


def _enum_table(kind: type) -> dict[str, Any]:
    return {str(v).rpartition(".")[2]: v for v in vars(torch).values() if isinstance(v, kind)}


_DTYPE_NAMES = _enum_table(torch.dtype)
_LAYOUTS = _enum_table(torch.layout)
_FORMATS = _enum_table(torch.memory_format)


def encode(value: Any, put: Callable[[torch.Tensor], Any], *, strict: bool = True, depth: int = 0) -> Any:
    """JSON for ``value``; tensors become whatever ``put`` returns (``{"tensor": name}``).

    Args:
        strict: raise NotPortableError on objects that cannot be stored; otherwise store
            an ``{"opaque": type}`` marker (loaded back as :class:`Opaque`).
    """
    if depth > MAX_DEPTH:
        raise NotPortableError("the value is nested too deeply to store")
    t = type(value)
    if value is None or t in (bool, int, str):
        return value
    if t is float:
        return value if value == value and abs(value) != float("inf") else {"float": repr(value)}
    if isinstance(value, torch.Tensor):
        return put(value)
    if t is Ref:
        return {"ref": [value.index, value.elem]}
    if t is torch.dtype:
        return {"dtype": str(value).rpartition(".")[2]}
    if t is torch.device:
        return {"device": str(value)}
    if t is torch.layout:
        return {"layout": str(value).rpartition(".")[2]}
    if t is torch.memory_format:
        return {"memory_format": str(value).rpartition(".")[2]}
    if t is torch.Size:
        return {"size": list(value)}
    if t is complex:
        return {"complex": [encode(value.real, put), encode(value.imag, put)]}
    if t is slice:
        parts = (value.start, value.stop, value.step)
        return {"slice": [encode(x, put, strict=strict, depth=depth + 1) for x in parts]}
    if value is Ellipsis:
        return {"ellipsis": True}
    sub = lambda v: encode(v, put, strict=strict, depth=depth + 1)  # noqa: E731
    if isinstance(value, tuple):
        return {"tuple": [sub(x) for x in value]}
    if t is list:
        return {"list": [sub(x) for x in value]}
    if isinstance(value, Mapping) and all(type(k) in (str, int) for k in value):
        items = [[k, sub(v)] for k, v in value.items()]
        if t is dict:
            return {"dict": items}
        name = value.type_name if t is SavedRecord else t.__qualname__
        return {"record": items, "type": name}
    if isinstance(value, Opaque) or not strict:
        return {"opaque": value.type_name if isinstance(value, Opaque) else t.__qualname__}
    raise NotPortableError(f"a value of type {t.__qualname__} cannot be stored without pickling")


class Decoder:
    """Turns stored JSON back into values, checking every field; tracks which tensors were used."""

    def __init__(self, tensors: dict[str, torch.Tensor], on_ref: Callable[[int, int | None], Any] | None = None):
        self.tensors = tensors
        self.on_ref = on_ref
        self.used: set[str] = set()

    def tensor(self, name: Any, where: str) -> torch.Tensor:
        if not isinstance(name, str) or name not in self.tensors:
            raise fail(f"{where} names tensor {name!r:.80}, which is not in the tensor file", name=name)
        self.used.add(name)
        return self.tensors[name]

    def check_all_used(self) -> None:
        unused = sorted(set(self.tensors) - self.used)
        if unused:
            raise fail(f"the tensor file holds tensors nothing refers to: {unused[:8]}", extra=unused)

    def value(self, obj: Any, where: str, depth: int = 0) -> Any:
        if depth > MAX_DEPTH:
            raise fail(f"{where} is nested too deeply")
        if obj is None or type(obj) in (bool, int, str):
            return obj
        if type(obj) is float:
            if obj != obj or abs(obj) == float("inf"):
                raise fail(f"{where} holds a non-finite float literal")
            return obj
        if not isinstance(obj, dict) or len(obj) not in (1, 2):
            raise fail(f"{where} holds a malformed value {str(obj)[:80]}")
        tag = next(iter(obj))
        if tag not in _TAGS or (len(obj) == 2 and set(obj) != {"record", "type"}):
            raise fail(f"{where} holds an unknown value tag {tag!r:.40}")
        arg = obj[tag]
        sub = lambda v: self.value(v, where, depth + 1)  # noqa: E731
        if tag == "float":
            if arg not in ("nan", "inf", "-inf"):
                raise fail(f"{where}: bad float {arg!r:.40}")
            return float(arg)
        if tag == "tensor":
            return self.tensor(arg, where)
        if tag == "ref":
            if not (isinstance(arg, list) and len(arg) == 2):
                raise fail(f"{where}: malformed ref")
            index = check_int(arg[0], f"{where}: a ref's op index")
            elem = None if arg[1] is None else check_int(arg[1], f"{where}: a ref's element", 0, 1 << 20)
            if self.on_ref is None:
                raise fail(f"{where} holds an op reference where none is allowed")
            return self.on_ref(index, elem)
        if tag in ("dtype", "layout", "memory_format"):
            table = {"dtype": _DTYPE_NAMES, "layout": _LAYOUTS, "memory_format": _FORMATS}[tag]
            if not isinstance(arg, str) or arg not in table:
                raise fail(f"{where}: unknown {tag} {arg!r:.40}")
            return table[arg]
        if tag == "device":
            if not isinstance(arg, str) or not re.fullmatch(r"[a-z_]{1,16}(:\d{1,4})?", arg):
                raise fail(f"{where}: malformed device {arg!r:.40}")
            try:
                return torch.device(arg)
            except RuntimeError:
                raise fail(f"{where}: unknown device {arg!r:.40}") from None
        if tag == "ellipsis":
            return Ellipsis
        if tag == "opaque":
            if not isinstance(arg, str):
                raise fail(f"{where}: malformed opaque marker")
            return Opaque(arg[:200])
        if tag == "dict" or tag == "record":
            if not isinstance(arg, list) or not all(
                isinstance(kv, list) and len(kv) == 2 and type(kv[0]) in (str, int) for kv in arg
            ):
                raise fail(f"{where}: malformed {tag}")
            if tag == "dict":
                return {k: sub(v) for k, v in arg}
            rec = SavedRecord((k, sub(v)) for k, v in arg)
            rec.type_name = str(obj.get("type", "record"))[:200]
            return rec
        if not isinstance(arg, list):
            raise fail(f"{where}: malformed {tag}")
        items = [sub(v) for v in arg]
        if tag == "tuple":
            return tuple(items)
        if tag == "list":
            return items
        if tag == "size":
            return torch.Size([check_int(d, f"{where}: a size", 0, MAX_DIM) for d in items])
        if tag == "slice":
            if len(items) != 3:
                raise fail(f"{where}: malformed slice")
            return slice(*items)
        if tag == "complex":
            if len(items) != 2 or not all(type(x) in (int, float) for x in items):
                raise fail(f"{where}: malformed complex")
            return complex(*items)
        raise fail(f"{where}: unknown tag {tag!r:.40}")  # pragma: no cover
