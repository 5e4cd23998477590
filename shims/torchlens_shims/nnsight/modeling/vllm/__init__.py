"""``nnsight.modeling.vllm``: the vLLM back end, refused with `VLLMUnsupportedError`."""

from __future__ import annotations

from ...unsupported import VLLM

__all__ = [
    "VLLM",
]
