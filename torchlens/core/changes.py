"""What a fork changed: ``ForkValues``, the one writer of a fork's own state, and ``ForkState``, a copy of it.

A fork shares its parent's records (one :class:`~torchlens.core.graph.Graph` object) and owns
only what it changed: op values replay recomputed, values module edits substitute for readers
after them, edited module outputs, the recipe of steps that produced them and the edits that
landed. Replay (and the loader) write these through the fork's ``changes``, a ``ForkValues``;
the fork reads them. Nothing else writes them.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from .steps import REPLAY, Step

__all__ = ["ForkState", "ForkValues"]


class ForkState(NamedTuple):
    """A copy of what a fork changed: op values, substitutions, module outputs, recipe, edits."""

    values: dict[int, Any]
    subst: dict[int, tuple[int, Any]]
    overrides: dict[str, Any]
    recipe: list[Step]
    edits: list[Any]


class ForkValues:
    """What one fork changed (see the module docstring); its methods are the only writes.

    ``values``: op index -> the fork's own output of that op (a ``Pending`` until first read);
    ``subst``: op index -> (position, value) readers from that op position on see instead (a
    module edit); ``overrides``: module call key -> its edited output; ``recipe``: the replay
    steps; ``edits``: the applied-edit records (the parent's, then the fork's own);
    ``unsaved_steps``: why steps could not be saved (a fork loaded from disk); ``strict``: an
    edit that changes nothing raises instead of warning.
    """

    __slots__ = ("values", "subst", "overrides", "recipe", "edits", "unsaved_steps", "strict")

    def __init__(self, *, values: dict[int, Any] | None = None, subst: dict[int, tuple[int, Any]] | None = None,
                 overrides: dict[str, Any] | None = None, recipe: list[Step] | None = None,
                 edits: list[Any] | None = None, unsaved_steps: list[str] | None = None, strict: bool = False) -> None:
        self.values: dict[int, Any] = dict(values or {})
        self.subst: dict[int, tuple[int, Any]] = dict(subst or {})
        self.overrides: dict[str, Any] = dict(overrides or {})
        self.recipe: list[Step] = list(recipe or [])
        self.edits: list[Any] = list(edits or [])
        self.unsaved_steps: list[str] = list(unsaved_steps or [])
        self.strict = strict

    def copy(self) -> ForkValues:
        """An independent copy (a fork of a fork starts from its parent's changes)."""
        return ForkValues(values=self.values, subst=self.subst, overrides=self.overrides, recipe=self.recipe,
                          edits=self.edits, unsaved_steps=self.unsaved_steps, strict=self.strict)

    # -- replay's writes -------------------------------------------------------------------------
    def set_value(self, index: int, value: Any) -> None:
        """Op ``index``'s own output on this fork is now ``value`` (a module substitution for it ends)."""
        self.values[index] = value
        self.subst.pop(index, None)

    def set_recomputed(self, index: int, value: Any) -> None:
        """Replay recomputed op ``index``; module substitutions of it stay."""
        self.values[index] = value

    def substitute(self, index: int, position: int, value: Any) -> None:
        """Readers from op position ``position`` on see ``value`` for op ``index`` (a module edit)."""
        self.subst[index] = (position, value)

    def set_module_output(self, key: str, value: Any) -> None:
        """The edited output of module call ``key``."""
        self.overrides[key] = value

    def add_step(self, step: Step) -> None:
        """Append ``step`` to the recipe (as a replay step)."""
        if step.phase != REPLAY:
            step = Step(step.site, step.edit, REPLAY)
        self.recipe.append(step)

    def drop_last_step(self) -> None:
        """Take back the recipe's last step (its replay failed)."""
        self.recipe.pop()

    def record_edit(self, applied: Any) -> None:
        """Note an edit that landed on the fork (an ``AppliedEdit``)."""
        self.edits.append(applied)

    def restore_fork(self, state: ForkState, unsaved_steps: list[str]) -> None:
        """Set every change from ``state`` (a copy taken before a failed replay, or decoded from disk)."""
        self.unsaved_steps = list(unsaved_steps)
        self.values = dict(state.values)
        self.subst = dict(state.subst)
        self.overrides = dict(state.overrides)
        self.recipe = list(state.recipe)
        self.edits = list(state.edits)
