"""Dataset rows to token-id batches, and batches to shards: the input side of activation datasets.

Rows are numbered in the order the dataset yields them (the row id stored beside every
record). A batch is ``batch_size`` consecutive rows, right-padded to its longest row with an
attention mask, so causal and masked models see exactly the real tokens of each row. Shards
are consecutive batches, closed as soon as they hold ``shard_size`` bytes of records: the
plan depends only on the data and the arguments, so a resumed or distributed run writes the
same shards as an uninterrupted local one.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..core.text import HOW_TO_PASS, encode, feed, pad_rows
from ..errors import DatasetRowError, TokenizerRequiredError

__all__ = ["Batch", "RawBatch", "ShardPlan", "iter_batches", "model_inputs", "plan_shards"]


@dataclass(frozen=True)
class RawBatch:
    """Consecutive rows as token-id lists, before padding (what crosses process boundaries)."""

    first_row: int
    ids: tuple[tuple[int, ...], ...]

    @property
    def tokens(self) -> int:
        return sum(len(r) for r in self.ids)

    def pad(self, pad_id: int) -> Batch:
        ids, mask = pad_rows(self.ids, pad_id, "right")  # right: a token's position is its index in the row
        rows = torch.arange(self.first_row, self.first_row + len(self.ids), dtype=torch.long)
        return Batch(rows, ids, mask)


@dataclass(frozen=True)
class Batch:
    """One batch as the model sees it (what a ``tl.map_dataset`` function receives).

    Attributes:
        rows: ``[B]`` the dataset row id of each row.
        input_ids: ``[B, T]`` token ids, right-padded.
        attention_mask: ``[B, T]`` 1 on real tokens, 0 on padding.
    """

    rows: torch.Tensor
    input_ids: torch.Tensor
    attention_mask: torch.Tensor

    @property
    def ragged(self) -> bool:
        return not bool(self.attention_mask.all())

    def inputs(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The keyword inputs for ``model``: ids, plus the mask when the forward takes one.

        Raises:
            DatasetRowError: the rows have different lengths but the model takes no attention mask.
        """
        return model_inputs(model, self)


def model_inputs(model: nn.Module, batch: Batch) -> dict[str, torch.Tensor]:
    """``{"input_ids": .., "attention_mask": ..}`` as far as ``model.forward`` accepts them (the
    text rule, :func:`torchlens.core.text.feed`: ids under the forward's first parameter's name
    when it takes neither).

    Raises:
        PaddingNotSupportedError: the rows have different lengths, and the forward takes no attention_mask.
    """
    what = f"rows {int(batch.rows[0])}..{int(batch.rows[-1])}"
    args, kwargs = feed(model, batch.input_ids, batch.attention_mask, what=what)
    if args:  # a forward taking neither input_ids nor attention_mask: ids under its first parameter's name
        return {next(iter(inspect.signature(model.forward).parameters)): args[0]}
    return kwargs


def _row_ids(row: Any, index: int, text_column: str) -> list[int] | str:
    """The token ids of one row, or its text (tokenized later, a batch at a time)."""
    if isinstance(row, str):
        return row
    if isinstance(row, dict):
        if "input_ids" in row:
            row = row["input_ids"]
        elif text_column in row:
            text = row[text_column]
            if not isinstance(text, str):
                raise DatasetRowError(f"row {index}: column {text_column!r} holds {type(text).__name__}, not text",
                                      row=index)
            return text
        else:
            raise DatasetRowError(f"row {index} is a dict without 'input_ids' or {text_column!r} "
                                  f"(keys: {sorted(map(str, row))[:8]})", row=index,
                                  remedy="Name the text column with text_column=, or give 'input_ids'.")
    if isinstance(row, torch.Tensor):
        if row.dim() == 2 and row.shape[0] == 1:
            row = row[0]
        if row.dim() != 1 or row.dtype.is_floating_point or row.dtype.is_complex or row.dtype == torch.bool:
            raise DatasetRowError(f"row {index} is a {row.dtype} tensor of shape {tuple(row.shape)}; a row is a "
                                  f"1-D integer tensor of token ids", row=index)
        ids = row.tolist()
    elif hasattr(row, "dtype") and hasattr(row, "tolist"):  # a numpy array, without importing numpy
        if getattr(row.dtype, "kind", "") not in "iu" or getattr(row, "ndim", 1) != 1:
            raise DatasetRowError(f"row {index} is an array of dtype {row.dtype}; a row holds integer token ids",
                                  row=index)
        ids = row.tolist()
    elif isinstance(row, (list, tuple)):
        ids = list(row)
    else:
        raise DatasetRowError(f"row {index} is a {type(row).__name__}; a row is token ids or text", row=index)
    bad = next((i for i in ids if isinstance(i, bool) or not hasattr(i, "__index__")), None)
    if bad is not None or any(int(i) < 0 for i in ids):
        what = repr(bad)[:40] if bad is not None else "a negative id"
        raise DatasetRowError(f"row {index} holds {what}; token ids are non-negative integers", row=index)
    return [int(i) for i in ids]


def iter_batches(data: Iterable[Any], batch_size: int, *, tokenizer: Any = None, text_column: str = "text",
                 max_length: int | None = None, add_special_tokens: bool = True) -> Iterator[RawBatch]:
    """Consecutive rows of ``data`` as token-id batches (text tokenized a batch at a time).

    Raises:
        DatasetRowError: a row is neither token ids nor text, or has no tokens.
        TokenizerRequiredError: a row is text and no tokenizer was given.
    """
    pending: list[Any] = []
    first = 0
    index = 0
    for row in data:
        pending.append(_row_ids(row, index, text_column))
        index += 1
        if len(pending) == batch_size:
            yield _finish(pending, first, tokenizer, max_length, add_special_tokens)
            first, pending = index, []
    if pending:
        yield _finish(pending, first, tokenizer, max_length, add_special_tokens)


def _finish(rows: list[Any], first: int, tokenizer: Any, max_length: int | None, special: bool) -> RawBatch:
    texts = [i for i, r in enumerate(rows) if isinstance(r, str)]
    if texts:
        if tokenizer is None:
            raise TokenizerRequiredError(f"row {first + texts[0]} is text and no tokenizer= was given",
                                         row=first + texts[0], remedy=HOW_TO_PASS)
        encoded = encode([rows[i] for i in texts], tokenizer, max_length=max_length, add_special_tokens=special)
        for i, ids in zip(texts, encoded["input_ids"]):
            rows[i] = ids
    out = []
    for i, ids in enumerate(rows):
        if max_length is not None:
            ids = ids[:max_length]
        if not ids:
            raise DatasetRowError(f"row {first + i} has no tokens", row=first + i,
                                  remedy="Drop empty rows from the dataset before caching.")
        out.append(tuple(ids))
    return RawBatch(first, tuple(out))


@dataclass(frozen=True)
class ShardPlan:
    """The batches of one shard, and a digest of their inputs (a resumed run must see the same)."""

    index: int
    batches: tuple[RawBatch, ...]
    inputs_sha256: str

    @property
    def rows(self) -> tuple[int, int]:
        last = self.batches[-1]
        return self.batches[0].first_row, last.first_row + len(last.ids)

    @property
    def tokens(self) -> int:
        return sum(b.tokens for b in self.batches)


def plan_shards(batches: Iterable[RawBatch], budget: int, per_token: bool) -> Iterator[ShardPlan]:
    """Group consecutive batches into shards of at least ``budget`` records (the last may hold fewer)."""
    group: list[RawBatch] = []
    records = 0
    index = 0
    for batch in batches:
        group.append(batch)
        records += batch.tokens if per_token else len(batch.ids)
        if records >= budget:
            yield _plan(index, group)
            index, group, records = index + 1, [], 0
    if group:
        yield _plan(index, group)


def _plan(index: int, group: list[RawBatch]) -> ShardPlan:
    digest = hashlib.sha256()
    for batch in group:
        digest.update(f"{batch.first_row}:".encode())
        for row in batch.ids:
            digest.update((",".join(map(str, row)) + ";").encode())
    return ShardPlan(index, tuple(group), digest.hexdigest())
