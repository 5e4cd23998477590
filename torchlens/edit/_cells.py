"""Batched cells: the patching cells of a grid replayed as the entries of one growing batch.

A patching cell on a short prompt recomputes a few rows per op, so on a CPU each op costs
the read of its weights, not its arithmetic: cells replayed apart read every weight once per
cell. Here the cells stack their edited values along a new leading axis and the recorded ops
downstream of their sites run on the stack under :func:`torch.vmap` (each entry is one cell,
so shapes baked into the recorded arguments — ``view(1, 8, 12, 64)`` — stay right and entries
never mix); the cells of a later site join the batch there (:func:`run_cells`), so each weight
is read once per segment for every cell. Each cell then gets its model output (a fork holding
the values it recomputed), or only the elements a patching metric reads
(:class:`~torchlens.edit.reads.OutputRead`).

:func:`plan_cells` declares, before anything runs, why a site cannot be replayed this way
(a guard or an in-place op the edit reaches, a value rewritten through a view, a module edit
whose readers include its own ops, an op ``torch.vmap`` cannot batch: a boolean mask or a count
the edit reaches, ``x[mask]`` or ``nonzero``, whose output shape would differ from cell to cell,
or a call vmap has no batching rule for); the caller then replays those cells as forks
(``Trace.forks``) and records the reason. Should vmap still refuse an op while the batch runs
(its own ``RuntimeError`` about batching rules or data-dependent shapes or control flow), the
sites whose cells reach that op are handed back with that reason (:func:`run_cells`) and only
the other sites' batch runs again; any other error propagates.

Through causal attention or on long prompts slicing
(``torchlens.edit._slicing``, which recomputes only the rows an edit reaches) wins:
:func:`mixes_back` measures the first, and when to batch is the caller's rule
(``patching.activation``).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from ..core.records import EDIT, GUARD, INPLACE, INPUT, ModuleCall, Op, Ref, build_args
from ..core.tree import flatten, held_tensors, unflatten
from ._execute import UNINITIALISED, refuse_reason
from .reads import OutputRead

__all__ = ["CellPass", "mixes_back", "plan_cells", "run_cells", "site_index"]

# vmap runs attention's fused CPU kernel entry by entry (no batching rule yet) and says so on every
# call; the values are exact, and the cost is small next to the batched weight reads.
_NO_RULE = "There is a performance drop because we have not yet implemented the batching rule"
# What functorch's own refusals say ("vmap: We do not support batching operators that can output
# dynamic shape", "Batching rule not implemented for aten::...", "vmap: ... data-dependent control
# flow"): a RuntimeError matching this while the batch runs is vmap's limit, not the model's error.
_VMAP_REFUSAL = re.compile(r"\bvmap\b|batching rule", re.IGNORECASE)


class CellPass(NamedTuple):
    """One batched pass: the ops downstream of op ``site`` in recorded order, the ops each cell's
    fork receives (``keep``: the outputs and what the output's caches hold), and ``read`` when
    only the metric's elements of the LM head are computed."""

    site: int
    ops: tuple[Op, ...]
    keep: tuple[int, ...]
    read: OutputRead | None


def plan_cells(trace: Any, record: Op | ModuleCall, read: OutputRead | None = None) -> CellPass | str:
    """How cells editing ``record``'s value run as one batch, or why they cannot (a sentence).

    Args:
        trace: the trace the cells fork (its op graph built).
        record: what the site matched: an op, or a module call whose first output tensor the
            cells edit (``restore_rows``).
        read: the metric's read of the LM head (``patching.activation``), or None.

    Returns:
        the :class:`CellPass`, or the reason it cannot apply.
    """
    site = site_index(trace, record)
    if isinstance(site, str):
        return site
    if not isinstance(trace.value(site), torch.Tensor):
        return f"the site's value ({trace.ops[site].label}) is not a tensor"
    if trace.stale_positions():
        return "the forward writes into tensors through views (in-place ops), which a batch cannot lay out again"
    reached = {site}
    ops: list[Op] = []
    for op in trace.ops[site + 1:]:
        if op.flags & INPUT or not any(r.index in reached for r in op.parent_refs):
            continue
        why = _unbatchable(trace, op, reached) or _refused(op)
        if why is not None:
            return why
        unsaved = next((r for r in op.parent_refs if r.index not in reached and not trace.has_value(r.index)), None)
        if unsaved is not None:
            return f"the trace did not keep {trace.ops[unsaved.index].label}, which op {op.label} reads"
        reached.add(op.index)
        ops.append(op)
    for data_read in trace.data_reads:
        if data_read.position > site and any(r.index in reached for r in data_read.refs):
            return (f"the forward branched on a value the edit reaches ({data_read.name}() at {data_read.source}): "
                    "each cell must check that guard alone")
    keep = _kept(trace, reached)
    if isinstance(keep, str):
        return keep
    if read is not None and (read.index not in reached or not _partial(trace.ops[read.index], reached)):
        read = None
    return CellPass(site, tuple(ops), keep, read)


def run_cells(trace: Any, passes: Sequence[CellPass], values: Sequence[Sequence[torch.Tensor]],
              names: Sequence[Sequence[str]]) -> list[list[Any] | str]:
    """Replay the cells of several sites as one growing batch.

    The batch starts at the first site with its cells; at each later site its cells join as new
    entries (their values before that site are the recorded ones), so every op after the last
    site runs once for every cell and each weight is read once per segment between two sites,
    not once per site. Entries never mix (``torch.vmap``; each entry computes only from its own
    site on).

    Args:
        trace: the trace planned on.
        passes: :func:`plan_cells`'s passes, one per site, in recorded order of their sites.
        values: per pass, per cell, the site's value after the cell's edit (the recorded shape and dtype).
        names: per pass, per cell, the name of the fork that holds its output.

    Returns:
        per pass, per cell, the elements the passes' ``read`` names (the LM head's row and
        columns, as ``replay_reads`` gives them: used when every pass has it), or else the model
        output of a fork of ``trace`` holding the values the cell recomputed; or, for a pass
        whose cells reach an op ``torch.vmap`` refused while running (a limit :func:`plan_cells`
        did not foresee), that refusal as a sentence: the other passes then ran again without it.

    Raises:
        ValueError: passes of repeated sites or out of recorded order.
    """
    sites = [c.site for c in passes]
    if sites != sorted(set(sites)):
        raise ValueError(f"run_cells takes passes of distinct sites in recorded order, got sites {sites}")
    try:
        return list(_run_chain(trace, passes, values, names))
    except _VmapRefused as refused:
        hit = [k for k, c in enumerate(passes) if any(op.index == refused.op.index for op in c.ops)]
        if not hit:  # (cannot happen: every op of the batch belongs to a pass)
            raise refused.__cause__ from None
        rest = [k for k in range(len(passes)) if k not in hit]
        got = run_cells(trace, [passes[k] for k in rest], [values[k] for k in rest],
                        [names[k] for k in rest]) if rest else []
        out: list[list[Any] | str] = [refused.reason] * len(passes)
        for k, g in zip(rest, got):
            out[k] = g
        return out


def _run_chain(trace: Any, passes: Sequence[CellPass], values: Sequence[Sequence[torch.Tensor]],
               names: Sequence[Sequence[str]]) -> list[list[Any]]:
    """:func:`run_cells` without its fallback: raises :class:`_VmapRefused` when vmap refuses an op."""
    sites = [c.site for c in passes]
    read = passes[0].read if all(c.read == passes[0].read for c in passes) else None
    keep = tuple(sorted({i for c in passes for i in c.keep}))
    wanted = (read.index,) if read is not None else keep
    ops = sorted({op.index: op for c in passes for op in c.ops}.values(), key=lambda op: op.index)
    last = _last_reads(ops)
    live: dict[int, torch.Tensor] = {}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_NO_RULE)
        for k, (c, vals) in enumerate(zip(passes, values)):
            live = _join(trace, live, c.site, torch.stack(list(vals)))
            stop = sites[k + 1] if k + 1 < len(sites) else len(trace.ops)
            segment = CellPass(c.site, tuple(op for op in ops if c.site < op.index <= stop), (), read)
            keep_after = tuple(i for i in set(live) | {op.index for op in segment.ops}
                               if last.get(i, -1) > stop or i in wanted)
            live = torch.vmap(lambda state, seg=segment, out=keep_after: _segment(trace, seg, state, out))(live)
    got = [live[i] for i in wanted]
    results: list[list[Any]] = []
    n = 0
    for group in names:
        results.append([])
        for name in group:
            if read is not None:
                results[-1].append(got[0][n])
            else:
                fork = trace.fork(name)
                for index, value in zip(keep, got):
                    fork.changes.set_recomputed(index, _entry(value, n))
                results[-1].append(fork.output)
            n += 1
    return results


def _join(trace: Any, live: dict[int, torch.Tensor], site: int, entries: torch.Tensor) -> dict[int, torch.Tensor]:
    """The batch with ``entries`` (new cells editing op ``site``) appended: their other values are
    the recorded ones (nothing before their site changed), the batch's old entries keep theirs."""
    if not live:
        return {site: entries}
    size = len(entries)
    old = len(flatten(next(iter(live.values())))[0][0])
    joined = {i: _cat(v, entries if i == site else _repeat(trace.value(i), size)) for i, v in live.items()}
    if site not in joined:
        joined[site] = torch.cat([_repeat(trace.value(site), old), entries])
    return joined


def _repeat(value: Any, n: int) -> Any:
    """``n`` entries of a recorded value (a tensor, or a tuple of them), as views."""
    leaves, spec = flatten(value)
    return unflatten([t.unsqueeze(0).expand(n, *t.shape) for t in leaves], spec)


def _cat(a: Any, b: Any) -> Any:
    """Batches ``a`` then ``b`` of one value (tensors, or tuples of them), along the batch axis."""
    (la, spec), lb = flatten(a), flatten(b)[0]
    return unflatten([torch.cat([x, y]) for x, y in zip(la, lb)], spec)


def _segment(trace: Any, seg: CellPass, state: dict[int, Any], out: tuple[int, ...]) -> dict[int, Any]:
    """Run ``seg.ops`` for one cell (vmap runs it for a batch) from the values ``state`` holds
    (the rest are the trace's); the values of ops ``out``."""
    new = dict(state)
    for op in seg.ops:
        args, kwargs = build_args(op, lambda r, j=op.index: _seen(trace, new, r, j))
        if seg.read is not None and op.index == seg.read.index:
            new[op.index] = _read_part(op, args, kwargs, seg.read)
        else:
            try:
                new[op.index] = op.func(*args, **kwargs)
            except RuntimeError as err:
                if not _VMAP_REFUSAL.search(str(err)):
                    raise
                raise _VmapRefused(op, err) from err
    return {i: new[i] for i in out}


class _VmapRefused(Exception):
    """``torch.vmap`` refused op ``op`` of the batch (its ``RuntimeError`` is the cause): the sites
    whose cells reach it replay as forks, with :attr:`reason`. Never leaves :func:`run_cells`."""

    def __init__(self, op: Op, err: RuntimeError) -> None:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        self.op = op
        self.reason = f"torch.vmap could not batch op {op.label} ({op.func_name}) at {op.source}: {first}"
        super().__init__(self.reason)


def _last_reads(ops: Sequence[Op]) -> dict[int, int]:
    """Per op index, the last position at which one of ``ops`` reads it."""
    last: dict[int, int] = {}
    for op in ops:
        for r in op.parent_refs:
            last[r.index] = max(last.get(r.index, -1), op.index)
    return last


def mixes_back(trace: Any, cells: CellPass, end: int, axis: int = 1) -> bool:
    """Whether an edit of the site's last row along ``axis`` reaches the first row of op ``end``
    (a later site, e.g. the same block's output): True for bidirectional attention (an encoder),
    where a cell's edit spreads to every row, False for causal attention, where slicing keeps
    the rows before the edit. Computed by running the ops up to ``end`` once on a changed last row."""
    if end not in {op.index for op in cells.ops}:
        return False
    x = trace.value(cells.site).clone()
    x.select(axis, x.shape[axis] - 1).add_(1.0)
    part = cells._replace(ops=tuple(op for op in cells.ops if op.index <= end), read=None)
    with torch.no_grad():
        new = _segment(trace, part, {cells.site: x}, (end,))[end]
    old = trace.value(end)
    return not torch.equal(new.select(axis, 0), old.select(axis, 0))


def _seen(trace: Any, new: dict[int, Any], ref: Any, consumer: int) -> Any:
    """What op ``consumer`` reads for ``ref``: the batch's value when the edit reached it, else the trace's."""
    v = new.get(ref.index)
    if v is None:
        return trace.seen_value(ref, consumer)
    return v if ref.elem is None else v[ref.elem]


def site_index(trace: Any, record: Op | ModuleCall) -> int | str:
    """The op whose value the cells edit: the record itself, or the op a module call returns
    when only ops after the call read it (an edit on a module is seen after it returns)."""
    if isinstance(record, Op):
        return record.index
    refs = [r for r in record.out_refs if r is not None]
    if not refs or refs[0].elem is not None:
        return f"module {record.address} returns its value inside another op's output"
    op = trace.ops[refs[0].index]
    if any(c < record.op_end for c in op.children_idx):
        return f"ops inside module {record.address} read its output before it returns"
    return op.index


class _Arg:
    """A recorded op's tensor argument as :func:`_unbatchable` sees it: whether the cells' edit
    reaches it (under vmap: a batched argument, one value per cell) and its dtype."""

    __slots__ = ("reached", "dtype")

    def __init__(self, reached: bool, dtype: torch.dtype | None) -> None:
        self.reached, self.dtype = reached, dtype


_MASKS = (torch.bool, torch.uint8)


def _reached_mask(args: tuple, kwargs: dict) -> bool:
    """An index or mask argument (after the indexed tensor) that is boolean and reached by the edit."""
    return any(isinstance(a, _Arg) and a.reached and a.dtype in _MASKS for a in flatten((args[1:], kwargs))[0])


def _arg(args: tuple, kwargs: dict, pos: int, name: str) -> Any:
    return args[pos] if len(args) > pos else kwargs.get(name)


def _is_tensor(a: Any) -> bool:
    return isinstance(a, (_Arg, torch.Tensor))


def _reached(a: Any) -> bool:
    return isinstance(a, _Arg) and a.reached


# Per op name, why torch.vmap cannot run it on the batch given its recorded call (None: it can),
# each found by running the op under vmap: an output shape that depends on values the edit reaches
# (vmap stacks one shape for all cells), or a call vmap has no batching rule or fallback for.
_SHAPE = "returns a shape that depends on values the edit reaches ({}), which can differ from cell to cell"
_NO_RULE_FOR = "has no batching rule in torch.vmap ({})"
_VMAP_LIMITS: dict[str, Callable[[Op, tuple, dict], str | None]] = {
    **dict.fromkeys(("getitem", "index", "index_put", "masked_select"), lambda op, a, k: _SHAPE.format(
        "it selects elements by a boolean mask: x[mask]") if _reached_mask(a, k) else None),
    **dict.fromkeys(("nonzero", "argwhere", "unique", "unique_consecutive"), lambda op, a, k: _SHAPE.format(
        "it lists or counts the input's elements")),
    "where": lambda op, a, k: _SHAPE.format("one-argument where lists the input's nonzero elements")
    if op.flags & GUARD else None,
    "repeat_interleave": lambda op, a, k: _SHAPE.format("the repeat counts") if (
        _reached(_arg(a, k, 1, "repeats")) or (_arg(a, k, 1, "repeats") is None and _reached(_arg(a, k, 0, "input")))
    ) else None,
    "bincount": lambda op, a, k: _SHAPE.format("its length is the largest value + 1")
    if _reached(_arg(a, k, 0, "input")) else None,
    "tensor_split": lambda op, a, k: _NO_RULE_FOR.format("split at a tensor of indices")
    if _is_tensor(_arg(a, k, 1, "indices")) or _is_tensor(k.get("tensor_indices_or_sections")) else None,
    "narrow": lambda op, a, k: _NO_RULE_FOR.format("a tensor start") if _is_tensor(_arg(a, k, 2, "start")) else None,
    **dict.fromkeys(("lstm", "gru", "rnn_tanh", "rnn_relu", "lstm_cell"), lambda op, a, k: _NO_RULE_FOR.format(
        "a recurrent layer's fused kernel")),
    "one_hot": lambda op, a, k: _SHAPE.format("one_hot without num_classes: its width is the largest class + 1")
    if _arg(a, k, 1, "num_classes") in (None, -1) else None,
}


def _unbatchable(trace: Any, op: Op, reached: set[int]) -> str | None:
    """Why ``torch.vmap`` cannot run ``op`` on the cells' batch, read from its recorded call
    (None: it can). ``reached``: the ops the edit reached before ``op``."""
    rule = _VMAP_LIMITS.get(op.func_name)
    if rule is None:
        return None
    args, kwargs = build_args(op, lambda r: _Arg(r.index in reached, _ref_dtype(trace, r)))
    why = rule(op, args, kwargs)
    return None if why is None else f"op {op.label} ({op.func_name}) at {op.source} {why}"


def _ref_dtype(trace: Any, ref: Ref) -> torch.dtype | None:
    op = trace.ops[ref.index]
    if ref.elem is None or not trace.has_value(ref.index):
        return op.dtype if ref.elem is None else None
    value = trace.value(ref.index)[ref.elem]
    return value.dtype if isinstance(value, torch.Tensor) else None


def _refused(op: Op) -> str | None:
    """Why a batch cannot recompute ``op`` (None: it can)."""
    why = refuse_reason(op)
    if why is not None:
        return why
    if op.flags & INPLACE:
        return f"op {op.label} ({op.func_name}) at {op.source} writes in place into a value the edit reaches"
    if op.flags & (EDIT | GUARD):
        what = "an edit applied during capture" if op.flags & EDIT else "a guard (its indices choose what runs next)"
        return f"op {op.label} ({op.func_name}) at {op.source} is {what}"
    if op.func_name in UNINITIALISED:
        return f"op {op.label} ({op.func_name}) at {op.source} returns uninitialised memory"
    return None


def _kept(trace: Any, reached: set[int]) -> tuple[int, ...] | str:
    """The reached ops a cell's fork needs for its output: those the model returns, and those
    whose tensors an object of the output holds (a KV cache)."""
    keep: list[int] = []
    for ref in trace.output_refs:
        if ref is not None and ref.index in reached and ref.index not in keep:
            keep.append(ref.index)
    held = {id(t) for leaf in flatten(trace.output)[0] if not isinstance(leaf, torch.Tensor)
            for _, t in held_tensors(leaf)}
    if held:
        keep += [i for i in sorted(reached) if trace.has_value(i) and id(trace.value(i)) in held and i not in keep]
    for i in keep:
        if not trace.has_value(i) or not _tensors(trace.value(i)):
            return f"the model returns {trace.ops[i].label}, which is not a tensor or a tuple of tensors"
    return tuple(keep)


def _tensors(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    return isinstance(value, (tuple, list)) and bool(value) and all(isinstance(v, torch.Tensor) for v in value)


def _partial(op: Op, reached: set[int]) -> bool:
    """Whether the LM head ``op`` can compute only the read elements: a ``linear`` that nothing
    else reads, whose weight and bias the edit leaves alone."""
    if op.func_name != "linear" or op.children_idx:
        return False
    args, kwargs = build_args(op, lambda r: r.index in reached)  # each recorded argument: does the edit reach it?
    if len(args) < 2 or kwargs.keys() - {"bias"} or args[0] is not True:
        return False
    return not any(a is True for a in (*args[1:], *kwargs.values()))


def _read_part(op: Op, args: tuple, kwargs: dict, read: OutputRead) -> torch.Tensor:
    """The LM head's elements ``read`` names (row ``read.position``, its columns) of one cell."""
    x, weight = args[0], args[1]
    bias = args[2] if len(args) > 2 else kwargs.get("bias")
    if read.columns is not None:
        cols = list(read.columns)
        weight = weight[cols]
        bias = None if bias is None else bias[cols]
    return op.func(x.narrow(read.axis, read.position, 1), weight, bias).squeeze(read.axis)


def _entry(value: Any, i: int) -> Any:
    return value[i] if isinstance(value, torch.Tensor) else type(value)(v[i] for v in value)
