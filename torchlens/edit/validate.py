"""``tl.validate``: replay the whole recorded graph from the inputs and compare every op.

A capture is only useful if the recorded graph describes the run. Validation re-issues
every op from its recorded arguments (starting from the recorded inputs), compares each
result with the recorded value, re-runs the real forward to compare the final output,
and reports branches whose condition was read from an activation the model computed.
An op that is not re-issued is never counted as agreeing: it is listed in
``report.unchecked`` with its reason, and unless it is not re-issued by design (an input,
uninitialised memory) the report is "not fully checked".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from .._progress import track
from ..core.actions import provide_methods
from ..core.records import EDIT, GUARD, INPLACE, INPUT, NOT_REPLAYABLE, RANDOM, RANDOM_NAMES, Op, Ref, build_args
from ..core.repr_html import repr_html
from ..core.trace import Trace
from ..core.tree import tensor_leaves
from ..errors import GuardChangedError, InvalidArgumentError, ReplayError, ValueNotSavedError
from ._execute import SHARED_TARGETS, UNINITIALISED, execute
from ._guards import recompute_read, same_value, short

__all__ = ["BY_DESIGN", "Divergence", "Unchecked", "ValidateMethod", "ValidationReport", "validate"]

# Kinds of ``Unchecked`` ops that are not re-issued by design; any other kind means "not fully checked".
BY_DESIGN = frozenset({"input", "uninitialised"})
_LISTED = 10  # not-checked ops the summary names before "... and N more"


@dataclass
class Divergence:
    label: str
    func_name: str
    max_abs_error: float
    source: str

    def __str__(self) -> str:
        return f"{self.label} ({self.func_name}) max abs error {self.max_abs_error:.3g} at {self.source}"


class Unchecked(NamedTuple):
    """An op validation did not re-issue and compare, and why.

    ``kind`` is one of: ``"input"`` and ``"uninitialised"`` (not re-issued by design: the
    replay starts from an input; ``torch.empty``'s memory is arbitrary, so replay keeps the
    recorded contents), ``"random"`` (the model draws random numbers: a replay would draw
    new ones), ``"unresolved"`` (a loaded op whose function is not on the allow-list),
    ``"edit not saved"``, ``"not replayable"`` (arguments the save could not store),
    ``"not saved"``, ``"meta"``, ``"failed"`` (re-issuing raised; also in ``errors``) and ``"written
    through a view"`` (it reads memory an in-place op wrote through another view in a way replay
    cannot lay out again; writes replay can lay out again are replayed and checked like any op).
    """

    label: str
    kind: str
    reason: str

    @property
    def by_design(self) -> bool:
        return self.kind in BY_DESIGN


@dataclass
class ValidationReport:
    """Per-op agreement of a replay with the recorded run, and of the output with a real forward.

    Every op is either re-issued and compared (``n_checked`` of them) or listed in ``unchecked``
    with its reason. ``ok`` means the capture is exact and fully checked: every op that can be
    re-issued was, and it and the output reproduce. ``fully_checked`` is False when some op that
    is not re-issued by design (inputs, uninitialised memory) was not re-issued either: a random
    op, a function a loaded trace could not resolve, an edit that was not saved; ``agrees`` is
    False when something re-issued disagreed. ``status`` says which: ``"OK"``, ``"NOT FULLY
    CHECKED"`` or ``"NOT OK"``. ``guards`` lists the values the forward branched on (``bool``/
    ``.item()`` reads, router indices); they are notes, not failures: replay re-checks them and
    refuses or re-executes when an edit changes one.
    """

    n_ops: int
    n_checked: int
    divergences: list[Divergence] = field(default_factory=list)
    unstable: list[str] = field(default_factory=list)
    guards: list[str] = field(default_factory=list)  # values the forward branched on; replay re-checks them
    output_max_abs_error: float | None = None
    errors: list[str] = field(default_factory=list)
    atol: float = 1e-5
    unchecked: list[Unchecked] = field(default_factory=list)
    output_not_compared: str | None = None  # why the output was not compared with a real forward, if asked to be

    @property
    def agrees(self) -> bool:
        """Nothing that was re-issued disagreed (no divergence, unstable read, error or output mismatch)."""
        out_ok = self.output_max_abs_error is None or self.output_max_abs_error <= self.atol
        return not self.divergences and not self.unstable and not self.errors and out_ok

    @property
    def fully_checked(self) -> bool:
        """Every op that is not left out by design was re-issued and compared."""
        return all(u.by_design for u in self.unchecked)

    @property
    def ok(self) -> bool:
        """The capture is exact and fully checked (``status == "OK"``)."""
        return self.agrees and self.fully_checked

    @property
    def status(self) -> str:
        """``"OK"``, ``"NOT FULLY CHECKED"`` (nothing disagreed, some op was not re-issued) or ``"NOT OK"``."""
        return "NOT OK" if not self.agrees else "NOT FULLY CHECKED" if not self.fully_checked else "OK"

    @property
    def first_divergence(self) -> Divergence | None:
        return self.divergences[0] if self.divergences else None

    def summary(self) -> str:
        counts: dict[str, int] = {}
        for u in self.unchecked:
            counts[u.kind] = counts.get(u.kind, 0) + 1
        left = "; ".join(f"{n} {kind}" for kind, n in counts.items())
        lines = [f"validate: {self.status} — {self.n_checked}/{self.n_ops} ops replayed"
                 + (f" (not replayed: {left})" if left else "")]
        if self.output_max_abs_error is not None:
            lines.append(f"  final output vs real forward: max abs error {self.output_max_abs_error:.3g}")
        if self.output_not_compared:
            lines.append(f"  final output not compared with a real forward: {self.output_not_compared}")
        if self.divergences:
            lines.append(f"  {len(self.divergences)} op(s) diverge; first: {self.divergences[0]}")
        missing = [u for u in self.unchecked if not u.by_design and u.kind not in _AS_ERRORS]
        if missing:
            lines.append(f"  {len(missing)} op(s) that replay would re-issue were not checked:")
            lines += [f"    {u.label}: {u.reason}" for u in missing[:_LISTED]]
            if len(missing) > _LISTED:
                lines.append(f"    ... and {len(missing) - _LISTED} more (report.unchecked)")
        if self.guards:
            lines.append(f"  {len(self.guards)} guard(s) (values the forward branched on) reproduced; "
                         "an edit that changes one makes fork.do re-execute or refuse")
        for u in self.unstable:
            lines.append(f"  unstable: {u}")
        for e in self.errors:
            lines.append(f"  error: {e}")
        return "\n".join(lines)

    __str__ = summary

    def _repr_html_(self) -> str:
        return repr_html(self)  # rendered by torchlens.analysis.notebook


_AS_ERRORS = frozenset({"not saved", "meta", "failed"})  # unchecked kinds the report also lists as errors


def _max_err(a: Any, b: Any) -> float:
    la, lb = tensor_leaves(a), tensor_leaves(b)
    if len(la) != len(lb):
        return float("inf")
    worst = 0.0
    for x, y in zip(la, lb):
        if x.shape != y.shape:
            return float("inf")
        if x.numel() == 0:
            continue
        if x.dtype == torch.bool or not x.is_floating_point():
            worst = max(worst, float((x != y).any()) * float("inf") if (x != y).any() else 0.0)
        else:
            d = (x.double() - y.double()).abs()
            d = torch.nan_to_num(d, nan=float("inf")) if not (x.isnan() == y.isnan()).all() else \
                torch.nan_to_num(d, nan=0.0)
            worst = max(worst, float(d.max()))
    return worst


def validate(trace, *, atol: float = 1e-5, rerun: bool = True, progress: bool | None = None) -> ValidationReport:
    """Replay ``trace`` from its inputs and report per-op agreement.

    Args:
        atol: largest absolute difference that still counts as agreement.
        rerun: also run the real forward again and compare the final output.
        progress: a progress bar over the ops (None: when stderr is a terminal and the
            replay takes more than a second; False: never).

    Returns:
        a ValidationReport: ``.ok`` (every op that can be re-issued was, and everything agrees),
        ``.status`` ("OK", "NOT FULLY CHECKED" or "NOT OK"), ``.unchecked`` (each op not
        re-issued, with its kind and reason), ``.first_divergence``, ``.summary()``.
    """
    with torch.set_grad_enabled(getattr(trace, "grad", False)):
        return _validate(trace, atol=atol, rerun=rerun, progress=progress)


def _validate(trace, *, atol: float, rerun: bool, progress: bool | None = None) -> ValidationReport:
    if not isinstance(trace, Trace):
        raise InvalidArgumentError(f"validate() takes a Trace from tl.trace, got {type(trace).__name__}")
    if not trace.has_op_graph:
        raise InvalidArgumentError(
            "this trace was captured without an op graph (module outputs only), so there is nothing to replay",
            remedy="Capture with tl.trace(model, x) and no backend='hooks' (and no module-only save= with "
                   "intervene=), so every op is recorded.",
        )
    trace.ensure_graph()
    values: dict[int, Any] = {}
    report = ValidationReport(len(trace.ops), 0, atol=atol)
    stopped: str | None = None  # why the rest of the ops cannot be checked (an op's value was not saved)
    for op in track(trace.ops, desc="validate", unit="op", progress=progress):
        j = op.index
        if stopped is not None:
            report.unchecked.append(Unchecked(op.label, "not saved", stopped))
            continue
        if op.flags & INPUT:
            values[j] = op.out
            report.unchecked.append(Unchecked(op.label, "input", "a forward input: the replay starts from it"))
            continue
        if not op.saved:
            report.errors.append(f"{op.label} was not saved; capture without save= to validate")
            stopped = f"validation stopped at {op.label}, whose value was not saved"
            report.unchecked.append(Unchecked(op.label, "not saved", stopped))
            continue
        left_out = _not_reissued(op) or _unreplayable_read(trace, op)
        if left_out is not None:
            values[j] = op.out  # what replay would read downstream: the rest of the graph is still checked
            report.unchecked.append(Unchecked(op.label, *left_out))
            continue
        missing: list[Ref] = []
        try:
            args, kwargs = build_args(op, _resolver(trace, values, missing, j))
            if missing:
                values[j] = op.out
                report.unstable.append(_lost_element(trace, op.label, op.source, missing[0]))
                report.unchecked.append(Unchecked(op.label, "failed", report.unstable[-1]))
                continue
            new = execute(op, args, kwargs)
        except ReplayError as exc:
            report.errors.append(str(exc).splitlines()[0])
            report.unchecked.append(Unchecked(op.label, "failed", report.errors[-1]))
            values[j] = op.out
            continue
        values[j] = new
        if any(t.is_meta for t in tensor_leaves((new, op.out))):
            # A meta tensor has no data to compare (a dispatcher evicted it): say so, never crash on it.
            report.errors.append(f"{op.label} ({op.func_name}) at {op.source} holds a meta tensor: no data to "
                                 "compare; capture the dispatched model with tl.trace so its weights are onloaded")
            report.unchecked.append(Unchecked(op.label, "meta", report.errors[-1]))
            continue
        report.n_checked += 1
        err = _max_err(new, op.out)
        if err > atol:
            report.divergences.append(Divergence(op.label, op.func_name, err, op.source))
    _check_guards(trace, values, report)
    if rerun and trace.model is not None and trace.complete:
        random = [u.label for u in report.unchecked if u.kind == "random"]
        if random:
            # A real forward draws new random numbers: comparing its output would report the RNG, not the capture.
            report.output_not_compared = (f"the model draws random numbers ({', '.join(random[:3])}"
                                          + (", ..." if len(random) > 3 else "") + "), so a new forward differs")
        else:
            with torch.no_grad():  # a capture-time edit is part of the run: the real forward applies it too
                real = trace.run().output if trace.steps else trace.model(*trace.args, **trace.kwargs)
            got, want = tensor_leaves(trace.output), tensor_leaves(real)
            if any(t.is_meta for t in got + want):
                report.errors.append("the model output holds a meta tensor: no data to compare")
            else:
                report.output_max_abs_error = _max_err(got, want)
    return report


def _not_reissued(op: Op) -> tuple[str, str] | None:
    """``(kind, reason)`` when validation does not re-issue ``op`` (see :class:`Unchecked`), else None."""
    where = f"{op.func_name} at {op.source}"
    if op.flags & RANDOM:
        if op.func_name in RANDOM_NAMES:
            return "random", (f"{where} draws random numbers (the model's own randomness): a replay would draw "
                              "new ones, so fork.do refuses through it")
        return "random", (f"{where} draws random numbers: dropout left on by training mode (call model.eval() "
                          "before capturing)")
    refusal = getattr(op.func, "refusal", None)  # a loaded op's stand-in says why it cannot be called
    if refusal is not None:
        return ("edit not saved" if op.flags & EDIT else "unresolved"), f"{where}: {refusal}"
    if op.flags & NOT_REPLAYABLE and op.flags & INPLACE:
        return "not replayable", f"{where} {SHARED_TARGETS}"
    if op.flags & NOT_REPLAYABLE or op.func is None:
        return "not replayable", f"{where}: its recorded arguments hold a value the save could not store"
    if op.func_name in UNINITIALISED:
        return "uninitialised", f"{where} allocates uninitialised memory: replay keeps the recorded contents"
    return None


def _unreplayable_read(trace: Trace, op: Op) -> tuple[str, str] | None:
    """``("written through a view", reason)`` when ``op`` reads memory an in-place op wrote through
    another view in a way replay cannot lay out again (``Trace.unreplayable_write``), else None."""
    for r in op.parent_refs:
        stale = trace.stale_after(r.index)
        write = trace.unreplayable_write(r.index) if stale is not None and op.index > stale else None
        if write is not None:
            return "written through a view", (
                f"{op.func_name} at {op.source} reads {trace.ops[r.index].label} after {write.label} "
                f"({write.func_name} at {write.source}) wrote into its memory through a view replay cannot lay out "
                "again (the view reinterprets the dtype, the memory may have moved, or the trace was loaded from "
                "disk, which keeps no write layout)")
    return None


def _resolver(trace: Trace, values: dict[int, Any], missing: list[Ref], position: int) -> Any:
    """Look up a reference in the replayed ``values`` as the op at ``position`` reads it (with the
    writes made through other views of its memory before then, replayed too); an element the
    replayed value no longer has (a tuple that came out shorter) is noted in ``missing`` and read
    from the record instead."""

    def replayed(index: int) -> Any:
        return values[index] if index in values else trace.ops[index].out

    def resolve(ref: Ref) -> Any:
        v = replayed(ref.index)
        if ref.elem is not None:
            if isinstance(v, (tuple, list)) and ref.elem < len(v):
                v = v[ref.elem]
            else:
                missing.append(ref)
                v = trace.ops[ref.index].out[ref.elem]
        return trace.with_writes(v, ref, position, replayed)

    return resolve


def _lost_element(trace: Trace, label: str, source: str, ref: Ref) -> str:
    parent = trace.ops[ref.index]
    return (f"{label} at {source} reads element {ref.elem} of {parent.label} ({parent.func_name}), which the "
            "replay no longer produces: the path depends on values that changed")


def _check_guards(trace, values: dict[int, Any], report: ValidationReport) -> None:
    """Recompute every guard (data read) from the replayed values: held guards are notes; a
    guard the replay does not reproduce is a real disagreement."""
    for read in trace.data_reads:
        if read.func is None:
            report.guards.append(f"{read.name}() at {read.source} (value not recorded: replay cannot cross it)")
            continue
        missing: list[Ref] = []
        try:
            new = recompute_read(read, _resolver(trace, values, missing, read.position))
        except GuardChangedError as exc:
            report.unstable.append(exc.message)
            continue
        except ValueNotSavedError:
            report.guards.append(f"{read.name}() at {read.source} (its input was not saved)")
            continue
        if missing:
            report.unstable.append(_lost_element(trace, f"guard {read.name}()", read.source, missing[0]))
        elif same_value(new, read.seen):
            report.guards.append(f"{read.name}() at {read.source} saw {short(read.seen)}")
        else:
            report.unstable.append(f"guard {read.name}() at {read.source}: the forward saw {short(read.seen)}, "
                                   f"the replay computes {short(new)}")
    for op in trace.ops:
        if op.flags & GUARD:
            report.guards.append(f"{op.func_name} indices of {op.label} at {op.source}")


@provide_methods(Trace)
class ValidateMethod:
    """``Trace.validate``, provided by ``edit/`` (see ``torchlens.core.actions``)."""

    def validate(self: Trace, *, atol: float = 1e-5, rerun: bool = True,
                 progress: bool | None = None) -> ValidationReport:
        """``tl.validate(self, ...)``: replay every op from its recorded inputs and compare (see :func:`validate`)."""
        return validate(self, atol=atol, rerun=rerun, progress=progress)
