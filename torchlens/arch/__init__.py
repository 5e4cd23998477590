"""Architectures: what an adapter knows about a model (``views``: ``tl.arch``, ``Layout``) and
resolving canonical site names against a model, once, at the edge (``resolve``)."""

from .checks import CheckedResidualAdd, check_layout
from .resolve import arch
from .views import (
    ADAPTER_REMEDY,
    CANONICAL,
    KINDS,
    Absent,
    ArchView,
    BlockOp,
    InputOf,
    Layout,
    OutputOf,
    ResidualAdd,
    base_prefix,
    config_dims,
    is_canonical,
)

__all__ = [
    "ADAPTER_REMEDY", "CANONICAL", "KINDS", "Absent", "ArchView", "BlockOp", "CheckedResidualAdd", "InputOf", "Layout",
    "OutputOf", "ResidualAdd", "arch", "base_prefix", "check_layout", "config_dims", "is_canonical",
]
