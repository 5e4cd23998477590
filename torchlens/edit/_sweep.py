"""The sweep strategy: fresh forks whose edits change the same rows, each op run once on all of them.

A sweep of edits (zero block ``i`` at the last position, for every ``i``; restore one clean row per
patching cell) replays each fork from its edit on, and a sliced replay recomputes only a few rows
per op. :class:`Sweep`, a strategy of the replay engine (``edit/_engine``), lands every edit first,
groups the forks whose edits change the same rows (a grid of layers and positions: one group per
position), and, for each op some forks of a group reach, holds one
:class:`~torchlens.edit._stack.Stack`: the rows ``start:`` along ``axis`` of each fork, one block
per fork (rows from 0: whole values); row rules, shape ops and attention (one batch entry per
fork) run once on it, other ops once per fork. Each fork stores its own rows of each op as the
one-fork strategies would, with the same replay log. A fork that has not reached an op yet is not
in its stack, so results equal each fork replayed alone to float rounding (stacking changes BLAS
blocking).

Eager attention's scores ``q @ k.T`` change in a corner (later keys reach earlier queries): they
are computed whole, one batch entry per fork, until a causal mask restores the corner's block
(``_regions.refine_corner``, as replay alone decides).

What the sweep cannot do it declares before it runs, and the engine records it in the forks'
replay records: before the walk, a fork it does not take (not fresh, its edit changes a whole
value); during it, an op a group cannot run stacked (in-place, a guard, uninitialised memory, an
op no rule bounds): that group's forks then go on alone, each with the one-fork strategies,
from that op on. A rule of the stacked variant that reads a stacked argument other than by its
changed rows says so while it is planned (``_stacked_ops.PerFork``): the op then runs once per
fork, still in the sweep.
"""

from __future__ import annotations

from typing import Any

import torch

from ..core.records import ModuleCall, Op
from ._engine import Engine, Strategy
from ._regions import Rows
from ._replay_run import Replayer
from ._sweep_group import SweepGroup

__all__ = ["Sweep"]


class Sweep(Strategy):
    """Stacked forks: fresh forks of one trace whose edits change the same rows, each op they
    reach run once on all their rows (see the module docstring). Made by :meth:`begin`."""

    name = "sweep"
    alone = False

    def __init__(self, engine: Engine, read: Any) -> None:
        super().__init__(engine)
        self.read = read
        self.parent: Any = None
        self.groups_of: dict[Replayer, SweepGroup] = {}  # run -> its group, while it is swept
        self.index_of = {r: k for k, r in enumerate(engine.runs)}  # run -> its index in engine.runs

    def close(self) -> None:
        self.groups_of = {}  # (each group holds this sweep: a cycle through every swept run's fork)
        self.index_of = {}

    @classmethod
    def begin(cls, engine: Engine, read: Any = None) -> Sweep | None:
        """Land every fork's edit and group the forks by the rows it changed; each fork the sweep
        does not take is declared (it goes on with the strategies after this one). None: it takes none."""
        sweep = cls(engine, read)
        runs = engine.active()
        if len(runs) < 2:
            engine.decline(sweep, runs, "a one-pass sweep takes two forks or more")
            return None
        parent = sweep.parent = getattr(runs[0].fork, "parent", None)
        if parent is None or any(getattr(r.fork, "parent", None) is not parent or r.saved.recipe or r.fork.grad
                                 or r.fork.stale_positions() for r in runs):
            engine.decline(sweep, runs, "a one-pass sweep takes fresh forks of one trace, without grad or in-place "
                                        "overwrites")
            return None
        landed: dict[int, Any] = {}
        with torch.no_grad():
            for run in runs:
                if run.landings() != 1:  # several landing places
                    site = run.steps_at(run.start)[0][0].site.describe()
                    engine.decline(sweep, [run], f"{site} lands on {run.landings()} records, not one")
                    continue
                engine.each(run, sweep._land, run, landed)
        groups: dict[tuple, list[Replayer]] = {}
        still = []
        for run, edited in ((r, landed[id(r)]) for r in runs if id(r) in landed and r in engine.live):
            if edited is None:
                still.append(run)
            else:
                o, region, _ = edited
                groups.setdefault((region, tuple(parent.value(o).shape)), []).append(run)
        found = list(groups.values()) or [[]]
        found[0] = sorted(found[0] + still, key=engine.runs.index)
        for members in found:
            if members:
                group = SweepGroup(sweep, members, landed)
                for run in members:
                    sweep.groups_of[run] = group
        return sweep if sweep.groups_of else None

    def _land(self, run: Replayer, landed: dict[int, Any]) -> None:
        """Apply ``run``'s edit at its position on its fork: ``landed[id(run)]`` is then the op whose
        value it changed, the changed rows and the value readers from there on see (None: it changed
        nothing); a fork whose edit does not change rows of one tensor is declared."""
        j = run.start
        entries = run.steps_at(j)
        refs = [r for _, t, _ in entries
                for r in (t.record.out_refs if isinstance(t.record, ModuleCall) else [t.record]) if r is not None]
        if any(getattr(r, "elem", None) is not None for r in refs):
            self.engine.decline(self, [run], "its edit lands on one element of a multi-output op")
            return
        run.land(j)
        changed = [r for r in refs if run.regions.get(r.index) is not None]
        if not changed:
            landed[id(run)] = None  # the edit changed nothing
            return
        if len(changed) != 1:  # (a module's other outputs, e.g. attention weights, unchanged are fine)
            self.engine.decline(self, [run], "its edit changed several outputs of the module")
            return
        o = changed[0].index
        region = run.regions[o]
        base = self.parent.value(o)
        edited = run.fork.seen_value(changed[0], j) if isinstance(entries[0][1].record, ModuleCall) \
            else run.fork.value(o)
        if not isinstance(region, Rows) or not isinstance(base, torch.Tensor) or not isinstance(edited, torch.Tensor) \
                or edited.shape != base.shape or edited.dtype != base.dtype:
            self.engine.decline(self, [run], "its edit changes the whole value (or its shape or dtype), not rows of it")
            return
        landed[id(run)] = (o, region, edited)

    # -- the strategy ------------------------------------------------------------------------------

    def groups(self, op: Op, runs: list[Replayer]) -> list[list[Replayer]]:
        get = self.groups_of.get
        one = get(runs[0])
        if one is not None and one.next_land > op.index and one.swept.issuperset(runs):
            return [runs]  # (the commonest case: every run in one group, no edit landing here)
        found: dict[SweepGroup, list[Replayer]] = {}
        for run in runs:
            group = get(run)
            if group is not None:
                members = found.get(group)
                if members is None:
                    members = found[group] = []
                members.append(run)
        out = []
        for group, members in found.items():
            if group.next_land <= op.index:
                group.land_until(op.index)
                members = [r for r in members if r in self.groups_of]
            if members:
                out.append(members)
        return out

    def cannot(self, op: Op, runs: list[Replayer]) -> str | None:
        return self.groups_of[runs[0]].cannot(op, runs)

    def run_op(self, op: Op, runs: list[Replayer]) -> None:
        self.groups_of[runs[0]].run_op(op, runs)

    def release(self, runs: list[Replayer]) -> None:
        """The group of ``runs`` cannot go on stacked: its forks go on alone."""
        group = self.groups_of[runs[0]]
        for run in group.members:
            self.groups_of.pop(run, None)
        group.swept.clear()

    def drop(self, run: Replayer) -> None:
        group = self.groups_of.pop(run, None)
        if group is not None:
            group.swept.discard(run)
