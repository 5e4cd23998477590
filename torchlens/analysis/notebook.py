"""Notebook displays (``_repr_html_``) for traces, forks, ops, module calls, reports and recipes.

Importing this module registers each renderer with :func:`torchlens.core.repr_html.repr_html`,
the one lookup the objects' ``_repr_html_`` asks; ``edit/`` and ``store/`` import no HTML.

Everything here is a compact summary plus tables folded into ``<details>``: no layout, no
plotting, no value statistics, so a 10,000-op trace renders in well under a second. The op
table lists at most :data:`MAX_ROWS` ops (the rest: ``trace.to_pandas()``).
"""

from __future__ import annotations

import os
from html import escape
from typing import Any

from ..core.records import EDIT, INPUT, ModuleCall, Op
from ..core.repr_html import repr_html
from ..core.trace import Trace
from ..edit.validate import ValidationReport
from ..store.recipes import Recipe
from .summary import call_tree, format_bytes, memory_held

__all__ = ["MAX_ROWS", "call_html", "comparison_html", "op_html", "recipe_html", "trace_html", "validation_html"]

MAX_ROWS = 2000  # op rows in a trace's HTML; a notebook cell with more is slow to scroll, not more useful

_STYLE = ("<style>.tl-box{font-family:var(--jp-code-font-family,monospace);font-size:12px}"
          ".tl-box table{border-collapse:collapse;margin:2px 0}"
          ".tl-box td,.tl-box th{padding:1px 8px;text-align:left;border-bottom:1px solid #eee}"
          ".tl-box summary{cursor:pointer}.tl-edit{color:#c62828;font-weight:bold}"
          ".tl-bad{color:#c62828}.tl-ok{color:#2e7d32}</style>")


def _box(title: str, facts: list[tuple[str, str]], parts: list[str]) -> str:
    rows = "".join(f"<tr><th>{escape(k)}</th><td>{v}</td></tr>" for k, v in facts)
    return f'{_STYLE}<div class="tl-box"><b>{title}</b><table>{rows}</table>{"".join(parts)}</div>'


def _short(source: str) -> str:
    path, _, line = source.rpartition(":")
    return f"{os.path.basename(path)}:{line}" if path else source


def _shape(shape: Any) -> str:
    return "-" if shape is None else escape(str(shape).replace(" ", ""))


def _table(header: tuple[str, ...], rows: list[str]) -> str:
    head = "".join(f"<th>{h}</th>" for h in header)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


_OP_HEADER = ("label", "func", "module:pass", "shape", "source")


def _op_row(op: Op, edited: bool) -> str:
    cls = ' class="tl-edit"' if edited else ""
    where = "-" if op.flags & INPUT else f"{escape(op.module or '<model>')}:{op.module_pass}"
    return (f"<tr{cls}><td>{escape(op.label)}</td><td>{escape(op.func_name)}</td><td>{where}</td>"
            f"<td>{_shape(op.shape)}</td><td>{escape(_short(op.source))}</td></tr>")


def _groups(trace: Any) -> list[tuple[str, list[Op]]]:
    """Ops grouped by the top-level module call that ran them (ops outside any: "<model>")."""
    parent, depth = call_tree(trace)
    tops = sorted((c for c in trace.calls if depth[c.key] == 1), key=lambda c: c.op_start)
    groups: list[tuple[str, list[Op]]] = []
    ops, pos = trace.ops, 0
    for call in tops:
        if call.op_start > pos:
            groups.append(("<model>", ops[pos:call.op_start]))
        title = f"{call.label} ({call.module_type})"
        groups.append((title, ops[call.op_start:call.op_end]))
        pos = max(pos, call.op_end)
    if pos < len(ops):
        groups.append(("<model>", ops[pos:]))
    return [(t, g) for t, g in groups if g]


def _edited_ops(trace: Any) -> set[int]:
    edited = {op.index for op in trace.ops if op.flags & EDIT}
    for e in trace.edits:
        index = trace.op_index(e.label)
        if index is not None:
            edited.add(index)
            continue
        for call in trace.calls_of(e.label):
            if e.pass_index is None or call.pass_index == e.pass_index:
                edited.update(r.index for r in call.out_refs if r is not None)
    return edited


def trace_html(trace: Trace) -> str:
    """The notebook display of a Trace or Fork: summary, edits, and per-module op tables."""
    model = type(trace.model).__name__ if trace.model is not None else "(loaded, no model)"
    kind = type(trace).__name__
    facts = [("model", escape(model)), ("ops", f"{len(trace.ops):,}"), ("module calls", f"{len(trace.calls):,}"),
             ("memory held", format_bytes(memory_held(trace))), ("engine", escape(trace.engine or "-"))]
    if trace.output_layers:
        facts.append(("outputs", escape(", ".join(trace.output_layers[:6]))))
    parent = getattr(trace, "parent", None)
    if parent is not None:
        facts.append(("fork of", escape(repr(parent.name))))
        facts.append(("recomputed ops", f"{len(trace.fork_state().values):,}"))
    parts = []
    if trace.edits:
        items = "".join(f"<li>{escape(e.label)}{'' if e.pass_index is None else f' (pass {e.pass_index})'}: "
                        f"{e.n_changed:,} elements changed, {escape(e.how)}</li>" for e in trace.edits)
        parts.append(f"<details open><summary>{len(trace.edits)} edit(s)</summary><ul>{items}</ul></details>")
    edited = _edited_ops(trace)
    budget = MAX_ROWS
    sections = []
    for title, ops in _groups(trace):
        shown = ops[:max(budget, 0)]
        budget -= len(shown)
        rows = [_op_row(op, op.index in edited) for op in shown]
        more = len(ops) - len(shown)
        tail = f"<small>... {more:,} more op(s): trace.to_pandas() lists them all</small>" if more else ""
        sections.append(f"<details><summary>{escape(title)} — {len(ops):,} ops</summary>"
                        f"{_table(_OP_HEADER, rows) if rows else ''}{tail}</details>")
    parts.append(f"<details><summary>ops by module ({len(sections)} groups)</summary>{''.join(sections)}</details>")
    return _box(f"{kind} {escape(repr(trace.name))}", facts, parts)


def op_html(op: Op) -> str:
    """The notebook display of one Op."""
    trace = op.trace
    facts = [("function", escape(op.func_name)), ("shape", _shape(op.shape)),
             ("dtype", escape(str(op.dtype).removeprefix("torch."))),
             ("module", "-" if op.flags & INPUT else f"{escape(op.module or '<model>')}:{op.module_pass}"),
             ("source", escape(op.source))]
    if trace is not None and trace.has_op_graph:
        facts.append(("parents", escape(", ".join(op.parents)) or "-"))
        children = op.children
        facts.append(("children", escape(", ".join(children[:12]) + (" ..." if len(children) > 12 else "")) or "-"))
    if not op.saved:
        facts.append(("value", "not saved"))
    return _box(f"Op {escape(op.label)}", facts, [])


def call_html(call: ModuleCall) -> str:
    """The notebook display of one ModuleCall: what it is and the ops it ran."""
    trace = call.trace
    facts = [("module", escape(call.address or "<model>")), ("type", escape(call.module_type)),
             ("pass", f"{call.pass_index} of {call.n_passes}"), ("ops", f"{call.op_end - call.op_start:,}")]
    parts = []
    if trace is not None:
        ops = trace.ops[call.op_start:call.op_end]
        rows = [_op_row(op, False) for op in ops[:MAX_ROWS]]
        parts.append(f"<details><summary>{len(ops):,} ops</summary>{_table(_OP_HEADER, rows)}</details>")
    return _box(f"ModuleCall {escape(call.key)}", facts, parts)


def validation_html(report: ValidationReport) -> str:
    """The notebook display of a ValidationReport."""
    state = f'<span class="{"tl-ok" if report.ok else "tl-bad"}">{report.status}</span>'
    facts = [("result", state), ("ops replayed", f"{report.n_checked:,} of {report.n_ops:,}"),
             ("tolerance", f"{report.atol:g}")]
    missing = [u for u in report.unchecked if not u.by_design]
    if report.output_max_abs_error is not None:
        facts.append(("output vs real forward", f"max abs error {report.output_max_abs_error:.3g}"))
    if report.output_not_compared:
        facts.append(("output vs real forward", f"not compared: {escape(report.output_not_compared)}"))
    parts = []
    if report.divergences:
        rows = [f"<tr><td>{escape(d.label)}</td><td>{escape(d.func_name)}</td><td>{d.max_abs_error:.3g}</td>"
                f"<td>{escape(_short(d.source))}</td></tr>" for d in report.divergences[:MAX_ROWS]]
        parts.append(f"<details open><summary>{len(report.divergences)} diverging op(s)</summary>"
                     f"{_table(('op', 'func', 'max abs error', 'source'), rows)}</details>")
    if missing:
        rows = [f"<tr><td>{escape(u.label)}</td><td>{escape(u.kind)}</td><td>{escape(u.reason)}</td></tr>"
                for u in missing[:MAX_ROWS]]
        parts.append(f"<details open><summary>{len(missing)} op(s) not checked</summary>"
                     f"{_table(('op', 'kind', 'reason'), rows)}</details>")
    for title, items in (("unstable", report.unstable), ("errors", report.errors)):
        if items:
            lis = "".join(f"<li>{escape(x)}</li>" for x in items)
            parts.append(f"<details open><summary>{len(items)} {title}</summary><ul>{lis}</ul></details>")
    return _box("ValidationReport", facts, parts)


def comparison_html(cmp: Any) -> str:
    """The notebook display of a ``tl.debug.compare`` result."""
    first = cmp.first_divergence
    facts = [("a vs b", escape(f"{cmp.a!r} vs {cmp.b!r}")),
             ("result", '<span class="tl-ok">no differences</span>' if cmp.same else
              f'<span class="tl-bad">{len(cmp.diverged):,} of {len(cmp.diffs):,} aligned sites diverge</span>'),
             ("tolerance", f"atol={cmp.atol:g}, rtol={cmp.rtol:g}")]
    if first is not None:
        facts.append(("first divergence", f'<span class="tl-edit">{escape(first.label)}</span> '
                                          f"({escape(first.func)}) at {escape(_short(first.source))}"))
    parts = []
    if cmp.diverged:
        rows = [f"<tr><td>{escape(d.label)}</td><td>{d.kind}</td><td>{escape(d.func)}</td>"
                f"<td>{'-' if d.max_abs is None else f'{d.max_abs:.3g}'}</td>"
                f"<td>{'-' if d.max_rel is None else f'{d.max_rel:.3g}'}</td><td>{escape(d.note)}</td></tr>"
                for d in cmp.diverged[:MAX_ROWS]]
        parts.append(f"<details><summary>diverging sites</summary>"
                     f"{_table(('site', 'kind', 'func', 'max abs', 'max rel', 'note'), rows)}</details>")
    for name, only in ((cmp.a, cmp.only_in_a), (cmp.b, cmp.only_in_b)):
        if only:
            parts.append(f"<details><summary>only in {escape(repr(name))}: {len(only)}</summary>"
                         f"{escape(', '.join(only[:200]))}</details>")
    return _box("Comparison", facts, parts)


def recipe_html(recipe: Recipe) -> str:
    """The notebook display of a Recipe (``tl.load_intervention``)."""
    model = (recipe.fingerprint or {}).get("class", "any model")
    facts = [("model", escape(str(model))), ("level", escape(recipe.level)), ("steps", str(len(recipe.steps)))]
    if recipe.path is not None:
        facts.append(("path", escape(str(recipe.path))))
    rows = [f"<tr><td>{i}</td><td>{escape(s.site.describe())}</td><td>{escape(repr(s.edit))}</td></tr>"
            for i, s in enumerate(recipe.steps)]
    parts = [f"<details open><summary>steps</summary>{_table(('#', 'site', 'edit'), rows)}</details>"]
    return _box("Recipe", facts, parts)


for _type, _render in ((Trace, trace_html), (Op, op_html), (ModuleCall, call_html),
                       (ValidationReport, validation_html), (Recipe, recipe_html)):
    repr_html.register(_type, _render)
