"""Replaying edits on forks: the entry points of the replay engine (``edit/_engine``).

:func:`replay_step` pushes one edit down one fork, :func:`replay_forks` one edit per fork for
several forks of one trace in one walk, :func:`replay_many` several edits per fork (``Trace.forks``,
``with trace.sweep()``). Each builds the strategy chain the engine offers every op: only what a
metric reads, stacked fresh forks, batched rows across forks, one fork's rows, the whole value.
A fork whose edit changes a guard comes back with its ``GuardChangedError``: re-executing the real
forward (``replay=``) is decided here, and recorded in the fork's replay record.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch

from ..core.inputs import input_tensors, replace_input, split_inputs
from ..core.records import INPUT, ModuleCall, Op
from ..core.steps import REPLAY_MODES, Step
from ..core.sweeping import check_batch_size
from ..core.tree import clone_value, tensor_leaves
from ..errors import (
    EmptySelectionError,
    GuardChangedError,
    InvalidArgumentError,
    ReplayFellBack,
    ReplayNotExactError,
    ValueNotSavedError,
)
from ._batch import RowBatch
from ._engine import Engine, Strategy
from ._execute import REEXECUTE
from ._fallbacks import declare
from ._regions import ReplayLog
from ._replay_run import Target
from ._strategies import ChangedRows, PartialRead, WholeValue
from ._sweep import Sweep
from .edits import AppliedEdit, EditContext, apply_edit, count_changed, land_edit

__all__ = ["REPLAY_MODES", "check_against_forward", "replay_forks", "replay_many", "replay_step",
           "unsaved_for_replay"]


def replay_step(fork, step: Step, *, model=None, inputs=None, check: bool = False, rerun=None,
                replay: str = "auto", sliced: bool = True):
    """Apply a (bound) replay step on ``fork``: push it down the recorded graph, or, with
    ``model`` and ``inputs``, re-execute the real forward through ``rerun`` (a capture function
    ``(model, args, kwargs, steps) -> Trace``) with the fork's whole recipe.

    When the edit changes a guard (a value the forward branched on, see ``torchlens.edit._guards``),
    ``replay`` decides: ``"strict"`` raises, ``"fallback"`` re-executes the real forward with the
    fork's recipe (the trace must hold its model), ``"auto"`` falls back when the model is there.
    A fallback warns (``ReplayFellBack``), says so on the fork's applied edits (``how``) and in the
    replay record (``edits[-1].replay.decisions``). On any error the fork is left exactly as it was.

    With ``sliced`` (the default) each op downstream recomputes only the rows the edit can reach
    (``torchlens.edit._slicing``); the applied edit's ``replay`` log lists what was recomputed,
    and every op replayed whole because no rule could bound it, with the reason.

    Raises:
        InvalidArgumentError: only one of ``model``/``inputs`` given, or an unknown ``replay``.
        GuardChangedError: a guard changed and no fallback was allowed or possible.
        ReplayNotExactError: the recorded graph cannot reproduce the edit exactly.
        EmptySelectionError: the site matches nothing in the trace.
    """
    if replay not in REPLAY_MODES:
        raise InvalidArgumentError(f"replay= is one of {REPLAY_MODES}, got {replay!r}")
    if (model is None) != (inputs is None):
        raise InvalidArgumentError(
            "do(..., model=, inputs=) needs both the model and its inputs to re-execute",
            remedy="Pass both model= and inputs=, or neither to replay the recorded graph.",
        )
    if model is not None:
        args, kwargs = split_inputs(inputs, model=model, tokenizer=fork.tokenizer)  # text: the fork's tokenizer
        _reexecute(fork, step, model, args, kwargs, rerun, "re-executed (model= and inputs= given)")
        return fork
    got = replay_forks([fork], [step], sliced=sliced, one_pass=False)[0]
    if isinstance(got, GuardChangedError):
        _guard_changed(fork, step, got, rerun, replay)  # re-executes, or raises
    elif isinstance(got, ValueNotSavedError):
        raise unsaved_for_replay(fork, step, got) from None
    elif isinstance(got, BaseException):
        raise got  # the fork is as it was
    if check:
        check_against_forward(fork)
    return fork


def _guard_changed(fork, step: Step, exc: GuardChangedError, rerun, replay: str) -> None:
    """The re-execution strategy: ``step``'s edit changed a guard on ``fork`` (restored), so the real
    forward runs with the fork's recipe, where ``replay`` allows it; the replay record says why."""
    if replay == "strict" or (replay == "auto" and fork.model is None):
        raise exc
    if fork.model is None:
        raise GuardChangedError(
            f"{exc.message}; replay='fallback' needs the model, and this trace holds none (it was loaded "
            "from disk)", remedy=REEXECUTE, **exc.fields) from exc
    decision = declare("replay", f"the edit changes a guard: {exc.message}")
    reason = f"re-executed: {exc.message}"
    _reexecute(fork, step, fork.model, fork.args, fork.kwargs, rerun, reason)
    if fork.edits:
        log = fork.edits[-1].replay = ReplayLog(sliced=False)
        log.decisions.append(decision)
        log.chosen["re-execution"] = 1
    warnings.warn(f"fork {fork.name!r}: {reason}", ReplayFellBack, stacklevel=4)


def replay_forks(forks: Sequence[Any], steps: Sequence[Step], *, read: Any = None, one_pass: bool = True,
                 sliced: bool = True) -> list[Any]:
    """Push ``steps[i]`` (a bound replay step) down ``forks[i]``, every fork of the same trace, in
    one walk of the recorded graph (``edit/_engine``).

    The engine offers each op, in order, to: only what ``read`` names (``read``, an ``OutputRead``
    of ``torchlens.edit.reads``); fresh forks whose edits change the same rows stacked, each op run
    once on all of them (``one_pass``, ``edit/_sweep``); each fork's rows batched with the other
    forks' (``edit/_batch``); one fork's changed rows (``sliced``); its whole value.

    A fork whose replay raises is restored to what it was and its error returned in its place;
    the others go on.

    Returns:
        per fork, its :class:`~torchlens.edit._replay_run.Replayer` (the fork now holds the edit), or
        the exception its replay raised (the fork is as it was).

    Raises:
        EmptySelectionError: a step's site matches nothing (raised before any fork changes).
    """
    targets = []
    for fork, step in zip(forks, steps):
        fork.require_op_graph("replaying an edit")
        records = step.site.match(fork)
        if not records:
            raise EmptySelectionError(f"{step.site.describe()} matches nothing in this trace",
                                      site=step.site.describe())
        targets.append([Target(r) for r in records])
    by_records: dict[int, list[int]] = {}  # forks of one trace share its records (an engine walks one graph)
    for i, fork in enumerate(forks):
        by_records.setdefault(id(fork.ops), []).append(i)
    got: list[Any] = [None] * len(forks)
    for members in by_records.values():
        engine = Engine([forks[i] for i in members], [steps[i] for i in members], [targets[i] for i in members],
                        sliced=sliced, read=read)
        for i, outcome in zip(members, engine.run(lambda e: _chain(e, read, one_pass))):
            got[i] = outcome
    return got


def _chain(engine: Engine, read: Any, one_pass: bool) -> list[Strategy]:
    """The strategies the engine offers each op, fastest first (``docs/replay-engine.md``)."""
    rows = ChangedRows(engine)
    chain: list[Strategy] = [] if read is None else [PartialRead(engine, read)]
    sweep = Sweep.begin(engine, read) if one_pass else None  # lands every fork's edit and groups them
    if sweep is not None:
        chain.append(sweep)
    if len(engine.runs) > 1:
        chain.append(RowBatch(engine, rows))
    return [*chain, rows, WholeValue(engine)]


def replay_many(forks: Sequence[Any], steps: Sequence[Sequence[Step]], *, rerun: Any, replay: str = "auto",
                check: bool = False, batch_size: int | None = None, collect_errors: bool = False) -> list[Any]:
    """Replay ``steps[i]`` (bound replay steps, in order) on ``forks[i]`` (fresh forks of one
    trace), ``batch_size`` forks at a time in one walk (:func:`replay_forks`: the first step of
    every fork together, then the second of those that have one ...). A fork whose edit changes
    a guard is handled alone, as ``fork.do(..., replay=replay)`` would (``rerun`` re-executes
    for a fallback).

    With ``collect_errors`` a fork's error does not stop the others: that fork is left as it was
    before its failing step (its later steps are not applied) and the error is returned in its place.

    Returns:
        the forks, each holding its edits; with ``collect_errors``, per fork the error its replay
        met (None: every step applied).

    Raises:
        InvalidArgumentError: an unknown ``replay`` or a ``batch_size`` below 1.
        GuardChangedError: a guard changed and no fallback was allowed or possible.
        ReplayNotExactError: the recorded graph cannot reproduce an edit exactly.
        EmptySelectionError: a site matches nothing in the trace.
    """
    if replay not in REPLAY_MODES:
        raise InvalidArgumentError(f"replay= is one of {REPLAY_MODES}, got {replay!r}")
    check_batch_size(batch_size)
    size = batch_size or max(1, len(forks))
    errors: list[BaseException | None] = [None] * len(forks)
    for k in range(0, len(forks), size):
        chunk = range(k, min(k + size, len(forks)))
        for r in range(max((len(steps[i]) for i in chunk), default=0)):
            now = [i for i in chunk if len(steps[i]) > r and errors[i] is None]
            # fresh forks stack their rows (the sweep strategy); forks holding edits batch theirs
            pushed = replay_forks([forks[i] for i in now], [steps[i][r] for i in now], one_pass=r == 0)
            for i, got in zip(now, pushed):
                err = _outcome(forks[i], steps[i][r], got, rerun, replay)
                if err is not None:
                    if not collect_errors:
                        raise err
                    errors[i] = err
        if check:
            for i in chunk:
                if errors[i] is None:
                    check_against_forward(forks[i])
    return errors if collect_errors else list(forks)


def _outcome(fork: Any, step: Step, got: Any, rerun: Any, replay: str) -> BaseException | None:
    """The error pushing ``step`` down ``fork`` ended with (``got``: what :func:`replay_forks` gave
    it; None: none). A changed guard met in a walk with other forks (which of them met it may not be
    known) is replayed alone, as ``fork.do(..., replay=replay)`` would: re-executed or refused."""
    if isinstance(got, GuardChangedError):
        try:
            replay_step(fork, step, rerun=rerun, replay=replay)
        except Exception as exc:  # noqa: BLE001 - handed back as that fork's error (collect_errors)
            return exc
        return None
    if isinstance(got, ValueNotSavedError):
        return unsaved_for_replay(fork, step, got)
    return got if isinstance(got, BaseException) else None


def unsaved_for_replay(fork, step: Step, first: ValueNotSavedError) -> ValueNotSavedError:
    """The error for a replay that met an op whose value ``save=`` did not keep (``first``): every op
    pushing ``step`` down ``fork`` reads and this trace lacks, at once, and re-execution as the remedy."""
    ops = fork.ops
    need: set[int] = set()
    changed: set[int] = set()
    start = len(ops)
    for record in step.site.match(fork):
        target = Target(record)
        start = min(start, target.position)
        edited = [r.index for r in record.out_refs if r is not None] if isinstance(record, ModuleCall) \
            else [record.index]
        need.update(edited)  # the edit receives the value it replaces
        changed.update(edited)
    for op in ops[start:]:  # each op the edit reaches reads its other arguments as recorded
        if not op.flags & INPUT and any(r.index in changed for r in op.parent_refs):
            changed.add(op.index)
            need.update(r.index for r in op.parent_refs if r.index not in changed)
    for read in fork.data_reads:  # a guard the edit reaches is recomputed from all it reads
        if read.position >= start and any(r.index in changed for r in read.refs):
            need.update(r.index for r in read.refs if r.index not in changed)
    missing = [ops[i].label for i in sorted(need) if not fork.has_value(i)]
    site = getattr(first, "site", None)
    if isinstance(site, str) and site not in missing:  # a read the walk above did not foresee
        missing.append(site)
    shown = ", ".join(repr(m) for m in missing[:12]) + (f" and {len(missing) - 12} more" if len(missing) > 12 else "")
    return ValueNotSavedError(
        f"replaying {step.site.describe()} needs the values of {len(missing)} op(s) this trace did not keep "
        f"(save= left them out): {shown}",
        site=step.site.describe(), missing=missing,
        remedy="Re-execute the real forward instead, which needs no kept value: fork.do(site, edit, model=model, "
               "inputs=x). Or capture again keeping them: add the labels in this error's .missing to save= (a list of "
               "labels is a selector), or save=None to keep every value.",
    )


def _reexecute(fork, step: Step, model, args: tuple, kwargs: dict, rerun, how: str) -> None:
    """Make ``fork`` a real re-executed capture of its recipe plus ``step`` (recorded as ``how``)."""
    recipe = [*fork.recipe, step]
    steps, landed = [], _Landed(fork.changes.strict)
    for s in [*fork.steps, *recipe]:
        edited = _edit_inputs(fork, s, args, kwargs, landed)
        if edited is None:
            steps.append(s.for_capture())
        else:
            args, kwargs = edited
    fresh = rerun(model, args, kwargs, steps)
    fork.adopt(fresh, recipe)
    for applied in landed.edits:  # (the input's edits, landed before the forward ran)
        fork.changes.record_edit(applied)
    for applied in fork.edits:
        applied.how = how


class _Landed:
    """Where the input's edits land before a re-executed forward (``land_edit``'s target): kept
    for the fork once the forward ran, refused first on a strict trace when one changes nothing."""

    def __init__(self, strict: bool) -> None:
        self.strict = strict
        self.edits: list[AppliedEdit] = []

    def record_edit(self, applied: AppliedEdit) -> None:
        self.edits.append(applied)


def _edit_inputs(fork, step: Step, args: tuple, kwargs: dict, landed: _Landed) -> tuple[tuple, dict] | None:
    """A step at the model's own input (``blocks.0.resid_pre`` where no module produces the first
    block's input), which no capture can edit, applied to the inputs the forward is given instead:
    every reader of the input then sees it, as on the fork. None: ``step`` is a capture's to apply."""
    if step.site.capture_refusal() is None:
        return None
    records = step.site.match(fork)
    given = dict(input_tensors(args, kwargs))
    if not records or not all(isinstance(r, Op) and r.flags & INPUT and r.label in given for r in records):
        return None  # (the capture refuses it, saying why)
    for op in records:
        value = given[op.label]
        ctx = EditContext(step.site.describe(), op.label, op.module, op.module_pass, op, fork)
        new = apply_edit(clone_value(value), step.edit, ctx)
        land_edit(landed, step.edit, AppliedEdit(step.site.describe(), op.label, None, count_changed(value, new),
                                                 before=value))
        args, kwargs = replace_input(args, kwargs, op.label, new)
    return args, kwargs


def check_against_forward(fork) -> None:
    """Re-execute ``fork``'s recipe on its model; raise ``ReplayNotExactError`` if the output differs."""
    real = fork.run(fork.model)
    got = tensor_leaves(fork.output)
    want = tensor_leaves(real.output)
    for a, b in zip(got, want):
        if a.shape != b.shape or not torch.allclose(a, b, atol=1e-5, rtol=1e-4):
            err = (a - b).abs().max().item() if a.shape == b.shape else float("inf")
            raise ReplayNotExactError(
                f"replayed output differs from re-execution (max abs error {err:.3g})",
                remedy=REEXECUTE,
            )
