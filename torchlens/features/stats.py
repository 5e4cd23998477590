"""Streaming feature statistics over a dataset: the data behind a feature dashboard, in bounded memory.

``tl.feature_stats(model, data, {site: sae}, out=dir)`` is a ``tl.cache_activations`` job (same
runner, same local and Ray backends, same resumable shards): each batch reads the site, encodes it
with the SAE, and stores per real token the ``store`` largest active features (indices + values,
``-1`` / ``0`` in unused slots) and the number of active features; beside the records each shard
keeps that shard's per-feature statistics (firing count, sum and max of the activation, and the
``top_k`` max-activating contexts with their surrounding token ids), folded batch by batch. The
driver merges the shards' statistics, one shard at a time: memory is one batch's activations
plus ``d_sae x top_k`` contexts, whatever the dataset's size.

Statistics come from the dense activations (every feature of every real token), so they are exact
even when a token has more than ``store`` active features (the ``<name>.active`` column says how many).
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from ..dictionaries.wrap import FeatureDictionary, as_dictionary
from ..errors import DatasetFormatError, FeatureIndexError, InvalidArgumentError
from ..store._reader import ActivationDataset
from ..store._runner import SUMMARY_PREFIX, SiteReader, model_identity
from ..store.datasets import DEFAULT_SHARD_SIZE, RunOptions, _describe_sites, _run

__all__ = ["FeatureRecorder", "FeatureStats", "SiteFeatureStats", "feature_stats", "load_feature_stats"]

STAT_NAMES = ("count", "total", "max", "top_value", "top_row", "top_position", "top_tokens")
NO_TOKEN = -1  # a context slot before the row's start or after its end, or an empty top-k slot


@dataclass
class SiteFeatureStats:
    """Per-feature statistics of one site's dictionary over a whole dataset.

    Attributes:
        tokens: real tokens seen.
        count: ``[d_sae]`` tokens on which each feature fired (activation > 0).
        total: ``[d_sae]`` float64 sum of each feature's activation over every token.
        max: ``[d_sae]`` each feature's largest activation (0 for one that never fired on a ReLU SAE).
        top_value: ``[d_sae, top_k]`` the largest activations, descending (``-inf`` in unused slots).
        top_row, top_position: ``[d_sae, top_k]`` where each of them is (dataset row, position; ``-1`` unused).
        top_tokens: ``[d_sae, top_k, left + 1 + right]`` the token ids around it (``-1`` past a row's ends);
            the activating token is at index ``left``.
        context: ``(left, right)``.
    """

    tokens: int
    count: torch.Tensor
    total: torch.Tensor
    max: torch.Tensor
    top_value: torch.Tensor
    top_row: torch.Tensor
    top_position: torch.Tensor
    top_tokens: torch.Tensor
    context: tuple[int, int]

    @property
    def frequency(self) -> torch.Tensor:
        """``[d_sae]`` the fraction of tokens on which each feature fired."""
        return self.count.double() / max(1, self.tokens)

    @property
    def mean(self) -> torch.Tensor:
        """``[d_sae]`` each feature's mean activation over every token (zeros included)."""
        return self.total / max(1, self.tokens)

    @property
    def mean_active(self) -> torch.Tensor:
        """``[d_sae]`` each feature's mean activation over the tokens it fired on (0 where it never fired)."""
        return torch.where(self.count > 0, self.total / self.count.clamp(min=1), torch.zeros_like(self.total))

    def top_contexts(self, feature: int, tokenizer: Any = None) -> list[dict[str, Any]]:
        """The max-activating contexts of one feature, largest first.

        Args:
            feature: the feature index.
            tokenizer: when given, each context also has ``text`` (its tokens decoded one by one).

        Returns:
            ``[{"value", "row", "position", "tokens"(, "text")}]``, ``tokens`` without the padding ids.

        Raises:
            FeatureIndexError: ``feature`` is outside ``0 .. d_sae - 1``.
        """
        feature = _check_feature(feature, self.count.shape[0])
        found = []
        for j in range(self.top_value.shape[1]):
            row = int(self.top_row[feature, j])
            if row < 0:
                break
            ids = [int(t) for t in self.top_tokens[feature, j] if int(t) != NO_TOKEN]
            item: dict[str, Any] = {"value": float(self.top_value[feature, j]), "row": row,
                                    "position": int(self.top_position[feature, j]), "tokens": ids}
            if tokenizer is not None:
                item["text"] = [tokenizer.decode([t]) for t in ids]
            found.append(item)
        return found


class FeatureStats:
    """The result of :func:`feature_stats`: per-site statistics and the sparse activations on disk.

    ``stats[name]`` is a :class:`SiteFeatureStats`; ``dataset`` is the :class:`ActivationDataset`
    whose records hold, per real token, ``row``, ``position``, ``token`` and per site
    ``<name>.index`` ``[store]`` (int32, ``-1`` unused), ``<name>.value`` ``[store]`` and
    ``<name>.active`` (the number of features that fired on it).
    """

    def __init__(self, dataset: ActivationDataset) -> None:
        self.dataset = dataset
        job = dataset.manifest.get("job", {})
        if job.get("kind") != "feature_stats":
            raise DatasetFormatError(f"{dataset.path} holds a {job.get('kind')!r} job, not feature statistics",
                                     remedy="Open it with tl.load_activations, or run tl.feature_stats(..., out=...).")
        self.names: list[str] = list(job["sites"])
        self.context = (int(job["context"][0]), int(job["context"][1]))
        self.stats = {name: self._merged(name, int(dataset.manifest["tokens"])) for name in self.names}

    def _merged(self, name: str, tokens: int) -> SiteFeatureStats:
        keys = [f"{SUMMARY_PREFIX}{name}/{s}" for s in STAT_NAMES]
        merged: dict[str, torch.Tensor] = {}
        for shard in self.dataset.manifest["shards"]:  # one shard's statistics in memory at a time
            with safe_open(str(self.dataset.path / shard["file"]), framework="pt") as handle:
                part = {k: handle.get_tensor(k) for k in keys}
            merged = merge_stats(merged, part, keys) if merged else part
        return SiteFeatureStats(tokens, *(merged[k] for k in keys), context=self.context)

    def __getitem__(self, name: str) -> SiteFeatureStats:
        if name not in self.stats:
            raise KeyError(f"no site {name!r}; this job has {self.names}")
        return self.stats[name]

    def sparse(self, name: str, shard: int) -> dict[str, torch.Tensor]:
        """One shard's records of a site: ``row``, ``position``, ``token``, ``index``, ``value``, ``active``."""
        self[name]
        cols = ["row", "position", "token", f"{name}.index", f"{name}.value", f"{name}.active"]
        got = self.dataset.shard(shard, cols)
        return {k.removeprefix(f"{name}."): v for k, v in got.items()}

    def dense(self, name: str, d_sae: int | None = None) -> torch.Tensor:
        """Every record's activations of a site as a dense ``[records, d_sae]`` tensor (for data that fit).

        Features beyond a token's ``store`` largest are 0 here (its ``active`` column counts them all).
        """
        width = int(self[name].count.shape[0]) if d_sae is None else d_sae
        parts = []
        for k in range(self.dataset.num_shards):
            s = self.sparse(name, k)
            out = torch.zeros(s["index"].shape[0], width, dtype=s["value"].dtype)
            used = s["index"] >= 0  # unused slots add 0 to feature 0 (a scatter would overwrite it)
            out.scatter_add_(1, s["index"].clamp(min=0).long(),
                             torch.where(used, s["value"], torch.zeros_like(s["value"])))
            parts.append(out)
        return torch.cat(parts)

    def __repr__(self) -> str:
        sites = ", ".join(f"{n}: d_sae={int(self.stats[n].count.shape[0])}" for n in self.names)
        return f"FeatureStats({str(self.dataset.path)!r}, {self.dataset.manifest['tokens']} tokens; {sites})"


def _check_feature(feature: Any, d_sae: int) -> int:
    if isinstance(feature, bool) or not hasattr(feature, "__index__"):
        raise InvalidArgumentError(f"feature takes an int, got {type(feature).__name__}")
    i = feature.__index__()
    if not -d_sae <= i < d_sae:
        raise FeatureIndexError(f"feature {i} is out of range: the dictionary has d_sae={d_sae} features "
                                f"(0 .. {d_sae - 1})", feature=i, d_sae=d_sae)
    return i % d_sae


def merge_stats(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], keys: list[str]) -> dict[str, torch.Tensor]:
    """Fold two partial statistics of one site (``keys`` in :data:`STAT_NAMES` order); ``a`` is earlier data."""
    count, total, mx, value, row, pos, toks = keys
    out = {count: a[count] + b[count], total: a[total] + b[total], mx: torch.maximum(a[mx], b[mx])}
    k = a[value].shape[1]
    values = torch.cat([a[value], b[value]], 1)
    # stable: among equal activations the earlier data stays first
    order = torch.sort(values, dim=1, descending=True, stable=True).indices[:, :k]
    out[value] = values.gather(1, order)
    for key in (row, pos):
        out[key] = torch.cat([a[key], b[key]], 1).gather(1, order)
    both = torch.cat([a[toks], b[toks]], 1)
    out[toks] = both.gather(1, order[:, :, None].expand(-1, -1, both.shape[2]))
    return out


class FeatureRecorder:
    """The per-batch function of :func:`feature_stats` (picklable: it travels to Ray workers).

    Reads the sites as ``tl.cache_activations`` does, encodes each with its dictionary, and returns
    the sparse records plus this batch's statistics (under the runner's summary prefix).
    """

    def __init__(self, features: dict[str, tuple[Any, FeatureDictionary]], *, store: int, top_k: int,
                 context: tuple[int, int], stop_early: bool) -> None:
        self.dictionaries = {name: d for name, (_, d) in features.items()}
        self.reader = SiteReader({name: site for name, (site, _) in features.items()}, None, stop_early)
        self.store = store
        self.top_k = top_k
        self.context = context

    def __call__(self, model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        values = self.reader(model, batch)
        mask = batch.attention_mask.bool()
        left, right = self.context
        ids = torch.where(mask, batch.input_ids, torch.full_like(batch.input_ids, NO_TOKEN))
        windows = nn.functional.pad(ids, (left, right), value=NO_TOKEN).unfold(1, left + 1 + right, 1)[mask]
        rows = batch.rows[:, None].expand_as(mask)[mask]
        positions = torch.arange(mask.shape[1])[None].expand_as(mask)[mask]
        out: dict[str, torch.Tensor] = {}
        for name, dictionary in self.dictionaries.items():
            x = values[name]
            dictionary.check_input(x, site=name)
            codes = dictionary.encode(x)
            width = min(self.store, codes.shape[-1])
            top = codes.topk(width, dim=-1)
            used = top.values > 0
            out[f"{name}.index"] = torch.where(used, top.indices, torch.full_like(top.indices, NO_TOKEN)).int()
            out[f"{name}.value"] = torch.where(used, top.values, torch.zeros_like(top.values))
            fired = (codes > 0).to(codes.dtype)  # float sums of 0/1: exact, and far faster than bool sums
            out[f"{name}.active"] = fired.sum(-1).int()
            full = bool(mask.all())  # rows of one length: a view, not a copy of every activation
            flat = codes.reshape(-1, codes.shape[-1]) if full else codes[mask]
            out.update(self._summary(name, flat, fired.reshape(flat.shape) if full else fired[mask], rows, positions,
                                     windows))
        return out

    def _summary(self, name: str, flat: torch.Tensor, fired: torch.Tensor, rows: torch.Tensor,
                 positions: torch.Tensor, windows: torch.Tensor) -> dict[str, torch.Tensor]:
        n, d_sae = flat.shape
        k = min(self.top_k, n)
        found = {
            "count": fired.sum(0).long(),
            # a batch's sum in the activations' dtype (contiguous, fast), batches added in float64
            "total": flat.sum(0).double(),
            "max": flat.amax(0) if n else torch.full((d_sae,), float("-inf"), dtype=flat.dtype),
        }
        top = flat.T.topk(k, dim=1)  # [d_sae, k]: along rows of the transpose, ~3x faster than along dim 0
        hit = top.values > 0
        value = torch.where(hit, top.values, torch.full_like(top.values, float("-inf")))
        row = torch.where(hit, rows[top.indices], torch.full_like(top.indices, NO_TOKEN))
        pos = torch.where(hit, positions[top.indices], torch.full_like(top.indices, NO_TOKEN))
        near = windows[top.indices]
        toks = torch.where(hit[:, :, None], near, torch.full_like(near, NO_TOKEN))
        pad = self.top_k - k  # fewer real tokens than top_k in this batch: empty slots
        if pad:
            value = nn.functional.pad(value, (0, pad), value=float("-inf"))
            row = nn.functional.pad(row, (0, pad), value=NO_TOKEN)
            pos = nn.functional.pad(pos, (0, pad), value=NO_TOKEN)
            toks = nn.functional.pad(toks, (0, 0, 0, pad), value=NO_TOKEN)
        found.update(top_value=value.contiguous(), top_row=row.contiguous(), top_position=pos.contiguous(),
                     top_tokens=toks.int().contiguous())
        return {f"{SUMMARY_PREFIX}{name}/{s}": found[s] for s in STAT_NAMES}

    def merge_summary(self, a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Fold two batches' (or shards') statistics; ``a`` is the earlier data."""
        out = {}
        for name in self.dictionaries:
            keys = [f"{SUMMARY_PREFIX}{name}/{s}" for s in STAT_NAMES]
            out.update(merge_stats(a, b, keys))
        return out


def _features(features: Any) -> dict[str, tuple[Any, FeatureDictionary]]:
    if not isinstance(features, dict) or not features:
        raise InvalidArgumentError(f"features takes a dict {{site: sae}}, got {type(features).__name__}",
                                   remedy="e.g. features={'transformer.h.1': sae}.")
    found = {}
    for site, sae in features.items():
        name = site if isinstance(site, str) else site.describe() if hasattr(site, "describe") else None
        if not name:
            raise InvalidArgumentError(f"a features key must be a site (a module address or tl selector), got {site!r}")
        dictionary = as_dictionary(sae)
        if dictionary.d_sae is None:
            raise InvalidArgumentError(f"{dictionary.name} does not declare its number of features (d_sae)",
                                       remedy="Give the module a d_sae attribute, or W_enc / W_dec weights.")
        found[name] = (site, dictionary)
    return found


def _positive(name: str, value: Any) -> int:
    if type(value) is not int or value < 1:
        raise InvalidArgumentError(f"{name} must be a positive int, got {value!r}")
    return value


def _context(context: Any) -> tuple[int, int]:
    pair = (context, context) if type(context) is int else context
    if (not isinstance(pair, (tuple, list)) or len(pair) != 2
            or not all(type(c) is int and c >= 0 for c in pair)):
        raise InvalidArgumentError(f"context takes tokens on each side (an int) or (left, right), got {context!r}")
    return int(pair[0]), int(pair[1])


def _identity(dictionary: FeatureDictionary) -> Any:
    module = dictionary.module
    if isinstance(module, nn.Module):
        return model_identity(module)  # a different SAE checkpoint is a different job
    return type(module).__qualname__


def feature_stats(
    model: Any,
    data: Iterable[Any],
    features: dict[Any, Any],
    *,
    out: str | pathlib.Path,
    top_k: int = 16,
    context: int | tuple[int, int] = (8, 4),
    store: int = 32,
    batch_size: int = 16,
    tokenizer: Any = None,
    shard_size: int | str = DEFAULT_SHARD_SIZE,
    max_length: int | None = None,
    text_column: str = "text",
    add_special_tokens: bool = True,
    backend: str = "local",
    num_workers: int = 2,
    threads_per_worker: int = 1,
    ray_address: str | None = None,
    progress: bool | None = None,
    overwrite: bool = False,
    stop_early: bool = True,
) -> FeatureStats:
    """Per-feature statistics of SAEs over a dataset, and its sparse feature activations on disk.

    For each ``{site: sae}``: how often each feature fires (activation > 0), its mean and max
    activation, and its ``top_k`` max-activating contexts (dataset row, position, activation and
    the surrounding token ids); per real token the ``store`` largest active features are stored as
    indices + values in safetensors shards. Same job machinery as ``tl.cache_activations``: bounded
    memory, resumable (rerun the call), ``backend="ray"`` gives the same files.

    The other arguments (``batch_size``, ``tokenizer``, ``shard_size``, ``max_length``, ``text_column``,
    ``add_special_tokens``, ``backend``, ``num_workers``, ``threads_per_worker``, ``ray_address``,
    ``progress``, ``overwrite``, ``stop_early``) are those of :func:`tl.cache_activations`.

    Args:
        model: as :func:`tl.cache_activations` (a module, a picklable factory, or a path).
        data: rows of token ids or text, as :func:`tl.cache_activations`.
        features: ``{site: sae}``; each ``sae`` is any module with ``encode``/``decode`` (a SAELens
            ``SAE``, ``tl.features.load_sae(path)``), reading the site's value ``[batch, tokens, d_in]``.
        out: the job directory.
        top_k: max-activating contexts kept per feature.
        context: token ids kept around each context: ``n`` on each side, or ``(left, right)``.
        store: active features stored per token (the largest); statistics always use them all.

    Returns:
        A :class:`FeatureStats`: ``result[site]`` holds the statistics, ``result.dataset`` the records.

    Raises:
        NotAFeatureDictionaryError: a value of ``features`` has no ``encode``/``decode``.
        FeatureWidthError, FeatureDtypeError: a site's value does not fit its SAE (both widths, or which of
            dtype/device, are named); nothing is written past the first batch.
        SiteNotFoundError, DatasetRowError, JobMismatchError, ShardWriteError: as :func:`tl.cache_activations`.
    """
    found = _features(features)
    top_k, store = _positive("top_k", top_k), _positive("store", store)
    left_right = _context(context)
    recorder = FeatureRecorder(found, store=store, top_k=top_k, context=left_right, stop_early=stop_early)
    args = {"kind": "feature_stats", "sites": _describe_sites({n: s for n, (s, _) in found.items()}),
            "dictionaries": {n: _identity(d) for n, (_, d) in found.items()}, "top_k": top_k,
            "context": list(left_right), "store": store}
    options = RunOptions.of(dict(out=out, batch_size=batch_size, tokenizer=tokenizer, dtype=None,
                                 shard_size=shard_size, max_length=max_length, text_column=text_column,
                                 add_special_tokens=add_special_tokens, backend=backend, num_workers=num_workers,
                                 threads_per_worker=threads_per_worker, ray_address=ray_address,
                                 progress=progress, overwrite=overwrite))
    dataset = _run(model, data, recorder, True, args, options)
    return FeatureStats(dataset)


def load_feature_stats(path: str | pathlib.Path, *, verify: bool = False) -> FeatureStats:
    """Open a finished :func:`feature_stats` job (its statistics are merged from the shards again).

    Raises:
        DatasetFormatError: no finished job there, it is not feature statistics, or a checksum differs.
    """
    return FeatureStats(ActivationDataset(path, verify=verify))
