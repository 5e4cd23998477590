"""Everyday inspection of a trace: ``trace.summary()`` (per module call) and ``trace.to_pandas()`` (per op).

``summary()`` lists every module call with its ops, parameters, output shape and the memory
its recorded activations hold: text in a terminal (``print``), HTML in a notebook.
``to_pandas()`` gives one row per op (label, function, module, pass, shape, dtype, source
line, parents) for filtering and joining with pandas (an optional extra); its source lines
read from the model's package on (``transformers/models/gpt2/modeling_gpt2.py:123``), the
full path in ``source_path``.
"""

from __future__ import annotations

import html
import os
import sys
from dataclasses import dataclass
from typing import Any

import torch

from ..core.actions import provide_methods
from ..core.records import INPUT, ModuleCall, Op
from ..core.trace import Trace
from ..core.tree import tensor_leaves
from ..errors import OptionalDependencyError

__all__ = ["ModuleRow", "Summary", "SummaryMethods", "call_tree", "encloses", "format_bytes", "memory_held",
           "op_records", "package_path", "summary", "to_pandas"]


def format_bytes(n: int) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


def _value_of(trace: Any, op: Op, own: dict[int, Any] | None) -> Any:
    if own is not None:
        return own.get(op.index)
    return op._out if op.saved else None


def _storage_bytes(values: Any, seen: set[tuple[int, int]]) -> int:
    total = 0
    for t in tensor_leaves(values):
        if t.device.type == "meta":
            continue
        storage = t.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if key in seen:
            continue  # views and aliases share one storage: count it once
        seen.add(key)
        total += storage.nbytes()
    return total


def memory_held(trace: Any, ops: Any = None) -> int:
    """Bytes of activation storage the trace keeps alive (a fork: its recomputed values too).

    Args:
        trace: a Trace or Fork.
        ops: only these ops (default: all); shared storages count once.

    Returns:
        the number of bytes.
    """
    seen: set[tuple[int, int]] = set()
    total = 0
    chosen = trace.ops if ops is None else ops
    for op in chosen:
        if op.saved:
            total += _storage_bytes(op._out, seen)
    if ops is None:
        total += _storage_bytes(trace.held_values(), seen)
    return total


def call_tree(trace: Any) -> tuple[dict[str, ModuleCall | None], dict[str, int]]:
    """Each module call's enclosing call and its nesting depth, by ``address:pass`` (the model's call is 0)."""
    order = sorted(trace.calls, key=lambda c: (c.op_start, -c.op_end, len(c.address)))
    parent: dict[str, ModuleCall | None] = {}
    depth: dict[str, int] = {}
    stack: list[ModuleCall] = []
    for call in order:
        while stack and not encloses(stack[-1], call):
            stack.pop()
        parent[call.key] = stack[-1] if stack else None
        depth[call.key] = len(stack)
        stack.append(call)
    return parent, depth


def encloses(outer: ModuleCall, inner: ModuleCall) -> bool:
    """Whether call ``inner`` ran inside call ``outer`` (a submodule, or the same call)."""
    prefix = outer.address in ("", inner.address) or inner.address.startswith(outer.address + ".")
    return prefix and outer.op_start <= inner.op_start and inner.op_end <= outer.op_end


@dataclass
class ModuleRow:
    """One module call in a summary."""

    key: str
    address: str
    module_type: str
    depth: int
    n_ops: int
    n_params: int | None
    out_shape: Any
    memory: int


class Summary:
    """``trace.summary()``: per module call, its ops, parameters, output shape and memory held.

    ``print(summary)`` gives a text table; a notebook shows an HTML table; ``.rows`` holds the data.
    """

    def __init__(self, title: str, rows: list[ModuleRow], total_ops: int, total_memory: int) -> None:
        self.title = title
        self.rows = rows
        self.total_ops = total_ops
        self.total_memory = total_memory

    def _cells(self, row: ModuleRow) -> tuple[str, ...]:
        params = "-" if row.n_params is None else f"{row.n_params:,}"
        return ("  " * row.depth + (row.address or "<model>"), row.module_type, str(row.n_ops), params,
                _shape(row.out_shape), format_bytes(row.memory))

    _HEADER = ("module", "type", "ops", "params", "output shape", "memory held")

    def __str__(self) -> str:
        rows = [self._HEADER, *(self._cells(r) for r in self.rows)]
        widths = [max(len(r[i]) for r in rows) for i in range(len(self._HEADER))]
        lines = ["  ".join(c.ljust(w) if i < 2 or i == 4 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                 .rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        footer = f"{self.total_ops} ops, {len(self.rows)} module calls, {format_bytes(self.total_memory)} held"
        return "\n".join([self.title, *lines, footer])

    def __repr__(self) -> str:
        return str(self)

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{h}</th>" for h in self._HEADER)
        body = []
        for r in self.rows:
            cells = self._cells(r)
            name = f'<td style="padding-left:{0.3 + r.depth}em;text-align:left">{html.escape(cells[0].strip())}</td>'
            body.append("<tr>" + name + "".join(f"<td>{html.escape(c)}</td>" for c in cells[1:]) + "</tr>")
        return (f"<div class=\"torchlens-summary\"><b>{html.escape(self.title)}</b>"
                f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"
                f"<small>{self.total_ops} ops, {len(self.rows)} module calls, "
                f"{format_bytes(self.total_memory)} held</small></div>")


def _shape(shape: Any) -> str:
    if shape is None:
        return "-"
    return str(shape).replace(" ", "")


def _saved_parameters(trace: Any) -> dict[str, int]:
    """Parameter name -> numel for a loaded trace (no model): the named tensors its ops read."""
    names = getattr(trace, "saved_tensor_names", None) or {}
    found: dict[str, int] = {}
    if not names:
        return found
    for op in trace.ops:
        leaves = op.args_spec[0] if op.args_spec is not None else ()
        for leaf in leaves:
            name = names.get(id(leaf)) if isinstance(leaf, torch.Tensor) else None
            if name is not None and name.startswith("param/"):  # buffers ("buffer/...") are not parameters
                found[name.removeprefix("param/")] = leaf.numel()
    return found


def _param_count(model: torch.nn.Module | None, address: str, cache: dict[str, int | None],
                 saved: dict[str, int]) -> int | None:
    if model is None:
        if not saved:
            return None
        return sum(n for name, n in saved.items() if not address or name.startswith(address + "."))
    if address not in cache:
        try:
            module = model.get_submodule(address) if address else model
        except AttributeError:
            cache[address] = None
        else:
            cache[address] = sum(p.numel() for p in module.parameters())
    return cache[address]


def summary(trace: Any) -> Summary:
    """Per module call: ops, parameters (when the model is at hand), output shape, memory held.

    Args:
        trace: a Trace or Fork.

    Returns:
        a :class:`Summary` (text with ``print``, HTML in a notebook, data in ``.rows``).
    """
    depths = call_tree(trace)[1]
    cache: dict[str, int | None] = {}
    saved = _saved_parameters(trace) if trace.model is None else {}
    rows = []
    for call in sorted(trace.calls, key=lambda c: (c.op_start, -c.op_end, len(c.address))):
        shapes = [trace.ops[r.index].shape for r in call.out_refs if r is not None]
        shape = shapes[0] if len(shapes) == 1 else tuple(shapes) if shapes else None
        rows.append(ModuleRow(call.key, call.label, call.module_type, depths[call.key], call.op_end - call.op_start,
                              _param_count(trace.model, call.address, cache, saved), shape,
                              memory_held(trace, trace.ops[call.op_start:call.op_end])))
    model = type(trace.model).__name__ if trace.model is not None else "loaded trace"
    title = f"{trace.name} ({model})"
    return Summary(title, rows, len(trace.ops), memory_held(trace))


def _import_roots() -> list[str]:
    """The folders Python imports from (``sys.path``, '' as the working folder), longest first."""
    roots: set[str] = set()
    for entry in sys.path:
        if isinstance(entry, str):
            folder = os.path.abspath(entry or os.curdir)
            roots.update((folder, os.path.realpath(folder)))
    return sorted(roots, key=len, reverse=True)


def package_path(path: str, roots: list[str] | None = None) -> str:
    """A source file's path from its top-level package on, with "/" separators.

    ``.../site-packages/transformers/models/gpt2/modeling_gpt2.py`` becomes
    ``transformers/models/gpt2/modeling_gpt2.py``: the path below the deepest import folder
    (``sys.path`` entry) holding it, widened to the whole package when that folder is itself
    inside a package; a file outside every import folder keeps its package folders (those with
    an ``__init__.py``). A path that is not absolute (``<string>``) is returned as it is.

    Args:
        path: an absolute file path.
        roots: the import folders, longest first (default: from ``sys.path``).
    """
    if not os.path.isabs(path):
        return path
    path = os.path.normpath(path)
    head = os.path.dirname(path)
    for candidate in dict.fromkeys((path, os.path.realpath(path))):
        root = next((r for r in (roots if roots is not None else _import_roots())
                     if candidate.startswith(r.rstrip(os.sep) + os.sep)), None)
        if root is not None:
            path, head = candidate, root
            break
    while os.path.isfile(os.path.join(head, "__init__.py")):  # inside a package: climb to its top
        parent = os.path.dirname(head)
        if parent == head:
            break
        head = parent
    return os.path.relpath(path, head).replace(os.sep, "/")


def op_records(trace: Any) -> list[dict[str, Any]]:
    """One plain dict per op: label, func, module, pass, shape, dtype, source, source_path, parents.

    ``source`` is ``file:line`` with the file from its package on (:func:`package_path`),
    ``source_path`` the recorded full path; ``pass`` is None for the inputs.
    """
    if trace.has_op_graph:
        trace.ensure_graph()
    ops = trace.ops
    roots = _import_roots()
    short: dict[str, str] = {}
    records = []
    for op in ops:
        parents = [] if op.parent_refs is None else list(dict.fromkeys(ops[r.index].label for r in op.parent_refs))
        dtype = op.dtype
        path, colon, line = (op.source or "").rpartition(":")
        if not colon or not line.isdigit():
            path, line = op.source or "", ""
        if path not in short:
            short[path] = package_path(path, roots) if path else path
        records.append({
            "label": op.label, "func": op.func_name,
            "module": None if op.flags & INPUT else op.module,
            "pass": None if op.flags & INPUT else op.module_pass,
            "shape": op.shape, "dtype": None if dtype is None else str(dtype).removeprefix("torch."),
            "source": f"{short[path]}:{line}" if line else short[path], "source_path": path or None,
            "parents": parents,
        })
    return records


_COLUMNS = ("label", "func", "module", "pass", "shape", "dtype", "source", "source_path", "parents")


def to_pandas(trace: Any) -> Any:
    """One row per op: label, func, module, pass, shape, dtype, source, source_path, parents.

    ``pass`` is an integer column (pandas' nullable ``Int64`` when an input row has none);
    ``source`` is ``file:line`` from the model's package on
    (``transformers/models/gpt2/modeling_gpt2.py:123``), ``source_path`` the file's full path.

    Args:
        trace: a Trace or Fork.

    Returns:
        a ``pandas.DataFrame`` indexed by execution order.

    Raises:
        OptionalDependencyError: pandas is not installed.
    """
    try:
        import pandas as pd  # optional, heavy: only this table needs it
    except ImportError as exc:
        raise OptionalDependencyError("to_pandas() needs pandas, which is not installed",
                                      remedy="pip install 'torchlens[pandas]' (or pip install pandas).") from exc
    records = op_records(trace)
    frame = pd.DataFrame(records, columns=list(_COLUMNS))
    passes = [r["pass"] for r in records]
    frame["pass"] = pd.array(passes, dtype="Int64" if None in passes else "int64")
    return frame


@provide_methods(Trace)
class SummaryMethods:
    """``Trace.summary`` and ``Trace.to_pandas``, provided by ``analysis/`` (see ``torchlens.core.actions``)."""

    def summary(self: Trace) -> Summary:
        """Per module call: ops, parameters, output shape and memory held (``print`` it, or show it in a notebook)."""
        return summary(self)

    def to_pandas(self: Trace) -> Any:
        """One row per op (label, func, module, pass, shape, dtype, source, parents) as a pandas DataFrame.

        Raises:
            OptionalDependencyError: pandas is not installed.
        """
        return to_pandas(self)
