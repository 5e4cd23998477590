"""Text renderings of a trace for terminals and logs (no rich dependency needed)."""

from __future__ import annotations

import os
from typing import Any


def _short_source(source: str) -> str:
    path, _, line = source.rpartition(":")
    return f"{os.path.basename(path)}:{line}" if path else source


def op_table(trace, selector: Any = None, limit: int | None = None) -> str:
    """Label, function, module:pass, shape and source line of each op (of ``selector``)."""
    if selector is None:
        records = [op for op in trace.ops]
    else:
        records = [s.record for s in trace.find_sites(selector) if s.kind == "op"]
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


__all__ = ["op_table"]
