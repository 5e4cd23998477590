"""The worker side of activation datasets: run a shard's batches through the model and write it.

Everything here is plain picklable data plus functions of it, so the same code runs in the
calling process (``backend="local"``) and in Ray workers: a :class:`Job` says what to compute
per batch; :func:`run_shard` computes a planned shard and writes its file.
"""

from __future__ import annotations

import hashlib
import pathlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..api import check_model, extract, stops_on_modules
from ..core.tree import first_tensor
from ..errors import DatasetError, DatasetRowError, InvalidArgumentError
from ._batches import Batch, RawBatch, ShardPlan
from ._fingerprints import fingerprint
from ._safetensors import ST_NAMES
from ._shards import write_shard

__all__ = ["RESERVED", "SUMMARY_PREFIX", "Job", "SiteReader", "build_model", "model_identity", "probe", "run_batch",
           "run_shard"]

RESERVED = ("row", "position", "token")  # columns every per-token shard holds beside the sites
# A per-batch function may also return per-shard summaries under this prefix (any shape, not per
# record): they are folded batch by batch with the function's ``merge_summary(a, b)`` and stored in
# the shard file beside the records, committed with it (tl.feature_stats keeps its statistics so).
SUMMARY_PREFIX = "__summary__."
SAMPLES_PER_PARAM = 1024  # values hashed per parameter: different weights, different job


class SiteReader:
    """The per-batch function of ``tl.cache_activations``: the sites' values, as ``tl.extract`` reads them."""

    def __init__(self, sites: Any, intervene: Any = None, stop_early: bool = True) -> None:
        self.sites = sites
        self.intervene = intervene
        # None: not decided yet. The first batch in each process runs the whole forward (which
        # refuses a site module that runs twice); later ones stop after the last site when
        # every site is a whole module.
        self.stop: bool | None = None if stop_early else False

    def __call__(self, model: nn.Module, batch: Batch) -> dict[str, torch.Tensor]:
        values = extract(model, batch.inputs(model), self.sites, intervene=self.intervene, stop=bool(self.stop))
        if self.stop is None:
            self.stop = stops_on_modules(model, self.sites, self.intervene)
        out = {}
        for key, value in values.items():
            tensor = first_tensor(value) if not isinstance(value, list) else None
            if tensor is None:
                raise DatasetError(
                    f"site {key!r} gives {type(value).__name__} (several ops or no tensor), not one tensor",
                    site=key, remedy="Name one op or module per site (tl.extract(model, x, sites) shows the values).",
                )
            out[key] = tensor
        return out


@dataclass
class Job:
    """What to compute per batch and how to store it (picklable: it travels to Ray workers)."""

    fn: Callable[[nn.Module, Batch], dict[str, torch.Tensor]]
    per_token: bool
    dtype: torch.dtype | None
    pad_id: int


def build_model(model: Any) -> nn.Module:
    """A model from an ``nn.Module``, a zero-argument factory, or a ``from_pretrained`` path.

    Raises:
        UnsupportedModelError: the factory does not give an eager ``nn.Module``.
        InvalidArgumentError: ``model`` is none of these.
    """
    if isinstance(model, nn.Module):
        return check_model(model)
    if isinstance(model, (str, pathlib.Path)):
        import transformers  # heavy optional dependency: only a path needs it

        built = transformers.AutoModelForCausalLM.from_pretrained(str(model))
    elif callable(model):
        built = model()
    else:
        raise InvalidArgumentError(f"model= takes an nn.Module, a zero-argument factory or a from_pretrained path; "
                                   f"got {type(model).__name__}")
    return check_model(built).eval()


def model_identity(model: nn.Module) -> dict[str, Any]:
    """The model fingerprint (class, config type, parameter names and shapes) plus a digest of its values.

    The value digest hashes up to ``SAMPLES_PER_PARAM`` evenly spaced values of each parameter, so
    a different checkpoint is told apart without reading every weight.
    """
    fp = fingerprint(model)
    digest = hashlib.sha256()
    with torch.no_grad():
        for _, p in model.named_parameters():
            flat = p.detach().reshape(-1)
            if flat.numel() > SAMPLES_PER_PARAM:
                flat = flat[torch.arange(SAMPLES_PER_PARAM) * (flat.numel() - 1) // (SAMPLES_PER_PARAM - 1)]
            digest.update(flat.float().cpu().numpy().tobytes())
    return {"class": fp["class"], "model_type": fp["model_type"], "params_sha256": fp["params_sha256"],
            "values_sha256": digest.hexdigest(), "n_params": len(fp["params"])}


def _check_rows(model: nn.Module, batch: Batch) -> None:
    """Refuse ids and lengths the model cannot take, before torch raises an IndexError deep inside."""
    config = getattr(model, "config", None)
    vocab = getattr(config, "vocab_size", None)
    if isinstance(vocab, int) and int(batch.input_ids.max()) >= vocab:
        where = (batch.input_ids >= vocab).nonzero()[0]
        row = int(batch.rows[where[0]])
        raise DatasetRowError(f"row {row} holds token id {int(batch.input_ids[tuple(where)])}, but the model's "
                              f"vocabulary has {vocab} ids", row=row,
                              remedy="Tokenize with the model's own tokenizer.")
    limit = next((getattr(config, k) for k in ("n_positions", "max_position_embeddings")
                  if isinstance(getattr(config, k, None), int)), None)
    if limit is not None and batch.input_ids.shape[1] > limit:
        row = int(batch.rows[int(batch.attention_mask.sum(1).argmax())])
        raise DatasetRowError(f"row {row} has {batch.input_ids.shape[1]} tokens; the model takes at most {limit}",
                              row=row, remedy=f"Pass max_length={limit} (or less) to truncate rows.")


def run_batch(job: Job, model: nn.Module, raw: RawBatch) -> dict[str, torch.Tensor]:
    """One batch's records: per token (real tokens only, with row/position/token ids) or per row.

    Raises:
        DatasetRowError: ids or lengths the model cannot take.
        DatasetError: the function returned something that is not a tensor per row / per token.
    """
    batch = raw.pad(job.pad_id)
    _check_rows(model, batch)
    with torch.no_grad():
        values = job.fn(model, batch)
    if not isinstance(values, dict) or not values:
        raise DatasetError(f"the per-batch function returned {type(values).__name__}, not a non-empty dict of tensors",
                           remedy="Return {name: tensor} from the function.")
    rows, width = batch.input_ids.shape
    mask = batch.attention_mask.bool()
    summary = {k: values[k] for k in values if k.startswith(SUMMARY_PREFIX)}
    if summary and not callable(getattr(job.fn, "merge_summary", None)):
        raise DatasetError(f"the per-batch function returned summaries {sorted(summary)[:3]} but has no "
                           f"merge_summary(a, b) method to fold them", remedy="Give it one, or drop the summaries.")
    values = {k: v for k, v in values.items() if k not in summary}
    out: dict[str, torch.Tensor] = {}
    if job.per_token:
        out["row"] = batch.rows[:, None].expand(rows, width)[mask]
        out["position"] = torch.arange(width)[None].expand(rows, width)[mask]
        out["token"] = batch.input_ids[mask]
    else:
        out["row"] = batch.rows
    for name, value in values.items():
        if name in RESERVED:
            raise InvalidArgumentError(f"{name!r} is a reserved column name ({', '.join(RESERVED)})",
                                       remedy="Name the site or value differently (sites={'name': site}).")
        if not isinstance(value, torch.Tensor):
            raise DatasetError(f"value {name!r} is a {type(value).__name__}, not a tensor", site=name,
                               remedy="Return {name: tensor} from the function.")
        value = value.detach()
        if job.dtype is not None:
            value = value.to(job.dtype)
        lead = (rows, width) if job.per_token else (rows,)
        if tuple(value.shape[: len(lead)]) != lead:
            per = "[batch, tokens, ...]" if job.per_token else "[batch, ...]"
            raise DatasetError(
                f"value {name!r} has shape {tuple(value.shape)}; a record needs {per} = {list(lead)}", site=name,
                remedy="Pick a site whose value is one vector per token (or store per row with tl.map_dataset).",
            )
        if value.dtype not in ST_NAMES:
            raise DatasetError(f"value {name!r} has dtype {value.dtype}, which safetensors cannot store", site=name,
                               remedy="Pass dtype=torch.float32 (or float16/bfloat16).")
        out[name] = (value[mask] if job.per_token else value).cpu().contiguous()
    out.update((k, v.detach().cpu().contiguous()) for k, v in summary.items())
    return out


def columns_of(records: dict[str, torch.Tensor]) -> dict[str, dict[str, Any]]:
    """The manifest's column table: dtype code and per-record shape of each column."""
    return {name: {"dtype": ST_NAMES[t.dtype], "shape": list(t.shape[1:])} for name, t in records.items()
            if not name.startswith(SUMMARY_PREFIX)}


def probe(job: Job, model: nn.Module, raw: RawBatch) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The column table (from one batch) and that batch's records."""
    records = run_batch(job, model, raw)
    return columns_of(records), records


def run_shard(job: Job, model: nn.Module, plan: ShardPlan, out: pathlib.Path, columns: dict[str, Any],
              first: dict[str, torch.Tensor] | None = None) -> dict[str, Any]:
    """Compute and write one planned shard; return its manifest entry.

    Args:
        first: the records of the plan's first batch if already computed (the probe's).

    Raises:
        DatasetError: a batch's columns differ from the job's column table.
        ShardWriteError: the shard could not be written (no partial file is left).
    """
    chunks: dict[str, list[torch.Tensor]] = {name: [] for name in columns}
    summary: dict[str, torch.Tensor] = {}
    records = 0
    for i, raw in enumerate(plan.batches):
        got = first if (i == 0 and first is not None) else run_batch(job, model, raw)
        table = columns_of(got)
        if table != columns:
            bad = sorted(k for k in set(table) | set(columns) if table.get(k) != columns.get(k))
            raise DatasetError(f"rows {raw.first_row}+ give columns {[(k, table.get(k)) for k in bad]}, but the job's "
                               f"columns are {[(k, columns.get(k)) for k in bad]}", columns=bad,
                               remedy="Return the same names, dtypes and per-record shapes for every batch.")
        part = {k: t for k, t in got.items() if k.startswith(SUMMARY_PREFIX)}
        for name, t in got.items():
            if name not in part:
                chunks[name].append(t)
        records += int(got["row"].shape[0])
        if part:
            summary = job.fn.merge_summary(summary, part) if summary else part
    chunks.update((k, [t.reshape(1) if t.dim() == 0 else t]) for k, t in summary.items())
    entry = write_shard(out, plan.index, chunks)
    first_row, end_row = plan.rows
    entry.update(index=plan.index, rows=[first_row, end_row], records=records, tokens=plan.tokens,
                 inputs_sha256=plan.inputs_sha256)
    return entry
