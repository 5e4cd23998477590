"""What the core asks of the packages above it, behind one small typed protocol: replay.

The core holds records and answers reads. Replaying an edit (``edit/``), capturing the model
again (``api``) and resolving a model's names (``arch/``) live above it, and the core cannot
import them: the top package installs one :class:`TraceServices` object when it is imported
(``torchlens/_core_services.py``), and ``Fork.do``, ``Trace.forks``, ``Trace.run`` and
``Trace.bind`` call through it. Everything else a trace offers above the core (validating,
saving, tables, pictures, facets) is a method its owning package provides on import
(``core.actions.provide_methods``), not a service.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, Protocol, overload

from ..errors import TorchLensError

if TYPE_CHECKING:
    from torch import nn

    from .fork import Fork
    from .selectors import Names, Selector
    from .steps import Step
    from .trace import Trace

__all__ = ["TraceServices", "install", "services"]


class TraceServices(Protocol):
    """The operations of a trace that live above the core: replay and re-execution."""

    def names(self, model: nn.Module) -> Names:
        """``model``'s names (real addresses, canonical names, sub-sites), for ``Selector.bind``."""

    def replay(self, fork: Fork, step: Step, *, model: nn.Module | None, inputs: Any, check: bool,
               replay: str) -> Fork:
        """Apply ``step`` on ``fork`` (replay, or re-execution when model/inputs are given or a
        changed guard makes replay fall back, as ``replay`` allows); ``inputs`` are the user's
        inputs in any form ``tl.trace`` takes."""

    @overload
    def replay_many(self, forks: list[Fork], steps: list[list[Step]], *, check: bool, replay: str,
                    batch_size: int | None, collect_errors: Literal[False] = False) -> list[Fork]: ...

    @overload
    def replay_many(self, forks: list[Fork], steps: list[list[Step]], *, check: bool, replay: str,
                    batch_size: int | None, collect_errors: Literal[True]) -> list[BaseException | None]: ...

    def replay_many(self, forks: list[Fork], steps: list[list[Step]], *, check: bool, replay: str,
                    batch_size: int | None, collect_errors: bool = False) -> list[Fork] | list[BaseException | None]:
        """Apply ``steps[i]`` (in order) on ``forks[i]`` (fresh forks of one trace), replayed together;
        the forks, or with ``collect_errors`` per fork the error its replay met (None: none)."""

    def rerun(self, trace: Trace, model: nn.Module, args: tuple, kwargs: dict[str, Any], steps: list[Step],
              until: Selector | None) -> Trace:
        """Capture the model again with ``steps`` as capture-time edits (stop after ``until``)."""


_installed: TraceServices | None = None


def install(impl: TraceServices) -> None:
    """Make ``impl`` the services every trace uses (done once by ``import torchlens``)."""
    global _installed
    _installed = impl


def services() -> TraceServices:
    """The installed services.

    Raises:
        TorchLensError: nothing installed (the core was used without importing ``torchlens``).
    """
    if _installed is None:
        raise TorchLensError("the TorchLens services are not installed",
                             remedy="import torchlens before using torchlens.core")
    return _installed
