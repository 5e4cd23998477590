"""``nnsight.modeling.mixins.loadable``: `Loadable`, an envoy whose module is built from an id."""

from __future__ import annotations

from typing import Any

import torch

from ...envoy import Envoy

__all__ = ["Loadable", "split_envoy_kwargs"]

_ENVOY_KWARGS = ("envoys", "rename")


def split_envoy_kwargs(kwargs: dict) -> dict:
    """Take the envoy-tree options (``envoys=``, ``rename=``) out of ``kwargs``; return them."""
    return {key: kwargs.pop(key) for key in _ENVOY_KWARGS if key in kwargs}


class Loadable(Envoy):
    """An envoy built from a module, or from anything ``_load`` turns into one.

    Subclass it and define ``_load(self, *args, **kwargs) -> torch.nn.Module``; an
    ``nn.Module`` given as the first argument is wrapped as it is.

    Raises:
        NotImplementedError: an id was given and the subclass defines no ``_load``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        envoy_kwargs = split_envoy_kwargs(kwargs)
        if args and isinstance(args[0], torch.nn.Module):
            module = args[0]
        else:
            module = self._load(*args, **kwargs)
        super().__init__(module, **envoy_kwargs)

    def _load(self, *args: Any, **kwargs: Any) -> torch.nn.Module:
        raise NotImplementedError(f"{type(self).__name__} defines no _load(); subclass Loadable and define it")
