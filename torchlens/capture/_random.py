"""Forwards that draw random numbers: the warning a capture gives, and the refusal of the workflows.

A model left in training mode runs dropout: its forward draws a new mask on every call, so a
recorded value is one draw among many, replay cannot reproduce the ops that drew it, and
patching or attribution would compare random draws. The recorder flags each such op ``RANDOM``
as it records it (``Recorder.random``: nothing is looked for afterwards); the module-only engine
records no ops and looks at the model's dropout modules instead, once per capture.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

from torch import nn

from ..core.records import RANDOM
from ..edit.edits import _caller_stacklevel
from ..errors import RandomForwardError, RandomOpsWarning
from ._classify import DROPOUT_NAMES

__all__ = ["active_dropout", "refuse_random", "warn_random"]

_DROPOUT = nn.modules.dropout._DropoutNd
_SHOWN = 5  # ops or modules named in a message; the rest are counted


def active_dropout(modules: Iterable[tuple[str, nn.Module]]) -> list[str]:
    """The addresses of dropout modules that are on: training mode and ``p > 0``."""
    return [address for address, module in modules
            if module.training and isinstance(module, _DROPOUT) and module.p > 0]


def _listed(names: list[str]) -> str:
    more = len(names) - _SHOWN
    return ", ".join(names[:_SHOWN]) + (f" and {more} more" if more > 0 else "")


def _why(model: Any, ops: list[Any], dropout: list[str]) -> str:
    """What drew the random numbers, in words: training mode first when it is the cause."""
    from_dropout = dropout or any(op.func_name in DROPOUT_NAMES or op.func_name == "scaled_dot_product_attention"
                                  for op in ops)
    if getattr(model, "training", False) or from_dropout:
        return "the model is in training mode, so dropout is on"
    return "the model's forward itself draws random numbers"


def _described(ops: list[Any], dropout: list[str]) -> str:
    if ops:
        where = [f"{op.label} in {op.module or 'the model'}" for op in ops]
        return f"{_count(len(ops), 'op')} drew random numbers ({_listed(where)})"
    return f"{_count(len(dropout), 'dropout module')} on ({_listed(dropout)})"


def _count(n: int, what: str) -> str:
    return f"{n} {what}" if n == 1 else f"{n} {what}s"


def warn_random(model: Any, ops: list[Any], dropout: list[str]) -> None:
    """Warn (``RandomOpsWarning``) that a capture's forward drew random numbers: ``ops`` the
    recorded ops flagged ``RANDOM``, ``dropout`` the dropout modules that are on."""
    why = _why(model, ops, dropout)
    remedy = ("call model.eval() before capturing" if why.startswith("the model is in training")
              else "seed it (torch.manual_seed) to reproduce a run")
    warnings.warn(f"this capture's forward is random: {_described(ops, dropout)}; {why}. Its values are one "
                  f"random draw, and replay and the patching workflows refuse those ops: {remedy}",
                  RandomOpsWarning, stacklevel=_caller_stacklevel())


def refuse_random(what: str, *traces: Any, model: Any = None) -> None:
    """Refuse (``RandomForwardError``) a workflow whose runs drew random numbers: ops of ``traces``
    flagged ``RANDOM``, or, with ``model``, dropout modules that are on now (for a workflow that runs
    the model itself).

    Raises:
        RandomForwardError: naming ``what``, the ops or modules, and ``model.eval()`` first.
    """
    ops = [op for trace in traces for op in trace.ops if op.flags & RANDOM]
    dropout = active_dropout(model.named_modules()) if isinstance(model, nn.Module) else []
    if not ops and not dropout:
        return
    owner = model if model is not None else next((t.model for t in traces if t.model is not None), None)
    why = _why(owner, ops, dropout)
    raise RandomForwardError(
        f"{what} compares runs of the model, and they are random: {_described(ops, dropout)}; {why}",
        remedy=RandomForwardError.remedy if why.startswith("the model is in training")
        else "Seed the model's random ops or take them out of its forward; model.eval() turns off dropout only.",
        ops=[op.label for op in ops], modules=dropout)
