"""The on-disk side of activation datasets: shard files, the manifest, and the directory rules.

A job directory holds ``manifest.json`` and ``shard-NNNNN.safetensors`` files. A shard is
written under a temporary name (``.tmp-<pid>`` suffix), flushed, fsynced and renamed, and
only then listed in the manifest, which is itself replaced atomically: the manifest is the
commit record. A shard file the manifest does not list (a run killed between the rename and
the commit) is simply written again on resume; a temporary file is debris and is removed.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
from typing import Any

import torch

from ..capture._safetensors_format import shard_name  # re-exported: datasets name shards alike
from ..errors import DatasetFormatError, JobMismatchError, ShardWriteError
from ._safetensors import ST_DTYPES, ST_NAMES

__all__ = [
    "FORMAT", "FORMAT_VERSION", "MANIFEST", "check_directory", "commit_manifest", "file_sha256", "read_manifest",
    "remove_debris", "shard_name", "write_shard",
]

FORMAT = "torchlens.activations"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TMP_MARK = ".tmp-"
# Names a job directory may hold besides shards; anything else means it is not ours.
OWN_NAMES = (MANIFEST, "arrow")


def _open_for_write(path: pathlib.Path) -> Any:
    """The file a shard is written to (one place, so tests can simulate a full disk)."""
    return open(path, "wb")


def _fsync_dir(path: pathlib.Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # some filesystems cannot open a directory; the rename is still atomic there
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _raw(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (bf16 has no numpy dtype: view as bytes)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def write_shard(out: pathlib.Path, index: int, columns: dict[str, list[torch.Tensor]], *,
                durable: bool = True) -> dict[str, Any]:
    """Write one shard from per-column lists of row chunks; return its file name, size and sha256.

    The chunks of a column are written one after the other (never concatenated in memory), so
    the peak is the buffered shard plus nothing. The header follows safetensors exactly.

    Raises:
        ShardWriteError: the disk is full or an I/O error happened; no file of this shard is left.
    """
    shapes = {}
    for name, chunks in columns.items():
        first = chunks[0]
        rows = sum(int(c.shape[0]) for c in chunks)
        shapes[name] = (first.dtype, [rows, *first.shape[1:]])
    order = sorted(shapes, key=lambda n: (-shapes[n][0].itemsize, n))  # keeps every tensor aligned
    header: dict[str, Any] = {"__metadata__": {"format": "pt", "written_by": "torchlens"}}
    pos = 0
    for name in order:
        dtype, shape = shapes[name]
        size = dtype.itemsize
        for d in shape:
            size *= d
        header[name] = {"dtype": ST_NAMES[dtype], "shape": shape, "data_offsets": [pos, pos + size]}
        pos += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    final = out / shard_name(index)
    tmp = out / f"{final.name}{TMP_MARK}{os.getpid()}"
    digest = hashlib.sha256()
    try:
        with _open_for_write(tmp) as f:
            for chunk in (len(raw).to_bytes(8, "little"), raw):
                f.write(chunk)
                digest.update(chunk)
            for name in order:
                for piece in columns[name]:
                    if piece.numel():
                        view = _raw(piece.contiguous())
                        f.write(view)
                        digest.update(view)
            f.flush()
            if durable:  # a trace's scratch store (durable=False) need not survive a power cut
                os.fsync(f.fileno())
        os.replace(tmp, final)
        if durable:
            _fsync_dir(out)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise _write_error(f"writing {final.name} in {out} failed", exc, shard=index) from exc
    except BaseException:  # Ctrl-C mid-write: the half-written file goes (a resumed job writes the shard again)
        tmp.unlink(missing_ok=True)
        raise
    return {"file": final.name, "bytes": 8 + len(raw) + pos, "sha256": digest.hexdigest()}


def _write_error(message: str, exc: OSError, **fields: Any) -> ShardWriteError:
    error = ShardWriteError(f"{message}: {exc.strerror or exc}", **fields)
    error.errno = exc.errno  # after __init__: OSError's own initialiser resets it
    return error


def file_sha256(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def commit_manifest(out: pathlib.Path, manifest: dict[str, Any]) -> None:
    """Replace ``manifest.json`` atomically (temp, fsync, rename): the commit point of a shard.

    Raises:
        ShardWriteError: the manifest could not be written; the previous one is intact.
    """
    path = out / MANIFEST
    tmp = out / f"{MANIFEST}{TMP_MARK}{os.getpid()}"
    try:
        with _open_for_write(tmp) as f:
            f.write(json.dumps(manifest, indent=1, sort_keys=True).encode())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(out)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise _write_error(f"writing {path} failed", exc) from exc
    except BaseException:  # Ctrl-C: the previous manifest stays, the half-written one goes
        tmp.unlink(missing_ok=True)
        raise


def read_manifest(out: pathlib.Path) -> dict[str, Any] | None:
    """The manifest of a job directory, checked for the fields readers rely on; None if absent.

    Raises:
        DatasetFormatError: the manifest is not valid JSON or not an activation-dataset manifest.
    """
    path = out / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise DatasetFormatError(f"{path} is not valid JSON: {str(exc)[:200]}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DatasetFormatError(f"{path} is not a TorchLens activation-dataset manifest")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise DatasetFormatError(f"{path} has format_version {manifest.get('format_version')!r}; this TorchLens "
                                 f"reads version {FORMAT_VERSION}", remedy="Read it with the TorchLens that wrote it.")
    columns, shards = manifest.get("columns"), manifest.get("shards")
    if not isinstance(columns, dict) or not isinstance(shards, list):
        raise DatasetFormatError(f"{path} lacks its 'columns' or 'shards' table")
    for name, col in columns.items():
        if not isinstance(col, dict) or col.get("dtype") not in ST_DTYPES or not isinstance(col.get("shape"), list):
            raise DatasetFormatError(f"{path}: column {name!r:.80} is malformed")
    for shard in shards:
        file = shard.get("file") if isinstance(shard, dict) else None
        if not isinstance(file, str) or pathlib.PurePath(file).name != file or not file.startswith("shard-"):
            raise DatasetFormatError(f"{path}: a shard entry names {file!r:.80}, not a shard file of this directory")
    return manifest


def remove_debris(out: pathlib.Path) -> None:
    """Delete temporary files a killed writer left (never a committed shard or the manifest)."""
    for path in out.iterdir():
        if TMP_MARK in path.name and path.is_file():
            path.unlink(missing_ok=True)


def check_directory(out: pathlib.Path, identity: dict[str, Any], overwrite: bool) -> dict[str, Any] | None:
    """Prepare ``out`` for a job: the manifest to resume from (same job), or None to start afresh.

    Raises:
        JobMismatchError: ``out`` holds another job, or files that are not a TorchLens dataset.
    """
    out.mkdir(parents=True, exist_ok=True)
    manifest = read_manifest(out)
    if manifest is not None and overwrite:
        _clear(out)
        manifest = None
    if manifest is None:
        foreign = sorted(p.name for p in out.iterdir()
                         if not (p.name.startswith("shard-") or TMP_MARK in p.name or p.name in OWN_NAMES))
        if foreign:
            raise JobMismatchError(f"{out} is not empty and holds no TorchLens dataset (found {foreign[:5]})",
                                   remedy="Choose an empty or new out= directory.", found=foreign)
        remove_debris(out)
        return None
    differ = _differences(manifest.get("job", {}), identity)
    if differ:
        raise JobMismatchError(
            f"{out} holds a different job; it differs in {', '.join(differ)}",
            differences=differ,
        )
    remove_debris(out)
    return manifest


def _differences(saved: dict[str, Any], wanted: dict[str, Any]) -> list[str]:
    keys = sorted(set(saved) | set(wanted))
    # Compare through JSON so tuples and lists (and int/float spellings) agree as on disk.
    norm = json.loads(json.dumps(wanted, sort_keys=True, default=str))
    return [k for k in keys if saved.get(k) != norm.get(k)]


def _clear(out: pathlib.Path) -> None:
    for path in out.iterdir():
        if path.is_file() and (path.name.startswith("shard-") or path.name == MANIFEST or TMP_MARK in path.name):
            path.unlink()
