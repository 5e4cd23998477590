"""Pictures of the executed graph: DOT text of a trace, fork or comparison, laid out by Graphviz.

Nodes are ops (label, function, shape) and module calls; modules are nested boxes (DOT
clusters). ``depth`` collapses every module call nested ``depth`` levels below the model into
one node that keeps its in/out edges (``depth=1``: the model's direct children, e.g. the blocks
of a plain transformer, are single nodes); ``depth="auto"`` picks the deepest level whose picture
stays readable (at most :data:`AUTO_MAX_NODES` nodes). ``focus=selector`` draws one region at full
detail, with the ops feeding it and reading from it as dashed context nodes. A module called
several times is drawn once per pass (unrolled) or, with ``rolled=True``, once with "×N" and the
loop edges between its passes.

A fork highlights the sites its edits landed on and the ops replay recomputed; a comparison
(``tl.debug.compare(a, b)``) highlights the first divergence and every diverging site.

Node ids are stable so tests and tools can read the DOT text: an op is ``"<label>"``, a collapsed
module call ``"module:<address>:<pass>"`` (rolled: ``"module:<address>"``), the model output
``"output"``; clusters are ``"cluster:<address>:<pass>"`` (rolled: ``"cluster:<address>"``).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import sys
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core.actions import provide_methods
from ..core.fork import Fork
from ..core.records import EDIT, INPUT, ModuleCall, Op
from ..core.trace import Trace
from ..edit.edits import _caller_stacklevel
from ..errors import DrawingScaledDown, GraphvizNotFoundError, InvalidArgumentError, OptionalDependencyError
from .summary import call_tree, encloses

__all__ = ["AUTO_MAX_NODES", "DrawMethods", "Drawing", "draw", "render", "to_dot"]

AUTO_MAX_NODES = 60  # past this a laid-out graph stops being readable on one screen
FORMATS = ("svg", "png", "pdf", "dot")

_EDITED = "#e53935"  # red: where an edit landed / the first divergence
_RECOMPUTED = "#ffcc80"  # orange: recomputed by replay / diverging
_CONTEXT = "#eeeeee"


@dataclass
class _Scene:
    """What one picture shows: node per op, clusters per module call, highlights."""

    trace: Trace
    depth: int | None
    rolled: bool
    edited_ops: set[int] = field(default_factory=set)
    edited_calls: set[str] = field(default_factory=set)
    hot_ops: set[int] = field(default_factory=set)  # recomputed / diverging ops
    hot_calls: set[str] = field(default_factory=set)
    title: str = ""


# -- the module-call tree -----------------------------------------------------------------


def _owner(trace: Trace, op: Op) -> ModuleCall | None:
    """The innermost module call that ran ``op`` (None for inputs and ops outside the model call)."""
    if op.flags & INPUT or op.module is None:
        return None
    calls = trace.calls_of(op.module)
    if not 1 <= op.module_pass <= len(calls):
        return None
    call = calls[op.module_pass - 1]
    return call if call.op_start <= op.index < call.op_end else None


# -- building the picture ---------------------------------------------------------------------


class _Builder:
    def __init__(self, scene: _Scene, focus_ops: set[int] | None) -> None:
        self.scene = scene
        self.trace = scene.trace
        self.parent, self.depth = call_tree(self.trace)
        self.has_children = {p.key for p in self.parent.values() if p is not None}
        self.focus = focus_ops
        self.rep_call = self._representatives() if scene.rolled else {}

    # rolled view: every call inside a repeated module maps to its counterpart in the first pass
    def _representatives(self) -> dict[str, ModuleCall]:
        rep: dict[str, ModuleCall] = {}
        by_start = {(c.address, c.op_start): c for c in self.trace.calls}
        for address in self.trace.module_addresses:
            calls = self.trace.calls_of(address)
            if len(calls) < 2 or address == "" or any(c.key in rep for c in calls):
                continue
            sizes = {c.op_end - c.op_start for c in calls}
            if len(sizes) != 1:
                continue  # passes differ in shape: keep them unrolled
            first = calls[0]
            for call in calls:
                shift = call.op_start - first.op_start
                for inner in self.trace.calls:
                    if encloses(call, inner):
                        twin = by_start.get((inner.address, inner.op_start - shift))
                        if twin is not None:
                            rep[inner.key] = twin
        return rep

    def _rep(self, call: ModuleCall) -> ModuleCall:
        return self.rep_call.get(call.key, call)

    def rolled_passes(self, call: ModuleCall) -> int:
        return call.n_passes if self.scene.rolled and call.key in self.rep_call else 1

    def call_id(self, call: ModuleCall) -> str:
        call = self._rep(call)
        return call.address if self.scene.rolled and self.rep_call and call.key in self.rep_call else call.key

    def visible(self, op: Op) -> tuple[str, ModuleCall | None]:
        """The node that shows ``op`` (its own, or a collapsed module's) and the cluster it sits in."""
        owner = _owner(self.trace, op)
        collapsed = self._collapsed_call(op)
        if collapsed is not None:
            return f"module:{self.call_id(collapsed)}", self.parent.get(collapsed.key)
        if self.rep_call and owner is not None and owner.key in self.rep_call:
            shift = op.index - owner.op_start
            twin = self.rep_call[owner.key]
            return self.trace.ops[twin.op_start + shift].label, twin
        return op.label, owner

    def build(self) -> tuple[dict[str, tuple[str, ModuleCall | None, Any]], set[tuple[str, str]]]:
        """Nodes (id -> (kind, cluster call, record)) and edges between node ids."""
        trace = self.trace
        trace.ensure_graph()
        nodes: dict[str, tuple[str, ModuleCall | None, Any]] = {}
        edges: set[tuple[str, str]] = set()
        shown = self._shown_ops()
        vis: dict[int, str] = {}
        real: dict[int, str] = {}  # rolled view: the actual pass a collapsed node's op ran in
        for i in sorted(shown):
            op = trace.ops[i]
            node, cluster = self.visible(op)
            cluster = self._rep(cluster) if cluster is not None else None
            vis[i] = node
            context = self.focus is not None and i not in self.focus
            if node.startswith("module:"):
                actual = self._collapsed_call(op)
                real[i] = actual.key
                nodes.setdefault(node, ("module", cluster, self._rep(actual)))
            else:
                rec = trace.ops[trace.op_index(node)]
                nodes.setdefault(node, ("context" if context else "op", None if context else cluster, rec))
        for i in shown:
            op = trace.ops[i]
            for ref in op.parent_refs or ():
                if ref.index not in vis:
                    continue
                if vis[ref.index] != vis[i] or real.get(ref.index, "") != real.get(i, ""):
                    edges.add((vis[ref.index], vis[i]))  # the second case: a rolled module feeding its next pass
        outs = [trace.op_index(label) for label in trace.output_layers]
        if self.focus is None and any(i is not None and i in vis for i in outs):
            nodes["output"] = ("output", None, None)
            edges.update((vis[i], "output") for i in outs if i is not None and i in vis)
        return nodes, edges

    def _collapsed_call(self, op: Op) -> ModuleCall | None:
        """The module call drawn as one node in place of ``op`` (None: the op is drawn itself).

        That is the outermost call around the op at the cut depth, or above it when it has no
        submodule calls (a leaf Linear above the cut is one node, not a box around one op)."""
        cut = self.scene.depth
        if self.focus is not None or cut is None:
            return None
        chain: list[ModuleCall] = []
        c = _owner(self.trace, op)
        while c is not None:
            chain.append(c)
            c = self.parent.get(c.key)
        for call in reversed(chain):  # outermost first
            if call.address and (self.depth[call.key] == cut or call.key not in self.has_children):
                return call
        return None

    def _shown_ops(self) -> set[int]:
        ops = self.trace.ops
        if self.focus is None:
            return set(range(len(ops)))
        shown = set(self.focus)
        for i in self.focus:
            shown.update(r.index for r in ops[i].parent_refs or ())
            shown.update(ops[i].children_idx or ())
        return shown


def _scene_for(obj: Any, depth: Any, rolled: bool, highlight: Any) -> _Scene:
    comparison = None
    if hasattr(obj, "first_divergence") and hasattr(obj, "diffs"):
        comparison = obj
        trace = _compared_trace(obj)
    elif isinstance(obj, Trace):
        trace = obj
    elif not isinstance(obj, type) and isinstance(getattr(obj, "trace", None), Trace):
        trace = obj.trace  # an object standing for one trace: a generation's step
    else:
        raise InvalidArgumentError(
            f"draw() takes a trace, a fork, a generation step or a comparison, got {type(obj).__name__}")
    if not trace.has_op_graph:
        raise InvalidArgumentError(
            "this trace was captured without an op graph (module outputs only), so there is no graph to draw",
            remedy="Capture with tl.trace(model, x) (not tl.extract or backend='hooks').")
    scene = _Scene(trace, None, rolled, title=_title(trace, comparison))
    _mark_edits(scene, trace)
    if comparison is None and highlight is not None:
        comparison = highlight
    if comparison is not None:
        _mark_comparison(scene, comparison)
    scene.depth = _pick_depth(scene, depth)
    return scene


def _compared_trace(comparison: Any) -> Trace:
    sources = [ref() for ref in getattr(comparison, "sources", ()) if ref() is not None]
    if len(sources) < 2:
        raise InvalidArgumentError(
            "this comparison no longer holds its traces (they were freed), so there is no graph to draw",
            remedy="Keep the traces alive and call tl.draw(b, highlight=tl.debug.compare(a, b)).")
    return sources[1]


def _title(trace: Trace, comparison: Any) -> str:
    model = type(trace.model).__name__ if trace.model is not None else "loaded trace"
    what = f"{trace.name} ({model}): {len(trace.ops)} ops, {len(trace.calls)} module calls"
    if comparison is not None:
        first = comparison.first_divergence
        what += f" — compare {comparison.a!r} vs {comparison.b!r}: " + (
            "no differences" if first is None else f"first divergence {first.label}")
    return what


def _mark_edits(scene: _Scene, trace: Trace) -> None:
    for op in trace.ops:
        if op.flags & EDIT:
            scene.edited_ops.add(op.index)
    for e in trace.edits:
        if trace.has_label(e.label):
            scene.edited_ops.add(trace.op_index(e.label))
            continue
        calls = trace.calls_of(e.label)
        for call in calls if e.pass_index is None else calls[e.pass_index - 1:e.pass_index]:
            scene.edited_calls.add(call.key)
            scene.edited_ops.update(r.index for r in call.out_refs if r is not None)
    if isinstance(trace, Fork):
        scene.hot_ops.update(trace.fork_state().values)


def _mark_comparison(scene: _Scene, comparison: Any) -> None:
    trace = scene.trace
    first = comparison.first_divergence
    for d in comparison.diverged:
        strong = first is not None and d.key == first.key and d.kind == first.kind
        if d.kind == "op":
            index = trace.op_index(d.key)
            if index is not None:
                (scene.edited_ops if strong else scene.hot_ops).add(index)
        else:
            (scene.edited_calls if strong else scene.hot_calls).add(d.key)
            address, _, pass_index = d.key.rpartition(":")
            calls = trace.calls_of(address)
            if strong and pass_index.isdigit() and 0 < int(pass_index) <= len(calls):
                scene.edited_ops.update(r.index for r in calls[int(pass_index) - 1].out_refs if r is not None)


def _pick_depth(scene: _Scene, depth: Any) -> int | None:
    if depth is None:
        return None
    if depth != "auto":
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise InvalidArgumentError(f"depth is a positive int, None (every op) or 'auto'; got {depth!r}")
        return depth
    _, depths = call_tree(scene.trace)
    deepest = max(depths.values(), default=0)
    if len(scene.trace.ops) + 1 <= AUTO_MAX_NODES:
        return None
    for d in range(deepest, 0, -1):
        scene.depth = d
        nodes, _ = _Builder(scene, None).build()
        if len(nodes) <= AUTO_MAX_NODES:
            return d
    return 1


def _focus_ops(trace: Trace, focus: Any) -> set[int] | None:
    if focus is None:
        return None
    region: set[int] = set()
    for site in trace.find_sites(focus):
        rec = site.record
        region.update(range(rec.op_start, rec.op_end) if isinstance(rec, ModuleCall) else (rec.index,))
    return region


# -- DOT text ---------------------------------------------------------------------------------


def _q(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _shape_text(shape: Any) -> str:
    if shape is None:
        return "?"
    if isinstance(shape, tuple) and shape and all(isinstance(s, int) for s in shape):
        return "×".join(str(s) for s in shape)
    return str(shape).replace(" ", "")


def to_dot(obj: Any, *, depth: int | str | None = "auto", focus: Any = None, rolled: bool = False,
           highlight: Any = None) -> str:
    """The DOT source of the executed graph of ``obj``.

    Args:
        obj: a Trace, a Fork (edits and recomputed ops highlighted) or a comparison from
            ``tl.debug.compare(a, b)`` (the graph of ``b``, divergences highlighted).
        depth: collapse module calls nested this many levels below the model into single
            nodes; None draws every op; "auto" picks the deepest readable level.
        focus: a selector (module path, ``tl.in_module(...)``, op label ...): draw that region
            at full detail with its direct inputs and readers as context.
        rolled: draw every pass of a repeated module once (with loop edges), not once per pass.
        highlight: a comparison whose divergences to highlight on a trace or fork.

    Returns:
        the DOT text (needs no Graphviz installed).

    Raises:
        InvalidArgumentError: ``obj`` is not drawable, or ``depth`` is not valid.
        SiteNotFoundError / EmptySelectionError: ``focus`` matches nothing.
    """
    scene = _scene_for(obj, depth, rolled, highlight)
    builder = _Builder(scene, _focus_ops(scene.trace, focus))
    nodes, edges = builder.build()
    lines = [
        "digraph torchlens {",
        f"  graph [rankdir=TB, fontname=Helvetica, fontsize=11, labelloc=t, label={_q(scene.title)}, "
        "newrank=true];",
        '  node [shape=box, style="rounded,filled", fillcolor="#f5f5f5", fontname=Helvetica, fontsize=10];',
        "  edge [color=\"#607d8b\", arrowsize=0.6];",
    ]
    clusters: dict[str | None, list[str]] = {}
    for node_id, (kind, cluster, rec) in nodes.items():
        key = builder.call_id(cluster) if cluster is not None and cluster.address != "" else None
        clusters.setdefault(key, []).append(_node_line(builder, node_id, kind, rec))
    needed = _cluster_calls(builder, [c for _, c, _ in nodes.values() if c is not None])
    lines.extend(clusters.pop(None, []))
    lines.extend(_cluster_lines(builder, needed, clusters))
    lines.extend(f"  {_q(a)} -> {_q(b)};" for a, b in sorted(edges, key=lambda e: (_order(nodes, e[0]),
                                                                                  _order(nodes, e[1]))))
    lines.append("}")
    return "\n".join(lines) + "\n"


def _order(nodes: dict, node_id: str) -> tuple[int, str]:
    rec = nodes[node_id][2]
    if isinstance(rec, Op):
        return rec.index, node_id
    if isinstance(rec, ModuleCall):
        return rec.op_start, node_id
    return 1 << 60, node_id


def _node_line(b: _Builder, node_id: str, kind: str, rec: Any) -> str:
    scene = b.scene
    attrs: dict[str, str] = {}
    if kind == "output":
        attrs.update(label=_q("output"), shape="oval", fillcolor='"#c5cae9"')
    elif kind == "module":
        n = b.rolled_passes(rec)
        name = rec.address + (f" ×{n}" if n > 1 else "" if rec.n_passes == 1 or scene.rolled
                              else f" (pass {rec.pass_index}/{rec.n_passes})")
        inside = range(rec.op_start, rec.op_end)
        attrs.update(label=_q("\n".join((name, rec.module_type, _shape_text(_call_shape(b.trace, rec))))),
                     shape="box3d", fillcolor='"#e3f2fd"')
        if rec.key in scene.edited_calls or any(i in scene.edited_ops for i in inside):
            attrs.update(fillcolor=f'"{_EDITED}"', fontcolor="white", penwidth="2")
        elif rec.key in scene.hot_calls or any(i in scene.hot_ops for i in inside):
            attrs.update(fillcolor=f'"{_RECOMPUTED}"')
    else:
        attrs.update(label=_q("\n".join((rec.label, rec.func_name, _shape_text(rec.shape)))))
        if rec.flags & INPUT:
            attrs.update(shape="oval", fillcolor='"#c8e6c9"')
        if kind == "context":
            attrs.update(style='"rounded,dashed,filled"', fillcolor=f'"{_CONTEXT}"', fontcolor='"#757575"')
        if rec.index in scene.edited_ops:
            attrs.update(fillcolor=f'"{_EDITED}"', fontcolor="white", penwidth="2")
        elif rec.index in scene.hot_ops:
            attrs.update(fillcolor=f'"{_RECOMPUTED}"')
    return f"  {_q(node_id)} [{', '.join(f'{k}={v}' for k, v in attrs.items())}];"


def _call_shape(trace: Trace, call: ModuleCall) -> Any:
    shapes = [trace.ops[r.index].shape for r in call.out_refs if r is not None]
    return shapes[0] if len(shapes) == 1 else tuple(shapes) if shapes else None


def _cluster_calls(b: _Builder, calls: Iterable[ModuleCall]) -> set[str]:
    """Every cluster that must be drawn: the calls holding nodes and all their ancestors."""
    needed: set[str] = set()
    for call in calls:
        c: ModuleCall | None = call
        while c is not None and c.address != "":
            needed.add(c.key)
            c = b.parent.get(c.key)
    return needed


def _cluster_lines(b: _Builder, needed: set[str], members: dict[str | None, list[str]]) -> list[str]:
    children: dict[str | None, list[ModuleCall]] = {}
    by_key = {c.key: c for c in b.trace.calls}
    for key in needed:
        call = by_key[key]
        parent = b.parent.get(key)
        children.setdefault(parent.key if parent is not None and parent.address != "" else None, []).append(call)
    out: list[str] = []
    done: set[str] = set()

    def emit(call: ModuleCall, indent: str) -> None:
        cid = b.call_id(call)
        if cid in done:
            return
        done.add(cid)
        n = b.rolled_passes(call)
        label = call.address + (f" ×{n}" if n > 1 else "" if call.n_passes == 1 or b.scene.rolled
                                else f" (pass {call.pass_index}/{call.n_passes})")
        color = _EDITED if call.key in b.scene.edited_calls else "#90a4ae"
        out.append(f"{indent}subgraph {_q('cluster:' + cid)} {{")
        out.append(f"{indent}  label={_q(f'{label} ({call.module_type})')}; style=rounded; color=\"{color}\"; "
                   "fontsize=10;")
        out.extend(indent + line for line in members.get(cid, []))
        for child in sorted(children.get(call.key, []), key=lambda c: c.op_start):
            emit(child, indent + "  ")
        out.append(f"{indent}}}")

    for top in sorted(children.get(None, []), key=lambda c: c.op_start):
        emit(top, "  ")
    return out


# -- rendering --------------------------------------------------------------------------------


def render(dot: str, fmt: str = "svg") -> bytes:
    """Lay out ``dot`` with Graphviz and return the picture's bytes.

    Args:
        dot: DOT source (from :func:`to_dot`).
        fmt: "svg", "png" or "pdf".

    Returns:
        the file content.

    Raises:
        OptionalDependencyError: the ``graphviz`` Python package is not installed.
        GraphvizNotFoundError: Graphviz's ``dot`` program is not installed.
        InvalidArgumentError: an unknown format.

    Warns:
        DrawingScaledDown: Graphviz shrank a bitmap (PNG) to fit its size limit.
    """
    if fmt not in FORMATS or fmt == "dot":
        raise InvalidArgumentError(f"cannot render format {fmt!r}; use one of svg, png, pdf")
    try:
        import graphviz  # optional: the viz extra
    except ImportError as exc:
        raise OptionalDependencyError("drawing needs the graphviz Python package, which is not installed",
                                      remedy="pip install 'torchlens[viz]' (or pip install graphviz); "
                                             "trace.to_dot() works without it.") from exc
    # graphviz hands dot's stderr to sys.stderr: catch it to turn a silent shrink into a warning
    with contextlib.redirect_stderr(io.StringIO()) as said:
        try:
            data = graphviz.Source(dot).pipe(format=fmt)
        except graphviz.ExecutableNotFound as exc:
            raise GraphvizNotFoundError("Graphviz's 'dot' program was not found on PATH, so the graph cannot be "
                                        "laid out (trace.to_dot() still returns the DOT source)") from exc
    _report_graphviz(said.getvalue(), fmt)
    return data


# dot's message when a bitmap would pass its size limit (32767 px a side for cairo):
# "dot: graph is too large for cairo-renderer bitmaps. Scaling by 0.704621 to fit"
_SCALED = re.compile(r"too (?:large|big)\b.*?scaling by ([0-9.]+)", re.IGNORECASE)


def _report_graphviz(text: str, fmt: str) -> None:
    """Warn ``DrawingScaledDown`` for a shrunk bitmap; pass any other Graphviz message on to stderr."""
    rest = []
    for line in text.splitlines(keepends=True):
        scaled = _SCALED.search(line)
        if scaled is None:
            rest.append(line)
            continue
        warnings.warn(f"Graphviz scaled this {fmt.upper()} picture down by {scaled.group(1)} to fit its bitmap size "
                      f"limit, so its labels may be unreadable. {DrawingScaledDown.remedy}",
                      DrawingScaledDown, stacklevel=_caller_stacklevel())
    if rest:
        sys.stderr.write("".join(rest))


class Drawing:
    """A drawn graph: ``.dot`` source, ``.path`` of the written file, inline SVG in notebooks."""

    def __init__(self, dot: str, path: Path | None = None) -> None:
        self.dot = dot
        self.path = path
        self._svg: str | None = None

    def svg(self) -> str:
        """The picture as SVG text (laid out once, then cached)."""
        if self._svg is None:
            self._svg = render(self.dot, "svg").decode("utf-8")
        return self._svg

    def png(self) -> bytes:
        """The picture as PNG bytes."""
        return render(self.dot, "png")

    def _repr_svg_(self) -> str | None:
        try:
            return self.svg()
        except (GraphvizNotFoundError, OptionalDependencyError):
            return None  # the notebook falls back to __repr__, which says how to get the picture

    def __repr__(self) -> str:
        where = f" written to {self.path}" if self.path is not None else ""
        return (f"<Drawing: {self.dot.count(' -> ')} edges{where}; .dot holds the source, .svg() lays it out "
                f"with Graphviz>")


def draw(obj: Any, path: str | os.PathLike | None = None, *, fmt: str | None = None,
         depth: int | str | None = "auto", focus: Any = None, rolled: bool = False, highlight: Any = None) -> Drawing:
    """Draw the executed graph of a trace, fork, generation step or comparison (see :func:`to_dot` for the options).

    Args:
        obj: a Trace, a Fork, or a comparison from ``tl.debug.compare(a, b)``.
        path: write the picture here; the suffix (.svg, .png, .pdf, .dot) picks the format.
        fmt: the format when ``path`` has no known suffix (default svg).
        depth: see :func:`to_dot`.
        focus: see :func:`to_dot`.
        rolled: see :func:`to_dot`.
        highlight: see :func:`to_dot`.

    Returns:
        a :class:`Drawing` (shown inline by Jupyter).

    Raises:
        GraphvizNotFoundError: a picture file was asked for and Graphviz's ``dot`` is missing.
        OptionalDependencyError: the graphviz Python package is missing.
        InvalidArgumentError: an unknown format.
    """
    dot = to_dot(obj, depth=depth, focus=focus, rolled=rolled, highlight=highlight)
    if path is None:
        return Drawing(dot)
    target = Path(path)
    fmt = (fmt or target.suffix.lstrip(".") or "svg").lower()
    if fmt not in FORMATS:
        raise InvalidArgumentError(f"cannot write {target.name!r}: unknown format {fmt!r}",
                                   remedy="Use a .svg, .png, .pdf or .dot file name, or pass fmt=.")
    data = dot.encode("utf-8") if fmt == "dot" else render(dot, fmt)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(data)
    return Drawing(dot, target)


@provide_methods(Trace)
class DrawMethods:
    """``Trace.to_dot`` and ``Trace.draw``, provided by ``analysis/`` (see ``torchlens.core.actions``)."""

    def to_dot(self: Trace, *, depth: int | str | None = "auto", focus: Any = None, rolled: bool = False,
               highlight: Any = None) -> str:
        """The DOT source of the executed graph (works without Graphviz installed).

        Args:
            depth: collapse module calls nested this deep into single nodes; None: every op;
                "auto": the deepest level that stays readable.
            focus: a selector: draw that region at full detail, with its inputs and readers.
            rolled: draw a module called several times once, with loop edges.
            highlight: a ``tl.debug.compare`` result whose divergences to highlight.

        Returns:
            the DOT text.
        """
        return to_dot(self, depth=depth, focus=focus, rolled=rolled, highlight=highlight)

    def draw(self: Trace, path: str | os.PathLike | None = None, *, fmt: str | None = None,
             depth: int | str | None = "auto", focus: Any = None, rolled: bool = False,
             highlight: Any = None) -> Drawing:
        """Draw the executed graph with Graphviz: a file at ``path`` (.svg/.png/.pdf/.dot), inline in notebooks.

        Args:
            path: where to write the picture (None: only return the Drawing).
            fmt: the format when ``path`` has no known suffix.
            depth: see :meth:`to_dot`.
            focus: see :meth:`to_dot`.
            rolled: see :meth:`to_dot`.
            highlight: see :meth:`to_dot`.

        Returns:
            a ``Drawing`` (``.dot``, ``.path``, ``.svg()``; shown inline by Jupyter).

        Raises:
            GraphvizNotFoundError: Graphviz's ``dot`` program is not installed (``to_dot()`` still works).
        """
        return draw(self, path, fmt=fmt, depth=depth, focus=focus, rolled=rolled, highlight=highlight)
