"""What a caller asks of a capture, in one object every engine receives."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ..core.selectors import Label, ModuleOutput, Selector, _And, _Or, split_pass
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


def real_address(model: nn.Module, path: str) -> tuple[str, int | None]:
    """Address and pass of a module path, canonical adapter names resolved; raises if absent."""
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


def normalize(model: nn.Module, selector: Selector) -> Selector:
    """Turn plain-string sites that name modules into module selectors (so hooks serve them)."""
    if isinstance(selector, Label):
        try:
            real_address(model, selector.label)
        except LookupError:
            return selector
        return ModuleOutput(selector.label)
    if isinstance(selector, _Or):
        return _Or(normalize(model, selector.a), normalize(model, selector.b))
    if isinstance(selector, _And):
        return _And(normalize(model, selector.a), normalize(model, selector.b))
    return selector
