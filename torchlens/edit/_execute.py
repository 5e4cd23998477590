"""Re-issuing one recorded op as replay does (:func:`execute`), what can never be re-issued
exactly (:func:`refuse_reason`), and the sets of ops replay treats apart: shape ops that map
new rows alone (``ROW_VIEWS``) and ops whose output memory is uninitialised."""

from __future__ import annotations

from typing import Any

import torch

from ..core.records import INPLACE, NOT_REPLAYABLE, RANDOM, Op
from ..errors import ReplayError

__all__ = ["EVAL_REMEDY", "REEXECUTE", "ROW_VIEWS", "SHARED_TARGETS", "UNINITIALISED", "execute", "refuse_reason"]

REEXECUTE = "do(site, edit, model=model, inputs=x) re-executes the real forward instead."
# Why an in-place op writing several tensors is not re-issued (the recorder flags it NOT_REPLAYABLE).
SHARED_TARGETS = ("writes several tensors that share memory at once (a _foreach_*_ op given overlapping views): "
                  "replay would write them apart")
EVAL_REMEDY = ("Call model.eval() before capturing if this is dropout left on by training mode; otherwise "
               + REEXECUTE)


# Shape ops replay applies to the new rows alone when their input is a RowPatch (see _rerun_view).
ROW_VIEWS = frozenset({"view", "reshape", "transpose", "swapaxes", "t", "permute", "unsqueeze", "squeeze",
                       "flatten", "unflatten"})
# Ops whose output memory is uninitialised: re-issuing them gives arbitrary values, so replay
# gives them the recorded contents (the model overwrites what it uses; this keeps replay exact).
# ``Tensor.new(*sizes)`` (the legacy constructor) is uninitialised too; ``Tensor.new(data)`` copies
# constant data, so keeping its recorded contents gives the same values.
UNINITIALISED = frozenset({"empty", "empty_like", "new_empty", "empty_strided", "empty_permuted", "new"})


def execute(op: Op, args: tuple, kwargs: dict) -> Any:
    """Call an op's function; in-place ops work on a clone so recorded values stay intact."""
    if op.func_name in UNINITIALISED:
        fresh = op.func(*args, **kwargs)
        if op.saved and isinstance(fresh, torch.Tensor) and isinstance(op.out, torch.Tensor) \
                and fresh.shape == op.out.shape and fresh.dtype == op.out.dtype:
            fresh.copy_(op.out)
        return fresh
    if op.flags & INPLACE:
        if "out" in kwargs and isinstance(kwargs["out"], (torch.Tensor, tuple, list)):
            target = kwargs["out"] = _cloned(kwargs["out"])
        else:
            target = _cloned(args[0])  # a list for the _foreach_*_ ops, which write several tensors
            args = (target, *args[1:])
        result = _call(op, args, kwargs)
        return target if result is None or result is target else result
    return _call(op, args, kwargs)


def _cloned(target: Any) -> Any:
    """A copy of an in-place op's target (a tensor, or the tensors of a list or tuple) to write into."""
    if isinstance(target, (tuple, list)):
        copies: dict[int, torch.Tensor] = {}  # one tensor listed twice is written twice: one copy of it
        return type(target)(copies.setdefault(id(t), t.clone()) if isinstance(t, torch.Tensor) else t
                            for t in target)
    return target.clone()


def _call(op: Op, args: tuple, kwargs: dict) -> Any:
    try:
        return op.func(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - re-raised with the op and its model line
        raise ReplayError(
            f"re-executing op {op.label} ({op.func_name}) issued at {op.source} failed: {exc}",
            op_label=op.label,
            source=op.source,
            remedy=REEXECUTE,
        ) from exc


def refuse_reason(op: Op) -> str | None:
    """Why ``op`` can never be re-issued exactly from its recorded arguments (None: it can)."""
    if op.flags & RANDOM:
        return f"op {op.label} ({op.func_name}) at {op.source} draws random numbers"
    if op.flags & NOT_REPLAYABLE and op.flags & INPLACE:
        return f"op {op.label} ({op.func_name}) at {op.source} {SHARED_TARGETS}"
    if op.flags & NOT_REPLAYABLE or op.func is None:
        return f"op {op.label} ({op.func_name}) at {op.source} cannot be re-issued from its recorded arguments"
    return None
