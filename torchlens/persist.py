"""Saved traces (``trace.save`` / ``tl.load_trace``) on the safe on-disk layer they share with recipes.

A save is a directory: ``manifest.json`` (plain JSON: the graph, or a recipe's steps) and
``tensors.safetensors`` (every tensor it carries). Loading must be safe for a file from a
stranger, so it never unpickles and never imports: functions are looked up by qualified
name in a table built from torch's own overridable-function list (and a few factories);
files are opened relative to the directory, without following symlinks; every declared
size is checked against the bytes actually present before anything is allocated. Saving
writes a hidden temporary directory, manifest last, and renames it into place, so an
interrupted save never leaves a directory that loads.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
import tempfile
import uuid
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree

from .core.records import EDIT, INPUT, NOT_REPLAYABLE, ModuleCall, Op, Ref
from .core.tree import flatten, unflatten
from .errors import (
    FormatVersionError,
    InvalidArgumentError,
    NotPortableError,
    RecipeExistsError,
    RecipeFormatError,
    ReplayNotExactError,
    UnsafePathError,
)

FORMAT = "torchlens"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TENSOR_FILE = "tensors.safetensors"
MAX_MANIFEST_BYTES = 256 << 20
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit
MAX_DEPTH = 64
MAX_DIM = 1 << 48
_SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")
_QUALNAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*){0,6}\Z")

# -- safetensors, written and read by us so every byte is checked -------------------------

ST_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "U16": torch.uint16,
    "I32": torch.int32, "U32": torch.uint32, "I64": torch.int64, "U64": torch.uint64,
    "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
    "C64": torch.complex64, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
ST_NAMES = {v: k for k, v in ST_DTYPES.items()}


def fail(message: str, cls: type[RecipeFormatError] = RecipeFormatError, **fields: Any) -> RecipeFormatError:
    return cls(message, **fields)


def _storable(t: torch.Tensor) -> torch.Tensor:
    if t.layout is not torch.strided or t.is_meta or t.is_quantized or t.dtype not in ST_NAMES:
        raise NotPortableError(
            f"a tensor of dtype {t.dtype} / layout {t.layout} cannot be stored in safetensors",
            remedy="Convert it to a dense tensor of a standard dtype first.",
        )
    return t.detach().resolve_conj().resolve_neg().cpu().contiguous()


def write_safetensors(f: Any, tensors: dict[str, torch.Tensor]) -> tuple[str, int, dict[str, Any]]:
    """Write ``tensors`` in the safetensors layout; return (sha256, size, declared table)."""
    ready = {name: _storable(t) for name, t in tensors.items()}
    order = sorted(ready, key=lambda n: (-ready[n].element_size(), n))  # keeps every tensor aligned
    header: dict[str, Any] = {}
    declared: dict[str, Any] = {}
    pos = 0
    for name in order:
        t = ready[name]
        size = t.numel() * t.element_size()
        header[name] = {"dtype": ST_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [pos, pos + size]}
        declared[name] = {"dtype": ST_NAMES[t.dtype], "shape": list(t.shape)}
        pos += size
    header["__metadata__"] = {"format": "pt", "written_by": "torchlens"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    digest = hashlib.sha256()
    for chunk in (len(raw).to_bytes(8, "little"), raw):
        f.write(chunk)
        digest.update(chunk)
    for name in order:
        t = ready[name]
        if t.numel():
            chunk = t.reshape(-1).view(torch.uint8).numpy().tobytes()
            f.write(chunk)
            digest.update(chunk)
    return digest.hexdigest(), 8 + len(raw) + pos, dict(sorted(declared.items()))


def _int(value: Any, what: str, lo: int = 0, hi: int = 1 << 62) -> int:
    if type(value) is not int or not lo <= value <= hi:
        raise fail(f"{what} must be an integer in [{lo}, {hi}], got {value!r:.80}")
    return value


def check_declared(declared: Any) -> dict[str, tuple[torch.dtype, list[int]]]:
    """The manifest's tensor table: ``{name: {"dtype": "F32", "shape": [..]}}``, checked."""
    if not isinstance(declared, dict):
        raise fail("manifest 'tensors' must be an object")
    out = {}
    for name, entry in declared.items():
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape"}:
            raise fail(f"manifest tensor {name!r:.80} must have exactly 'dtype' and 'shape'")
        out[name] = (_dtype(entry["dtype"], name), _shape(entry["shape"], name))
    return out


def _dtype(code: Any, name: str) -> torch.dtype:
    if not isinstance(code, str) or code not in ST_DTYPES:
        raise fail(f"tensor {name!r:.80} has unknown dtype {code!r:.40}; known: {sorted(ST_DTYPES)}")
    return ST_DTYPES[code]


def _shape(shape: Any, name: str) -> list[int]:
    if not isinstance(shape, list) or len(shape) > 64:
        raise fail(f"tensor {name!r:.80} has a malformed shape")
    return [_int(d, f"a dimension of tensor {name!r:.80}", 0, MAX_DIM) for d in shape]


def read_safetensors(data: bytes, declared: dict[str, tuple[torch.dtype, list[int]]]) -> dict[str, torch.Tensor]:
    """Parse safetensors bytes, checking every offset and size against ``declared`` first."""
    if len(data) < 8:
        raise fail(f"the tensor file is truncated ({len(data)} bytes)")
    n = int.from_bytes(data[:8], "little")
    if n > MAX_HEADER_BYTES or n > len(data) - 8:
        raise fail(f"the tensor file declares a {n}-byte header but holds {len(data) - 8} bytes")
    header = loads_json(data[8 : 8 + n], "the tensor file header")
    if not isinstance(header, dict):
        raise fail("the tensor file header is not a JSON object")
    meta = header.pop("__metadata__", None)
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise fail("the tensor file's __metadata__ must map strings to strings")
    body = memoryview(data)[8 + n :]
    entries = []
    for name, e in header.items():
        if not isinstance(e, dict) or set(e) != {"dtype", "shape", "data_offsets"}:
            raise fail(f"tensor file entry {name!r:.80} is malformed")
        dtype, shape = _dtype(e["dtype"], name), _shape(e["shape"], name)
        offs = e["data_offsets"]
        if not isinstance(offs, list) or len(offs) != 2:
            raise fail(f"tensor file entry {name!r:.80} has malformed data_offsets")
        begin, end = (_int(o, f"an offset of tensor {name!r:.80}", 0, len(body)) for o in offs)
        numel = 1
        for d in shape:
            numel *= d
        if end < begin or numel * dtype.itemsize != end - begin:
            raise fail(f"tensor {name!r:.80} declares shape {shape} of {dtype} but spans {end - begin} bytes")
        entries.append((begin, end, name, dtype, shape))
    pos = 0
    for begin, end, name, *_ in sorted(entries):
        if begin != pos:
            raise fail(f"the tensor file has a hole or overlap at tensor {name!r:.80}")
        pos = end
    if pos != len(body):
        raise fail(f"the tensor file has {len(body) - pos} bytes no tensor accounts for")
    missing, extra = sorted(set(declared) - set(header)), sorted(set(header) - set(declared))
    if missing or extra:
        raise fail(f"tensor names differ from the manifest: missing {missing[:8]}, extra {extra[:8]}",
                   missing=missing, extra=extra)
    out = {}
    for begin, end, name, dtype, shape in entries:
        want = declared[name]
        if want != (dtype, shape):
            raise fail(f"tensor {name!r:.80} is {dtype} {shape} in the file but {want[0]} {want[1]} in the manifest")
        out[name] = (torch.frombuffer(bytearray(body[begin:end]), dtype=dtype).reshape(shape) if end > begin
                     else torch.empty(shape, dtype=dtype))
    return out


# -- JSON and the directory ---------------------------------------------------------------


def loads_json(raw: bytes | memoryview, what: str) -> Any:
    """Strict JSON: UTF-8, no NaN/Infinity literals, no duplicate keys; errors say which file."""

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in items:
            if k in out:
                raise ValueError(f"duplicate key {k!r:.80}")
            out[k] = v
        return out

    def constant(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    try:
        return json.loads(bytes(raw).decode("utf-8"), object_pairs_hook=pairs, parse_constant=constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise fail(f"{what} is not valid JSON: {str(exc)[:200]}") from None


def check_file_name(name: Any) -> str:
    if not isinstance(name, str) or not _SAFE_NAME.match(name):
        raise fail(f"the manifest names file {name!r:.120}; only plain file names inside the directory are "
                   "allowed (no paths, no '..', no absolute paths)", UnsafePathError, name=name)
    return name


class SavedDir:
    """An opened save directory: files are read by plain name relative to it, never via a symlink."""

    def __init__(self, path: Any) -> None:
        self.path = Path(os.fspath(path))
        try:
            self.fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
        except FileNotFoundError:
            raise fail(f"{self.path} does not exist", path=str(self.path)) from None
        except (NotADirectoryError, OSError) as exc:
            raise fail(f"{self.path} is not a readable save directory: {exc}", path=str(self.path)) from None

    def read(self, name: str, limit: int) -> bytes:
        name = check_file_name(name)
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=self.fd)
        except FileNotFoundError:
            raise fail(f"{self.path / name} is missing (an interrupted save never has a manifest)") from None
        except OSError as exc:  # ELOOP: a symlink
            raise fail(f"{self.path / name} cannot be opened safely (a symlink?): {exc.strerror}",
                       UnsafePathError, name=name) from None
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise fail(f"{self.path / name} is not a regular file", UnsafePathError, name=name)
            if st.st_size > limit:
                raise fail(f"{self.path / name} is {st.st_size} bytes, over the {limit}-byte limit")
            return f.read(limit + 1)[:limit]

    def close(self) -> None:
        os.close(self.fd)

    def __enter__(self) -> SavedDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_manifest(d: SavedDir, kind: str) -> dict[str, Any]:
    manifest = loads_json(d.read(MANIFEST, MAX_MANIFEST_BYTES), f"{d.path / MANIFEST}")
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise fail(f"{d.path} is not a TorchLens save (manifest 'format' is not {FORMAT!r})")
    version = manifest.get("format_version")
    if type(version) is not int or version < 1:
        raise fail(f"{d.path}: format_version must be a positive integer, got {version!r:.40}")
    if version > FORMAT_VERSION:
        raise fail(f"{d.path} was written in format {version} by a newer TorchLens "
                   f"({manifest.get('torchlens_version')!r:.40}); this one reads up to {FORMAT_VERSION}",
                   FormatVersionError, version=version)
    found = manifest.get("kind")
    if found != kind:
        other = {"trace": "tl.load_trace", "recipe": "tl.load_intervention"}.get(found, "") if isinstance(
            found, str) else ""
        raise fail(f"{d.path} holds a {str(found)[:40]!r}, not a {kind}" + (f"; use {other}" if other else ""))
    return manifest


def read_file_entry(d: SavedDir, manifest: dict, role: str, required: bool = True) -> bytes | None:
    """The bytes of file ``role`` named in ``manifest['files']``, size and sha256 checked."""
    files = manifest.get("files")
    if not isinstance(files, dict) or not all(isinstance(k, str) for k in files):
        raise fail("manifest 'files' must be an object")
    entry = files.get(role)
    if entry is None:
        if required:
            raise fail(f"manifest lists no {role!r} file")
        return None
    if not isinstance(entry, dict) or set(entry) != {"name", "sha256", "bytes"}:
        raise fail(f"manifest file entry {role!r} must have exactly name, sha256 and bytes")
    size = _int(entry["bytes"], f"the size of file {role!r}", 0, 1 << 46)
    data = d.read(entry["name"], size)
    if len(data) != size:
        raise fail(f"{d.path / entry['name']} is {len(data)} bytes, the manifest says {size} (truncated?)")
    if hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise fail(f"{d.path / entry['name']} does not match its sha256 in the manifest (corrupted?)")
    return data


def read_tensors(d: SavedDir, manifest: dict) -> dict[str, torch.Tensor]:
    declared = check_declared(manifest.get("tensors"))
    files = manifest.get("files")
    if isinstance(files, dict) and set(files) - {"tensors", "pickle"}:
        raise fail(f"manifest lists unknown files {sorted(set(files) - {'tensors', 'pickle'})[:5]}")
    data = read_file_entry(d, manifest, "tensors")
    return read_safetensors(data, declared)


def write_dir(path: Any, manifest: dict[str, Any], tensors: dict[str, torch.Tensor],
              extra: dict[str, tuple[str, bytes]] | None = None, *, overwrite: bool = False) -> Path:
    """Write a save directory atomically: temp dir, tensors, extras, manifest last, rename.

    Raises:
        RecipeExistsError: ``path`` exists and ``overwrite`` is false, or it is not a
            TorchLens save (so replacing it could destroy unrelated files).
    """
    target = Path(os.fspath(path)).absolute()
    _check_target(target, overwrite)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent))
    try:
        files: dict[str, Any] = {}
        with open(tmp / TENSOR_FILE, "xb") as f:
            sha, size, declared = write_safetensors(f, tensors)
            _sync(f)
        files["tensors"] = {"name": TENSOR_FILE, "sha256": sha, "bytes": size}
        for role, (name, data) in (extra or {}).items():
            with open(tmp / check_file_name(name), "xb") as f:
                f.write(data)
                _sync(f)
            files[role] = {"name": name, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
        head = {"format": FORMAT, "kind": manifest.pop("kind"), "format_version": FORMAT_VERSION}
        _write_manifest(tmp, {**head, **manifest, "tensors": declared, "files": files})
        _swap_into_place(tmp, target, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _sync(f: Any) -> None:
    f.flush()
    os.fsync(f.fileno())


def dumps_manifest(manifest: dict[str, Any]) -> str:
    """JSON with one top-level field per line and one list item / dict entry per line below it."""

    def one(v: Any) -> str:
        return json.dumps(v, allow_nan=False, separators=(", ", ": "))

    parts = []
    for key, value in manifest.items():
        if isinstance(value, list) and value and not all(isinstance(x, (str, int, float)) for x in value):
            body = "[\n" + ",\n".join(f"  {one(x)}" for x in value) + "\n ]"
        elif isinstance(value, dict) and len(value) > 1:
            body = "{\n" + ",\n".join(f"  {one(k)}: {one(v)}" for k, v in value.items()) + "\n }"
        else:
            body = one(value)
        parts.append(f" {one(key)}: {body}")
    return "{\n" + ",\n".join(parts) + "\n}\n"


def _write_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    text = dumps_manifest(manifest)
    with open(directory / MANIFEST, "x", encoding="utf-8") as f:
        f.write(text)
        _sync(f)


def _check_target(target: Path, overwrite: bool) -> None:
    if not os.path.lexists(target):
        return
    if not overwrite:
        raise RecipeExistsError(f"{target} already exists", path=str(target))
    if target.is_symlink() or not target.is_dir() or not (target / MANIFEST).is_file():
        raise RecipeExistsError(
            f"{target} exists and is not a TorchLens save; refusing to replace it",
            remedy="Choose another path; overwrite=True only replaces an earlier TorchLens save.",
            path=str(target),
        )


def _swap_into_place(tmp: Path, target: Path, overwrite: bool) -> None:
    if not os.path.lexists(target):
        try:
            os.rename(tmp, target)
        except OSError:
            raise RecipeExistsError(f"{target} appeared while saving", path=str(target)) from None
        return
    _check_target(target, overwrite)
    backup = target.parent / f".{target.name}.{uuid.uuid4().hex}.old"
    os.rename(target, backup)
    try:
        os.rename(tmp, target)
    except BaseException:
        os.rename(backup, target)
        raise
    shutil.rmtree(backup, ignore_errors=True)


# -- values: JSON for structure, tensors by name -------------------------------------------


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


pytree.register_pytree_node(SavedRecord, _record_flatten, _record_unflatten,
                            serialized_type_name="torchlens.persist.SavedRecord")


class Opaque:
    """Stands in for a value that was not stored (an object TorchLens cannot save safely)."""

    def __init__(self, type_name: str) -> None:
        self.type_name = type_name

    def __repr__(self) -> str:
        return f"<not saved: {self.type_name}>"


class TensorTable:
    """Tensors to write, deduplicated by identity so shared tensors load back shared."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self._ids: dict[int, str] = {}

    def put(self, t: torch.Tensor, stem: str) -> str:
        name = self._ids.get(id(t))
        if name is not None:
            return name
        _storable_check(t)
        name = stem if stem not in self.tensors else f"{stem}#{len(self.tensors)}"
        self.tensors[name] = t
        self._ids[id(t)] = name
        return name


def _storable_check(t: torch.Tensor) -> None:
    if t.layout is not torch.strided or t.is_meta or t.is_quantized or t.dtype not in ST_NAMES:
        _storable(t)


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
            index = _int(arg[0], f"{where}: a ref's op index")
            elem = None if arg[1] is None else _int(arg[1], f"{where}: a ref's element", 0, 1 << 20)
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
            return torch.Size([_int(d, f"{where}: a size", 0, MAX_DIM) for d in items])
        if tag == "slice":
            if len(items) != 3:
                raise fail(f"{where}: malformed slice")
            return slice(*items)
        if tag == "complex":
            if len(items) != 2 or not all(type(x) in (int, float) for x in items):
                raise fail(f"{where}: malformed complex")
            return complex(*items)
        raise fail(f"{where}: unknown tag {tag!r:.40}")  # pragma: no cover


# -- functions by qualified name, from an allowlist -----------------------------------------

# Tensor-creating functions a TorchFunctionMode sees but torch lists as "ignored" (not overridable).
_FACTORIES = {
    "torch": frozenset({
        "arange", "tensor", "as_tensor", "scalar_tensor", "zeros", "ones", "full", "empty", "empty_strided",
        "empty_permuted", "eye", "linspace", "logspace", "range", "tril_indices", "triu_indices", "rand", "randn",
        "randint", "randperm", "normal", "rand_like", "randn_like", "randint_like", "as_strided", "fill", "vander",
        "hann_window", "hamming_window", "bartlett_window", "blackman_window", "kaiser_window",
    }),
    "torch.Tensor": frozenset({
        "new_empty", "new_empty_strided", "new_full", "new_ones", "new_tensor", "new_zeros", "unflatten",
    }),
}
_DENIED = frozenset({
    "register_hook", "register_post_accumulate_grad_hook", "apply_", "map_", "map2_", "__setstate__",
    "__reduce__", "__reduce_ex__", "__deepcopy__", "module_load", "set_", "share_memory_", "storage",
    "untyped_storage", "_typed_storage", "data_ptr", "tolist", "numpy", "__array__", "__array_wrap__",
    "pin_memory", "record_stream", "backward", "from_file", "load", "save", "from_numpy", "frombuffer",
})
_FUNCS: tuple[dict[str, Any], dict[Any, str]] | None = None


def function_table() -> tuple[dict[str, Any], dict[Any, str]]:
    """``(name -> function, function -> name)`` for every torch function a trace may replay."""
    global _FUNCS
    if _FUNCS is not None:
        return _FUNCS
    import torch.nn.functional as F
    from torch.overrides import get_overridable_functions

    allowed: set[Any] = set()
    for funcs in get_overridable_functions().values():
        for fn in funcs:
            try:
                allowed.add(fn)
            except TypeError:
                pass
    spaces = {"torch": torch, "torch.Tensor": torch.Tensor, "torch.nn.functional": F, "torch.linalg": torch.linalg,
              "torch.fft": torch.fft, "torch.special": torch.special}
    by_name: dict[str, Any] = {}
    by_func: dict[Any, str] = {}
    for prefix, space in spaces.items():
        for attr in sorted(dir(space)):
            dunder = attr.startswith("__") and attr.endswith("__")
            if attr in _DENIED or (attr.startswith("_") and not dunder):
                continue
            try:
                obj = getattr(space, attr)
                found = [(f"{prefix}.{attr}", obj)]
                if prefix == "torch.Tensor" and type(obj).__name__ == "getset_descriptor" or isinstance(obj, property):
                    found.append((f"{prefix}.{attr}.__get__", obj.__get__))
            except Exception:  # noqa: BLE001 - some attributes refuse to be read on the class
                continue
            for name, fn in found:
                try:
                    ok = fn in allowed or attr in _FACTORIES.get(prefix, ())
                except TypeError:
                    continue
                if ok:
                    by_name[name] = fn
                    by_func.setdefault(fn, name)
    _FUNCS = (by_name, by_func)
    return _FUNCS


def function_name(fn: Any) -> str | None:
    try:
        return function_table()[1].get(fn)
    except TypeError:
        return None


# -- saving a trace -------------------------------------------------------------------------


class SourceLocation:
    """Where a loaded op was issued (stands in for the code object a live capture keeps)."""

    __slots__ = ("co_filename", "co_name")

    def __init__(self, filename: str, name: str = "") -> None:
        self.co_filename = filename
        self.co_name = name


class UnavailableEdit:
    """The function of a loaded capture-time edit op whose edit could not be saved."""

    __name__ = "edit"

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise ReplayNotExactError(
            f"the capture-time edit at {self.ctx.site} was not saved with the trace (a plain function edit)",
            remedy="Re-capture with the model (trace.run(model)), or use named helpers so the edit is saved.",
        )


def _root(trace: Any) -> Any:
    """The trace whose records a fork shares (a fork re-executed with ``model=`` owns new ones)."""
    while getattr(trace, "parent", None) is not None and trace.parent.ops is trace.ops:
        trace = trace.parent
    return trace


def _capture_whens(base: Any) -> list[Any]:
    """The capture-time edits of the run: ``base.steps`` plus any edit op's own ``When``
    (a fork re-executed with ``model=`` ran its replay steps as capture-time edits)."""
    whens = list(base.steps)
    seen = {id(w) for w in whens}
    for op in base.ops:
        when = getattr(op.func, "when", None) if op.flags & EDIT else None
        if when is not None and id(when) not in seen:
            seen.add(id(when))
            whens.append(when)
    return whens


def _tensor_names(model: Any) -> dict[int, str]:
    names: dict[int, str] = {}
    if isinstance(model, torch.nn.Module):
        for name, p in model.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), f"param/{name}")
        for name, b in model.named_buffers(remove_duplicate=False):
            names.setdefault(id(b), f"buffer/{name}")
    return names


def save_trace(trace: Any, path: Any, selector: Any = None, overwrite: bool = False) -> Path:
    """Write ``trace`` (or a fork) as a directory: graph JSON + activations safetensors.

    Args:
        selector: keep only the activations of ops / module calls it matches (plus the
            inputs and a fork's edits). Parameters and other constants ops read are then
            left out too, so the loaded trace is for reading, not for replay.
        overwrite: replace an earlier TorchLens save at ``path``.

    Returns:
        the directory written.

    Raises:
        RecipeExistsError: ``path`` exists (and ``overwrite`` is false).
    """
    from .core.selectors import as_selector
    from .recipes import encode_steps, fingerprint_of

    base = _root(trace)
    is_fork = trace is not base
    if base.ops:
        base._ensure_graph()
    keep = None if selector is None else _keep_set(trace, as_selector(selector).match(trace))
    table = TensorTable()
    arg_names = _tensor_names(trace.model) or getattr(base, "_saved_names", {})

    def put_as(stem: str) -> Callable[[torch.Tensor], dict]:
        return lambda t: {"tensor": table.put(t, arg_names.get(id(t), stem))}

    whens = _capture_whens(base)
    step_index = {id(w): k for k, w in enumerate(whens)}
    ops = [_encode_op(op, put_as, keep, step_index) for op in base.ops]
    calls = [_encode_call(c, put_as, keep) for c in base.calls]
    steps, unsaved = encode_steps([("capture", w.site, w.edit) for w in whens], base, table, "trace")
    manifest: dict[str, Any] = {
        "kind": "trace",
        "torchlens_version": _version(),
        "fingerprint": fingerprint_of(trace),
        "name": base.name,
        "engine": base.engine,
        "complete": base.complete,
        "grad": bool(getattr(base, "grad", False)),
        "ops": ops,
        "calls": calls,
        "input_layers": list(base.input_layers),
        "output_layers": list(base.output_layers),
        "call_args": encode((tuple(base.args), dict(base.kwargs)), put_as("input"), strict=False),
        "output": _encode_output(base, put_as, keep),
        "output_refs": [None if r is None else [r.index, r.elem] for r in base._output_refs],
        "data_reads": [[pos, None if ref is None else [ref.index, ref.elem],
                        getattr(code, "co_filename", "<unknown>"), lineno, name]
                       for pos, ref, code, lineno, name in base.data_reads],
        "stale": [[i, p] for i, p in sorted(base._stale.items())],
        "edits": [_applied(e) for e in base.edits],
        "steps": steps,
        "unsaved_steps": unsaved,
        "fork": _encode_fork(trace, put_as, keep, table) if is_fork else None,
    }
    return write_dir(path, manifest, table.tensors, overwrite=overwrite)


def _keep_set(trace: Any, matched: list[Any]) -> set[int]:
    """Records whose values a selector-limited save keeps (a kept module output is read
    through the ops that produced it, as a capture's ``save=`` does)."""
    keep = {id(r) for r in matched}
    for r in matched:
        if isinstance(r, ModuleCall):
            keep.update(id(trace.ops[ref.index]) for ref in r.out_refs if ref is not None)
    return keep


def _version() -> str:
    from . import __version__

    return __version__


def _applied(e: Any) -> dict[str, Any]:
    return {"site": e.site, "label": e.label, "pass": e.pass_index, "n_changed": e.n_changed}


def _kept(record: Any, keep: set[int] | None) -> bool:
    return keep is None or id(record) in keep


def _encode_op(op: Op, put_as: Callable, keep: set[int] | None, step_index: dict[int, int]) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "label": op.label,
        "func": None if op.flags & (INPUT | EDIT) else function_name(op.func),
        "func_name": op.func_name,
        "module": op.module,
        "pass": op.module_pass,
        "flags": op.flags,
        "source": None if op._code is None else [op._code.co_filename, op._lineno],
        "args": None,
        "out": None,
    }
    if not op.flags & INPUT and op.args_spec is not None:
        leaves, spec = op.args_spec
        # A selector-limited save is for reading a few sites: weights are left out, which
        # makes the ops that read them non-replayable in the loaded trace.
        put = put_as(f"const/{op.label}") if keep is None else (lambda t: {"opaque": "Tensor (not saved)"})
        entry["args"] = encode(unflatten(list(leaves), spec), put, strict=False)
    if op.saved and (op.flags & INPUT or _kept(op, keep)):
        try:
            entry["out"] = encode(op._out, put_as(f"op/{op.label}"))
        except NotPortableError:
            entry["out"] = None
    if entry["out"] is None and op.shape is not None:  # keep what a dropped value looked like
        entry["meta"] = encode((op.shape, op.dtype), lambda t: None, strict=False)
    if op.flags & EDIT:
        entry["edit"] = _encode_edit_op(op, step_index)
    return entry


def _encode_edit_op(op: Op, step_index: dict[int, int]) -> dict[str, Any]:
    applier = op.func
    ctx = getattr(applier, "ctx", None)
    record = getattr(ctx, "op", None)
    target = {"module": record.key} if isinstance(record, ModuleCall) else {"op": getattr(record, "label", None)}
    spec = getattr(applier, "spec", None)
    n = len(op.args_spec[0]) if op.args_spec else 0
    return {
        "step": step_index.get(id(getattr(applier, "when", None))),
        "target": target,
        "ctx": [getattr(ctx, "site", ""), getattr(ctx, "label", op.label), getattr(ctx, "module", op.module),
                getattr(ctx, "pass_index", op.module_pass)],
        "skeleton": None if spec is None else encode(unflatten([0] * n, spec), lambda t: None, strict=False),
    }


def _encode_call(call: ModuleCall, put_as: Callable, keep: set[int] | None) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "address": call.address, "pass": call.pass_index, "type": call.module_type,
        "start": call.op_start, "end": call.op_end,
        "out_refs": [None if r is None else [r.index, r.elem] for r in call.out_refs],
        "out": None, "skeleton": None,
    }
    if call._out is not None and _kept(call, keep):
        entry["out"] = encode(call._out, put_as(f"module/{call.key}"), strict=False)
    elif call.out_spec is not None:
        # placeholders must not be None: ModelOutput drops None fields, losing leaves
        entry["skeleton"] = encode(unflatten([0] * len(call.out_refs), call.out_spec), lambda t: None,
                                   strict=False)
    return entry


def _encode_output(base: Any, put_as: Callable, keep: set[int] | None) -> Any:
    refs = [r for r in base._output_refs if r is not None]
    if keep is not None and not all(id(base.ops[r.index]) in keep for r in refs):
        return None
    return encode(base._output_raw, put_as("output"), strict=False)


def _encode_fork(fork: Any, put_as: Callable, keep: set[int] | None, table: TensorTable) -> dict[str, Any]:
    from .recipes import encode_steps

    values = [[i, encode(v, put_as(f"fork/{fork.ops[i].label}"), strict=False)]
              for i, v in sorted(fork._values.items()) if _kept(fork.ops[i], keep)]
    subst = [[i, pos, encode(v, put_as(f"fork/subst/{fork.ops[i].label}"), strict=False)]
             for i, (pos, v) in sorted(fork._subst.items())]
    overrides = [[k, encode(v, put_as(f"fork/module/{k}"), strict=False)] for k, v in fork._overrides.items()]
    recipe, unsaved = encode_steps([("replay", s.selector, s.edit) for s in fork.recipe], fork, table, "fork")
    return {"name": fork.name, "values": values, "subst": subst, "overrides": overrides,
            "recipe": recipe, "unsaved_steps": unsaved, "edits": [_applied(e) for e in fork.edits]}


# -- loading a trace ------------------------------------------------------------------------


def _get(obj: Any, key: str, kinds: Any, where: str) -> Any:
    if not isinstance(obj, dict) or key not in obj:
        raise fail(f"{where} lacks {key!r}")
    value = obj[key]
    if kinds is not None and not (isinstance(value, kinds) and not (type(value) is bool and bool not in (
            kinds if isinstance(kinds, tuple) else (kinds,)))):
        raise fail(f"{where}: {key!r} has the wrong type ({type(value).__name__})")
    return value


def _str(obj: Any, key: str, where: str, limit: int = 4096) -> str:
    value = _get(obj, key, str, where)
    if len(value) > limit:
        raise fail(f"{where}: {key!r} is too long")
    return value


def load_trace(path: Any) -> Any:
    """Load a saved trace (or fork) for reads, ``find_sites``, ``compare`` and replay.

    Nothing in the directory is executed: functions are resolved by name against torch's
    overridable functions; an unknown name leaves that op readable but not replayable.
    The loaded trace has no model (``trace.model is None``); ``trace.run(model)`` re-runs
    the stored inputs on a model you pass.

    Args:
        path: the directory ``trace.save`` wrote.

    Returns:
        a Trace, or a Fork (whose ``parent`` is the loaded base trace) if a fork was saved.

    Raises:
        RecipeFormatError: the directory is malformed, hostile or newer (the subclasses
            FormatVersionError and UnsafePathError say which).
    """
    check_path_arg(path)
    with SavedDir(path) as d:
        manifest = read_manifest(d, "trace")
        tensors = read_tensors(d, manifest)
    return guarded(_build_trace, manifest, tensors)


def guarded(build: Callable[..., Any], *args: Any) -> Any:
    """Run a loader; a slip past the field checks still surfaces as a RecipeFormatError.

    The error then carries ``unexpected`` (the original exception type), which the fuzz
    tests treat as a bug: every malformed input should be caught by a named check.
    """
    try:
        return build(*args)
    except RecursionError:
        raise fail("the save is nested too deeply") from None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, RuntimeError) as exc:
        if isinstance(exc, RecipeFormatError):
            raise
        raise fail(f"the save is malformed: {type(exc).__name__}: {str(exc)[:200]}",
                   unexpected=type(exc).__name__) from exc


_TRACE_KEYS = {"format", "kind", "format_version", "torchlens_version", "fingerprint", "name", "engine", "complete",
               "ops", "calls", "input_layers", "output_layers", "call_args", "output", "output_refs", "data_reads",
               "stale", "edits", "steps", "unsaved_steps", "fork", "tensors", "files"}
_OP_KEYS = {"label", "func", "func_name", "module", "pass", "flags", "source", "args", "out"}
_CALL_KEYS = {"address", "pass", "type", "start", "end", "out_refs", "out", "skeleton"}
_FORK_KEYS = {"name", "values", "subst", "overrides", "recipe", "unsaved_steps", "edits"}


def fields(obj: Any, required: set[str], where: str, optional: set[str] = frozenset()) -> dict[str, Any]:
    """``obj`` as a dict with exactly the ``required`` keys (plus any of ``optional``)."""
    if not isinstance(obj, dict):
        raise fail(f"{where} must be an object")
    missing, extra = required - set(obj), set(obj) - required - optional
    if missing or extra:
        raise fail(f"{where}: missing fields {sorted(missing)[:5]}, unknown fields {sorted(extra)[:5]}")
    return obj


def _build_trace(m: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Any:
    from .core.trace import Fork, Trace
    from .recipes import check_fingerprint_dict, decode_steps

    fields(m, _TRACE_KEYS, "the manifest", {"grad"})
    base = Trace(None)
    base.fingerprint = check_fingerprint_dict(m["fingerprint"])
    base.name = _str(m, "name", "manifest")
    base.engine = _str(m, "engine", "manifest", 100)
    base.complete = _get(m, "complete", bool, "manifest")
    base.grad = m.get("grad", False) is True
    dec = Decoder(tensors)
    ops_json = _get(m, "ops", list, "manifest")
    for i, entry in enumerate(ops_json):
        base._add_op(_decode_op(i, entry, dec))
    if len(base._labels) != len(base.ops):
        raise fail("op labels are not unique")
    n = len(base.ops)
    for i, entry in enumerate(_get(m, "calls", list, "manifest")):
        base._add_call(_decode_call(i, entry, dec, n))
    base.input_layers = _labels(m, "input_layers", base)
    base.output_layers = _labels(m, "output_layers", base)
    steps, base.unsaved_steps = decode_steps(m["steps"], m["unsaved_steps"], dec, "capture")
    base.steps = [w for w in steps if w is not None]
    for i, entry in enumerate(ops_json):
        if base.ops[i].flags & EDIT:
            _attach_edit(base.ops[i], entry.get("edit"), base, steps)
    call_args = dec.value(m["call_args"], "call_args")
    if not (isinstance(call_args, tuple) and len(call_args) == 2 and isinstance(call_args[0], tuple)
            and isinstance(call_args[1], dict) and all(isinstance(k, str) for k in call_args[1])):
        raise fail("call_args must be (args, kwargs)")
    base.args, base.kwargs = call_args
    base._output_raw = dec.value(m["output"], "output")
    base._output_refs = _refs(m["output_refs"], "output_refs", n)
    base.data_reads = [_data_read(r, n) for r in _get(m, "data_reads", list, "manifest")]
    base._stale = {_int(i, "stale", 0, n - 1): _int(p, "stale", 0, n) for i, p in _pairs(m["stale"], "stale")}
    base.edits = _edits(m["edits"])
    _check_refs(base)
    # a re-save of this trace names parameters as the original save did
    base._saved_names = {id(t): k for k, t in tensors.items() if k.startswith(("param/", "buffer/"))}
    base._graph_ready = False
    base._ensure_graph()
    if m["fork"] is None:
        dec.check_all_used()
        return base
    fork_json = fields(m["fork"], _FORK_KEYS, "fork")
    fork = Fork(base, _str(fork_json, "name", "fork"))
    fork._values = {_int(i, "fork value", 0, n - 1): dec.value(v, f"fork value {i}")
                    for i, v in _pairs(fork_json["values"], "fork values")}
    fork._subst = {}
    for item in _get(fork_json, "subst", list, "fork"):
        if not (isinstance(item, list) and len(item) == 3):
            raise fail("fork substitutions are malformed")
        fork._subst[_int(item[0], "fork subst", 0, n - 1)] = (_int(item[1], "fork subst", 0, n),
                                                              dec.value(item[2], "fork subst"))
    keys = {c.key for c in base.calls}
    fork._overrides = {}
    for key, v in _pairs(fork_json["overrides"], "fork overrides"):
        if not isinstance(key, str) or key not in keys:
            raise fail(f"fork override names unknown module call {str(key)[:80]!r}")
        fork._overrides[key] = dec.value(v, f"fork override {key}")
    recipe, fork.unsaved_steps = decode_steps(fork_json["recipe"], fork_json["unsaved_steps"], dec, "replay")
    fork.recipe = [s for s in recipe if s is not None]
    fork.edits = _edits(fork_json["edits"])
    dec.check_all_used()
    return fork


def _check_refs(base: Any) -> None:
    """Every reference must name an op whose stored value has that shape of output."""

    def check(ref: Ref | None, what: str) -> None:
        if ref is None:
            return
        op = base.ops[ref.index]
        if not op.saved:
            return
        out = op._out
        ok = isinstance(out, torch.Tensor) if ref.elem is None else (
            isinstance(out, (tuple, list)) and ref.elem < len(out) and isinstance(out[ref.elem], torch.Tensor))
        if not ok:
            raise fail(f"{what} refers to {op.label}" + ("" if ref.elem is None else f"[{ref.elem}]")
                       + ", which holds no such tensor")

    for op in base.ops:
        for ref in op.parent_refs or ():
            check(ref, f"op {op.label}")
    for call in base.calls:
        for ref in call.out_refs:
            check(ref, f"module call {call.key}")
    for ref in base._output_refs:
        check(ref, "the model output")
    for read in base.data_reads:
        check(read[1], "a data read")


def _pairs(value: Any, what: str) -> list[list[Any]]:
    if not isinstance(value, list) or not all(isinstance(p, list) and len(p) == 2 for p in value):
        raise fail(f"{what} must be a list of pairs")
    return value


def _labels(m: dict, key: str, base: Any) -> list[str]:
    labels = _get(m, key, list, "manifest")
    if not all(isinstance(x, str) and x in base._labels for x in labels):
        raise fail(f"{key} names ops that do not exist")
    return labels


def _refs(value: Any, what: str, limit: int) -> list[Ref | None]:
    if not isinstance(value, list):
        raise fail(f"{what} must be a list")
    out: list[Ref | None] = []
    for r in value:
        if r is None:
            out.append(None)
        elif isinstance(r, list) and len(r) == 2:
            elem = None if r[1] is None else _int(r[1], what, 0, 1 << 20)
            out.append(Ref(_int(r[0], f"{what} index", 0, limit - 1), elem))
        else:
            raise fail(f"{what} holds a malformed reference")
    return out


def _source(entry: dict, where: str) -> tuple[Any, int]:
    src = entry.get("source")
    if src is None:
        return None, 0
    if not (isinstance(src, list) and len(src) == 2 and isinstance(src[0], str)):
        raise fail(f"{where}: malformed source")
    return SourceLocation(src[0][:4096]), _int(src[1], f"{where}: source line", 0, 1 << 31)


def _decode_op(i: int, entry: Any, dec: Decoder) -> Op:
    where = f"op {i}"
    fields(entry, _OP_KEYS, where, {"edit", "meta"})
    label = _str(entry, "label", where, 500)
    flags = _int(entry["flags"], f"{where}: flags", 0, 63)
    if ("edit" in entry) != bool(flags & EDIT):
        raise fail(f"{where}: edit metadata and the edit flag disagree")
    name = _get(entry, "func", (str, type(None)), where)
    func = None
    if name is not None:
        if not _QUALNAME.match(name):
            raise fail(f"{where}: malformed function name {name[:80]!r}")
        func = function_table()[0].get(name)
    if func is None and not flags & (INPUT | EDIT):
        flags |= NOT_REPLAYABLE
    code, lineno = _source(entry, where)
    op = Op(i, label, func, _str(entry, "func_name", where, 200), None, _str(entry, "module", where, 1000),
            _int(entry["pass"], f"{where}: pass", 1, 1 << 31), code, lineno, None, None, flags)
    if entry["out"] is None:
        op.saved = False
        if "meta" in entry:
            op._meta = _meta(Decoder({}).value(entry["meta"], f"{where} meta"), where)
    else:
        op._out = dec.value(entry["out"], f"{where} output")
        out = op._out
        if not (isinstance(out, torch.Tensor) or (
                isinstance(out, (tuple, list)) and all(isinstance(t, (torch.Tensor, type(None))) for t in out))):
            raise fail(f"{where}: an op's output is a tensor or a sequence of tensors")
    if flags & INPUT:
        if entry["out"] is None or entry["args"] is not None:
            raise fail(f"{where}: an input has a stored value and no arguments")
        op.args_spec, op.parent_refs = None, []
        return op

    def on_ref(index: int, elem: int | None) -> Ref:
        if index >= i:
            raise fail(f"{where} reads op {index}, which does not run before it")
        return Ref(index, elem)

    dec.on_ref = on_ref
    try:
        structure = dec.value(entry["args"], f"{where} arguments")
    finally:
        dec.on_ref = None
    if not (isinstance(structure, tuple) and len(structure) == 2 and isinstance(structure[0], tuple)
            and isinstance(structure[1], dict) and all(isinstance(k, str) for k in structure[1])):
        raise fail(f"{where}: arguments must be (args, kwargs)")
    leaves, spec = pytree.tree_flatten(structure)
    if any(isinstance(leaf, Opaque) for leaf in leaves):
        op.flags |= NOT_REPLAYABLE
    op.args_spec = (leaves, spec)
    op.parent_refs = [leaf for leaf in leaves if type(leaf) is Ref]
    return op


def _meta(value: Any, where: str) -> tuple[Any, torch.dtype | None]:
    """(shape, dtype) of a value that was not saved: a shape is a tuple of ints, or of such tuples."""

    def is_shape(s: Any) -> bool:
        return isinstance(s, tuple) and all(type(d) is int and d >= 0 for d in s)

    if not (isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], (torch.dtype, type(None)))
            and (is_shape(value[0]) or (isinstance(value[0], tuple) and all(is_shape(s) for s in value[0])))):
        raise fail(f"{where}: meta must be (shape, dtype)")
    return value[0], value[1]


def _decode_call(i: int, entry: Any, dec: Decoder, n: int) -> ModuleCall:
    where = f"module call {i}"
    fields(entry, _CALL_KEYS, where)
    start = _int(entry["start"], f"{where}: start", 0, n)
    end = _int(entry["end"], f"{where}: end", start, n)
    call = ModuleCall(_str(entry, "address", where, 1000), _int(entry["pass"], f"{where}: pass", 1, 1 << 31),
                      _str(entry, "type", where, 200), None, None, start)
    call.op_end = end
    call.out_refs = _refs(entry["out_refs"], f"{where} out_refs", end)
    out, skeleton = entry["out"], entry["skeleton"]
    if out is not None:
        call._out = dec.value(out, f"{where} output")
        leaves, call.out_spec = flatten(call._out)
    elif skeleton is not None:
        leaves, call.out_spec = flatten(Decoder({}).value(skeleton, f"{where} skeleton"))
    else:
        leaves = [None] * len(call.out_refs)
    if len(leaves) != len(call.out_refs):
        raise fail(f"{where}: output has {len(leaves)} leaves but {len(call.out_refs)} references")
    return call


def _data_read(r: Any, n: int) -> tuple:
    if not (isinstance(r, list) and len(r) == 5 and isinstance(r[2], str) and isinstance(r[4], str)):
        raise fail("data_reads are malformed")
    ref = _refs([r[1]], "data_reads", n)[0]
    return (_int(r[0], "data_reads", 0, n), ref, SourceLocation(r[2][:4096]), _int(r[3], "data_reads", 0, 1 << 31),
            r[4][:100])


def _edits(value: Any) -> list[Any]:
    from .edits import AppliedEdit

    if not isinstance(value, list):
        raise fail("edits must be a list")
    out = []
    for e in value:
        if not (isinstance(e, dict) and set(e) == {"site", "label", "pass", "n_changed"}):
            raise fail("an applied edit is malformed")
        out.append(AppliedEdit(str(e["site"])[:1000], str(e["label"])[:1000],
                               None if e["pass"] is None else _int(e["pass"], "edit pass", 0, 1 << 31),
                               _int(e["n_changed"], "edit n_changed")))
    return out


def _attach_edit(op: Op, meta: Any, base: Any, steps: list[Any]) -> None:
    """Give a loaded capture-time edit op a function: the saved edit, or a refusing stand-in."""
    from .capture.recorder import EditApplier
    from .edits import EditContext

    where = f"edit op {op.label}"
    fields(meta, {"step", "target", "ctx", "skeleton"}, where)
    target = _get(meta, "target", dict, where)
    record: Any = None
    if isinstance(target.get("module"), str):
        record = next((c for c in base.calls if c.key == target["module"]), None)
    elif isinstance(target.get("op"), str):
        index = base._labels.get(target["op"])
        record = base.ops[index] if index is not None else None
    ctx_fields = _get(meta, "ctx", list, where)
    if len(ctx_fields) != 4 or not all(isinstance(x, (str, int, type(None))) for x in ctx_fields):
        raise fail(f"{where}: malformed ctx")
    ctx = EditContext(str(ctx_fields[0]), str(ctx_fields[1]), ctx_fields[2], ctx_fields[3], record,
                      weakref.proxy(base))
    step = meta.get("step")
    skeleton = meta.get("skeleton")
    spec = None if skeleton is None else flatten(Decoder({}).value(skeleton, where))[1]
    if type(step) is int and 0 <= step < len(steps) and steps[step] is not None:
        op.func = EditApplier(steps[step], spec, ctx)
    else:
        op.func = UnavailableEdit(ctx)
        op.flags |= NOT_REPLAYABLE


def check_path_arg(path: Any) -> None:
    if not isinstance(path, (str, os.PathLike)):
        raise InvalidArgumentError(f"path must be a str or os.PathLike, got {type(path).__name__}")
