"""Saved traces: ``trace.save`` / ``tl.load_trace``, on the safe on-disk layer shared with recipes.

A save is a directory: ``manifest.json`` (the graph as plain JSON) and
``tensors.safetensors`` (every tensor it carries). Loading must be safe for a file from a
stranger, so it never unpickles and never imports. The layers below live in their own
modules: :mod:`torchlens.ondisk` (the directory: atomic writes, safe reads),
:mod:`torchlens.safetensors_io` (the checked tensor file), :mod:`torchlens.format_checks`
(strict JSON and field checks), :mod:`torchlens.value_codec` (values as JSON),
:mod:`torchlens.fn_allowlist` (functions by name) and :mod:`torchlens.trace_decode`
(rebuilding a trace). Their public names stay importable from here.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .._progress import track
from ..capture._trace_store import read_back
from ..core.actions import provide_methods
from ..core.records import EDIT, INPUT, Deferred, ModuleCall, Op
from ..core.selectors import as_selector
from ..core.trace import Trace
from ..core.tree import unflatten
from ..errors import NotPortableError
from ._fingerprints import fingerprint_of
from ._fn_allowlist import function_name, function_table
from ._load_checks import MAX_DEPTH, MAX_DIM, fail, guarded, loading, loads_json
from ._ondisk import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    MAX_MANIFEST_BYTES,
    TENSOR_FILE,
    SavedDir,
    check_file_name,
    check_path_arg,
    dumps_manifest,
    installed_version,
    read_file_entry,
    read_manifest,
    read_tensors,
    read_views,
    write_dir,
)
from ._safetensors import MAX_HEADER_BYTES, ST_DTYPES, ST_NAMES, check_declared, read_safetensors, write_safetensors
from ._trace_decode import SourceLocation, UnavailableEdit, build_trace, fields
from ._value_codec import Decoder, Opaque, SavedRecord, TensorTable, encode
from .recipes import encode_steps

__all__ = [
    "SaveMethod",
    "FORMAT", "FORMAT_VERSION", "MANIFEST", "MAX_DEPTH", "MAX_DIM", "MAX_HEADER_BYTES", "MAX_MANIFEST_BYTES",
    "ST_DTYPES", "ST_NAMES", "TENSOR_FILE", "Decoder", "Opaque", "SavedDir", "SavedRecord", "SourceLocation",
    "TensorTable", "UnavailableEdit", "check_declared", "check_file_name", "check_path_arg", "dumps_manifest",
    "encode", "fail", "fields", "function_name", "function_table", "guarded", "load_trace", "loads_json",
    "read_file_entry", "read_manifest", "read_safetensors", "read_tensors", "save_trace", "write_dir",
    "write_safetensors",
]


# -- saving a trace -------------------------------------------------------------------------


def _root(trace: Any) -> Any:
    """The trace whose records a fork shares (a fork re-executed with ``model=`` owns new ones)."""
    while getattr(trace, "parent", None) is not None and trace.parent.ops is trace.ops:
        trace = trace.parent
    return trace


def _capture_whens(base: Any) -> list[Any]:
    """The capture-time edits of the run: ``base.steps`` plus any edit op's own ``When``
    (a fork re-executed with ``model=`` ran its replay steps as capture-time edits)."""
    whens = list(base.steps)
    seen = {id(w) for w in whens}
    for op in base.ops:
        when = getattr(op.func, "when", None) if op.flags & EDIT else None
        if when is not None and id(when) not in seen:
            seen.add(id(when))
            whens.append(when)
    return whens


def _tensor_names(model: Any) -> dict[int, str]:
    names: dict[int, str] = {}
    if isinstance(model, torch.nn.Module):
        for name, p in model.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), f"param/{name}")
        for name, b in model.named_buffers(remove_duplicate=False):
            names.setdefault(id(b), f"buffer/{name}")
    return names


def save_trace(trace: Any, path: Any, selector: Any = None, overwrite: bool = False) -> Path:
    """Write ``trace`` (or a fork) as a directory: graph JSON + activations safetensors.

    Args:
        selector: keep only the activations of ops / module calls it matches (plus the
            inputs and a fork's edits). Parameters and other constants ops read are then
            left out too, so the loaded trace is for reading, not for replay.
        overwrite: replace an earlier TorchLens save at ``path``.

    Returns:
        the directory written.

    Raises:
        RecipeExistsError: ``path`` exists (and ``overwrite`` is false).
    """
    # A value read back from a trace's store (``store=``) is listed, not kept, and read again as
    # it is written: saving a trace kept on disk holds one value at a time, not all of them.
    with read_back() as stored:
        return _save(trace, path, selector, overwrite, stored)


def _save(trace: Any, path: Any, selector: Any, overwrite: bool, stored: Callable[[torch.Tensor], Any]) -> Path:
    base = _root(trace)
    is_fork = trace is not base
    if base.ops:
        base.ensure_graph()
    keep = None if selector is None else _keep_set(trace, as_selector(selector).match(trace))
    table = TensorTable(views=True)
    arg_names = _tensor_names(trace.model) or base.saved_tensor_names

    def put(t: torch.Tensor, stem: str) -> dict:
        origin = stored(t)
        if origin is not None:
            store, name = origin
            view = store.view_of(name)  # stored as a view: listed as one, of the tensor it views
            listed = None if view is None else table.put_lazy_view(origin, t, (store, view[0]), view[1], stem)
            return {"tensor": listed or table.put_lazy(origin, t, lambda: store.get(name), stem)}
        return {"tensor": table.put(t, arg_names.get(id(t), stem))}

    def put_as(stem: str) -> Callable[[torch.Tensor], dict]:
        return lambda t: put(t, stem)

    whens = _capture_whens(base)
    step_index = {id(w): k for k, w in enumerate(whens)}
    ops = [_encode_op(op, put_as, keep, step_index) for op in track(base.ops, desc="save trace", unit="op")]
    calls = [_encode_call(c, put_as, keep) for c in base.calls]
    steps, unsaved = encode_steps([("capture", w.site, w.edit) for w in whens], base, table, "trace")
    manifest: dict[str, Any] = {
        "kind": "trace",
        "torchlens_version": installed_version(),
        "fingerprint": fingerprint_of(trace),
        "name": base.name,
        "engine": base.engine,
        "op_graph": base.has_op_graph,
        "complete": base.complete,
        "grad": bool(getattr(base, "grad", False)),
        "ops": ops,
        "calls": calls,
        "input_layers": list(base.input_layers),
        "output_layers": list(base.output_layers),
        "call_args": encode((tuple(base.args), dict(base.kwargs)), put_as("input"), strict=False),
        "output": _encode_output(base, put_as, keep),
        "output_refs": [None if r is None else [r.index, r.elem] for r in base.output_refs],
        "data_reads": [[r.position, None if r.ref is None else [r.ref.index, r.ref.elem],
                        getattr(r.code, "co_filename", "<unknown>"), r.lineno, r.name]
                       for r in base.data_reads],
        "stale": [[i, p] for i, p in sorted(base.stale_positions().items())],
        "edits": [_applied(e) for e in base.edits],
        "steps": steps,
        "unsaved_steps": unsaved,
        "fork": _encode_fork(trace, put_as, keep, table) if is_fork else None,
    }
    if table.views:
        manifest["views"] = dict(sorted(table.views.items()))
    return write_dir(path, manifest, table.tensors, overwrite=overwrite)


def _keep_set(trace: Any, matched: list[Any]) -> set[int]:
    """Records whose values a selector-limited save keeps (a kept module output is read
    through the ops that produced it, as a capture's ``save=`` does)."""
    keep = {id(r) for r in matched}
    for r in matched:
        if isinstance(r, ModuleCall):
            keep.update(id(trace.ops[ref.index]) for ref in r.out_refs if ref is not None)
    return keep


def _applied(e: Any) -> dict[str, Any]:
    return {"site": e.site, "label": e.label, "pass": e.pass_index, "n_changed": e.n_changed}


def _kept(record: Any, keep: set[int] | None) -> bool:
    return keep is None or id(record) in keep


def _encode_op(op: Op, put_as: Callable, keep: set[int] | None, step_index: dict[int, int]) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "label": op.label,
        "func": None if op.flags & (INPUT | EDIT) else function_name(op.func),
        "func_name": op.func_name,
        "module": op.module,
        "pass": op.module_pass,
        "flags": op.flags,
        "source": None if op._code is None else [op._code.co_filename, op._lineno],
        "args": None,
        "out": None,
    }
    if not op.flags & INPUT and op.args_spec is not None:
        leaves, spec = op.args_spec
        # An offloaded weight is recorded as a reference to the offload: the file gets the tensor.
        leaves = [leaf.load() if isinstance(leaf, Deferred) else leaf for leaf in leaves]
        # A selector-limited save is for reading a few sites: weights are left out, which
        # makes the ops that read them non-replayable in the loaded trace.
        put = put_as(f"const/{op.label}") if keep is None else (lambda t: {"opaque": "Tensor (not saved)"})
        entry["args"] = encode(unflatten(list(leaves), spec), put, strict=False)
    if op.saved and (op.flags & INPUT or _kept(op, keep)):
        try:
            entry["out"] = encode(op.out, put_as(f"op/{op.label}"))  # .out: a disk-backed value is read back
        except NotPortableError:
            entry["out"] = None
    if entry["out"] is None and op.shape is not None:  # keep what a dropped value looked like
        entry["meta"] = encode((op.shape, op.dtype), lambda t: None, strict=False)
    if op.flags & EDIT:
        entry["edit"] = _encode_edit_op(op, step_index)
    return entry


def _encode_edit_op(op: Op, step_index: dict[int, int]) -> dict[str, Any]:
    applier = op.func
    ctx = getattr(applier, "ctx", None)
    record = getattr(ctx, "op", None)
    target = {"module": record.key} if isinstance(record, ModuleCall) else {"op": getattr(record, "label", None)}
    spec = getattr(applier, "spec", None)
    n = len(op.args_spec[0]) if op.args_spec else 0
    return {
        "step": step_index.get(id(getattr(applier, "when", None))),
        "target": target,
        "ctx": [getattr(ctx, "site", ""), getattr(ctx, "label", op.label), getattr(ctx, "module", op.module),
                getattr(ctx, "pass_index", op.module_pass)],
        "skeleton": None if spec is None else encode(unflatten([0] * n, spec), lambda t: None, strict=False),
    }


def _encode_call(call: ModuleCall, put_as: Callable, keep: set[int] | None) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "address": call.address, "pass": call.pass_index, "type": call.module_type,
        "start": call.op_start, "end": call.op_end,
        "out_refs": [None if r is None else [r.index, r.elem] for r in call.out_refs],
        "out": None, "skeleton": None,
    }
    if call._out is not None and _kept(call, keep):
        entry["out"] = encode(call._out, put_as(f"module/{call.key}"), strict=False)
    elif call.out_spec is not None:
        # placeholders must not be None: ModelOutput drops None fields, losing leaves
        entry["skeleton"] = encode(unflatten([0] * len(call.out_refs), call.out_spec), lambda t: None,
                                   strict=False)
    return entry


def _encode_output(base: Any, put_as: Callable, keep: set[int] | None) -> Any:
    refs = [r for r in base.output_refs if r is not None]
    if keep is not None and not all(id(base.ops[r.index]) in keep for r in refs):
        return None
    return encode(base.raw_output, put_as("output"), strict=False)


def _encode_fork(fork: Any, put_as: Callable, keep: set[int] | None, table: TensorTable) -> dict[str, Any]:
    state = fork.fork_state()
    values = [[i, encode(v, put_as(f"fork/{fork.ops[i].label}"), strict=False)]
              for i, v in sorted(state.values.items()) if _kept(fork.ops[i], keep)]
    subst = [[i, pos, encode(v, put_as(f"fork/subst/{fork.ops[i].label}"), strict=False)]
             for i, (pos, v) in sorted(state.subst.items())]
    overrides = [[k, encode(v, put_as(f"fork/module/{k}"), strict=False)] for k, v in state.overrides.items()]
    recipe, unsaved = encode_steps([("replay", s.site, s.edit) for s in state.recipe], fork, table, "fork")
    return {"name": fork.name, "values": values, "subst": subst, "overrides": overrides,
            "recipe": recipe, "unsaved_steps": unsaved, "edits": [_applied(e) for e in state.edits]}


# -- loading a trace ------------------------------------------------------------------------


def load_trace(path: Any) -> Any:
    """Load a saved trace (or fork) for reads, ``find_sites``, ``compare`` and replay.

    Nothing in the directory is executed: functions are resolved by name against torch's
    overridable functions; an unknown name leaves that op readable but not replayable.
    The loaded trace has no model (``trace.model is None``); ``trace.run(model)`` re-runs
    the stored inputs on a model you pass.

    Args:
        path: the directory ``trace.save`` wrote.

    Returns:
        a Trace, or a Fork (whose ``parent`` is the loaded base trace) if a fork was saved.

    Raises:
        RecipeFormatError: the directory is malformed, hostile or newer (the subclasses
            FormatVersionError and UnsafePathError say which).
    """
    check_path_arg(path)
    with loading("trace"):
        with SavedDir(path) as d:
            manifest = read_manifest(d, "trace")
            tensors = read_tensors(d, manifest)
            tensors.update(read_views(manifest, tensors))
        return guarded(build_trace, manifest, tensors)


@provide_methods(Trace)
class SaveMethod:
    """``Trace.save``, provided by ``store/`` (see ``torchlens.core.actions``)."""

    def save(self: Trace, path: Any, *, selector: Any = None, overwrite: bool = False) -> Path:
        """Write the graph (JSON) and activations (safetensors), optionally only ``selector``'s ops
        (see :func:`save_trace`)."""
        return save_trace(self, path, selector=selector, overwrite=overwrite)
