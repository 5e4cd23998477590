"""The save directory: atomic writes, safe reads by plain name, the manifest and its files.

A save is a directory: ``manifest.json`` (plain JSON) and ``tensors.safetensors`` (every
tensor it carries), plus optional extra files listed in the manifest. Files are opened
relative to the directory, without following symlinks, and checked against the size and
sha256 the manifest records. Saving writes a hidden temporary directory, manifest last,
and renames it into place, so an interrupted save never leaves a directory that loads.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import json
import mmap
import os
import re
import shutil
import stat
import tempfile
import uuid
from pathlib import Path
from typing import Any

import torch

from .._interrupts import HoldInterrupts
from ..errors import FormatVersionError, InvalidArgumentError, RecipeExistsError, UnsafePathError
from ._load_checks import check_int, fail, loads_json
from ._safetensors import check_declared, read_safetensors, write_safetensors

__all__ = [
    "FIRST_VERSION", "FORMAT", "FORMAT_VERSION", "MANIFEST", "MAX_MANIFEST_BYTES", "SavedDir", "TENSOR_FILE",
    "VIEWS_VERSION", "check_file_name", "check_path_arg", "dumps_manifest", "installed_version", "read_file_entry",
    "read_manifest", "read_tensors", "read_views", "write_dir",
]

FORMAT = "torchlens"
FORMAT_VERSION = 2  # the newest this reader reads; a save is written in the oldest that holds it
FIRST_VERSION = 1  # recipes, and traces without views
VIEWS_VERSION = 2  # the first with "views" (tensors saved as views of others): older readers refuse it
MANIFEST = "manifest.json"
TENSOR_FILE = "tensors.safetensors"
MAX_MANIFEST_BYTES = 256 << 20


_HASH_CHUNK = 64 << 20
_SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")


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
            raise fail(f"{self.path} does not exist", path=str(self.path),
                       remedy="Check the path: it names the directory trace.save(...) or "
                       "fork.save_intervention(...) wrote.") from None
        except (NotADirectoryError, OSError) as exc:
            raise fail(f"{self.path} is not a readable save directory: {exc}", path=str(self.path)) from None

    def read(self, name: str, limit: int) -> bytes:
        with self._open(name, limit) as f:
            return f.read(limit + 1)[:limit]

    def map(self, name: str, size: int) -> mmap.mmap | bytes:
        """File ``name`` memory-mapped copy-on-write (its pages are read when used, and a write
        to a tensor made on it stays in this process), checked to be ``size`` bytes."""
        with self._open(name, size) as f:
            found = os.fstat(f.fileno()).st_size
            if found != size:
                raise fail(f"{self.path / name} is {found} bytes, the manifest says {size} (truncated?)")
            return mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) if size else b""

    def _open(self, name: str, limit: int) -> Any:
        name = check_file_name(name)
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=self.fd)
        except FileNotFoundError:
            raise fail(f"{self.path / name} is missing (an interrupted save never has a manifest)") from None
        except OSError as exc:  # ELOOP: a symlink
            raise fail(f"{self.path / name} cannot be opened safely (a symlink?): {exc.strerror}",
                       UnsafePathError, name=name) from None
        f = os.fdopen(fd, "rb")
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            f.close()
            raise fail(f"{self.path / name} is not a regular file", UnsafePathError, name=name)
        if st.st_size > limit:
            f.close()
            raise fail(f"{self.path / name} is {st.st_size} bytes, over the {limit}-byte limit")
        return f

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


def read_file_entry(d: SavedDir, manifest: dict, role: str, required: bool = True,
                    mapped: bool = False) -> bytes | mmap.mmap | None:
    """The bytes of file ``role`` named in ``manifest['files']``, size and sha256 checked
    (``mapped``: memory-mapped, see :meth:`SavedDir.map`, not read into memory)."""
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
    size = check_int(entry["bytes"], f"the size of file {role!r}", 0, 1 << 46)
    data = d.map(entry["name"], size) if mapped else d.read(entry["name"], size)
    if len(data) != size:
        raise fail(f"{d.path / entry['name']} is {len(data)} bytes, the manifest says {size} (truncated?)")
    digest = hashlib.sha256()
    # a mapped file's pages are let go once hashed (nothing wrote to them: they are read again
    # from the file when a value is used), so checking a big file does not keep it resident
    drop = getattr(mmap, "MADV_DONTNEED", None) if mapped and size else None
    with memoryview(data) as view:
        for at in range(0, size, _HASH_CHUNK):
            digest.update(view[at:at + _HASH_CHUNK])
            if drop is not None:
                data.madvise(drop, at, min(_HASH_CHUNK, size - at))
    if digest.hexdigest() != entry["sha256"]:
        raise fail(f"{d.path / entry['name']} does not match its sha256 in the manifest (corrupted?)")
    return data


def read_views(manifest: dict, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors the manifest's ``views`` lists, each a view of a whole tensor of the file,
    every field checked (names, sizes, strides, and that the view stays inside its tensor)."""
    views = manifest.get("views", {})
    if not isinstance(views, dict):
        raise fail("manifest 'views' must be an object")
    out = {}
    for name, entry in views.items():
        where = f"view {name!r:.80}"
        if not isinstance(entry, dict) or set(entry) != {"of", "size", "stride", "offset"}:
            raise fail(f"{where} must have exactly of, size, stride and offset")
        base = tensors.get(entry["of"]) if isinstance(entry["of"], str) else None
        if base is None or name in tensors:
            raise fail(f"{where} names no tensor of the file to view, or has a tensor's name")
        size, stride = entry["size"], entry["stride"]
        if not (isinstance(size, list) and isinstance(stride, list) and len(size) == len(stride) <= 64):
            raise fail(f"{where} has a malformed size or stride")
        size = [check_int(n, f"a size of {where}", 0, 1 << 46) for n in size]
        stride = [check_int(n, f"a stride of {where}", 0, 1 << 46) for n in stride]
        offset = check_int(entry["offset"], f"the offset of {where}", 0, 1 << 46)
        last = offset + sum((n - 1) * s for n, s in zip(size, stride)) if all(size) else offset - 1
        if last >= base.numel() or offset > base.numel():
            raise fail(f"{where} reaches element {last} of a tensor of {base.numel()}")
        flat = base.reshape(-1)
        out[name] = flat.as_strided(size, stride, flat.storage_offset() + offset)
    return out


def read_tensors(d: SavedDir, manifest: dict) -> dict[str, torch.Tensor]:
    declared = check_declared(manifest.get("tensors"))
    files = manifest.get("files")
    if isinstance(files, dict) and set(files) - {"tensors", "pickle"}:
        raise fail(f"manifest lists unknown files {sorted(set(files) - {'tensors', 'pickle'})[:5]}")
    # mapped: a saved trace larger than memory loads, and a value is read when it is used
    data = read_file_entry(d, manifest, "tensors", mapped=True)
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
        version = VIEWS_VERSION if manifest.get("views") else FIRST_VERSION
        head = {"format": FORMAT, "kind": manifest.pop("kind"), "format_version": version}
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
    # Ctrl-C held off: between the two renames of an overwrite, neither save is in place
    with HoldInterrupts():
        _swap(tmp, target, overwrite)


def _swap(tmp: Path, target: Path, overwrite: bool) -> None:
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


def installed_version() -> str:
    """The version written into a manifest: the installed distribution's (``0+unknown`` from a source tree)."""
    try:
        return md.version("torchlens")
    except md.PackageNotFoundError:
        return "0+unknown"


def check_path_arg(path: Any) -> None:
    """Refuse a ``path`` argument that is not a str or os.PathLike (InvalidArgumentError)."""
    if not isinstance(path, (str, os.PathLike)):
        raise InvalidArgumentError(f"path must be a str or os.PathLike, got {type(path).__name__}")
