"""What a trace asks of the layers above the core, behind one small protocol.

The core holds records and answers reads; replaying an edit, saving, validating, printing,
resolving canonical site names and reading facets are done by packages above it
(``edit/``, ``store/``, ``analysis/``, ``arch/``). The core never imports them: the top
package installs one :class:`TraceServices` object when it is imported
(``torchlens/_core_services.py``), and ``Trace`` methods call through it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from ..errors import TorchLensError

if TYPE_CHECKING:
    from torch import nn

    from .selectors import Names, Selector
    from .sites import Site
    from .steps import Step
    from .trace import Fork, Trace

__all__ = ["TraceServices", "install", "services"]


class TraceServices(Protocol):
    """The operations of a trace that live above the core."""

    def names(self, model: nn.Module) -> Names:
        """``model``'s names (real addresses, canonical names, sub-sites), for ``Selector.bind``."""

    def replay(self, fork: Fork, step: Step, *, model: Any, inputs: Any, check: bool, replay: str) -> Fork:
        """Apply ``step`` on ``fork`` (replay, or re-execution when model/inputs are given or a
        changed guard makes replay fall back, as ``replay`` allows)."""

    def replay_many(self, forks: list[Fork], steps: list[list[Step]], *, check: bool, replay: str,
                    batch_size: int | None, collect_errors: bool = False) -> list[Any]:
        """Apply ``steps[i]`` (in order) on ``forks[i]`` (fresh forks of one trace), replayed together;
        the forks, or with ``collect_errors`` per fork the error its replay met (None: none)."""

    def rerun(self, trace: Trace, model: Any, args: tuple, kwargs: dict, steps: list[Step],
              until: Selector | None) -> Trace:
        """Capture the model again with ``steps`` as capture-time edits (stop after ``until``)."""

    def validate(self, trace: Trace, **kwargs: Any) -> Any:
        """``tl.validate(trace, **kwargs)``."""

    def save_trace(self, trace: Trace, path: Any, *, selector: Any, overwrite: bool) -> Any:
        """Write the trace (graph + activations)."""

    def save_intervention(self, trace: Trace, path: Any, *, level: str, overwrite: bool) -> Any:
        """Write the trace's steps as a ``.tlspec/`` recipe."""

    def table(self, trace: Trace, selector: Any, limit: int | None) -> str:
        """A text table of the trace's ops."""

    def facets(self, site: Site) -> Any:
        """The facet object a plugin offers for ``site``."""

    def to_dot(self, trace: Trace, **options: Any) -> str:
        """The DOT source of the trace's graph (``torchlens.analysis.draw.to_dot`` options)."""

    def draw(self, trace: Trace, path: Any, **options: Any) -> Any:
        """Draw the trace's graph (to ``path`` when given); a ``Drawing``."""

    def summary(self, trace: Trace) -> Any:
        """Per module call: ops, parameters, output shape, memory held (text and HTML)."""

    def to_pandas(self, trace: Trace) -> Any:
        """One row per op as a pandas DataFrame."""


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
