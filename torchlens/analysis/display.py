"""Text renderings of a trace for terminals and logs (no rich dependency needed)."""

from __future__ import annotations

import os
from typing import Any

from ..core.actions import provide_methods
from ..core.records import ModuleCall, Op
from ..core.trace import Trace
from ..errors import EmptySelectionError

__all__ = ["TableMethod", "op_table", "selected_ops"]


def _short_source(source: str) -> str:
    path, _, line = source.rpartition(":")
    return f"{os.path.basename(path)}:{line}" if path else source


def selected_ops(trace: Any, selector: Any) -> list[Op]:
    """The ops a selector covers, in execution order: matched ops, and every op run inside a matched
    module call (``"transformer.h.0"`` or ``tl.module(...)`` shows that module's ops).

    Raises:
        EmptySelectionError: the selector matches nothing (``SiteNotFoundError`` for a name that
            does not exist), or matches module calls in which no op was recorded.
    """
    found: dict[int, Op] = {}
    for site in trace.find_sites(selector):
        record = site.record
        ops = trace.ops[record.op_start:record.op_end] if isinstance(record, ModuleCall) else [record]
        for op in ops:
            found.setdefault(op.index, op)
    if not found:
        remedy = ("This trace holds module outputs only (no op graph); capture with tl.trace(model, x) to see ops."
                  if not trace.has_op_graph else "The module ran no tensor op (it returned its input); pick another.")
        raise EmptySelectionError(f"{selector!s} matches module calls but no op ran inside them", site=str(selector),
                                  remedy=remedy)
    return [found[i] for i in sorted(found)]


def op_table(trace: Any, selector: Any = None, limit: int | None = None) -> str:
    """Label, function, module:pass, shape and source line of each op (of ``selector``).

    Raises:
        EmptySelectionError: ``selector`` matches nothing (the nearest names are listed).
    """
    records = list(trace.ops) if selector is None else selected_ops(trace, selector)
    if limit is not None:
        records = records[:limit]
    rows = [("label", "func", "module:pass", "shape", "source")]
    for op in records:
        module = f"{op.module or '<root>'}:{op.module_pass}" if not op.is_input else "-"
        rows.append((op.label, op.func_name, module, str(op.shape), _short_source(op.source)))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


@provide_methods(Trace)
class TableMethod:
    """``Trace.table``, provided by ``analysis/`` (see ``torchlens.core.actions``)."""

    def table(self: Trace, selector: Any = None, limit: int | None = None) -> str:
        """A text table of ops (label, function, module:pass, shape, source line); see :func:`op_table`."""
        return op_table(self, selector, limit)
