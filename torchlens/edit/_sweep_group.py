"""One group of a sweep (``edit/_sweep``): the fresh forks whose edits change the same rows, walked
as one stack per op they reach (:class:`SweepGroup`).

For each op the group's forks reach it holds one :class:`~torchlens.edit._stack.Stack` (the rows
``start:`` along ``axis`` of each fork, one block per fork); row rules, shape ops and attention
(one batch entry per fork) run once on it (``_stacked_ops``), other ops once per fork, and each
fork stores its own rows as the one-fork strategies would, with the same replay log. What the
group cannot run stacked it declares (:meth:`SweepGroup.cannot`) and its forks go on alone.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..core.records import EDIT, GUARD, INPLACE, Op, build_args
from ._execute import ROW_VIEWS, UNINITIALISED, execute
from ._regions import WHOLE, Corner, RowPatch, Rows, as_built, refine_corner, rows_from_zero
from ._replay_run import Replayer
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
from ._strategies import check_path, reissue

__all__ = ["SweepGroup"]

_MIXED = object()  # a read of one output of a multi-output value the forks changed whole


class SweepGroup:
    """The forks of one sweep whose edits change the same rows, and the stacks of the ops they reached."""

    def __init__(self, sweep: Any, members: list[Replayer], landed: dict[int, Any]) -> None:
        self.sweep = sweep
        self.engine = sweep.engine
        self.parent = sweep.parent
        self.read = sweep.read
        self.replayers = sweep.engine.runs
        self.members = members
        self.ops = self.parent.ops
        self.stack: dict[int, Any] = {}  # op index -> Stack, or a tuple of them (None: unchanged) per output
        self.land_at: dict[int, list[tuple[int, Any]]] = {}
        for run in members:
            if landed[id(run)] is not None:
                self.land_at.setdefault(run.start, []).append((sweep.index_of[run], landed[id(run)]))
        self.next_land = min(self.land_at, default=math.inf)  # the first position an edit still lands at
        self.swept = set(members)  # the members still swept (the sweep's ``groups_of`` maps them to this group)
        self._at: tuple[Op, Any] | None = None  # the op _parents looked at last, and its stacked arguments
        self._base: tuple[Op, Any] | None = None  # the op cannot accepted last, and its recorded value

    def land_until(self, j: int) -> None:
        """Stack the edited rows of every fork whose edit landed at a position up to ``j``."""
        if self.next_land > j:
            return
        for p in sorted(p for p in self.land_at if p <= j):
            for i, edited in self.land_at.pop(p):
                if self.replayers[i] in self.sweep.groups_of:
                    self._stack_edit(i, *edited)
        self.next_land = min(self.land_at, default=math.inf)

    def cannot(self, op: Op, runs: list[Replayer]) -> str | None:
        stacks = self._parents(op)
        if stacks is _MIXED:
            return "it reads one output of a multi-output value the forks changed whole"
        if not stacks:
            return None  # (it reads only values no fork of the group changed: nothing to do)
        if op.flags & (INPLACE | EDIT | GUARD) or op.func_name in UNINITIALISED:
            return "it is in-place, a guard or uninitialised memory"
        if not self.parent.has_value(op.index):
            return "its recorded value was not kept"
        base = self._base_of(op)
        if isinstance(base, (tuple, list)):
            if not isinstance(op.shape, tuple) or len(base) != len(op.shape) \
                    or not all(isinstance(b, torch.Tensor) for b in base):
                return "its recorded outputs are not tensors, one per recorded shape"
        elif not isinstance(base, torch.Tensor) or base.dim() == 0:
            return "its recorded value is not a tensor of rows"
        self._base = (op, base)
        return None

    def _parents(self, op: Op) -> Any:
        """The stacks of the values ``op`` reads that some fork of the group changed (one per such
        argument; ``_MIXED``: it reads one output of a multi-output value the forks changed whole).
        Kept for :meth:`run_op` until the next op: the engine asks :meth:`cannot` first."""
        at = self._at
        if at is not None and at[0] is op:
            return at[1]
        stacks: Any = []
        stack = self.stack
        for r in op.parent_refs:
            s = stack.get(r.index)
            if s is None:
                continue
            if type(s) is not Stack or r.elem is not None:
                s = self._stack_of(r)
                if s is _MIXED:
                    stacks = _MIXED
                    break
                if s is None:
                    continue
            stacks.append(s)
        self._at = (op, stacks)
        return stacks

    def _base_of(self, op: Op) -> Any:
        """Op ``op``'s recorded value (looked up once: :meth:`cannot` read it)."""
        got = self._base
        return got[1] if got is not None and got[0] is op else self.parent.value(op.index)

    def run_op(self, op: Op, runs: list[Replayer]) -> None:
        at = self._at
        stacks = at[1] if at is not None and at[0] is op else self._parents(op)
        held, corner = set(), False
        for s in stacks:
            held.update(s.forks)
            corner = corner or s.corner is not None
        index_of = self.sweep.index_of
        forks = tuple(sorted(held.intersection([index_of[r] for r in runs])))
        if not forks:
            return
        note = f"stacked with {len(forks) - 1} other fork(s)" if len(forks) > 1 else ""
        if op.func_name in STACKED_OPS and not corner:
            try:
                done = self._stacked_rule(op, forks)
            except PerFork:  # a rule read a stacked argument other than by its rows (what PerFork declares)
                done = None
            if done is not None:  # (rows of the shape the op's stacked forks give: checked in the rule)
                self._keep(op, forks, *done, note, fits=True)
                return
        done = self._scores(op, forks, stacks)
        if done is not None:
            self._keep(op, forks, *done[:3], note, done[3])
            return
        self._per_fork(op, forks)

    def _stack_of(self, ref: Any) -> Any:
        """The stack of the value ``ref`` reads (None: no fork of the group changed it; ``_MIXED``:
        one output of a multi-output value the forks changed whole)."""
        s = self.stack.get(ref.index)
        if isinstance(s, tuple):
            return s[ref.elem] if ref.elem is not None else None if all(x is None for x in s) else _MIXED
        return s if ref.elem is None else None if s is None else _MIXED

    def _stack_edit(self, i: int, o: int, region: Rows, edited: torch.Tensor) -> None:
        """Add fork ``i``'s edited rows of op ``o`` to the stack (readers from here on see them)."""
        base = self.parent.value(o)
        s = self.stack.get(o)
        if s is None:
            self.stack[o] = Stack(base, region.axis, region.start, _cut(edited, region), (i,), region=region)
            return
        # other forks reached this op first: its stack must hold every row this edit changed
        # (the same rows or more along its axis; a whole value, from rows 0, holds anything)
        if not isinstance(s, Stack) or s.corner is not None \
                or not (s.start == 0 or s.axis == region.axis and s.start <= region.start):
            run = self.replayers[i]
            self.engine.decline(self.sweep, [run], f"op {self.ops[o].label}'s stack holds other rows than its edit "
                                                   "changed: it goes on alone")
            self.sweep.drop(run)
            return
        mine = edited.narrow(s.axis, s.start, s.block)
        forks = tuple(sorted((*s.forks, i)))
        s.rows = torch.cat([mine if f == i else s.rows_of(f) for f in forks], s.axis)
        s.forks = forks

    def _stacked_rule(self, op: Any, forks: tuple[int, ...]) -> tuple[Rows, torch.Tensor, str]:
        j, regions, stacked, later = op.index, {}, set(), []
        name = op.func_name
        swept = SweptWhole if name == ATTENTION else Swept
        stack, seen_value = self.stack, self.parent.seen_value

        def resolve(ref):
            s = stack.get(ref.index)
            if s is not None and (type(s) is not Stack or ref.elem is not None):
                s = self._stack_of(ref)
            if s is None:
                return seen_value(ref, j)
            rows = s.rows if s.forks == forks else s.aligned(forks)
            stacked.add(id(rows))
            patch = swept(s.base, s.axis, s.start, rows)
            regions[id(patch)] = s.region
            if s.start:
                later.append(s)
            return patch

        args, kwargs = build_args(op, resolve)
        shape = op.shape
        # forks' whole values (rows from 0): planned as rows, so an op that keeps their axis runs
        # once on all of them (a head's patch changes every later value whole)
        if later:
            plan = plan_op(op, args, kwargs, regions, shape)
        else:
            with rows_from_zero():
                plan = plan_op(op, args, kwargs, regions, shape)
        region = plan.region
        if name in SHAPED:
            return shaped(op, args, kwargs, plan, len(forks))
        if not isinstance(region, Rows) or not isinstance(shape, tuple):
            raise PerFork
        want = list(shape)
        want[region.axis] = (want[region.axis] - region.start) * len(forks)
        if op.func_name in ROW_VIEWS:
            x = args[0] if args else None
            # (one stacked argument in all: x, no other)
            if plan.kind != "full" or not isinstance(x, Swept) \
                    or len(regions) > 1 and any(isinstance(a, Swept) for a in (*args[1:], *kwargs.values())):
                raise PerFork
            if op.func_name in MEMORY_VIEWS:
                if math.prod(x.shape[: x.axis]) != math.prod(shape[: region.axis]):
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

            if n == 1 or stacked.issuperset(call.axes):  # (every argument cut to rows is stacked)
                rows = call.func(*call.args, **call.kwargs)
            else:
                def per_fork(v: Any) -> Any:
                    if isinstance(v, torch.Tensor):
                        axis = call.axes.get(id(v))
                        # an unchanged argument cut to the same rows: once per fork
                        return v if axis is None or id(v) in stacked else torch.cat([v] * n, axis)
                    if isinstance(v, (list, tuple)):
                        return type(v)(per_fork(x) for x in v)
                    return v

                rows = call.func(*(per_fork(a) for a in call.args),
                                 **{k: per_fork(v) for k, v in call.kwargs.items()})
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
        return plan_op(op, args, kwargs, regions), resolve

    def _scores(self, op: Any, forks: tuple[int, ...], stacks: list[Any]) -> tuple[Any, Any, str, bool] | None:
        """Eager attention's scores for every fork in one call, each fork one batch entry:
        ``q @ k.T`` of stacked rows, or an elementwise op (scale, mask) of scores kept whole;
        then each fork's block refined as replay alone does (None: this does not apply)."""
        if op.func_name != "matmul" and op.func_name not in ELEMENTWISE \
                or any(s.forks != forks for s in stacks):
            return None
        plan, _ = self._fork_plan(op, forks[0])  # every fork of the stacks changed the same rows
        base = self._base_of(op)
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

    def _per_fork(self, op: Any, forks: tuple[int, ...]) -> None:
        """Run ``op`` once per fork, each on its own rows, and stack what they give (as replay alone
        logs them); first declare the op to the next strategies when no rule bounds what a fork
        changed. Forks whose values changed in different regions go on alone from here."""
        plans = {i: self._fork_plan(op, i) for i in forks}
        for plan, _ in plans.values():
            if not (plan.kind == "skip" or plan.kind == "rows" and isinstance(plan.region, Rows)
                    or plan.kind == "full" and (plan.region is WHOLE or isinstance(plan.region, Corner)
                                                or _row_regions(plan.region))):
                runs = [self.replayers[i] for i in forks]
                self.sweep.release(runs)
                self.engine.hand_on(self.sweep, op, runs, "no rule bounds what a fork changed")
                return
        base = self._base_of(op)
        got: list[tuple[int, Any, Any]] = []  # (fork, region, its rows or whole value)
        kinds, corner, reason = set(), False, ""
        for i in forks:
            plan, resolve = plans[i]
            kinds.add(plan.kind)
            reason = reason or plan.reason
            if plan.kind == "skip":  # it reads only rows this fork did not change (e.g. the first token)
                got.append((i, None, None))
            elif plan.kind == "rows":
                got.append((i, plan.region, plan.call()))
            else:
                built = self._built(op, i, resolve)
                if built is None:  # that fork failed (restored, its error handed back): the others go on
                    continue
                if isinstance(plan.region, Corner):  # attention scores: did a causal mask restore the corner's block?
                    corner = True
                    refined = refine_corner(base, built, plan.region)
                    got.append((i, WHOLE_ROWS, built) if refined is WHOLE else (i, refined, built)
                               if isinstance(refined, Corner) else (i, refined, _cut(built, refined)))
                elif plan.region is WHOLE:  # the whole value changed: kept as all its rows along axis 0
                    if isinstance(built, torch.Tensor):
                        got.append((i, WHOLE_ROWS, built))
                    elif isinstance(built, (tuple, list)) and built \
                            and all(isinstance(b, torch.Tensor) and b.dim() for b in built):
                        # several outputs (an LSTM's output and states): all rows of each
                        got.append((i, tuple(WHOLE_ROWS for _ in built), tuple(built)))
                    else:  # no rows to stack it by: each fork keeps its value, the group goes on alone
                        got.append((i, WHOLE, built))
                elif several(plan.region):
                    got.append((i, plan.region, tuple(None if r is None else _cut(b, r)
                                                       for b, r in zip(built, plan.region))))
                else:
                    got.append((i, plan.region, _cut(built, plan.region)))
        if not got:
            return
        how = "fallback" if reason else "rows" if kinds == {"rows"} else "mapped"
        region = got[0][1]
        if region is WHOLE or any(r is WHOLE for _, r, _ in got):
            self._apart(op, got, how, not corner, "its new value has no rows to stack by (not tensors of rows)")
            return
        if any(r != region for _, r, _ in got):
            self._apart(op, got, how, not corner, "the forks changed different regions of it")
            return
        if region is None:
            return
        forks = tuple(i for i, _, _ in got)
        if several(region):
            rows = tuple(None if r is None else torch.cat([g[2][k] for g in got], r.axis) for k, r in enumerate(region))
        else:
            rows = torch.cat([g[2] for g in got], 0 if isinstance(region, Corner) else region.axis)
        how = "full" if region == WHOLE_ROWS and not reason else how
        self._keep(op, forks, region, rows, how, reason, not corner)  # (run apart: the log's note is the reason)

    def _built(self, op: Any, i: int, resolve: Any) -> Any:
        """Op ``op`` recomputed whole for fork ``i`` alone, on the recorded path (None: the fork
        failed, e.g. its edit changed a shape the op baked in; the engine restored it)."""
        run, out = self.replayers[i], []

        def work() -> None:
            value = reissue(op, *build_args(op, lambda r: as_built(resolve(r))))
            check_path(run, op, value)
            out.append(value)

        self.engine.each(run, work)
        if out and run in self.sweep.groups_of:
            return out[0]
        return None

    def _apart(self, op: Any, got: list[tuple[int, Any, Any]], how: str, logged: bool, why: str) -> None:
        """The forks' new values of ``op`` cannot be stacked (``why``: they changed different regions
        of it, ...): each keeps its own value, and the group goes on alone from here (declared in
        their replay records)."""
        j, base = op.index, self._base_of(op)
        runs = [self.replayers[i] for i, _, _ in got]
        for (_, region, value), run in zip(got, runs):
            size = None
            if region is None:
                continue
            if region is WHOLE or region == WHOLE_ROWS:
                run.store(j, value, WHOLE)
            elif isinstance(region, Corner):
                run.store(j, value, region)
            elif several(region):
                run.store(j, Outputs(tuple(b if r is None else RowPatch(b, r.axis, r.start, v)
                                           for b, r, v in zip(base, region, value))), region)
            else:
                run.store(j, RowPatch(base, region.axis, region.start, value), region)
                size = (region.axis, region.start, base.shape[region.axis]) if logged else None
            run.log.entries.append((op.label, op.func_name, _as_whole(how) if region is WHOLE or region == WHOLE_ROWS
                                    else how, size, ""))
        self.engine.decline(self.sweep, runs, f"op {op.label} ({op.func_name}): {why}; they go on alone")
        self.sweep.release(runs)

    def _keep(self, op: Any, forks: tuple[int, ...], region: Any, rows: Any, how: str, note: str,
              logged: bool = True, fits: bool = False) -> None:
        """Put the stacked rows of ``op`` in the stack and give each fork its own (``logged``: the
        replay log names the rows; ``fits``: a tensor of rows was checked against the op's shape)."""
        j = op.index
        base = self._base_of(op)
        live = self.engine.live
        if isinstance(region, Corner):  # each fork's whole value, as all its rows along axis 0
            s = self.stack[j] = _checked(Stack(base, 0, 0, rows, forks, region))
            for k, i in enumerate(forks):
                if self.replayers[i] in live:
                    self.replayers[i].store(j, rows.narrow(0, k * s.block, s.block), region)
                    self.replayers[i].log.entries.append((op.label, op.func_name, how, None, note))
            return
        if several(region):
            stacks = tuple(None if r is None else _checked(Stack(b, r.axis, r.start, x, forks))
                           for b, r, x in zip(base, region, rows))
            self.stack[j] = stacks
            parts = [None if s is None else s.rows.split(s.block, s.axis) for s in stacks]
            whole = all(r is not None and r.start == 0 for r in region)  # every output whole
            how = _as_whole(how) if whole else how
            for k, i in enumerate(forks):  # several outputs: built together when read
                if self.replayers[i] not in live:
                    continue
                value = Outputs(tuple(b if s is None else p[k] if whole else RowPatch(b, s.axis, s.start, p[k])
                                      for b, s, p in zip(base, stacks, parts)))
                self.replayers[i].store(j, value, WHOLE if whole else region)
                self.replayers[i].log.entries.append((op.label, op.func_name, how, None, note))
            return
        s = self.stack[j] = _checked(Stack(base, region.axis, region.start, rows, forks, region=region), fits)
        axis, start, m, rows = s.axis, region.start, s.block, s.rows
        whole = start == 0  # every row: each fork holds its whole value
        how = _as_whole(how) if whole else how
        entry = (op.label, op.func_name, how, None if whole or not logged else (axis, start, base.shape[axis]), note)
        replayers = self.replayers
        for k, i in enumerate(forks):
            replayer = replayers[i]
            if replayer not in live:
                continue
            if whole:
                replayer.store(j, rows.narrow(axis, k * m, m), WHOLE)
            else:
                replayer.store(j, BlockPatch(base, axis, start, rows, k * m), region)
            replayer.log.entries.append(entry)


def _row_regions(region: Any) -> bool:
    if several(region):
        return all(r is None or isinstance(r, Rows) for r in region) and any(r is not None for r in region)
    return isinstance(region, Rows)


def _as_whole(how: str) -> str:
    """How the log names a value recomputed whole, as replay alone names it (a fallback stays one)."""
    return how if how == "fallback" else "full"


def _cut(value: torch.Tensor, region: Rows) -> torch.Tensor:
    return value.narrow(region.axis, region.start, value.shape[region.axis] - region.start)


def _checked(s: Stack, fits: bool = False) -> Stack:
    """``s``, whose rows must be one block of the recorded shape per fork (else a stacked rule is wrong;
    ``fits``: the rows are a tensor of that shape, only their dtype is left to check)."""
    if fits and s.rows.dtype == s.base.dtype:
        return s
    want = list(s.base.shape)
    want[s.axis] = s.block * len(s.forks)
    if not isinstance(s.rows, torch.Tensor) or list(s.rows.shape) != want or s.rows.dtype != s.base.dtype:
        raise RuntimeError(f"a sweep rule built rows of shape {getattr(s.rows, 'shape', None)}, not {want}: "
                           "a bug in torchlens.edit._sweep_group")
    return s
