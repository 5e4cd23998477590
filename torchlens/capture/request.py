"""What a caller asks of a capture, in one object every engine receives.

Sites arrive already bound to the model (canonical names resolved by ``torchlens.arch``
at the edge), so an engine deals in real module addresses and op labels only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ..core.selectors import Selector, split_pass
from ..core.steps import Step
from .hooks import resolve_module

__all__ = ["CaptureRequest", "module_address"]


@dataclass
class CaptureRequest:
    model: nn.Module
    args: tuple
    kwargs: dict
    record_ops: bool = True
    sites: Selector | None = None
    intervene: list[Step] = field(default_factory=list)
    save: Selector | None = None
    grad: bool = False
    until: Selector | None = None
    strict: bool = False  # an edit that changes nothing raises instead of warning (kept by the trace)
    # Where recorded values go as they are produced (``put(key, value)`` returns a handle that reads
    # the value back, ``close()`` once the forward ends): a disk store (store=) or a device offload.
    sink: Any = None
    max_bytes: int | None = None  # values held in memory beyond this raise CaptureMemoryError (None: no limit)
    # Stop the forward once every site module has returned (module hooks only; the model's own
    # output is then never computed): what a reader of early layers needs and nothing more.
    stop_after_sites: bool = False

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


def module_address(model: nn.Module, path: str) -> tuple[str, int | None]:
    """Address and pass of a bound module path (``addr`` or ``addr:N``), checked against ``model``.

    Raises:
        SiteNotFoundError: ``model`` has no module at that address.
    """
    address, pass_index = split_pass(path)
    resolve_module(model, address)
    return address, pass_index
