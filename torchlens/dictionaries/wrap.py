"""One normalised view of a feature dictionary (an SAE or a transcoder), whatever built it.

``as_dictionary(obj)`` accepts any ``nn.Module`` with ``encode(x) -> f`` and ``decode(f) -> x_hat``
(ReLU, JumpReLU, TopK ...), a SAELens ``SAE`` as it is, or a ``FeatureDictionary`` already (a folder in
SAELens's on-disk layout is read by :func:`~torchlens.dictionaries.load.load_sae`). The wrapper owns the
checks every attaching or editing caller needs (input width, dtype, device, feature index), each a typed
``FeatureError`` with a remedy.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..errors import (
    FeatureDtypeError,
    FeatureIndexError,
    FeatureSiteError,
    FeatureWidthError,
    NotAFeatureDictionaryError,
)

__all__ = ["FeatureDictionary", "as_dictionary"]


class FeatureDictionary:
    """A feature dictionary seen through one interface: ``encode``, ``decode``, widths, ``W_dec``, dtype, device.

    Built by :func:`as_dictionary`; the wrapped module is ``.module`` and is never changed.
    ``d_in`` / ``d_sae`` / ``W_dec`` are ``None`` when the module does not declare them
    (no ``cfg``, no ``W_dec`` / ``W_enc`` / ``encoder`` / ``decoder`` to read them from).
    """

    def __init__(self, module: Any, *, name: str | None = None) -> None:
        encode, decode = getattr(module, "encode", None), getattr(module, "decode", None)
        if not callable(encode) or not callable(decode):
            missing = [m for m, f in (("encode", encode), ("decode", decode)) if not callable(f)]
            raise NotAFeatureDictionaryError(
                f"{type(module).__name__} is not a feature dictionary: it has no {' and no '.join(missing)} method",
                given=type(module).__name__)
        self.module = module
        self.name = name or type(module).__name__
        self.d_in, self.d_sae = _widths(module)

    # -- what it computes ---------------------------------------------------------------------------

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Feature activations of ``x`` (``[..., d_in] -> [..., d_sae]``), by the module's own ``encode``."""
        return self.module.encode(x)

    def decode(self, f: torch.Tensor) -> torch.Tensor:
        """The reconstruction of feature activations ``f`` (``[..., d_sae] -> [..., d_in]``)."""
        return self.module.decode(f)

    # -- what it declares ---------------------------------------------------------------------------

    @property
    def W_dec(self) -> torch.Tensor | None:  # noqa: N802 - the field's name in every SAE paper and library
        """Decoder directions, one row per feature (``d_sae x d_in``), or ``None`` when not declared."""
        m = self.module
        w = getattr(m, "W_dec", None)
        if isinstance(w, torch.Tensor) and w.dim() == 2:
            return w if self.d_in is None or w.shape[-1] == self.d_in else w.T
        dec = getattr(m, "decoder", None)
        if isinstance(dec, nn.Linear):
            return dec.weight.T  # nn.Linear stores out x in
        return None

    @property
    def dtype(self) -> torch.dtype | None:
        """The dtype of the dictionary's weights (``None`` when it has no tensor weights)."""
        p = _first_weight(self.module)
        return p.dtype if p is not None else None

    @property
    def device(self) -> torch.device | None:
        """The device of the dictionary's weights (``None`` when it has no tensor weights)."""
        p = _first_weight(self.module)
        return p.device if p is not None else None

    # -- checks (one owner: attaching and editing call these) -----------------------------------------

    def check_input(self, value: Any, *, site: str = "the site") -> None:
        """Raise a typed error when ``value`` cannot be this dictionary's input: not a tensor, width, dtype, device.

        Raises:
            FeatureWidthError: the last axis of ``value`` is not ``d_in`` (both widths named).
            FeatureDtypeError: dtype or device differ (the message says which).
        """
        if not isinstance(value, torch.Tensor):
            raise FeatureSiteError(
                f"{site} produces a {type(value).__name__}, not one tensor; a feature dictionary reads one tensor",
                site=site)
        width = value.shape[-1] if value.dim() else None
        if self.d_in is not None and width != self.d_in:
            raise FeatureWidthError(
                f"{self.name} reads vectors of width d_in={self.d_in}, but {site} has width {width} "
                f"(shape {tuple(value.shape)})", site=site, d_in=self.d_in, site_width=width)
        dtype, device = self.dtype, self.device
        if device is not None and value.device != device:
            raise FeatureDtypeError(
                f"device mismatch: {self.name} is on {device}, {site} is on {value.device}",
                site=site, which="device", dictionary=str(device), value=str(value.device))
        if dtype is not None and value.dtype != dtype:
            raise FeatureDtypeError(
                f"dtype mismatch: {self.name} is {dtype}, {site} is {value.dtype}",
                site=site, which="dtype", dictionary=str(dtype), value=str(value.dtype))

    def check_feature(self, index: Any) -> list[int]:
        """The feature indices in ``index`` (an int or a sequence / tensor of ints) as a list, each in range.

        Raises:
            FeatureIndexError: an index is outside ``0 .. d_sae - 1`` (negative indices count from the end).
        """
        if isinstance(index, torch.Tensor):
            items = [int(i) for i in index.reshape(-1).tolist()]
        elif isinstance(index, int | slice) or hasattr(index, "__index__"):
            items = [index] if not isinstance(index, slice) else list(range(self.d_sae or 0)[index])
        else:
            items = list(index)
        out = []
        for i in items:
            i = int(i)
            n = self.d_sae
            if n is not None and not -n <= i < n:
                raise FeatureIndexError(
                    f"feature {i} is out of range: {self.name} has d_sae={n} features (0 .. {n - 1})",
                    feature=i, d_sae=n)
            out.append(i % n if n is not None else i)
        return out

    def __repr__(self) -> str:
        return f"FeatureDictionary({self.name}, d_in={self.d_in}, d_sae={self.d_sae})"


def _first_weight(module: Any) -> torch.Tensor | None:
    if isinstance(module, nn.Module):
        for p in module.parameters():
            return p
        for b in module.buffers():
            if b.is_floating_point():
                return b
    return None


def _widths(module: Any) -> tuple[int | None, int | None]:
    """``(d_in, d_sae)`` read from what the module declares: ``cfg``, attributes, then weight shapes."""
    cfg = getattr(module, "cfg", None)
    d_in = _int_attr(cfg, "d_in") or _int_attr(module, "d_in")
    d_sae = _int_attr(cfg, "d_sae") or _int_attr(module, "d_sae")
    if d_in is None or d_sae is None:
        w_enc, w_dec = getattr(module, "W_enc", None), getattr(module, "W_dec", None)
        if isinstance(w_enc, torch.Tensor) and w_enc.dim() == 2:  # SAELens / TransformerLens: d_in x d_sae
            d_in, d_sae = d_in or w_enc.shape[0], d_sae or w_enc.shape[1]
        elif isinstance(w_dec, torch.Tensor) and w_dec.dim() == 2:  # d_sae x d_in
            d_sae, d_in = d_sae or w_dec.shape[0], d_in or w_dec.shape[1]
        else:
            enc, dec = getattr(module, "encoder", None), getattr(module, "decoder", None)
            if isinstance(enc, nn.Linear):
                d_in, d_sae = d_in or enc.in_features, d_sae or enc.out_features
            elif isinstance(dec, nn.Linear):
                d_in, d_sae = d_in or dec.out_features, d_sae or dec.in_features
    return d_in, d_sae


def _int_attr(obj: Any, name: str) -> int | None:
    value = getattr(obj, name, None) if obj is not None else None
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


def as_dictionary(obj: Any, *, name: str | None = None) -> FeatureDictionary:
    """Wrap ``obj`` as a :class:`FeatureDictionary` (returned unchanged when it already is one).

    Args:
        obj: an ``nn.Module`` (or any object) with ``encode(x)`` and ``decode(f)`` methods, e.g. a SAELens
            ``SAE``, a transcoder, or a module from :func:`~torchlens.features.load_sae`.
        name: how messages name it (default: its class name).

    Returns:
        The wrapper; ``obj`` itself is neither copied nor changed.

    Raises:
        NotAFeatureDictionaryError: ``obj`` has no ``encode`` or no ``decode`` method.
    """
    if isinstance(obj, FeatureDictionary):
        return obj
    return FeatureDictionary(obj, name=name)
