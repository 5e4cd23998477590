"""``Fork``: an isolated branch of a trace, holding its parent's records and owning what it changed.

A fork holds its parent's :class:`~torchlens.core.graph.Graph` (the same object: records are shared,
never copied) and owns only what it changed, a :class:`~torchlens.core.changes.ForkValues` replay
writes through (``fork.changes``), so forks of forks are cheap and never disturb their parent.
``Trace.fork()`` makes one: ``Fork`` declares itself the trace's branch class
(``class Fork(Trace, branch=True)``), so :mod:`torchlens.core.trace` never imports this module.
"""

from __future__ import annotations

from typing import Any

from .changes import ForkState, ForkValues
from .graph import MISSING
from .services import services
from .steps import REPLAY, Step
from .sweeping import SettledAttribute
from .trace import Trace
from .tree import Pending

__all__ = ["Fork"]


class Fork(Trace, branch=True):
    """A branch of a trace. Holds its parent's records (the same ``Graph``) and every unchanged
    value through them; what it changed is its own ``changes`` (a ``ForkValues``)."""

    # what the fork changed: read through SettledAttribute, which first replays edits a sweep block queued
    changes = SettledAttribute()

    def __init__(self, parent: Trace, name: str | None = None) -> None:
        if isinstance(parent, Fork):
            own = parent.changes.copy()  # (replays the parent's queued edits first)
        else:
            own = ForkValues(edits=parent.edits, unsaved_steps=parent.unsaved_steps, strict=parent.strict)
        super().__init__(parent._graph, name=name or f"{parent.name}/fork", tokenizer=parent.tokenizer)
        self._deferred: Any = None  # the SweepBlock holding this fork's queued edits, or the error they met
        self.parent = parent
        self.changes = own

    # -- reading fork state ------------------------------------------------------------------
    @property
    def steps(self) -> list[Step]:
        """The capture-time steps of the trace this fork branched from (its own are its ``recipe``)."""
        return self.parent.steps

    @property
    def edits(self) -> list[Any]:
        """The edits that landed (``AppliedEdit``), in order: the parent's, then this fork's own."""
        return self.changes.edits

    @property
    def recipe(self) -> list[Step]:
        """The replay steps this fork applied, in order."""
        return self.changes.recipe

    @property
    def unsaved_steps(self) -> list[str]:
        """Why steps could not be saved (a trace or fork loaded from disk)."""
        return self.changes.unsaved_steps

    def value(self, index: int, *, pending_ok: bool = False) -> Any:
        values = self.changes.values
        v = values.get(index, MISSING)
        if v is MISSING:
            return self._graph.ops[index].out
        if not pending_ok and isinstance(v, Pending):
            v = values[index] = v.resolve()  # built once, on the first read
        return v

    def has_value(self, index: int) -> bool:
        return index in self.changes.values or self._graph.ops[index].saved

    def held_values(self) -> list[Any]:
        return [v.held() if isinstance(v, Pending) else v for v in self.changes.values.values()]

    def _own_values(self) -> dict[int, Any]:
        return self.changes.values

    def _substitution(self, index: int) -> tuple[int, Any] | None:
        subst = self.changes.subst
        return subst.get(index) if subst else None

    def _module_outputs(self) -> dict[str, Any]:
        return self.changes.overrides

    def fork_state(self) -> ForkState:
        """A copy of what this fork changed (for saving and inspection)."""
        own = self.changes
        return ForkState({i: self.value(i) for i in own.values}, dict(own.subst), dict(own.overrides),
                         list(own.recipe), list(own.edits))

    def module_override(self, key: str) -> Any:
        """The edited output of module call ``key`` on this fork (``MISSING``-free: None if none)."""
        return self.changes.overrides.get(key)

    def has_module_override(self, key: str) -> bool:
        return key in self.changes.overrides

    def all_steps(self) -> list[Step]:
        return [*self.steps, *self.recipe]

    # -- becoming a re-executed capture --------------------------------------------------------
    def adopt(self, fresh: Trace, recipe: list[Step]) -> None:
        """Become ``fresh`` (a re-executed capture of this fork's steps) while staying this fork of
        the same parent: its records are now this fork's, its steps this fork's ``recipe``."""
        graph = fresh._graph
        graph.point_records_at(self)  # else they point at ``fresh``, gone once this returns
        self._graph = graph
        self.tokenizer = fresh.tokenizer
        self.changes = ForkValues(recipe=recipe, edits=graph.edits, unsaved_steps=graph.unsaved_steps,
                                  strict=graph.strict)

    def do(self, site: Any, edit: Any, *, model=None, inputs=None, check: bool = False,
           replay: str = "auto") -> Fork:
        """Apply ``edit`` at ``site`` on this fork and push it down the recorded graph.

        Without ``model``/``inputs`` only ops downstream of the site are re-executed from
        their recorded arguments. With both, the real forward is re-executed with the
        fork's whole recipe. ``check=True`` replays and then re-executes to compare.

        Replay follows the recorded path only while every guard (a value the forward branched
        on: ``if x.sum() > 0``, ``.item()``, the experts a router's ``topk`` picked, data-dependent
        shapes) is unchanged. When the edit changes one, ``replay`` decides: ``"strict"`` raises
        ``GuardChangedError``; ``"fallback"`` re-executes the real forward with the fork's steps
        (warns ``ReplayFellBack`` and marks the fork's ``edits`` ``how="re-executed: ..."``);
        ``"auto"`` (default) falls back when the trace holds its model, else raises.

        Inside ``with trace.sweep():`` (on this fork's parent) the edit is checked and queued, and
        replayed with the block's other forks (see :meth:`Trace.sweep`).

        Returns:
            this fork, for chaining.

        Raises:
            GuardChangedError: a guard changed and no fallback was allowed or possible.
            ReplayNotExactError: the recorded graph cannot reproduce this edit exactly.
        """
        step = Step(self.bind(site, strings_as_modules=True), edit, REPLAY)
        block = self.parent._sweeping
        if block is not None and model is None and inputs is None and not check:
            return block.defer(self, step, replay)  # replayed with the block's other forks
        return services().replay(self, step, model=model, inputs=inputs, check=check, replay=replay)
