"""``nnsight.modeling.huggingface``: `HuggingFaceModel`, a `Meta` model named by a hub id and revision.

Subclasses define ``_load_meta`` / ``_load`` (`TransformersModel` is the ready-made one). The
shim never downloads and never places models on NDIF: model keys for the remote back end
(``to_model_key``) are refused with `RemoteUnsupportedError`.
"""

from __future__ import annotations

from typing import Any

from ..errors import RemoteUnsupportedError
from .mixins.meta import Meta

__all__ = ["HuggingFaceModel"]

# nnsight canonicalises hub ids here before building remote keys; kept for code that seeds it
_ID_CACHE: dict[str, str] = {}


class HuggingFaceModel(Meta):
    """A model named by ``repo_id`` (and ``revision``), built by the subclass's loaders.

    Args:
        repo_id: the hub id, or an already-built ``torch.nn.Module`` (then dispatched).
        revision: the hub revision, kept on the model.
        **kwargs: passed to ``_load_meta`` / ``_load`` (see `Meta`).
    """

    def __init__(self, repo_id: Any, *args: Any, revision: str | None = None, **kwargs: Any) -> None:
        object.__setattr__(self, "repo_id", None if not isinstance(repo_id, str) else repo_id)
        object.__setattr__(self, "revision", revision)
        object.__setattr__(self, "kwargs", kwargs)
        super().__init__(repo_id, *args, **kwargs)

    def to_model_key(self) -> str:
        """NDIF's key for this model: refused (the shim never places models remotely)."""
        raise RemoteUnsupportedError("model keys name a model for NDIF, which the shim never contacts")

    _remoteable_model_key = to_model_key

    @classmethod
    def from_model_key(cls, key: str, **kwargs: Any) -> HuggingFaceModel:
        """Rebuild from an NDIF model key: refused, as `to_model_key`."""
        raise RemoteUnsupportedError("model keys name a model for NDIF, which the shim never contacts")
