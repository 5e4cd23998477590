"""``tl.debug.compare(a, b)``: align two traces (or a trace and a fork) op by op and say where
they first differ.

Ops align by label and module calls by ``address:pass`` (both are deterministic for one
model), and are visited in execution order with each module's output placed right after
its last op, innermost module first. An edit shows up where it was made: a capture-time
edit of an op counts as that op's value, a module edit (capture-time or replayed) as the
module's output, so a clean run against an edited fork diverges first at the edited site.
"""

from __future__ import annotations

import math
import os
import weakref
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ..core.fork import Fork
from ..core.records import EDIT, ModuleCall, Op
from ..core.tree import flatten
from ..errors import InvalidArgumentError, TorchLensError
from .notebook import comparison_html


@dataclass
class Diff:
    """One aligned op or module call: how far apart the two values are."""

    kind: str  # "op" or "module"
    key: str  # op label, or module "address:pass"
    label: str
    func: str
    source: str
    max_abs: float | None
    max_rel: float | None
    diverged: bool
    note: str = ""
    shape_a: Any = None
    shape_b: Any = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("max_abs", "max_rel"):
            v = d[k]
            d[k] = v if v is None or math.isfinite(v) else str(v)
        for k in ("shape_a", "shape_b"):
            d[k] = _plain(d[k])
        return d


def _plain(shape: Any) -> Any:
    if isinstance(shape, (tuple, list)):
        return [_plain(s) for s in shape]
    return shape


@dataclass
class Comparison:
    """What ``tl.debug.compare`` found; ``str()`` is a short table, ``to_dict()`` the full data."""

    a: str
    b: str
    atol: float
    rtol: float
    only_in_a: list[str] = field(default_factory=list)
    only_in_b: list[str] = field(default_factory=list)
    # weak references to (a, b), so tl.draw(comparison) can show the graph without keeping activations alive
    sources: tuple = field(default=(), repr=False, compare=False)
    diffs: list[Diff] = field(default_factory=list)

    @property
    def diverged(self) -> list[Diff]:
        return [d for d in self.diffs if d.diverged]

    @property
    def first_divergence(self) -> Diff | None:
        """The earliest aligned op or module output whose values differ."""
        return next((d for d in self.diffs if d.diverged), None)

    @property
    def same(self) -> bool:
        """No op or module only in one, and no aligned value differs beyond atol / rtol."""
        return not self.only_in_a and not self.only_in_b and self.first_divergence is None

    def __bool__(self) -> bool:  # "if compare(a, b):" reads as "if they differ"
        return not self.same

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able data (non-finite numbers as strings)."""
        first = self.first_divergence
        return {
            "a": self.a, "b": self.b, "atol": self.atol, "rtol": self.rtol, "same": self.same,
            "n_compared": len(self.diffs), "n_diverged": len(self.diverged),
            "only_in_a": list(self.only_in_a), "only_in_b": list(self.only_in_b),
            "first_divergence": None if first is None else first.to_dict(),
            "diffs": [d.to_dict() for d in self.diffs],
        }

    def _names(self) -> tuple[str, str]:
        if self.a == self.b:
            return f"a ({self.a!r})", f"b ({self.b!r})"
        return repr(self.a), repr(self.b)

    def summary(self) -> str:
        name_a, name_b = self._names()
        lines = [f"compare {name_a} vs {name_b} (atol={self.atol:g}, rtol={self.rtol:g}): "
                 + ("no differences" if self.same else
                    f"{len(self.diverged)} of {len(self.diffs)} aligned sites diverge")]
        first = self.first_divergence
        if first is not None:
            lines.append(f"first divergence: {first.kind} {first.label} ({first.func}) at {first.source}, "
                         f"max abs {_num(first.max_abs)}" + (f" [{first.note}]" if first.note else ""))
        for name, only in ((name_a, self.only_in_a), (name_b, self.only_in_b)):
            if only:
                more = f" ... (+{len(only) - 8})" if len(only) > 8 else ""
                lines.append(f"only in {name}: {', '.join(only[:8])}{more}")
        return "\n".join(lines)

    def table(self, limit: int = 20) -> str:
        """The summary and a box table of the first ``limit`` diverging sites."""
        rows = [(d.label, d.kind, d.func, _num(d.max_abs), _num(d.max_rel), d.note, _short(d.source))
                for d in self.diverged[:limit]]
        if not rows:
            return self.summary()
        text = self.summary() + "\n" + _box(("site", "kind", "func", "max abs", "max rel", "note", "source"), rows)
        hidden = len(self.diverged) - limit
        return text + (f"\n... {hidden} more diverging site(s); see .to_dict()" if hidden > 0 else "")

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        first = self.first_divergence
        state = "same" if first is None else f"{len(self.diverged)} diverge, first {first.label}"
        return f"<Comparison {self.a!r} vs {self.b!r}: {state}>"

    def _repr_html_(self) -> str:
        return comparison_html(self)


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.3g}"


def _short(source: str) -> str:
    path, _, line = source.rpartition(":")
    return f"{os.path.basename(path)}:{line}" if path else source


def _box(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    """A table in rich's default heavy-head box style, without depending on rich."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]

    def line(left: str, fill: str, mid: str, right: str) -> str:
        return left + mid.join(fill * (w + 2) for w in widths) + right

    def cells(row: tuple[str, ...], bar: str) -> str:
        return bar + bar.join(f" {str(c).ljust(w)} " for c, w in zip(row, widths)) + bar

    out = [line("┏", "━", "┳", "┓"), cells(header, "┃"), line("┡", "━", "╇", "┩")]
    out += [cells(r, "│") for r in rows]
    out.append(line("└", "─", "┴", "┘"))
    return "\n".join(out)


# -- alignment -------------------------------------------------------------------------------


def _edit_target(op: Op) -> tuple[str, str] | None:
    """What a capture-time edit op edited: ("op", label) or ("module", key)."""
    record = getattr(getattr(op.func, "ctx", None), "op", None)
    if isinstance(record, ModuleCall):
        return ("module", record.key)
    if isinstance(record, Op):
        return ("op", record.label)
    return None


def _events(trace: Any, edited: set[str]) -> list[tuple[str, str, Any]]:
    """(kind, key, record) for every op and module call, in execution order.

    Modules ending at the same op finish innermost first, except that an ``edited`` module
    comes first: nested modules returning the same tensor all show its edit, but the edit
    was made at that one.
    """
    keyed: list[tuple[tuple, str, str, Any]] = []
    for op in trace.ops:
        if not op.flags & EDIT:
            keyed.append(((op.index, 1, 0), "op", op.label, op))
    for n, call in enumerate(trace.calls):
        first = 0 if call.key in edited else 1
        order = (call.op_end - 1, 2, first, -call.op_start, -n) if trace.ops else (n,)
        keyed.append((order, "module", call.key, call))
    keyed.sort(key=lambda e: e[0])
    return [(kind, key, rec) for _, kind, key, rec in keyed]


def _edited_modules(trace: Any) -> set[str]:
    """Keys of module calls edited during capture or by a fork's replay."""
    keys = set(trace.fork_state().overrides) if isinstance(trace, Fork) else set()
    for op in trace.ops:
        if op.flags & EDIT:
            target = _edit_target(op)
            if target is not None and target[0] == "module":
                keys.add(target[1])
    return keys


def _replay_targets(trace: Any) -> set[tuple[str, str]]:
    """(kind, key) of every site a fork's replay steps edited (for the 'edited' note)."""
    out: set[tuple[str, str]] = set()
    for step in trace.fork_state().recipe if isinstance(trace, Fork) else []:
        try:
            records = step.site.match(trace)
        except TorchLensError:
            continue
        out.update(("module", r.key) if isinstance(r, ModuleCall) else ("op", r.label) for r in records)
    return out


def _edited_ops(trace: Any) -> dict[str, int]:
    """Label of each op edited during capture -> index of the edit op holding its edited value."""
    out: dict[str, int] = {}
    for op in trace.ops:
        if op.flags & EDIT:
            target = _edit_target(op)
            if target is not None and target[0] == "op":
                out[target[1]] = op.index
    return out


def _value(trace: Any, kind: str, record: Any, edited: dict[str, int]) -> Any:
    if kind == "module":
        return trace.module_output(record)
    return trace.value(edited.get(record.label, record.index))


def _source(trace: Any, kind: str, record: Any) -> str:
    if kind == "op":
        return record.source
    refs = [r for r in record.out_refs if r is not None]
    if refs:
        return trace.ops[refs[0].index].source
    if record.op_end > record.op_start:
        return trace.ops[record.op_end - 1].source
    return "<unknown>"


def _shape(value: Any) -> Any:
    leaves = [x for x in flatten(value)[0] if isinstance(x, torch.Tensor)]
    if len(leaves) == 1:
        return tuple(leaves[0].shape)
    return tuple(tuple(x.shape) for x in leaves)


def _distance(x: Any, y: Any, atol: float, rtol: float) -> tuple[float, float, bool, str]:
    """(max abs diff, max relative diff, diverged, note) over the tensor leaves of two values."""
    if x is y:
        return 0.0, 0.0, False, ""
    xs = [v for v in flatten(x)[0] if isinstance(v, torch.Tensor)]
    ys = [v for v in flatten(y)[0] if isinstance(v, torch.Tensor)]
    if len(xs) != len(ys):
        return math.inf, math.inf, True, "structure"
    worst_abs = worst_rel = 0.0
    diverged = False
    note = ""
    for a, b in zip(xs, ys):
        if a is b:
            continue
        if a.shape != b.shape:
            return math.inf, math.inf, True, "shape"
        if a.dtype != b.dtype:
            note = "dtype"
        if a.numel() == 0:
            continue
        a64, b64 = _wide(a), _wide(b)
        nan_a, nan_b = torch.isnan(a64), torch.isnan(b64)
        d = (a64 - b64).abs()
        d = torch.where(nan_a & nan_b, torch.zeros_like(d), d)
        d = torch.where(nan_a ^ nan_b, torch.full_like(d, math.inf), d)
        scale = torch.maximum(a64.abs(), b64.abs())
        rel = torch.where(d == 0, torch.zeros_like(d), d / scale)
        rel = torch.nan_to_num(rel, nan=math.inf)
        worst_abs = max(worst_abs, float(d.max()))
        worst_rel = max(worst_rel, float(rel.max()))
        if bool((d > atol + rtol * b64.abs().nan_to_num(0.0)).any()):
            diverged = True
    return worst_abs, worst_rel, diverged, note


def _wide(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t.to(torch.complex128) if t.is_complex() else t.to(torch.float64)


def compare(a: Any, b: Any, *, atol: float = 1e-5, rtol: float = 1e-4) -> Comparison:
    """Align two traces (or a trace and a fork) op by op and report where they differ.

    Args:
        a: a trace or fork (captured, replayed, or loaded with ``tl.load_trace``), or a generation
            (``tl.generate``): two generations compare step by step (``GenerationComparison``: the
            first differing step, op and token).
        b: the trace, fork or generation to compare it with.
        atol: absolute tolerance: an element differs when ``|a - b| > atol + rtol * |b|``.
        rtol: relative tolerance, in the same rule.

    Returns:
        a Comparison: ``only_in_a`` / ``only_in_b`` (op labels and module ``address:pass``),
        per-site ``max_abs`` / ``max_rel`` in ``diffs``, ``first_divergence`` with its source
        line, ``same``, ``str()`` (a short table) and ``to_dict()``.

    Raises:
        InvalidArgumentError: ``a`` or ``b`` is not a trace, or a tolerance is negative.
    """
    if hasattr(a, "steps") and callable(getattr(a, "compare", None)):  # generations compare step by step
        return a.compare(b, atol=atol, rtol=rtol)
    for name, t in (("a", a), ("b", b)):
        if not (hasattr(t, "ops") and hasattr(t, "calls") and hasattr(t, "value")):
            raise InvalidArgumentError(f"compare() takes traces or forks; {name} is a {type(t).__name__}")
    if not (atol >= 0 and rtol >= 0):
        raise InvalidArgumentError(f"atol and rtol must be >= 0, got atol={atol}, rtol={rtol}")
    mods_a, mods_b = _edited_modules(a), _edited_modules(b)
    edited_mods = mods_a ^ mods_b
    ev_a, ev_b = _events(a, edited_mods), _events(b, edited_mods)
    in_b = {(kind, key): rec for kind, key, rec in ev_b}
    in_a = {(kind, key) for kind, key, _ in ev_a}
    edited_a, edited_b = _edited_ops(a), _edited_ops(b)
    replayed = _replay_targets(a) ^ _replay_targets(b)
    result = Comparison(getattr(a, "name", "a"), getattr(b, "name", "b"), atol, rtol,
                        sources=(weakref.ref(a), weakref.ref(b)))
    result.only_in_a = [key for kind, key, _ in ev_a if (kind, key) not in in_b]
    result.only_in_b = [key for kind, key, _ in ev_b if (kind, key) not in in_a]
    result.only_in_a += [op.label for op in a.ops if op.flags & EDIT and not b.has_label(op.label)]
    result.only_in_b += [op.label for op in b.ops if op.flags & EDIT and not a.has_label(op.label)]
    for kind, key, rec_a in ev_a:
        rec_b = in_b.get((kind, key))
        if rec_b is None:
            continue
        label = (rec_a.label or "<root>") if kind == "module" else rec_a.label
        func = rec_a.module_type if kind == "module" else rec_a.func_name
        note = ""
        if (kind == "op" and (key in edited_a) != (key in edited_b)) or (kind == "module" and key in edited_mods) \
                or (kind, key) in replayed:
            note = "edited"
        try:
            va, vb = _value(a, kind, rec_a, edited_a), _value(b, kind, rec_b, edited_b)
        except TorchLensError:
            result.diffs.append(Diff(kind, key, label, func, _source(a, kind, rec_a), None, None, False, "not saved"))
            continue
        max_abs, max_rel, diverged, why = _distance(va, vb, atol, rtol)
        result.diffs.append(Diff(kind, key, label, func, _source(a, kind, rec_a), max_abs, max_rel, diverged,
                                 ", ".join(x for x in (note, why) if x), _shape(va), _shape(vb)))
    return result


__all__ = ["Comparison", "Diff", "compare"]
