"""Replay that computes, of the final op, only what its reader reads (patching metrics).

A patching cell scores one number, e.g. a logit difference: two logits of one row. The LM
head (a ``linear`` onto the vocabulary) is the single most expensive op of a sliced replay
— one row reads the whole unembedding matrix — yet the metric needs two of its dot products.
:func:`replay_read` replays an edit like :func:`torchlens.edit.replay.replay_step` (sliced) but
computes of that op only the row and columns an :class:`OutputRead` names, and refuses (a
typed error) to show the rest of the fork's output, which was never computed.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ..core.records import Op, build_args
from ..core.steps import Step
from ..core.tree import Pending
from ..errors import ReplayNotExactError
from ._regions import WHOLE, RowPatch
from ._replay_run import Replayer
from .replay import replay_forks

__all__ = ["OutputRead", "replay_read", "replay_reads"]


class OutputRead(NamedTuple):
    """The only elements of a final op that a consumer reads: row ``position`` along ``axis``
    and ``columns`` of the last axis (None: every column). The op must be a ``linear`` that no
    other op reads (an LM head), so replay can compute just those dot products."""

    index: int
    axis: int
    position: int
    columns: tuple[int, ...] | None

    def cannot(self, replayer: Replayer, op: Op) -> str | None:
        """Why only what this read names of ``op`` cannot be computed for ``replayer`` (None: it can)."""
        if op.func_name != "linear" or op.children_idx:
            return "not a linear that nothing else reads"
        args, kwargs, changed_ids = self._args(replayer, op)
        if kwargs.keys() - {"bias"} or len(args) < 2:
            return "not a linear that nothing else reads"
        x, weight = args[0], args[1]
        bias = args[2] if len(args) > 2 else kwargs.get("bias")
        if id(weight) in changed_ids or bias is not None and id(bias) in changed_ids:
            return "its weight or bias changed"
        if not isinstance(x, (torch.Tensor, RowPatch)) or x.dim() != len(op.shape) or self.axis >= x.dim() - 1:
            return "the read row is not a row of its input"
        return None

    def compute(self, replayer: Replayer, op: Op) -> None:
        """Compute only what this read names of ``op`` for ``replayer`` (``replayer.read_value``
        holds the elements; the op's value refuses to be read whole). :meth:`cannot` said it can."""
        fork, j = replayer.fork, op.index
        args, kwargs, _ = self._args(replayer, op)
        x, weight = args[0], args[1]
        bias = args[2] if len(args) > 2 else kwargs.get("bias")
        cols = None if self.columns is None else list(self.columns)
        if cols is not None:
            weight = weight[cols]
            bias = None if bias is None else bias[cols]
        replayer.read_value = op.func(x.narrow(self.axis, self.position, 1), weight, bias).squeeze(self.axis)
        fork.changes.set_recomputed(j, _Unread(op.label))
        replayer.changed.add(j)
        replayer.regions[j] = WHOLE
        n = x.shape[self.axis]
        what = "every column" if cols is None else f"{len(cols)} columns"
        replayer.log.entries.append((op.label, op.func_name, "read", (self.axis, n - 1, n),
                                     f"only row {self.position}, {what}: what the metric reads"))

    @staticmethod
    def _args(replayer: Replayer, op: Op) -> tuple[tuple, dict, set[int]]:
        """``op``'s arguments on the fork, a changed input left a RowPatch (only one of its rows is
        read), and the ids of the changed ones."""
        fork, j, changed = replayer.fork, op.index, replayer.changed
        changed_ids: set[int] = set()

        def resolve(r):
            if r.index not in changed:
                return fork.seen_value(r, j)
            v = fork.seen_value(r, j, pending_ok=True)
            changed_ids.add(id(v))
            return v

        args, kwargs = build_args(op, resolve)
        return args, kwargs, changed_ids


class _Unread(Pending):
    """The value of an op replay computed only partly (:func:`replay_read`): reading it whole is refused."""

    __slots__ = ("label",)

    def __init__(self, label: str) -> None:
        self.label = label

    def resolve(self) -> Any:
        raise ReplayNotExactError(
            f"this fork computed only the elements of {self.label} its metric declared (replay_read); the rest "
            "is not there", op_label=self.label, remedy="Replay with fork.do(site, edit) to read the whole output.")


def replay_read(fork: Any, step: Step, read: OutputRead) -> torch.Tensor:
    """Push a bound replay ``step`` down ``fork`` computing of op ``read.index`` only what ``read`` names.

    Every other op replays as in :func:`torchlens.edit.replay.replay_step` (sliced); reading the
    fork's whole output afterwards raises ``ReplayNotExactError``, never shows stale values.
    When the op's arguments do not allow it (its weight changed, it is not a ``linear``) it is
    recomputed whole and the log (``fork.edits[-1].replay``) says so.

    Args:
        fork: a fresh fork of the trace (one patching cell).
        step: the bound replay step.
        read: what is read.

    Returns:
        the read elements: the op's output at ``read.position`` along ``read.axis`` (that axis
        dropped), restricted to ``read.columns``.

    Raises:
        GuardChangedError: the edit changes a guard (the caller re-executes instead).
        ReplayNotExactError: the recorded graph cannot reproduce the edit exactly.
        EmptySelectionError: the site matches nothing in the trace.
    """
    got = replay_reads([fork], [step], read)[0]
    if isinstance(got, BaseException):
        raise got  # the fork is left as it was
    return got


def replay_reads(forks: list[Any], steps: list[Step], read: OutputRead) -> list[Any]:
    """:func:`replay_read` of ``steps[i]`` on ``forks[i]`` (fresh forks of one trace), replayed
    together: in one pass per group of forks whose edits change the same rows
    (``torchlens.edit._sweep``), the rest op by op with their row recomputations stacked
    (``torchlens.edit._batch``).

    Returns:
        per fork, the read elements, or the exception its replay raised (that fork is left as
        it was; a ``GuardChangedError`` means the caller should re-execute it).

    Raises:
        EmptySelectionError: a site matches nothing in the trace (no fork changed).
    """
    got = replay_forks(forks, steps, read=read)
    return [r if isinstance(r, BaseException) else _read_of(r, read) for r in got]


def _read_of(replayer: Replayer, read: OutputRead) -> torch.Tensor:
    if replayer.read_value is not None:
        return replayer.read_value
    row = replayer.fork.value(read.index).select(read.axis, read.position)  # not reached, or run whole
    return row if read.columns is None else row[..., list(read.columns)]
