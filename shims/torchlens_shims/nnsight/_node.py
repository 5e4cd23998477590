"""`ModuleNode`: how the layers below `envoy` recognise an envoy.

An envoy opens tracers, sources its module and drives runs, so the `envoy` module
sits above the run machinery and none of it may import `envoy`. What that
machinery calls on an envoy it reaches by duck typing (annotated under
``TYPE_CHECKING``); the one place that must *tell* an envoy from any other value —
a cache navigating the model tree, where ``cache.model.config`` is not a module —
asks ``isinstance(node, ModuleNode)``, which every envoy is.
"""

from __future__ import annotations

__all__ = ["ModuleNode"]


class ModuleNode:
    """Base class of every `Envoy`: one module of a wrapped model. Adds no attributes."""

    __slots__ = ()
