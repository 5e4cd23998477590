"""``nnsight.modeling.vllm.batching``: the vLLM batcher; every name is refused."""

from __future__ import annotations

from ..._unsupported import refusing
from ...errors import VLLMUnsupportedError

__all__: list[str] = []

__getattr__ = refusing(
    __name__,
    VLLMUnsupportedError,
    "the vLLM engine is not available through the shim",
)
