"""``nnsight.modeling.mixins.meta``: build a model on the meta device, load weights on first run.

`MetaDevice` puts every tensor created inside it on the ``meta`` device (shapes and dtypes,
no storage). `Meta` builds its module that way through ``_load_meta`` and *dispatches* (loads
the real module through ``_load`` and rebuilds the envoy tree over it) when asked, or on
the first trace.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch._guards import detect_fake_mode
from torch.overrides import TorchFunctionMode

from ...envoy import Envoy
from .loadable import Loadable, split_envoy_kwargs

__all__ = ["Meta", "MetaDevice"]


class MetaDevice(TorchFunctionMode):
    """Every tensor created (or moved with ``.to``) inside the context lands on ``meta``."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = "meta"
        elif func in _FACTORIES:
            kwargs["device"] = "meta"
        result = func(*args, **kwargs)
        return result

    def __enter__(self) -> MetaDevice:
        self._device = torch.device("meta")
        self._device.__enter__()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self._device.__exit__(*exc)


_FACTORIES = {
    torch.empty, torch.zeros, torch.ones, torch.full, torch.rand, torch.randn, torch.randint,
    torch.arange, torch.tensor, torch.eye, torch.linspace,
}


class Meta(Loadable):
    """A `Loadable` that builds on the meta device first; see the module docstring.

    Args:
        *args: a module (wrapped as it is, already dispatched) or what ``_load`` takes.
        dispatch: load the real weights now instead of on the first trace.
        **kwargs: passed to ``_load_meta`` / ``_load`` (``envoys=`` and ``rename=`` go to the tree).

    Raises:
        NotImplementedError: the subclass defines no ``_load_meta`` (or no ``_load`` at dispatch).
    """

    def __init__(self, *args: Any, dispatch: bool = False, **kwargs: Any) -> None:
        envoy_kwargs = split_envoy_kwargs(kwargs)
        object.__setattr__(self, "_load_args", args)
        object.__setattr__(self, "_load_kwargs", kwargs)
        object.__setattr__(self, "_envoy_kwargs", envoy_kwargs)
        if args and isinstance(args[0], torch.nn.Module):
            module, dispatched = args[0], True
        elif dispatch:
            module, dispatched = self._load(*args, **kwargs), True
        else:
            with MetaDevice():
                module = self._load_meta(*args, **kwargs)
            dispatched = False
        object.__setattr__(self, "dispatched", dispatched)
        Envoy.__init__(self, module, **envoy_kwargs)
        self._built()

    def _load_meta(self, *args: Any, **kwargs: Any) -> torch.nn.Module:
        raise NotImplementedError(f"{type(self).__name__} defines no _load_meta(); subclass Meta and define it")

    def _built(self) -> None:
        """Called after the envoy tree is (re)built over a module; subclasses add what they own."""

    def dispatch(self) -> Meta:
        """Load the real module (once) and point every envoy of the tree at it.

        Returns:
            This model, now on its real weights (stored ``model.edit()`` bodies are kept).
        """
        if not self.dispatched:
            module = self._load(*self._load_args, **self._load_kwargs)
            edits = self._edits
            with warnings.catch_warnings():
                # the same architecture again: its moved-submodule warnings were given at the meta build
                warnings.filterwarnings("ignore", message=".*has a submodule named", category=UserWarning)
                Envoy.__init__(self, module, path=self.path, **self._envoy_kwargs)
            object.__setattr__(self, "_edits", edits)
            object.__setattr__(self, "dispatched", True)
            self._built()
        return self

    def trace(self, *args: Any, **kwargs: Any) -> Any:
        """`Envoy.trace` on the real weights: dispatches first when still on meta."""
        self.dispatch()
        return super().trace(*args, **kwargs)

    def interleave(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """`Envoy.interleave` on the real weights, except under ``scan`` (fake tensors need none)."""
        if detect_fake_mode() is None:
            self.dispatch()
        return super().interleave(fn, *args, **kwargs)
