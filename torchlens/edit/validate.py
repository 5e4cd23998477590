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

from ..core.records import INPUT, build_args
from ..core.trace import Trace
from ..core.tree import tensor_leaves
from ..errors import InvalidArgumentError, ReplayError
from .replay import execute

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
    """Per-op agreement of a replay with the recorded run, and of the output with a real forward."""

    n_ops: int
    n_checked: int
    divergences: list[Divergence] = field(default_factory=list)
    unstable: list[str] = field(default_factory=list)
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
        for u in self.unstable:
            lines.append(f"  unstable: {u}")
        for e in self.errors:
            lines.append(f"  error: {e}")
        return "\n".join(lines)

    __str__ = summary


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


def _param_derived(trace) -> set[int]:
    """Ops whose value depends on a parameter/buffer (i.e. on what the model computed)."""
    params: set[int] = set()
    model = trace.model
    if model is not None:
        params = {id(p) for p in model.parameters()} | {id(b) for b in model.buffers()}
    derived: set[int] = set()
    for op in trace.ops:
        if op.flags & INPUT:
            continue
        if any(r.index in derived for r in op.parent_refs):
            derived.add(op.index)
            continue
        leaves, _ = op.args_spec
        if any(isinstance(leaf, torch.Tensor) and id(leaf) in params for leaf in leaves):
            derived.add(op.index)
    return derived


def validate(trace, *, atol: float = 1e-5, rerun: bool = True) -> ValidationReport:
    """Replay ``trace`` from its inputs and report per-op agreement.

    Args:
        atol: largest absolute difference that still counts as agreement.
        rerun: also run the real forward again and compare the final output.

    Returns:
        a ValidationReport (``.ok``, ``.first_divergence``, ``.summary()``).
    """
    with torch.set_grad_enabled(getattr(trace, "grad", False)):
        return _validate(trace, atol=atol, rerun=rerun)


def _validate(trace, *, atol: float, rerun: bool) -> ValidationReport:
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
    for op in trace.ops:
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
    derived = _param_derived(trace)
    for _pos, ref, code, lineno, name in trace.data_reads:
        if ref is not None and ref.index in derived:
            report.unstable.append(
                f"data-dependent control flow: {name}() of {trace.ops[ref.index].label} at "
                f"{code.co_filename}:{lineno}; an edit upstream could change which ops run"
            )
    if rerun and trace.model is not None and trace.complete:
        with torch.no_grad():
            real = trace.model(*trace.args, **trace.kwargs)
        report.output_max_abs_error = _max_err(tensor_leaves(trace.output), tensor_leaves(real))
    return report

