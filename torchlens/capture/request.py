"""What a caller asks of a capture, in one object every engine receives."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ..core.selectors import InModule, Label, ModuleOutput, Selector, _And, _Or, split_pass
from ..edits import When
from .hooks import resolve_module


@dataclass
class CaptureRequest:
    model: nn.Module
    args: tuple
    kwargs: dict
    record_ops: bool = True
    sites: Selector | None = None
    intervene: list[When] = field(default_factory=list)
    save: Selector | None = None
    grad: bool = False
    until: Selector | None = None

    def selectors(self) -> list[Selector]:
        found = [w.site for w in self.intervene]
        found += [s for s in (self.sites, self.until) if s is not None]
        return found

    def module_only(self) -> bool:
        """True when every site is a module output, so module hooks alone can serve it."""
        return all(s.module_paths() is not None for s in self.selectors())

    def describe(self) -> str:
        parts = ["every op" if self.record_ops else "module outputs"]
        parts += [s.describe() for s in self.selectors()]
        return ", ".join(parts)


# How op labels look (``linear_3``, ``scaled_dot_product_attention_1``, ``input_0``, ``input_ids``).
_OP_LABEL = re.compile(r"^(?:[A-Za-z0-9_]+_\d+|input_.+)$")


def split_inputs(x: Any) -> tuple[tuple, dict]:
    """How a user's ``x`` / ``inputs=`` is passed to the model: a dict as keywords, a tuple as
    positional arguments, anything else as the single positional argument."""
    if isinstance(x, dict):
        return (), dict(x)
    if isinstance(x, tuple):
        return x, {}
    return (x,), {}


def real_address(model: nn.Module, path: str) -> tuple[str, int | None]:
    """Address and pass of a module path, canonical adapter names resolved; raises if absent.

    Raises:
        SiteNotFoundError: no such module, or a canonical name this model does not have (or
        one that names an op, not a module output, such as ``blocks.0.resid_mid``).
    """
    address, pass_index = split_pass(path)
    try:
        resolve_module(model, address)
        return address, pass_index
    except LookupError:
        from ..plugins import resolve_canonical

        real = resolve_canonical(model, address)
        if real is None:
            raise
        resolve_module(model, real)
        return real, pass_index


def _canonical(model: nn.Module, path: str) -> Selector | None:
    """The adapter's selector for ``path`` when it is not a real module address of ``model``."""
    try:
        resolve_module(model, split_pass(path)[0])
        return None
    except LookupError:
        from ..plugins import canonical_selector

        return canonical_selector(model, path)


def _bind(model: nn.Module, path: str) -> ModuleOutput | None:
    """A ModuleOutput for a canonical name, bound to what it means in this model."""
    target = _canonical(model, path)
    if target is None:
        return None
    bound = ModuleOutput(path)  # the canonical name stays (recipes stay portable across families)
    bound._target = target
    return bound


def normalize(model: nn.Module, selector: Selector) -> Selector:
    """Resolve sites against the captured model before capture starts.

    Plain-string sites that name modules become module selectors (so hooks serve them);
    canonical adapter names (``blocks.3.mlp``, ``blocks.3.resid_mid``) are bound to the
    module output or op they stand for in this model.
    """
    if isinstance(selector, ModuleOutput):
        return _bind(model, selector.path) or selector
    if isinstance(selector, InModule):
        target = _canonical(model, selector.path)
        if target is None:
            return selector
        paths = target.module_paths()
        if not paths or len(paths) != 1:
            from ..errors import SiteNotFoundError

            raise SiteNotFoundError(
                f"tl.in_module({selector.path!r}) needs a module, but this canonical name is an op "
                f"({target.describe()})",
                site=selector.path,
                remedy=f"Use tl.module({selector.path!r}) for the op itself.",
            )
        bound = InModule(selector.path)
        bound._address, bound._pass = split_pass(paths[0])
        return bound
    if isinstance(selector, Label):
        bound = _bind(model, selector.label)
        if bound is not None:
            return bound
        try:
            real_address(model, selector.label)
        except LookupError:
            if _OP_LABEL.match(selector.label):
                return selector  # an op label: known once the op runs
            from ..errors import SiteNotFoundError
            from .names import nearest

            names = [n for n, _ in model.named_modules() if n]
            raise SiteNotFoundError(
                f"{selector.label!r} is neither a module of {type(model).__name__} nor an op label; "
                f"nearest modules: {nearest(selector.label, names)}",
                site=selector.label,
                candidates=nearest(selector.label, names),
            ) from None
        return ModuleOutput(selector.label)
    if isinstance(selector, _Or):
        return _Or(normalize(model, selector.a), normalize(model, selector.b))
    if isinstance(selector, _And):
        return _And(normalize(model, selector.a), normalize(model, selector.b))
    return selector
