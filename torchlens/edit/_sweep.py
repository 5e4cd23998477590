"""Replaying a sweep of fresh forks as one pass: every fork's changed rows of an op in one tensor.

:func:`torchlens.edit._batch.push_together` walks one replayer per fork in step; each fork
still plans, builds and stores every op it reaches, so twelve forks pay the Python of twelve
replays. :func:`sweep` lands every edit first, groups the forks whose edits change the same
rows (a grid of layers and positions: one group per position), and walks the recorded graph
once per group: an op some forks changed holds one :class:`~torchlens.edit._stack.Stack`,
the rows ``start:`` along ``axis`` of each fork, one block per fork (rows from 0: whole
values); row rules, shape ops and attention (one batch entry per fork) run once on it, other
ops once per fork. Each fork then stores its own rows of each op as its own replayer would,
with the same replay log. A fork that has not reached an op yet is not in its stack, so
results equal each fork replayed alone to float rounding (stacking changes BLAS blocking).

Eager attention's scores ``q @ k.T`` change in a corner (later keys reach earlier queries):
they are computed whole, one batch entry per fork, until a causal mask restores the corner's
block (``_regions.refine_corner``, as replay alone decides). What the sweep does not cover
restores the forks it concerns, which the caller replays the general way: an edit changing
a whole value (or raising) restores its fork; an in-place, guard or random op, a data read
the edits reach, or an error in the walk restores that fork's group.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from ..core.records import EDIT, GUARD, INPLACE, INPUT, ModuleCall, build_args
from ..core.steps import Step
from ..errors import GuardChangedError, ReplayError, ValueNotSavedError
from ._execute import ROW_VIEWS, UNINITIALISED, execute, refuse_reason
from ._fallbacks import declare
from ._regions import WHOLE, Corner, RowPatch, Rows, as_built, refine_corner, rows_from_zero
from ._run import Replayer, Target
from ._slicing import ELEMENTWISE, collect_rows, plan_op
from ._stack import WHOLE_ROWS, BlockPatch, Outputs, Stack, forks_batch, refine_forks
from ._stacked_ops import (
    ATTENTION,
    MEMORY_VIEWS,
    SHAPED,
    STACKED_OPS,
    PerFork,
    Swept,
    SweptWhole,
    attention,
    several,
    shaped,
)

__all__ = ["sweep"]

class _Abort(Exception):
    """The sweep does not cover this (the message says why): the forks concerned are restored and
    replayed the general way, the reason in their replay record."""


def sweep(forks: Sequence[Any], steps: Sequence[Step], *, read: Any = None,
          declined: dict[int, str] | None = None) -> list[Replayer | BaseException | None] | None:
    """Push ``steps[i]`` (a bound replay step) down ``forks[i]`` for every fork, in one pass over
    the recorded graph per group of forks whose edits change the same rows, their changed rows
    stacked per op.

    Every edit lands first (a fresh fork's edit reads the recorded value); the forks are then
    grouped by the rows their edit changed (a grid of layers and positions: one group per
    position), and each group walks the graph once.

    What the sweep cannot do it declares (``_fallbacks.declare``) before the general path takes
    over; an error it does not expect propagates, every fork restored.

    Args:
        forks: fresh forks (no edits yet) of one trace, two or more.
        steps: one bound replay step per fork, each landing on one module call or op.
        read: an ``OutputRead`` (``torchlens.edit.reads``): of its op each fork computes only
            what it names (the replayer's ``read_value``).
        declined: filled with, per fork the sweep does not cover (by index), why.

    Returns:
        per fork, its :class:`~torchlens.edit.replay.Replayer` (the fork now holds its edit), the
        error its edit raised (the fork is as it was), or None for a fork the sweep does not
        cover (that fork is as it was; ``declined`` says why); None when it covers none.
    """
    why = declined if declined is not None else {}

    def decline(members: Sequence[int], reason: str) -> None:
        for i in members:
            why[i] = reason
        declare("sweep", reason)

    everyone = range(len(forks))
    if len(forks) < 2:
        decline(everyone, "a one-pass sweep takes two forks or more")
        return None
    parent = getattr(forks[0], "parent", None)
    if parent is None or any(getattr(f, "parent", None) is not parent or f.recipe or f.grad or f.stale_positions()
                             for f in forks):
        decline(everyone, "a one-pass sweep takes fresh forks of one trace, without grad or in-place overwrites")
        return None
    records = []
    for fork, step in zip(forks, steps):
        if not fork.has_op_graph:
            decline(everyone, "the trace holds no op graph")  # (the general path raises it)
            return None
        found = step.site.match(fork)
        if len(found) != 1:  # nothing (the general path raises) or several landing places
            decline(everyone, f"{step.site.describe()} lands on {len(found)} records, not one")
            return None
        records.append(found[0])
    before = [f.fork_state() for f in forks]
    swept: list[Replayer | BaseException | None] = [None] * len(forks)

    def restore(members: Sequence[int]) -> None:
        for i in members:
            forks[i].restore_fork(before[i], forks[i].unsaved_steps)
            swept[i] = None

    landed: dict[int, tuple[int, Any]] = {}
    try:
        replayers = []
        for fork, step, record in zip(forks, steps, records):
            fork.add_step(step)
            replayer = Replayer(fork, sliced=True, read=read)
            replayer.prepare(fork.recipe[-1], [Target(record)])
            replayers.append(replayer)
        with torch.no_grad():
            for i, replayer in enumerate(replayers):
                j = Target(records[i]).position
                try:
                    landed[i] = (j, _land(parent, replayer, j))
                except _Abort as exc:
                    restore([i])
                    decline([i], str(exc))
                except Exception as exc:  # noqa: BLE001 - the edit itself raised: handed back as that fork's error
                    restore([i])
                    swept[i] = exc
            for members in _groups(parent, landed):
                try:
                    _Sweep(parent, replayers, members, landed, read).run()
                except _Abort as exc:
                    restore(members)
                    decline(members, str(exc))
                except (GuardChangedError, ReplayError, ValueNotSavedError) as exc:
                    # which fork of the stack met it is not known: each replays alone, which says
                    restore(members)
                    decline(members, f"the walk met {type(exc).__name__}: each fork replays alone")
                else:
                    for i in members:
                        swept[i] = replayers[i]
    except BaseException:
        restore(everyone)  # an unexpected error, or interrupted: no fork is left half replayed
        raise
    return swept if any(r is not None for r in swept) else None


def _land(parent: Any, replayer: Replayer, j: int) -> tuple[int, Rows, torch.Tensor] | None:
    """Apply a fork's edit at position ``j`` on the fork itself: the op whose value it changed,
    the changed rows and the value readers from ``j`` on see (None: it changed nothing)."""
    entries = replayer._steps_at[j]
    refs = [r for _, t, _ in entries
            for r in (t.record.out_refs if isinstance(t.record, ModuleCall) else [t.record]) if r is not None]
    if any(getattr(r, "elem", None) is not None for r in refs):
        raise _Abort("its edit lands on one element of a multi-output op")
    replayer._apply_steps(entries)
    changed = [r for r in refs if replayer.regions.get(r.index) is not None]
    if not changed:
        return None  # the edit changed nothing
    if len(changed) != 1:  # (a module's other outputs, e.g. attention weights, unchanged are fine)
        raise _Abort("its edit changed several outputs of the module")
    o = changed[0].index
    region = replayer.regions[o]
    base = parent.value(o)
    edited = replayer.fork.seen_value(changed[0], j) if isinstance(entries[0][1].record, ModuleCall) \
        else replayer.fork.value(o)
    if not isinstance(region, Rows) or not isinstance(base, torch.Tensor) or not isinstance(edited, torch.Tensor) \
            or edited.shape != base.shape or edited.dtype != base.dtype:
        raise _Abort("its edit changes the whole value (or its shape or dtype), not rows of it")
    return o, region, edited


def _groups(parent: Any, landed: dict[int, tuple[int, Any]]) -> list[list[int]]:
    """The landed forks grouped by the rows their edit changed and that value's shape: stacking a
    fork changing fewer rows would recompute (and hold) rows it never changed, up to a whole
    forward per fork on a grid of positions. Forks whose edit changed nothing join the first group."""
    groups: dict[tuple, list[int]] = {}
    still = []
    for i, (_, edited) in landed.items():
        if edited is None:
            still.append(i)
            continue
        o, region, _ = edited
        groups.setdefault((region, tuple(parent.value(o).shape)), []).append(i)
    found = list(groups.values()) or [[]]
    found[0] = sorted(found[0] + still)
    return [g for g in found if g]


class _Sweep:
    """One walk of the recorded graph for ``members`` (indices into ``replayers``), whose edits
    have landed (``landed[i]``: position and what ``_land`` gave) and change the same rows."""

    def __init__(self, parent: Any, replayers: list[Replayer], members: list[int],
                 landed: dict[int, tuple[int, Any]], read: Any) -> None:
        self.parent = parent
        self.read = read
        self.replayers = replayers
        self.members = [replayers[i] for i in members]
        self.ops = parent.ops
        self.stack: dict[int, Any] = {}  # op index -> Stack, or a tuple of them (None: unchanged) per output
        self.land_at: dict[int, list[tuple[int, Any]]] = {}
        for i in members:
            j, edited = landed[i]
            self.land_at.setdefault(j, []).append((i, edited))

    def run(self) -> None:
        n = len(self.ops)
        next_read = self._next_read()
        for j in range(min(self.land_at), n + 1):
            for i, edited in self.land_at.get(j, ()):
                if edited is not None:
                    self._stack_edit(i, *edited)
            if j >= next_read:
                for replayer in self.members:
                    reads = replayer._reads
                    while replayer._read_i < len(reads) and reads[replayer._read_i].position <= j:
                        replayer._check_read(reads[replayer._read_i])
                        replayer._read_i += 1
                next_read = self._next_read()
            if j == n:
                return
            op = self.ops[j]
            if op.flags & INPUT:
                continue
            stacks = [s for s in (self._stack_of(r) for r in op.parent_refs) if s is not None]
            if not stacks:
                continue
            if refuse_reason(op) or op.flags & (INPLACE | EDIT | GUARD) or op.func_name in UNINITIALISED:
                raise _Abort(f"op {op.label} ({op.func_name}) is in-place, random, a guard or uninitialised memory")
            forks = tuple(sorted({f for s in stacks for f in s.forks}))
            if self.read is not None and j == self.read.index:
                # the read op (an LM head nothing else reads): each fork computes only what is read
                if any(self.read.cannot(self.replayers[i], op) for i in forks):
                    raise _Abort(f"the read op {op.label} cannot compute only what is read for every fork")
                for i in forks:
                    self.read.compute(self.replayers[i], op)
                continue
            note = f"stacked with {len(forks) - 1} other fork(s)" if len(forks) > 1 else ""
            try:
                if op.func_name not in STACKED_OPS or any(s.corner is not None for s in stacks):
                    raise PerFork
                region, rows, how = self._stacked(op, forks)
                logged = True
            except PerFork:
                done = self._scores(op, forks, stacks)
                if done is None:
                    region, rows, how, logged, note = self._per_fork(op, forks)
                else:
                    region, rows, how, logged = done
            if region is not None:  # (None: no fork's value of this op changed)
                self._keep(op, forks, region, rows, how, note, logged)

    def _next_read(self) -> float:
        """The position of the next data read some fork has not checked yet (inf: none)."""
        return min((r._reads[r._read_i].position for r in self.members if r._read_i < len(r._reads)),
                   default=math.inf)

    def _stack_of(self, ref: Any) -> Stack | None:
        s = self.stack.get(ref.index)
        if isinstance(s, tuple):
            return s[ref.elem] if ref.elem is not None else None if all(x is None for x in s) else _abort()
        return s if ref.elem is None else None if s is None else _abort()

    def _stack_edit(self, i: int, o: int, region: Rows, edited: torch.Tensor) -> None:
        """Add fork ``i``'s edited rows of op ``o`` to the stack (readers from here on see them)."""
        base = self.parent.value(o)
        s = self.stack.get(o)
        if s is None:
            self.stack[o] = Stack(base, region.axis, region.start, _cut(edited, region), (i,))
            return
        # other forks reached this op first: its stack must hold every row this edit changed
        # (the same rows or more along its axis; a whole value, from rows 0, holds anything)
        if not isinstance(s, Stack) or s.corner is not None \
                or not (s.start == 0 or s.axis == region.axis and s.start <= region.start):
            raise _Abort(f"op {o}'s stack holds other rows than this edit changed")
        mine = edited.narrow(s.axis, s.start, s.block)
        forks = tuple(sorted((*s.forks, i)))
        s.rows = torch.cat([mine if f == i else s.rows_of(f) for f in forks], s.axis)
        s.forks = forks

    def _stacked(self, op: Any, forks: tuple[int, ...]) -> tuple[Rows, torch.Tensor, str]:
        """Run ``op`` once on every fork's rows (raises PerFork where its rule cannot)."""
        j, regions, stacked = op.index, {}, set()

        def resolve(ref):
            s = self._stack_of(ref)
            if s is None:
                return self.parent.seen_value(ref, j)
            rows = s.aligned(forks)
            stacked.add(id(rows))
            patch = (SweptWhole if op.func_name == ATTENTION else Swept)(s.base, s.axis, s.start, rows)
            regions[id(patch)] = Rows(s.axis, s.start)
            return patch

        args, kwargs = build_args(op, resolve)
        # forks' whole values (rows from 0): planned as rows, so an op that keeps their axis runs
        # once on all of them (a head's patch changes every later value whole)
        with rows_from_zero(all(r.start == 0 for r in regions.values())):
            plan = plan_op(op, args, kwargs, lambda t: regions.get(id(t)))
        region = plan.region
        name = op.func_name
        if name in SHAPED:
            return shaped(op, args, kwargs, plan, len(forks))
        if not isinstance(region, Rows) or not isinstance(op.shape, tuple):
            raise PerFork
        want = list(op.shape)
        want[region.axis] = (want[region.axis] - region.start) * len(forks)
        if op.func_name in ROW_VIEWS:
            x = args[0] if args else None
            if plan.kind != "full" or not isinstance(x, Swept) \
                    or any(isinstance(a, Swept) for a in (*args[1:], *kwargs.values())):
                raise PerFork
            if op.func_name in MEMORY_VIEWS:
                if math.prod(x.shape[: x.axis]) != math.prod(op.shape[: region.axis]):
                    raise PerFork
                rows = x.rows.reshape(want)
            else:
                rows = op.func(x.rows, *args[1:], **kwargs)
            how = "mapped"
        else:
            call = collect_rows(plan) if plan.kind == "rows" else None
            if call is None:
                raise PerFork
            n = len(forks)
            if name == ATTENTION:
                return region, attention(call, args, kwargs, n, want), "rows"

            def per_fork(v: Any) -> Any:
                if isinstance(v, torch.Tensor):
                    axis = call.axes.get(id(v))
                    # an unchanged argument cut to the same rows: once per fork
                    return v if axis is None or id(v) in stacked or n == 1 else torch.cat([v] * n, axis)
                if isinstance(v, (list, tuple)):
                    return type(v)(per_fork(x) for x in v)
                return v

            rows = call.func(*(per_fork(a) for a in call.args), **{k: per_fork(v) for k, v in call.kwargs.items()})
            how = "rows"
        if not isinstance(rows, torch.Tensor) or list(rows.shape) != want:
            raise PerFork
        return region, rows, how

    def _fork_plan(self, op: Any, i: int) -> tuple[Any, Any]:
        """How fork ``i`` alone would recompute ``op`` (``plan_op`` on its own values), and the
        resolver giving its arguments (a changed one as a RowPatch, or whole)."""
        j, regions = op.index, {}

        def resolve(ref):
            s = self._stack_of(ref)
            if s is None:
                return self.parent.seen_value(ref, j)
            if s.corner is not None or s.start == 0:  # the fork's whole value (changed in that corner)
                whole = s.rows_of(i)
                regions[id(whole)] = s.corner or WHOLE
                return whole
            patch = RowPatch(s.base, s.axis, s.start, s.rows_of(i))
            regions[id(patch)] = Rows(s.axis, s.start)
            return patch

        args, kwargs = build_args(op, resolve)
        return plan_op(op, args, kwargs, lambda t: regions.get(id(t))), resolve

    def _scores(self, op: Any, forks: tuple[int, ...], stacks: list[Any]) -> tuple[Any, Any, str, bool] | None:
        """Eager attention's scores for every fork in one call, each fork one batch entry:
        ``q @ k.T`` of stacked rows, or an elementwise op (scale, mask) of scores kept whole;
        then each fork's block refined as replay alone does (None: this does not apply)."""
        if op.func_name != "matmul" and op.func_name not in ELEMENTWISE \
                or any(s.forks != forks for s in stacks):
            return None
        plan, _ = self._fork_plan(op, forks[0])  # every fork of the stacks changed the same rows
        base = self.parent.value(op.index)
        if plan.kind != "full" or not isinstance(plan.region, Corner) or not isinstance(base, torch.Tensor):
            return None
        n, changed = len(forks), set()

        def resolve(ref):
            s = self._stack_of(ref)
            if s is None:
                return self.parent.seen_value(ref, op.index)
            v = s.rows if s.corner is not None else forks_batch(s.base, s.axis, s.start, s.rows, n)
            changed.add(id(v))
            return v

        args, kwargs = build_args(op, resolve)
        # an unchanged tensor with as many dims as the scores must broadcast over the forks' batch entries
        if any(isinstance(t, torch.Tensor) and id(t) not in changed and t.dim() >= base.dim()
               and t.shape[t.dim() - base.dim()] != 1 for t in (*args, *kwargs.values())):
            return None
        out = execute(op, args, kwargs)
        got = refine_forks(base, out, plan.region, n) if isinstance(out, torch.Tensor) else None
        if got is None:
            return None
        return got[0], got[1], "full" if got[0] == WHOLE_ROWS else "mapped", False

    def _per_fork(self, op: Any, forks: tuple[int, ...]) -> tuple[Any, Any, str, bool, str]:
        """Run ``op`` once per fork, each on its own rows, and stack what they give; then whether
        the replay log names the rows (not for eager attention's scores) and why no rule could
        bound the op (its log says ``fallback``), as replay alone logs them."""
        j, got, kinds, corner, reason = op.index, [], set(), False, ""
        for i in forks:
            plan, resolve = self._fork_plan(op, i)
            kinds.add(plan.kind)
            reason = reason or plan.reason
            if plan.kind == "skip":  # it reads only rows this fork did not change (e.g. the first token)
                got.append((None, None))
                continue
            if plan.kind == "rows" and isinstance(plan.region, Rows):
                got.append((plan.region, plan.call()))
                continue
            if plan.kind != "full" or not (plan.region is WHOLE or isinstance(plan.region, Corner)
                                           or _row_regions(plan.region)):
                raise _Abort(f"op {op.label} ({op.func_name}): no rule bounds what a fork changed")
            built = execute(op, *build_args(op, lambda r, resolve=resolve: as_built(resolve(r))))
            if isinstance(plan.region, Corner):  # attention scores: did a causal mask restore the corner's block?
                if not isinstance(built, torch.Tensor):
                    raise _Abort(f"op {op.label} ({op.func_name}): attention scores that are not a tensor")
                corner = True
                refined = refine_corner(self.parent.value(j), built, plan.region)
                got.append((WHOLE_ROWS, built) if refined is WHOLE else (refined, built)
                           if isinstance(refined, Corner) else (refined, _cut(built, refined)))
                continue
            if plan.region is WHOLE:  # the whole value changed: kept as all its rows along axis 0
                if not isinstance(built, torch.Tensor) or built.dim() == 0:
                    raise _Abort(f"op {op.label} ({op.func_name}): a whole value that is not a tensor of rows")
                got.append((WHOLE_ROWS, built))
                continue
            if several(plan.region):
                if not isinstance(built, (tuple, list)) or len(built) != len(plan.region):
                    raise _Abort(f"op {op.label} ({op.func_name}): its outputs do not match its changed regions")
                got.append((plan.region, tuple(None if r is None else _cut(b, r) for b, r in zip(built, plan.region))))
            else:
                got.append((plan.region, _cut(built, plan.region)))
        region = got[0][0]
        if any(r != region for r, _ in got):
            raise _Abort(f"op {op.label} ({op.func_name}): the forks changed different regions of it")
        if region is None:
            return None, None, "skip", True, ""
        if several(region):
            rows = tuple(None if r is None else torch.cat([g[1][k] for g in got], r.axis) for k, r in enumerate(region))
        else:
            rows = torch.cat([g[1] for g in got], 0 if isinstance(region, Corner) else region.axis)
        how = "fallback" if reason else "full" if region == WHOLE_ROWS else "rows" if kinds == {"rows"} else "mapped"
        return region, rows, how, not corner, reason

    def _keep(self, op: Any, forks: tuple[int, ...], region: Any, rows: Any, how: str, note: str,
              logged: bool = True) -> None:
        """Put the stacked rows of ``op`` in the stack and give each fork its own (``logged``: the
        replay log names the rows)."""
        j = op.index
        base = self.parent.value(j)
        if isinstance(region, Corner):  # each fork's whole value, as all its rows along axis 0
            s = self.stack[j] = _checked(Stack(base, 0, 0, rows, forks, region))
            for k, i in enumerate(forks):
                self.replayers[i].store(j, rows.narrow(0, k * s.block, s.block), region)
                self.replayers[i].log.entries.append((op.label, op.func_name, how, None, note))
            return
        if several(region):
            if not isinstance(base, (tuple, list)) or len(base) != len(region):
                raise _Abort(f"op {op.label} ({op.func_name}): recorded outputs do not match its changed regions")
            stacks = tuple(None if r is None else _checked(Stack(b, r.axis, r.start, x, forks))
                           for b, r, x in zip(base, region, rows))
            self.stack[j] = stacks
            parts = [None if s is None else s.rows.split(s.block, s.axis) for s in stacks]
            whole = all(r is not None and r.start == 0 for r in region)  # every output whole
            how = _as_whole(how) if whole else how
            for k, i in enumerate(forks):  # several outputs: built together when read
                value = Outputs(tuple(b if s is None else p[k] if whole else RowPatch(b, s.axis, s.start, p[k])
                                       for b, s, p in zip(base, stacks, parts)))
                self.replayers[i].store(j, value, WHOLE if whole else region)
                self.replayers[i].log.entries.append((op.label, op.func_name, how, None, note))
            return
        if not isinstance(base, torch.Tensor):
            raise _Abort(f"op {op.label} ({op.func_name}): its recorded value is not a tensor")
        s = self.stack[j] = _checked(Stack(base, region.axis, region.start, rows, forks))
        size = (region.axis, region.start, base.shape[region.axis]) if logged else None
        axis, m, rows = s.axis, s.block, s.rows
        whole = region.start == 0  # every row: each fork holds its whole value
        how = _as_whole(how) if whole else how
        for k, i in enumerate(forks):
            replayer = self.replayers[i]
            if whole:
                replayer.store(j, rows.narrow(axis, k * m, m), WHOLE)
                replayer.log.entries.append((op.label, op.func_name, how, None, note))
                continue
            replayer.store(j, BlockPatch(base, region.axis, region.start, rows, k * m), region)
            replayer.log.entries.append((op.label, op.func_name, how, size, note))


def _abort() -> Any:
    raise _Abort("an op reads one output of a multi-output value the forks changed whole")


def _row_regions(region: Any) -> bool:
    if several(region):
        return all(r is None or isinstance(r, Rows) for r in region) and any(r is not None for r in region)
    return isinstance(region, Rows)


def _as_whole(how: str) -> str:
    """How the log names a value recomputed whole, as replay alone names it (a fallback stays one)."""
    return how if how == "fallback" else "full"


def _cut(value: Any, region: Rows) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise _Abort("a recomputed value is not a tensor")
    return value.narrow(region.axis, region.start, value.shape[region.axis] - region.start)


def _checked(s: Stack) -> Stack:
    """``s`` if its rows are one block of the recorded shape per fork, else abort."""
    want = list(s.base.shape)
    want[s.axis] = s.block * len(s.forks)
    if not isinstance(s.rows, torch.Tensor) or list(s.rows.shape) != want or s.rows.dtype != s.base.dtype:
        raise _Abort("stacked rows are not one block of the recorded shape per fork")
    return s

