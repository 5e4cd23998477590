"""safetensors, written and read by us so every byte is checked.

The reader never trusts the file: the header is strict JSON of bounded size, every
offset and shape is checked against the bytes actually present (no holes, no overlaps,
no trailing bytes) and against the manifest's declared table before anything is allocated.
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
from typing import Any

import torch

from ..capture._safetensors_format import ST_DTYPES, ST_NAMES  # re-exported for store/'s readers and writers
from ..errors import NotPortableError
from ._load_checks import MAX_DIM, check_int, fail, loads_json

__all__ = [
    "MAX_HEADER_BYTES", "ST_DTYPES", "ST_NAMES", "check_declared", "read_safetensors", "storable",
    "write_safetensors",
]

MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit




def storable(t: torch.Tensor) -> torch.Tensor:
    """A dense, contiguous CPU copy of ``t`` that safetensors can hold, or NotPortableError."""
    if t.layout is not torch.strided or t.is_meta or t.is_quantized or t.dtype not in ST_NAMES:
        raise NotPortableError(
            f"a tensor of dtype {t.dtype} / layout {t.layout} cannot be stored in safetensors",
            remedy="Convert it to a dense tensor of a standard dtype first.",
        )
    return t.detach().resolve_conj().resolve_neg().cpu().contiguous()


def write_safetensors(f: Any, tensors: dict[str, Any]) -> tuple[str, int, dict[str, Any]]:
    """Write ``tensors`` in the safetensors layout; return (sha256, size, declared table).

    A value with a ``load()`` (a ``LazyTensor``: its ``dtype`` and ``shape`` known) is read only
    when its bytes are written, and let go right after: the file may be larger than memory.
    """
    ready = {name: t if hasattr(t, "load") else storable(t) for name, t in tensors.items()}
    # by element size, largest first: keeps every tensor aligned
    order = sorted(ready, key=lambda n: (-ready[n].dtype.itemsize, n))
    header: dict[str, Any] = {}
    declared: dict[str, Any] = {}
    pos = 0
    for name in order:
        t = ready[name]
        size = math.prod(t.shape) * t.dtype.itemsize
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
        if hasattr(t, "load"):
            t = storable(t.load())
            if t.dtype != ready[name].dtype or tuple(t.shape) != tuple(ready[name].shape):
                raise NotPortableError(f"tensor {name!r} read back as {t.dtype} {tuple(t.shape)}, not the "
                                       f"{ready[name].dtype} {tuple(ready[name].shape)} it had when it was listed",
                                       remedy="Save again; the values on disk changed while saving.")
        if t.numel():
            chunk = t.reshape(-1).view(torch.uint8).numpy().tobytes()
            f.write(chunk)
            digest.update(chunk)
        del t
    return digest.hexdigest(), 8 + len(raw) + pos, dict(sorted(declared.items()))


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
    return [check_int(d, f"a dimension of tensor {name!r:.80}", 0, MAX_DIM) for d in shape]


def read_safetensors(data: bytes | mmap.mmap, declared: dict[str, tuple[torch.dtype, list[int]]]
                     ) -> dict[str, torch.Tensor]:
    """Parse safetensors bytes, checking every offset and size against ``declared`` first. From a
    copy-on-write ``mmap`` the tensors are made on its pages (aligned ones; others are copied)."""
    mapped = isinstance(data, mmap.mmap)
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
        begin, end = (check_int(o, f"an offset of tensor {name!r:.80}", 0, len(body)) for o in offs)
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
        at = 8 + n + begin
        if end == begin:
            out[name] = torch.empty(shape, dtype=dtype)
        elif mapped and at % dtype.itemsize == 0:  # on the mapped file's pages: nothing read yet
            out[name] = torch.frombuffer(data, dtype=dtype, count=(end - begin) // dtype.itemsize,
                                         offset=at).reshape(shape)
        else:
            out[name] = torch.frombuffer(bytearray(body[begin:end]), dtype=dtype).reshape(shape)
    return out
