"""Patching metrics: the logit difference and probability of answer tokens, and what they read.

An answer is one token id for every batch row (an int), or one token id per batch row (a
1-D list or integer tensor: row ``i``'s answer is ``answers[i]``, the IOI batch's one answer
pair per prompt). A list is never "several answers for every row": its length must equal the
batch size, and a 2-D shape is refused rather than guessed at. Each metric declares what it
reads of the logits (:class:`MetricReads`), so patching computes only those logits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..core.indices import python_indices
from ..core.tree import first_tensor
from ..errors import InvalidArgumentError

__all__ = ["Answer", "MetricReads", "logit_diff", "logits_of", "metric_position", "prob", "score"]

# An answer: one token id for every row, or one per batch row.
Answer = int | Sequence[int] | torch.Tensor
_SEVERAL = ("A list gives one answer per batch row. For several answers on every row, average one metric per "
            "answer: lambda out: (logit_diff(a, b)(out) + logit_diff(c, d)(out)) / 2.")


def logits_of(output: Any) -> torch.Tensor:
    """The logits of a model output: its ``.logits``, else its first tensor.

    Raises:
        InvalidArgumentError: the output holds no tensor.
    """
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    t = first_tensor(output)
    if t is None:
        raise InvalidArgumentError("the model output holds no tensor to read logits from",
                                   remedy="Pass metric= a function of the model output.")
    return t


def metric_position(position: int, length: int) -> int:
    """A metric's read position as a non-negative index into ``length`` positions (``-1``: the last).

    Raises:
        InvalidArgumentError: the position is outside the output (never wrapped).
    """
    return python_indices(position, length, what="position", axis=f"the output has {length} positions")[0]


@dataclass(frozen=True)
class MetricReads:
    """What a metric reads of the logits, so patching computes only that: the row at
    ``position`` and the vocabulary ``columns`` (None: all); ``score(t)`` is the metric's value
    from ``t = logits[:, position][:, columns]``. :func:`logit_diff` and :func:`prob` declare it
    as ``metric.reads``; a metric without it gets the whole output of every cell."""

    position: int
    columns: tuple[int, ...] | None
    score: Callable[[torch.Tensor], torch.Tensor]


def _answer(value: Any, name: str) -> int | torch.Tensor:
    """An answer argument as an int (every row) or a 1-D int64 tensor (one id per row)."""
    if isinstance(value, bool) or isinstance(value, torch.Tensor) and value.dtype == torch.bool:
        raise InvalidArgumentError(f"{name}= is a token id, got a bool", remedy="Pass token ids (ints).")
    if isinstance(value, int) or isinstance(value, torch.Tensor) and value.dim() == 0 \
            and not value.is_floating_point() and not value.is_complex():
        ids = torch.tensor([int(value)])
    elif isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() \
            and not value.is_floating_point() and not value.is_complex():
        ids = value.detach().to("cpu", torch.long)
    elif isinstance(value, (list, tuple)) and value and all(
            isinstance(v, int) and not isinstance(v, bool) for v in value):
        ids = torch.tensor(value, dtype=torch.long)
    else:
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise InvalidArgumentError(
            f"{name}= is a token id (every row) or a 1-D list/integer tensor of token ids (one per batch row); "
            f"got {shape}", remedy=_SEVERAL)
    if bool((ids < 0).any()):
        raise InvalidArgumentError(f"{name}= holds negative token ids {ids[ids < 0].tolist()}",
                                   remedy="Token ids count from 0 (tokenizer ids).")
    per_row = isinstance(value, (list, tuple)) or isinstance(value, torch.Tensor) and value.dim() == 1
    return ids if per_row else int(ids[0])


def _show(answer: int | torch.Tensor) -> str:
    return str(answer) if isinstance(answer, int) else str(answer.tolist())


def _pick(rows: torch.Tensor, answer: int | torch.Tensor, name: str) -> torch.Tensor:
    """``rows[i, answer]`` (an int) or ``rows[i, answer[i]]`` (one per row), for rows ``[batch, vocab]``."""
    if isinstance(answer, int):
        return rows[:, answer]
    if answer.numel() != rows.shape[0]:
        raise InvalidArgumentError(
            f"{name}= lists {answer.numel()} answer(s), one per batch row, but the output has {rows.shape[0]} "
            "row(s)", remedy="Give one token id per prompt of the batch, or an int for the same answer on every "
            "row. " + _SEVERAL)
    return rows.gather(1, answer.to(rows.device).unsqueeze(1)).squeeze(1)


def _read_row(output: Any, position: int, answers: Sequence[int | torch.Tensor]) -> torch.Tensor:
    """``logits[:, position]`` of a model output, every answer checked against the vocabulary."""
    logits = logits_of(output)
    if logits.dim() < 3:
        raise InvalidArgumentError(f"the logits have shape {tuple(logits.shape)}, not [batch, positions, vocab]",
                                   remedy="Pass metric= a function of the model output.")
    vocab = logits.shape[-1]
    for a in answers:
        top = a if isinstance(a, int) else int(a.max())
        if top >= vocab:
            raise InvalidArgumentError(f"token id {top} is outside the vocabulary ({vocab} logits)",
                                       remedy=f"Pick token ids between 0 and {vocab - 1}.")
    return logits[:, metric_position(position, logits.shape[1])]


def _columns(*answers: int | torch.Tensor) -> tuple[tuple[int, ...], list[int | torch.Tensor]]:
    """The distinct token ids the answers name (the columns read) and each answer as indices into them."""
    ids = [a if isinstance(a, int) else int(t) for a in answers for t in ([a] if isinstance(a, int) else a)]
    columns = tuple(dict.fromkeys(ids))
    where = {t: k for k, t in enumerate(columns)}
    return columns, [where[a] if isinstance(a, int) else torch.tensor([where[int(t)] for t in a]) for a in answers]


def logit_diff(correct: Answer, wrong: Answer, *, position: int = -1) -> Callable[[Any], torch.Tensor]:
    """A metric: ``logits[i, position, correct] - logits[i, position, wrong]``, averaged over the rows ``i``.

    Args:
        correct: the token id that should win: an int (every row), or one id per batch row
            (a 1-D list or integer tensor, row ``i`` reads ``correct[i]``: the IOI batch).
        wrong: the token id it competes with, in the same form.
        position: the sequence position read (negative counts from the end).

    Returns:
        ``metric(model_output) -> scalar tensor``, declaring what it reads (``metric.reads``, a
        :class:`MetricReads`): patching then computes only the answers' logits per cell, not the
        whole LM head.

    Raises:
        InvalidArgumentError: an answer that is neither an int nor a 1-D list of ints, per-row
            answers of different lengths; when applied, an answer list whose length is not the
            batch size, a token id outside the vocabulary, a position outside the output.
    """
    c, w = _answer(correct, "correct"), _answer(wrong, "wrong")
    if not isinstance(c, int) and not isinstance(w, int) and c.numel() != w.numel():
        raise InvalidArgumentError(f"correct= lists {c.numel()} answers and wrong= {w.numel()}; both give one per "
                                   "batch row", remedy=_SEVERAL)
    _check_position(position)

    def metric(output: Any) -> torch.Tensor:
        logits = _read_row(output, position, (c, w))
        return (_pick(logits, c, "correct") - _pick(logits, w, "wrong")).mean()

    columns, (cc, wc) = _columns(c, w)
    metric.__name__ = f"logit_diff({_show(c)}, {_show(w)})"
    metric.reads = MetricReads(position, columns,
                               lambda t: (_pick(t, cc, "correct") - _pick(t, wc, "wrong")).mean())
    return metric


def prob(token: Answer, *, position: int = -1) -> Callable[[Any], torch.Tensor]:
    """A metric: the softmax probability of ``token`` at ``position``, averaged over the rows.

    Args:
        token: the token id: an int (every row), or one id per batch row (a 1-D list or
            integer tensor, row ``i`` reads ``token[i]``).
        position: the sequence position read (negative counts from the end).

    Returns:
        ``metric(model_output) -> scalar tensor``, declaring what it reads (``metric.reads``):
        patching then computes one row of the LM head per cell.

    Raises:
        InvalidArgumentError: as :func:`logit_diff`.
    """
    t = _answer(token, "token")
    _check_position(position)

    def metric(output: Any) -> torch.Tensor:
        return _pick(_read_row(output, position, (t,)).float().softmax(-1), t, "token").mean()

    metric.__name__ = f"prob({_show(t)})"
    metric.reads = MetricReads(position, None, lambda x: _pick(x.float().softmax(-1), t, "token").mean())
    return metric


def _check_position(position: Any) -> None:
    if isinstance(position, bool) or not isinstance(position, int):
        raise InvalidArgumentError(f"position= is an int (negative counts from the end), got {position!r}")


def score(metric: Callable[[Any], Any], output: Any) -> float:
    """``metric(output)`` as a float.

    Raises:
        InvalidArgumentError: the metric returned a tensor of more than one element.
    """
    value = metric(output)
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise InvalidArgumentError(f"the metric returned a tensor of shape {tuple(value.shape)}, not a scalar",
                                       remedy="Reduce it to one number (e.g. .mean()).")
        return float(value)
    return float(value)
