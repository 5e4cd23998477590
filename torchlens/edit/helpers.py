"""Named edit helpers: small objects with parameters, so recipes can be saved without code.

Each helper is a class with a unique ``name``, constructor keywords as parameters,
``params()`` returning them, and ``__call__(activation, *, ctx)``. Users and plugins add
their own with ``tl.register_helper`` or the ``torchlens_helpers`` hook.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from ..core.indices import python_indices
from ..core.tree import flatten, tensor_leaves, unflatten
from ..errors import EditShapeError, InvalidArgumentError, UnknownHelperError
from ..hookspecs import hookimpl
from ..plugins import helpers as registered_helpers
from ..plugins import is_registered, register

__all__ = [
    "Add", "BUILTIN_HELPERS", "BuiltinHelpersPlugin", "Helper", "MeanAblate", "Noise", "PatchFrom", "Scale",
    "ZeroAblate", "add", "helper_class", "mean_ablate", "noise", "patch_from", "register_helper", "scale",
    "zero_ablate",
]


class Helper:
    """Base of named helpers: equality, repr and (de)serialisation come from ``params()``.

    An edit that changes no element is reported (``tl.EditHadNoEffect``, an error on a strict
    trace); a helper for which that can be legitimate sets ``may_change_nothing = True``, and
    one that knows why it may do nothing says so in ``no_effect_hint``.
    """

    name: ClassVar[str] = ""
    may_change_nothing: ClassVar[bool] = False

    def params(self) -> dict[str, Any]:
        raise NotImplementedError

    def __call__(self, activation: Any, *, ctx: Any) -> Any:
        raise NotImplementedError

    def to_dict(self) -> dict[str, Any]:
        return {"helper": self.name, "params": self.params()}

    def touches(self, activation: Any) -> tuple[int, list[int]] | None:
        """``(axis, rows)`` such that this edit keeps every element of ``activation`` off those rows
        of ``axis`` (None: it may change anything). Replay then compares only those rows to find what
        changed, instead of the whole tensor."""
        return None

    def no_effect_hint(self, activation: Any) -> str:
        """Why this edit left ``activation`` unchanged, when the helper can tell ("" otherwise)."""
        return ""

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return False
        a, b = self.params(), other.params()
        if a.keys() != b.keys():
            return False
        for k in a:
            x, y = a[k], b[k]
            if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
                if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and torch.equal(x, y)):
                    return False
            elif x != y and not (hasattr(x, "ops") and x is y):
                return False
        return True

    __hash__ = object.__hash__

    def __repr__(self) -> str:
        shown = ", ".join(f"{k}={_short(v)}" for k, v in self.params().items())
        return f"tl.{self.name}({shown})"


def _short(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return f"tensor{tuple(v.shape)}"
    return repr(v) if not hasattr(v, "ops") else "<trace>"


class _RegisteredHelper:
    """The plugin ``tl.register_helper`` registers for one helper class."""

    def __init__(self, cls: type[Helper]) -> None:
        self.cls = cls

    @hookimpl
    def torchlens_helpers(self) -> list[type]:
        return [self.cls]


def register_helper(cls: type[Helper]) -> type[Helper]:
    """Make a helper class known by its ``name`` (usable as a decorator).

    It is registered through the plugin manager like a plugin's helpers; registering the
    same class again is a no-op, and a name another helper already has is reported and
    skipped (see ``torchlens.hookspecs``).

    Raises:
        InvalidArgumentError: not a Helper class with a non-empty ``name``.
    """
    if not isinstance(cls, type) or not getattr(cls, "name", ""):
        raise InvalidArgumentError("register_helper takes a Helper subclass with a non-empty name")
    name = f"torchlens:helper:{cls.__module__}.{cls.__qualname__}"
    if not is_registered(name):
        register(_RegisteredHelper(cls), name=name)
    return cls


def helper_class(name: str) -> type[Helper]:
    """The helper class registered under ``name``.

    Raises:
        UnknownHelperError: no helper has that name (the known names are listed).
    """
    known = registered_helpers()
    found = known.get(name)
    if found is None:
        raise UnknownHelperError(f"no edit helper named {name!r}; known: {sorted(known)}", helper=name)
    return found


def _replace_first(value: Any, fn) -> Any:
    """Apply ``fn`` to a tensor, or to the first tensor of a module's tuple/dict output."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    leaves, spec = flatten(value)
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            leaves[i] = fn(leaf)
            return unflatten(leaves, spec)
    raise InvalidArgumentError("the site holds no tensor to edit",
                               remedy="Select the op that produces the tensor, or write a function edit.")


class ZeroAblate(Helper):
    """Replace the activation with zeros."""

    name = "zero_ablate"

    def params(self) -> dict[str, Any]:
        return {}

    def __call__(self, activation, *, ctx):
        return _replace_first(activation, torch.zeros_like)


class MeanAblate(Helper):
    """Replace the activation with its mean over ``dims`` (or the mean of a reference trace's value)."""

    name = "mean_ablate"

    def __init__(self, dims: int | tuple[int, ...] | None = 0, reference: Any = None) -> None:
        self.dims = tuple(dims) if isinstance(dims, (list, tuple)) else dims
        self.reference = reference

    def params(self) -> dict[str, Any]:
        return {"dims": list(self.dims) if isinstance(self.dims, tuple) else self.dims, "reference": self.reference}

    def _mean(self, t: torch.Tensor) -> torch.Tensor:
        if self.dims is None:
            return t.mean().expand_as(t)
        return t.mean(dim=self.dims, keepdim=True)

    def no_effect_hint(self, activation: Any) -> str:
        leaves = tensor_leaves(activation)
        if self.reference is not None or self.dims is None or not leaves:
            return ""
        shape = tuple(leaves[0].shape)
        dims = self.dims if isinstance(self.dims, tuple) else (self.dims,)
        if all(-len(shape) <= d < len(shape) and shape[d] == 1 for d in dims):
            return (f"the mean over dims={self.dims} of an activation of shape {shape} averages a dimension of "
                    "size 1, which is the value itself; pass reference= a trace of a larger batch, or other dims")
        return ""

    def __call__(self, activation, *, ctx):
        source = activation if self.reference is None else _site_value(self.reference, ctx)
        mean = self._mean(_first_leaf(source))

        def fill(t):
            try:
                return mean.to(t.dtype).expand_as(t).clone()
            except RuntimeError:
                raise EditShapeError(
                    f"the mean at {ctx.site} has shape {tuple(mean.shape)}, which does not broadcast to the "
                    f"activation's {tuple(t.shape)}",
                    site=ctx.site,
                ) from None

        return _replace_first(activation, fill)


def _first_leaf(value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value

    leaves = tensor_leaves(value)
    if not leaves:
        raise InvalidArgumentError("the site holds no tensor")
    return leaves[0]


def _site_value(source: Any, ctx: Any, site: Any = None) -> Any:
    """The value at the same site (or ``site``) in another trace."""
    if isinstance(source, torch.Tensor):
        return source
    key = site if site is not None else ctx.label
    if site is None and getattr(ctx, "module", None) and ctx.label == ctx.module:
        key = ctx.module if ctx.pass_index in (None, 1) or _passes(source, ctx.module) == 1 else \
            f"{ctx.module}:{ctx.pass_index}"
    if not isinstance(key, str):
        return source.find_sites(key).first().out
    return source[key].out


def _passes(trace: Any, address: str) -> int:
    return len(trace.calls_of(address))


class PatchFrom(Helper):
    """Replace the activation with the value at the same site (or ``site``) of another trace."""

    name = "patch_from"
    may_change_nothing = True  # the donor's value may equal this one (a clean run patched into itself)

    def __init__(self, source: Any, site: Any = None) -> None:
        self.source = source
        self.site = site

    def params(self) -> dict[str, Any]:
        return {"source": self.source, "site": self.site}

    def __call__(self, activation, *, ctx):
        donor = _site_value(self.source, ctx, self.site)
        cur = activation if isinstance(activation, torch.Tensor) else None
        if cur is not None and isinstance(donor, torch.Tensor) and donor.shape != cur.shape:
            raise EditShapeError(
                f"patch source at {ctx.site} has shape {tuple(donor.shape)} but the activation has "
                f"{tuple(cur.shape)}",
                site=ctx.site,
                source_shape=tuple(donor.shape),
                activation_shape=tuple(cur.shape),
                remedy="Patch between prompts of the same length, or select positions with a function edit.",
            )
        if isinstance(donor, torch.Tensor):
            return _replace_first(activation, lambda t: donor.to(t.dtype).clone())
        return donor


class Scale(Helper):
    """Multiply the activation by ``k``."""

    name = "scale"

    def __init__(self, k: float) -> None:
        self.k = float(k)

    def params(self) -> dict[str, Any]:
        return {"k": self.k}

    def __call__(self, activation, *, ctx):
        return _replace_first(activation, lambda t: t * self.k)


class Add(Helper):
    """Add ``vector`` (steering), at every position or only at ``positions`` (dim -2)."""

    name = "add"

    def __init__(self, vector: torch.Tensor, positions: list[int] | int | None = None) -> None:
        if not isinstance(vector, torch.Tensor):
            raise InvalidArgumentError(f"tl.add() takes a tensor vector, got {type(vector).__name__}")
        self.vector = vector
        self.positions = [positions] if isinstance(positions, int) else (list(positions) if positions else None)

    def params(self) -> dict[str, Any]:
        return {"vector": self.vector, "positions": self.positions}

    def __call__(self, activation, *, ctx):
        def add(t):
            vec = self.vector.to(t.dtype)
            if self.positions is not None and t.dim() < 2:
                raise EditShapeError(f"tl.add(positions=...) adds at positions along dim -2, but the activation at "
                                     f"{ctx.site} has shape {tuple(t.shape)}", site=ctx.site,
                                     remedy="Omit positions= to add everywhere, or edit a site with a position axis.")
            try:
                torch.broadcast_shapes(vec.shape, t.shape if self.positions is None else t[..., 0, :].shape)
            except RuntimeError:
                raise EditShapeError(
                    f"steering vector of shape {tuple(vec.shape)} does not broadcast to the activation at "
                    f"{ctx.site} of shape {tuple(t.shape)}", site=ctx.site) from None
            if self.positions is None:
                return t + vec
            at = python_indices(self.positions, t.shape[-2], what="position",  # refused, never wrapped
                                axis=f"the activation at {ctx.site} has {t.shape[-2]} positions (dim -2)")
            out = t.clone()
            out[..., at, :] += vec.unsqueeze(-2) if vec.dim() >= 1 else vec
            return out

        return _replace_first(activation, add)


class Noise(Helper):
    """Add Gaussian noise (std ``std``) from a seeded generator: replay gives the same noise."""

    name = "noise"

    def __init__(self, std: float, seed: int = 0) -> None:
        self.std = float(std)
        self.seed = int(seed)

    def params(self) -> dict[str, Any]:
        return {"std": self.std, "seed": self.seed}

    def __call__(self, activation, *, ctx):
        def noisy(t):
            gen = torch.Generator(device=t.device).manual_seed(self.seed)
            return t + torch.randn(t.shape, generator=gen, dtype=t.dtype, device=t.device) * self.std

        return _replace_first(activation, noisy)


BUILTIN_HELPERS = (ZeroAblate, MeanAblate, PatchFrom, Scale, Add, Noise)


class BuiltinHelpersPlugin:
    @staticmethod
    @hookimpl
    def torchlens_helpers():
        return list(BUILTIN_HELPERS)


def zero_ablate() -> ZeroAblate:
    """Edit: replace the activation with zeros."""
    return ZeroAblate()


def mean_ablate(dims: int | tuple[int, ...] | None = 0, reference: Any = None) -> MeanAblate:
    """Edit: replace the activation with its mean over ``dims`` (of ``reference``'s value if given)."""
    return MeanAblate(dims, reference)


def patch_from(source_trace: Any, site: Any = None) -> PatchFrom:
    """Edit: take the value at the same site (or ``site``) from another trace."""
    return PatchFrom(source_trace, site)


def scale(k: float) -> Scale:
    """Edit: multiply the activation by ``k``."""
    return Scale(k)


def add(vector: torch.Tensor, positions: list[int] | int | None = None) -> Add:
    """Edit: add a steering ``vector`` (at ``positions`` only, if given)."""
    return Add(vector, positions)


def noise(std: float, seed: int = 0) -> Noise:
    """Edit: add seeded Gaussian noise (for causal-tracing corruption)."""
    return Noise(std, seed)
