"""Rebuilding a saved trace (or fork) from its checked manifest and tensors.

Every field is checked before it is used: op and call indices must point backwards,
references must name stored tensors of the right shape, functions are looked up in the
allowlist (never imported), and a capture-time edit whose code was not saved gets a
stand-in that refuses to replay. A function name not on the allowlist gets a refusing
stand-in too, and loading warns ``FunctionsNotResolved`` naming those ops at once.
"""

from __future__ import annotations

import re
import warnings
import weakref
from typing import Any

import torch
from torch.utils import _pytree as pytree

from .._progress import track
from ..capture._recorder import EditApplier
from ..core.builder import TraceBuilder
from ..core.changes import ForkState
from ..core.fork import Fork
from ..core.records import EDIT, INPUT, NOT_REPLAYABLE, ModuleCall, Op, Ref
from ..core.trace import DataRead
from ..core.tree import flatten
from ..edit.edits import AppliedEdit, EditContext, _caller_stacklevel
from ..errors import FunctionsNotResolved, ReplayNotExactError
from ._fingerprints import check_fingerprint_dict
from ._fn_allowlist import UnresolvedFunction, resolve_function
from ._load_checks import check_int, fail
from ._value_codec import Decoder, Opaque
from .recipes import decode_steps

__all__ = ["SourceLocation", "UnavailableEdit", "build_trace", "fields"]

_QUALNAME = re.compile(r"(flat:)?[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*){0,6}\Z")


class SourceLocation:
    """Where a loaded op was issued (stands in for the code object a live capture keeps)."""

    __slots__ = ("co_filename", "co_name")

    def __init__(self, filename: str, name: str = "") -> None:
        self.co_filename = filename
        self.co_name = name


class UnavailableEdit:
    """The function of a loaded capture-time edit op whose edit could not be saved."""

    __name__ = "edit"

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx
        # why the op cannot be re-issued (tl.validate lists it as not checked with this reason)
        self.refusal = f"the capture-time edit at {ctx.site} was not saved with the trace (a plain function edit)"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise ReplayNotExactError(
            self.refusal,
            remedy="Re-capture with the model (trace.run(model)), or use named helpers so the edit is saved.",
        )


def _get(obj: Any, key: str, kinds: Any, where: str) -> Any:
    if not isinstance(obj, dict) or key not in obj:
        raise fail(f"{where} lacks {key!r}")
    value = obj[key]
    if kinds is not None and not (isinstance(value, kinds) and not (type(value) is bool and bool not in (
            kinds if isinstance(kinds, tuple) else (kinds,)))):
        raise fail(f"{where}: {key!r} has the wrong type ({type(value).__name__})")
    return value


def _str(obj: Any, key: str, where: str, limit: int = 4096) -> str:
    value = _get(obj, key, str, where)
    if len(value) > limit:
        raise fail(f"{where}: {key!r} is too long")
    return value


_TRACE_KEYS = {"format", "kind", "format_version", "torchlens_version", "fingerprint", "name", "engine", "complete",
               "ops", "calls", "input_layers", "output_layers", "call_args", "output", "output_refs", "data_reads",
               "stale", "edits", "steps", "unsaved_steps", "fork", "tensors", "files"}
_OP_KEYS = {"label", "func", "func_name", "module", "pass", "flags", "source", "args", "out"}
_CALL_KEYS = {"address", "pass", "type", "start", "end", "out_refs", "out", "skeleton"}
_FORK_KEYS = {"name", "values", "subst", "overrides", "recipe", "unsaved_steps", "edits"}


def fields(obj: Any, required: set[str], where: str, optional: set[str] = frozenset()) -> dict[str, Any]:
    """``obj`` as a dict with exactly the ``required`` keys (plus any of ``optional``)."""
    if not isinstance(obj, dict):
        raise fail(f"{where} must be an object")
    missing, extra = required - set(obj), set(obj) - required - optional
    if missing or extra:
        raise fail(f"{where}: missing fields {sorted(missing)[:5]}, unknown fields {sorted(extra)[:5]}")
    return obj


def build_trace(m: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Any:
    """The Trace (or Fork) a checked manifest ``m`` and its ``tensors`` describe; run it under ``guarded``."""
    fields(m, _TRACE_KEYS, "the manifest", {"grad", "op_graph", "views"})
    build = TraceBuilder(None)
    base = build.trace
    dec = Decoder(tensors)
    ops_json = _get(m, "ops", list, "manifest")
    for i, entry in enumerate(track(ops_json, desc="load trace", unit="op")):
        build.add_op(_decode_op(i, entry, dec))
    n = len(base.ops)
    if len({op.label for op in base.ops}) != n:
        raise fail("op labels are not unique")
    for i, entry in enumerate(_get(m, "calls", list, "manifest")):
        build.add_call(_decode_call(i, entry, dec, n))
    steps, unsaved_steps = decode_steps(m["steps"], m["unsaved_steps"], dec, "capture")
    for i, entry in enumerate(ops_json):
        if base.ops[i].flags & EDIT:
            _attach_edit(base.ops[i], entry.get("edit"), base, steps)
    call_args = dec.value(m["call_args"], "call_args")
    if not (isinstance(call_args, tuple) and len(call_args) == 2 and isinstance(call_args[0], tuple)
            and isinstance(call_args[1], dict) and all(isinstance(k, str) for k in call_args[1])):
        raise fail("call_args must be (args, kwargs)")
    op_graph = m.get("op_graph", bool(ops_json))  # saved before the field existed: a hooks trace has no ops
    if not isinstance(op_graph, bool):
        raise fail("op_graph must be true or false")
    build.restore(
        name=_str(m, "name", "manifest"),
        engine=_str(m, "engine", "manifest", 100),
        op_graph=op_graph,
        complete=_get(m, "complete", bool, "manifest"),
        grad=m.get("grad", False) is True,
        fingerprint=check_fingerprint_dict(m["fingerprint"]),
        args=call_args[0],
        kwargs=call_args[1],
        input_layers=_labels(m, "input_layers", base),
        output_layers=_labels(m, "output_layers", base),
        output=dec.value(m["output"], "output"),
        output_refs=_refs(m["output_refs"], "output_refs", n),
        data_reads=[_data_read(r, n) for r in _get(m, "data_reads", list, "manifest")],
        stale={check_int(i, "stale", 0, n - 1): check_int(p, "stale", 0, n) for i, p in _pairs(m["stale"], "stale")},
        edits=_edits(m["edits"]),
        steps=[w for w in steps if w is not None],
        unsaved_steps=unsaved_steps,
        # a re-save of this trace names parameters as the original save did
        saved_tensor_names={id(t): k for k, t in tensors.items() if k.startswith(("param/", "buffer/"))},
    )
    _check_refs(base)
    _warn_unresolved(base)
    if m["fork"] is None:
        dec.check_all_used()
        return base
    fork_json = fields(m["fork"], _FORK_KEYS, "fork")
    fork = Fork(base, _str(fork_json, "name", "fork"))
    values = {check_int(i, "fork value", 0, n - 1): dec.value(v, f"fork value {i}")
              for i, v in _pairs(fork_json["values"], "fork values")}
    subst = {}
    for item in _get(fork_json, "subst", list, "fork"):
        if not (isinstance(item, list) and len(item) == 3):
            raise fail("fork substitutions are malformed")
        subst[check_int(item[0], "fork subst", 0, n - 1)] = (check_int(item[1], "fork subst", 0, n),
                                                            dec.value(item[2], "fork subst"))
    keys = {c.key for c in base.calls}
    overrides = {}
    for key, v in _pairs(fork_json["overrides"], "fork overrides"):
        if not isinstance(key, str) or key not in keys:
            raise fail(f"fork override names unknown module call {str(key)[:80]!r}")
        overrides[key] = dec.value(v, f"fork override {key}")
    recipe, unsaved = decode_steps(fork_json["recipe"], fork_json["unsaved_steps"], dec, "replay")
    fork.changes.restore_fork(ForkState(values, subst, overrides, [s for s in recipe if s is not None],
                                _edits(fork_json["edits"])), unsaved)
    dec.check_all_used()
    return fork


def _warn_unresolved(base: Any) -> None:
    """Say at load time which ops name a function that is not on the allowlist (their replay refuses)."""
    found = [op for op in base.ops if isinstance(op.func, UnresolvedFunction)]
    if not found:
        return
    named = ", ".join(f"{op.label} ({op.func.name or 'no name saved'})" for op in found[:10])
    more = f" and {len(found) - 10} more" if len(found) > 10 else ""
    warnings.warn(
        f"this saved trace names {len(found)} function(s) that are not on TorchLens's allow-list of torch functions, "
        f"so those ops can be read but not re-issued: {named}{more}. A fork whose replay reaches them raises "
        "ReplayNotExactError and tl.validate lists them as not checked; re-execute with the model instead "
        "(fork.do(site, edit, model=model, inputs=x)).",
        FunctionsNotResolved, stacklevel=_caller_stacklevel(),
    )


def _check_refs(base: Any) -> None:
    """Every reference must name an op whose stored value has that shape of output."""

    def check(ref: Ref | None, what: str) -> None:
        if ref is None:
            return
        op = base.ops[ref.index]
        if not op.saved:
            return
        out = op._out
        ok = isinstance(out, torch.Tensor) if ref.elem is None else (
            isinstance(out, (tuple, list)) and ref.elem < len(out) and isinstance(out[ref.elem], torch.Tensor))
        if not ok:
            raise fail(f"{what} refers to {op.label}" + ("" if ref.elem is None else f"[{ref.elem}]")
                       + ", which holds no such tensor")

    for op in base.ops:
        for ref in op.parent_refs or ():
            check(ref, f"op {op.label}")
    for call in base.calls:
        for ref in call.out_refs:
            check(ref, f"module call {call.key}")
    for ref in base.output_refs:
        check(ref, "the model output")
    for read in base.data_reads:
        check(read[1], "a data read")


def _pairs(value: Any, what: str) -> list[list[Any]]:
    if not isinstance(value, list) or not all(isinstance(p, list) and len(p) == 2 for p in value):
        raise fail(f"{what} must be a list of pairs")
    return value


def _labels(m: dict, key: str, base: Any) -> list[str]:
    labels = _get(m, key, list, "manifest")
    if not all(isinstance(x, str) and base.has_label(x) for x in labels):
        raise fail(f"{key} names ops that do not exist")
    return labels


def _refs(value: Any, what: str, limit: int) -> list[Ref | None]:
    if not isinstance(value, list):
        raise fail(f"{what} must be a list")
    out: list[Ref | None] = []
    for r in value:
        if r is None:
            out.append(None)
        elif isinstance(r, list) and len(r) == 2:
            elem = None if r[1] is None else check_int(r[1], what, 0, 1 << 20)
            out.append(Ref(check_int(r[0], f"{what} index", 0, limit - 1), elem))
        else:
            raise fail(f"{what} holds a malformed reference")
    return out


def _source(entry: dict, where: str) -> tuple[Any, int]:
    src = entry.get("source")
    if src is None:
        return None, 0
    if not (isinstance(src, list) and len(src) == 2 and isinstance(src[0], str)):
        raise fail(f"{where}: malformed source")
    return SourceLocation(src[0][:4096]), check_int(src[1], f"{where}: source line", 0, 1 << 31)


def _decode_op(i: int, entry: Any, dec: Decoder) -> Op:
    where = f"op {i}"
    fields(entry, _OP_KEYS, where, {"edit", "meta"})
    label = _str(entry, "label", where, 500)
    flags = check_int(entry["flags"], f"{where}: flags", 0, 255)
    if ("edit" in entry) != bool(flags & EDIT):
        raise fail(f"{where}: edit metadata and the edit flag disagree")
    name = _get(entry, "func", (str, type(None)), where)
    func = None
    if name is not None:
        if not _QUALNAME.match(name):
            raise fail(f"{where}: malformed function name {name[:80]!r}")
        func = resolve_function(name)
    if func is None and not flags & (INPUT | EDIT):
        flags |= NOT_REPLAYABLE
        func = UnresolvedFunction(name)
    code, lineno = _source(entry, where)
    op = Op(i, label, func, _str(entry, "func_name", where, 200), None, _str(entry, "module", where, 1000),
            check_int(entry["pass"], f"{where}: pass", 1, 1 << 31), code, lineno, None, None, flags)
    if entry["out"] is None:
        op.saved = False
        if "meta" in entry:
            op._meta = _meta(Decoder({}).value(entry["meta"], f"{where} meta"), where)
    else:
        op._out = dec.value(entry["out"], f"{where} output")
        out = op._out
        if not (isinstance(out, torch.Tensor) or (
                isinstance(out, (tuple, list)) and all(isinstance(t, (torch.Tensor, type(None))) for t in out))):
            raise fail(f"{where}: an op's output is a tensor or a sequence of tensors")
    if flags & INPUT:
        if entry["out"] is None or entry["args"] is not None:
            raise fail(f"{where}: an input has a stored value and no arguments")
        op.args_spec, op.parent_refs = None, []
        return op

    def on_ref(index: int, elem: int | None) -> Ref:
        if index >= i:
            raise fail(f"{where} reads op {index}, which does not run before it")
        return Ref(index, elem)

    dec.on_ref = on_ref
    try:
        structure = dec.value(entry["args"], f"{where} arguments")
    finally:
        dec.on_ref = None
    if not (isinstance(structure, tuple) and len(structure) == 2 and isinstance(structure[0], tuple)
            and isinstance(structure[1], dict) and all(isinstance(k, str) for k in structure[1])):
        raise fail(f"{where}: arguments must be (args, kwargs)")
    leaves, spec = pytree.tree_flatten(structure)
    if any(isinstance(leaf, Opaque) for leaf in leaves):
        op.flags |= NOT_REPLAYABLE
    op.args_spec = (leaves, spec)
    op.parent_refs = [leaf for leaf in leaves if type(leaf) is Ref]
    return op


def _meta(value: Any, where: str) -> tuple[Any, torch.dtype | None]:
    """(shape, dtype) of a value that was not saved: a shape is a tuple of ints, or of such tuples."""

    def is_shape(s: Any) -> bool:
        return isinstance(s, tuple) and all(type(d) is int and d >= 0 for d in s)

    if not (isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], (torch.dtype, type(None)))
            and (is_shape(value[0]) or (isinstance(value[0], tuple) and all(is_shape(s) for s in value[0])))):
        raise fail(f"{where}: meta must be (shape, dtype)")
    return value[0], value[1]


def _decode_call(i: int, entry: Any, dec: Decoder, n: int) -> ModuleCall:
    where = f"module call {i}"
    fields(entry, _CALL_KEYS, where)
    start = check_int(entry["start"], f"{where}: start", 0, n)
    end = check_int(entry["end"], f"{where}: end", start, n)
    call = ModuleCall(_str(entry, "address", where, 1000), check_int(entry["pass"], f"{where}: pass", 1, 1 << 31),
                      _str(entry, "type", where, 200), None, None, start)
    call.op_end = end
    call.out_refs = _refs(entry["out_refs"], f"{where} out_refs", end)
    out, skeleton = entry["out"], entry["skeleton"]
    if out is not None:
        call._out = dec.value(out, f"{where} output")
        leaves, call.out_spec = flatten(call._out)
    elif skeleton is not None:
        leaves, call.out_spec = flatten(Decoder({}).value(skeleton, f"{where} skeleton"))
    else:
        leaves = [None] * len(call.out_refs)
    if len(leaves) != len(call.out_refs):
        raise fail(f"{where}: output has {len(leaves)} leaves but {len(call.out_refs)} references")
    return call


def _data_read(r: Any, n: int) -> tuple:
    if not (isinstance(r, list) and len(r) == 5 and isinstance(r[2], str) and isinstance(r[4], str)):
        raise fail("data_reads are malformed")
    ref = _refs([r[1]], "data_reads", n)[0]
    return DataRead(check_int(r[0], "data_reads", 0, n), ref, SourceLocation(r[2][:4096]),
                    check_int(r[3], "data_reads", 0, 1 << 31), r[4][:100])


def _edits(value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise fail("edits must be a list")
    out = []
    for e in value:
        if not (isinstance(e, dict) and set(e) == {"site", "label", "pass", "n_changed"}):
            raise fail("an applied edit is malformed")
        out.append(AppliedEdit(str(e["site"])[:1000], str(e["label"])[:1000],
                               None if e["pass"] is None else check_int(e["pass"], "edit pass", 0, 1 << 31),
                               check_int(e["n_changed"], "edit n_changed")))
    return out


def _attach_edit(op: Op, meta: Any, base: Any, steps: list[Any]) -> None:
    """Give a loaded capture-time edit op a function: the saved edit, or a refusing stand-in."""
    where = f"edit op {op.label}"
    fields(meta, {"step", "target", "ctx", "skeleton"}, where)
    target = _get(meta, "target", dict, where)
    record: Any = None
    if isinstance(target.get("module"), str):
        record = next((c for c in base.calls if c.key == target["module"]), None)
    elif isinstance(target.get("op"), str):
        index = base.op_index(target["op"])
        record = base.ops[index] if index is not None else None
    ctx_fields = _get(meta, "ctx", list, where)
    if len(ctx_fields) != 4 or not all(isinstance(x, (str, int, type(None))) for x in ctx_fields):
        raise fail(f"{where}: malformed ctx")
    ctx = EditContext(str(ctx_fields[0]), str(ctx_fields[1]), ctx_fields[2], ctx_fields[3], record,
                      weakref.proxy(base))
    step = meta.get("step")
    skeleton = meta.get("skeleton")
    spec = None if skeleton is None else flatten(Decoder({}).value(skeleton, where))[1]
    if type(step) is int and 0 <= step < len(steps) and steps[step] is not None:
        op.func = EditApplier(steps[step], spec, ctx)
    else:
        op.func = UnavailableEdit(ctx)
        op.flags |= NOT_REPLAYABLE
