"""``tl.validate``: replay the whole recorded graph from the inputs and compare every op.

A capture is only useful if the recorded graph describes the run. Validation re-executes
every op from its recorded arguments (starting from the recorded inputs), compares each
result with the recorded value, re-runs the real forward to compare the final output,
and reports branches whose condition was read from an activation the model computed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .._progress import track
from ..analysis.notebook import validation_html
from ..core.records import GUARD, INPUT, build_args
from ..core.trace import Trace
from ..core.tree import tensor_leaves
from ..errors import GuardChangedError, InvalidArgumentError, ReplayError, ValueNotSavedError
from ._execute import execute
from ._guards import recompute_read, same_value, short

__all__ = ["Divergence", "ValidationReport", "validate"]


@dataclass
class Divergence:
    label: str
    func_name: str
    max_abs_error: float
    source: str

    def __str__(self) -> str:
        return f"{self.label} ({self.func_name}) max abs error {self.max_abs_error:.3g} at {self.source}"


@dataclass
class ValidationReport:
    """Per-op agreement of a replay with the recorded run, and of the output with a real forward.

    ``ok`` means the capture is exact: every op and the output reproduce. ``guards`` lists the
    values the forward branched on (``bool``/``.item()`` reads, router indices); they are notes, not
    failures: replay re-checks them and refuses or re-executes when an edit changes one.
    """

    n_ops: int
    n_checked: int
    divergences: list[Divergence] = field(default_factory=list)
    unstable: list[str] = field(default_factory=list)
    guards: list[str] = field(default_factory=list)  # values the forward branched on; replay re-checks them
    output_max_abs_error: float | None = None
    errors: list[str] = field(default_factory=list)
    atol: float = 1e-5

    @property
    def ok(self) -> bool:
        out_ok = self.output_max_abs_error is None or self.output_max_abs_error <= self.atol
        return not self.divergences and not self.unstable and not self.errors and out_ok

    @property
    def first_divergence(self) -> Divergence | None:
        return self.divergences[0] if self.divergences else None

    def summary(self) -> str:
        lines = [f"validate: {'OK' if self.ok else 'NOT OK'} — {self.n_checked}/{self.n_ops} ops replayed"]
        if self.output_max_abs_error is not None:
            lines.append(f"  final output vs real forward: max abs error {self.output_max_abs_error:.3g}")
        if self.divergences:
            lines.append(f"  {len(self.divergences)} op(s) diverge; first: {self.divergences[0]}")
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
        return validation_html(self)


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
        a ValidationReport (``.ok``, ``.first_divergence``, ``.summary()``).
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
    for op in track(trace.ops, desc="validate", unit="op", progress=progress):
        if op.flags & INPUT:
            values[op.index] = op.out
            continue
        if not op.saved:
            report.errors.append(f"{op.label} was not saved; capture without save= to validate")
            break
        j = op.index

        def resolve(ref, j=j):
            v = values[ref.index] if ref.index in values else trace.ops[ref.index].out
            return v if ref.elem is None else v[ref.elem]

        try:
            args, kwargs = build_args(op, resolve)
            new = execute(op, args, kwargs) if op.func is not None else op.out
        except ReplayError as exc:
            report.errors.append(str(exc).splitlines()[0])
            values[j] = op.out
            continue
        values[j] = new
        if any(t.is_meta for t in tensor_leaves((new, op.out))):
            # A meta tensor has no data to compare (a dispatcher evicted it): say so, never crash on it.
            report.errors.append(f"{op.label} ({op.func_name}) at {op.source} holds a meta tensor: no data to "
                                 "compare; capture the dispatched model with tl.trace so its weights are onloaded")
            continue
        report.n_checked += 1
        err = _max_err(new, op.out)
        if err > atol:
            report.divergences.append(Divergence(op.label, op.func_name, err, op.source))
        for r in op.parent_refs:
            stale = trace.stale_after(r.index)
            if stale is not None and j > stale:
                report.unstable.append(
                    f"{op.label} at {op.source} reads {trace.ops[r.index].label} after an in-place op changed "
                    "memory it views"
                )
                break
    _check_guards(trace, values, report)
    if rerun and trace.model is not None and trace.complete:
        with torch.no_grad():
            real = trace.model(*trace.args, **trace.kwargs)
        got, want = tensor_leaves(trace.output), tensor_leaves(real)
        if any(t.is_meta for t in got + want):
            report.errors.append("the model output holds a meta tensor: no data to compare")
        else:
            report.output_max_abs_error = _max_err(got, want)
    return report


def _check_guards(trace, values: dict[int, Any], report: ValidationReport) -> None:
    """Recompute every guard (data read) from the replayed values: held guards are notes; a
    guard the replay does not reproduce is a real disagreement."""

    def resolve(ref):
        v = values[ref.index] if ref.index in values else trace.ops[ref.index].out
        return v if ref.elem is None else v[ref.elem]

    for read in trace.data_reads:
        if read.func is None:
            report.guards.append(f"{read.name}() at {read.source} (value not recorded: replay cannot cross it)")
            continue
        try:
            new = recompute_read(read, resolve)
        except GuardChangedError as exc:
            report.unstable.append(exc.message)
            continue
        except ValueNotSavedError:
            report.guards.append(f"{read.name}() at {read.source} (its input was not saved)")
            continue
        if same_value(new, read.seen):
            report.guards.append(f"{read.name}() at {read.source} saw {short(read.seen)}")
        else:
            report.unstable.append(f"guard {read.name}() at {read.source}: the forward saw {short(read.seen)}, "
                                   f"the replay computes {short(new)}")
    for op in trace.ops:
        if op.flags & GUARD:
            report.guards.append(f"{op.func_name} indices of {op.label} at {op.source}")
