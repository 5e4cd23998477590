"""The safetensors dtype codes and shard file names, shared by every writer of safetensors shards.

The trace store written while a forward runs (:mod:`torchlens.capture._trace_store`) and the
files of ``store/`` (saved traces, activation datasets) use one table, kept here, at the lowest
package that writes such files.
"""

from __future__ import annotations

import torch

__all__ = ["ST_DTYPES", "ST_NAMES", "shard_name"]

ST_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "U16": torch.uint16,
    "I32": torch.int32, "U32": torch.uint32, "I64": torch.int64, "U64": torch.uint64,
    "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
    "C64": torch.complex64, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
ST_NAMES = {v: k for k, v in ST_DTYPES.items()}


def shard_name(index: int) -> str:
    """The file name of shard ``index`` (``shard-00003.safetensors``)."""
    return f"shard-{index:05d}.safetensors"
