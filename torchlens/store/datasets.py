"""Activation datasets: stream a dataset through a model to safetensors shards, locally or on Ray.

``tl.cache_activations(model, data, sites, out=dir)`` stores the sites' values at every real
token; ``tl.map_dataset(model, data, fn, out=dir)`` stores whatever ``fn(model, batch)``
returns per row or per token (a metric under a recipe, say). Both are bounded in memory by
the batch and ``shard_size``, resumable after a kill (rerun the same call), and give the same
files on ``backend="ray"``. ``tl.load_activations(dir)`` reads the result back.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import pathlib
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from .._progress import progress_bar
from ..core.selectors import as_sites
from ..core.text import pad_id, tokenizer_for
from ..errors import DatasetRowError, InvalidArgumentError, JobMismatchError
from ._batches import Batch, RawBatch, ShardPlan, iter_batches, plan_shards
from ._ondisk import installed_version
from ._reader import ActivationDataset
from ._runner import Job, SiteReader, build_model, model_identity, probe, run_shard
from ._safetensors import ST_DTYPES
from ._shards import FORMAT, FORMAT_VERSION, check_directory, commit_manifest, read_manifest

__all__ = ["ActivationDataset", "Batch", "cache_activations", "load_activations", "map_dataset"]

DEFAULT_SHARD_SIZE = "128MB"
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def cache_activations(
    model: Any,
    data: Iterable[Any],
    sites: Any,
    *,
    out: str | pathlib.Path,
    batch_size: int = 16,
    tokenizer: Any = None,
    intervene: Any = None,
    dtype: torch.dtype | None = None,
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
) -> ActivationDataset:
    """Store the sites' activations at every real token of a dataset, as safetensors shards.

    Each shard holds, per real token (padding is never stored), a ``row`` id, its ``position``
    in the row, the ``token`` id, and one column per site. Module sites are read with forward
    hooks only; op sites (``tl.func(...)``, op labels) use the op recorder, as ``tl.extract``.

    Args:
        model: an ``nn.Module``; or, for any backend, a picklable zero-argument factory returning
            one, or a path for ``transformers.AutoModelForCausalLM.from_pretrained``.
        data: an iterable or ``datasets.Dataset`` of rows: token ids (list of ints, 1-D integer
            tensor or array, ``{"input_ids": ...}``) or text (a string, ``{text_column: str}``).
        sites: what ``tl.extract`` takes: a list of sites (stored under ``str(site)``) or a dict
            ``{name: site}``. Each value must be ``[batch, tokens, ...]`` (a module returning a
            tuple contributes its first tensor).
        out: the job directory (created); rerunning the same call on it resumes the job.
        batch_size: rows per forward; rows of a batch are right-padded with an attention mask.
        tokenizer: a Hugging Face tokenizer, needed when rows are text (default: the model's
            ``tokenizer`` attribute, as every entry point: docs/concepts.md, "Text in").
        intervene: ``tl.when(site, edit)``, a list of them, or a loaded recipe, applied in every forward.
        dtype: store values in this dtype (default: as computed).
        shard_size: bytes of records per shard (``"128MB"``, ``"1GiB"`` or an int); with the batch,
            this bounds the memory a job uses.
        max_length: truncate rows to this many tokens (default: refuse rows the model cannot take).
        text_column: the column holding text in dict rows.
        add_special_tokens: passed to the tokenizer.
        backend: ``"local"`` (in this process) or ``"ray"`` (needs ``torchlens[ray]``).
        num_workers: Ray actors, each building its own model.
        threads_per_worker: torch threads (and Ray CPUs) per Ray actor.
        ray_address: a Ray cluster to connect to when Ray is not initialised (default: a local one).
        progress: a tqdm bar with tokens/s (default: on when stderr is a terminal).
        overwrite: discard a different job found in ``out`` instead of refusing.
        stop_early: when every site is a whole module, stop each forward once the last site
            has returned (the later layers and the unembedding never run; stored values are the
            same). The first batch in each process runs whole and refuses a site module that
            runs twice per forward. Pass ``False`` for a model whose control flow differs
            between batches so that a site module may run again after the others.

    Returns:
        the :class:`ActivationDataset` on ``out``.

    Raises:
        SiteNotFoundError: a site names nothing in the model (nothing is written).
        DatasetRowError: a row is not token ids or text, is empty, or is too long for the model.
        TokenizerRequiredError: a row is text and no tokenizer was given.
        JobMismatchError: ``out`` holds a different job (other model, arguments or data).
        ShardWriteError: a shard could not be written (disk full); rerun to resume.
    """
    described = _describe_sites(sites)  # (refuses a bad sites= before anything runs)
    reader = SiteReader(sites, intervene, stop_early)
    args = {"kind": "cache_activations", "sites": described, "intervene": _describe_intervene(intervene)}
    return _run(model, data, reader, True, args, RunOptions.of(locals()))


def map_dataset(
    model: Any,
    data: Iterable[Any],
    fn: Callable[[nn.Module, Batch], dict[str, torch.Tensor]],
    *,
    out: str | pathlib.Path,
    per: str = "row",
    batch_size: int = 16,
    tokenizer: Any = None,
    dtype: torch.dtype | None = None,
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
) -> ActivationDataset:
    """Store what ``fn(model, batch)`` returns for every batch of a dataset (a metric, a probe's input...).

    ``fn`` receives the model and a :class:`Batch` (``rows``, ``input_ids``, ``attention_mask``,
    ``batch.inputs(model)``) and returns ``{name: tensor}``; it runs under ``torch.no_grad()``.
    The job's identity includes ``fn``'s module and name: change its code, change ``out``.

    Args:
        fn: the per-batch function; for ``backend="ray"`` it must be picklable.
        per: ``"row"``: each tensor is ``[batch, ...]``, one record per row; ``"token"``: each is
            ``[batch, tokens, ...]``, one record per real token (with row/position/token ids).
        model, data, out, batch_size, tokenizer, dtype, shard_size, max_length, text_column,
            add_special_tokens, backend, num_workers, threads_per_worker, ray_address, progress,
            overwrite: as :func:`cache_activations`.

    Returns:
        the :class:`ActivationDataset` on ``out``.

    Raises:
        DatasetError: ``fn`` returned something that is not ``{name: tensor}`` of the right leading shape.
        DatasetRowError, TokenizerRequiredError, JobMismatchError, ShardWriteError: as :func:`cache_activations`.
    """
    if per not in ("row", "token"):
        raise InvalidArgumentError(f"per= is 'row' or 'token', got {per!r}")
    if not callable(fn):
        raise InvalidArgumentError(f"fn must be a function (model, batch) -> dict of tensors, got {type(fn).__name__}")
    args = {"kind": "map_dataset", "fn": _describe_fn(fn), "per": per}
    return _run(model, data, fn, per == "token", args, RunOptions.of(locals()))


def load_activations(path: str | pathlib.Path, *, verify: bool = False) -> ActivationDataset:
    """Open a finished activation dataset (shards are memory-mapped, nothing is read up front).

    Args:
        path: the job directory.
        verify: recompute every shard's sha256 against the manifest first.

    Raises:
        DatasetFormatError: no finished dataset there, or a checksum differs.
    """
    return ActivationDataset(path, verify=verify)


# -- the driver: one loop for both backends ---------------------------------------------------


class LocalExecutor:
    """Runs shards in this process, one after the other."""

    def __init__(self, model: Any, job: Job, out: pathlib.Path) -> None:
        self.model = build_model(model)
        self.job = job
        self.out = out
        self.first: dict[str, torch.Tensor] | None = None

    def start(self, first: RawBatch, need_columns: bool) -> tuple[dict[str, Any], dict[str, Any] | None]:
        identity = model_identity(self.model)
        if not need_columns:
            return identity, None
        columns, self.first = probe(self.job, self.model, first)
        return identity, columns

    def map(self, plans: Iterator[ShardPlan], columns: dict[str, Any]) -> Iterator[dict[str, Any]]:
        for plan in plans:
            first, self.first = (self.first if plan.index == 0 else None), None
            yield run_shard(self.job, self.model, plan, self.out, columns, first)

    def close(self) -> None:
        self.first = None


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """The keywords every dataset run shares (``cache_activations``, ``map_dataset``; each
    documented on :func:`cache_activations`), checked in one place."""

    out: str | pathlib.Path
    batch_size: int
    tokenizer: Any
    dtype: torch.dtype | None
    shard_size: int | str
    max_length: int | None
    text_column: str
    add_special_tokens: bool
    backend: str
    num_workers: int
    threads_per_worker: int
    ray_address: str | None
    progress: bool | None
    overwrite: bool

    @classmethod
    def of(cls, call: dict[str, Any]) -> RunOptions:
        """The options among an entry point's arguments (its ``locals()``), checked.

        Raises:
            InvalidArgumentError: a count that is not a positive int, a bad ``max_length`` or ``dtype``.
        """
        options = cls(**{f.name: call[f.name] for f in dataclasses.fields(cls)})
        for name in ("batch_size", "num_workers", "threads_per_worker"):
            value = getattr(options, name)
            if type(value) is not int or value < 1:
                raise InvalidArgumentError(f"{name} must be a positive int, got {value!r}")
        if options.max_length is not None and (type(options.max_length) is not int or options.max_length < 1):
            raise InvalidArgumentError(f"max_length must be a positive int or None, got {options.max_length!r}")
        if options.dtype is not None and not isinstance(options.dtype, torch.dtype):
            raise InvalidArgumentError(f"dtype must be a torch.dtype, got {type(options.dtype).__name__}")
        return options


def _run(model: Any, data: Iterable[Any], fn: Callable, per_token: bool, args: dict[str, Any],
         options: RunOptions) -> ActivationDataset:
    o = options
    shard_bytes = _parse_size(o.shard_size)
    out = pathlib.Path(o.out)
    tokenizer = tokenizer_for(model, o.tokenizer)
    job = Job(fn, per_token, o.dtype, pad_id(tokenizer))
    args = dict(args, batch_size=o.batch_size, shard_bytes=shard_bytes, dtype=None if o.dtype is None else str(o.dtype),
                max_length=o.max_length, text_column=o.text_column, add_special_tokens=o.add_special_tokens)
    batches = iter_batches(data, o.batch_size, tokenizer=tokenizer, text_column=o.text_column,
                           max_length=o.max_length, add_special_tokens=o.add_special_tokens)
    first = next(batches, None)
    if first is None:
        raise DatasetRowError("the dataset has no rows", remedy="Pass a dataset with at least one row.")
    if o.backend == "local":
        executor: Any = LocalExecutor(model, job, out)
    elif o.backend == "ray":
        from ._ray_backend import RayExecutor  # lazy: Ray is an optional extra, only this backend needs it

        executor = RayExecutor(model, job, out, num_workers=o.num_workers, threads=o.threads_per_worker,
                               address=o.ray_address)
    else:
        raise InvalidArgumentError(f"backend is 'local' or 'ray', got {o.backend!r}")
    try:
        on_disk = None if o.overwrite or not out.is_dir() else read_manifest(out)
        model_id, columns = executor.start(first, need_columns=on_disk is None)
        args["model"] = model_id
        manifest = check_directory(out, args, o.overwrite)
        if manifest is None:
            if columns is None:  # the directory changed under us between the two looks
                model_id, columns = executor.start(first, need_columns=True)
            manifest = _new_manifest(args, columns, per_token)
        plans = plan_shards(itertools.chain([first], batches), _budget(manifest, shard_bytes), per_token)
        _drive(executor, plans, manifest, out, o.progress)
    finally:
        executor.close()
    return ActivationDataset(out)


def _drive(executor: Any, plans: Iterator[ShardPlan], manifest: dict[str, Any], out: pathlib.Path,
           progress: bool | None) -> None:
    """Run every planned shard the manifest does not hold yet, committing each as it lands."""
    done = {s["index"]: s for s in manifest["shards"]}
    seen: set[int] = set()
    with progress_bar(desc=f"caching to {out.name}", unit="tok", progress=progress) as bar:

        def todo() -> Iterator[ShardPlan]:
            for plan in plans:
                seen.add(plan.index)
                entry = done.get(plan.index)
                if entry is not None and (out / entry["file"]).is_file():
                    if entry["inputs_sha256"] != plan.inputs_sha256 or entry["rows"] != list(plan.rows):
                        raise JobMismatchError(f"{out} holds shard {plan.index} made from other rows "
                                               f"(rows {entry['rows']}); the data differ from the first run",
                                               differences=["data"])
                    bar.update(plan.tokens)
                    continue
                yield plan

        for entry in executor.map(todo(), manifest["columns"]):
            done[entry["index"]] = entry
            manifest["shards"] = [done[i] for i in sorted(done)]
            commit_manifest(out, manifest)
            bar.update(entry["tokens"])
    extra = sorted(set(done) - seen)
    if extra:
        raise JobMismatchError(f"{out} holds shards {extra[:5]} past the end of this dataset; the data differ "
                               f"from the first run", differences=["data"])
    shards = manifest["shards"]
    manifest.update(complete=True, shard_count=len(shards), rows=shards[-1]["rows"][1],
                    records=sum(s["records"] for s in shards), tokens=sum(s["tokens"] for s in shards))
    commit_manifest(out, manifest)


def _new_manifest(args: dict[str, Any], columns: dict[str, Any], per_token: bool) -> dict[str, Any]:
    return {"format": FORMAT, "format_version": FORMAT_VERSION, "torchlens_version": installed_version(),
            "per": "token" if per_token else "row", "job": json.loads(json.dumps(args, default=str)),
            "model": args["model"], "columns": columns, "record_bytes": _record_bytes(columns),
            "complete": False, "shards": []}


def _record_bytes(columns: dict[str, Any]) -> int:
    total = 0
    for col in columns.values():
        size = ST_DTYPES[col["dtype"]].itemsize
        for d in col["shape"]:
            size *= d
        total += size
    return total


def _budget(manifest: dict[str, Any], shard_bytes: int) -> int:
    return max(1, shard_bytes // max(1, manifest["record_bytes"]))


def _parse_size(size: int | str) -> int:
    if type(size) is int and size > 0:
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*", size, re.I) if isinstance(size, str) else None
    if match is None:
        raise InvalidArgumentError(f"shard_size takes a positive number of bytes or a size like '128MB', got {size!r}")
    value = int(float(match.group(1)) * _UNITS[(match.group(2) or "").upper()])
    if value < 1:
        raise InvalidArgumentError(f"shard_size must be at least one byte, got {size!r}")
    return value


# -- describing the job, so a resume with other arguments is refused -------------------------


def _describe_sites(sites: Any) -> Any:
    """The job's record of ``sites=`` (checked by ``as_sites``): each site's text, under its dict key."""
    def one(site: Any) -> str:
        return site if isinstance(site, str) else site.describe() if hasattr(site, "describe") else repr(site)

    pairs = as_sites(sites)
    if isinstance(sites, dict):
        return {k: one(v) for k, v in pairs}
    return [one(s) for _, s in pairs]


def _callable_name(fn: Any) -> str:
    target = getattr(fn, "func", fn)  # a functools.partial names its function
    name = getattr(target, "__qualname__", None) or type(target).__qualname__
    return f"{getattr(target, '__module__', None) or type(target).__module__}.{name}"


def _describe_fn(fn: Any) -> dict[str, Any]:
    """Name, code digest and bound values of a per-batch function: change any, change the job."""
    target = getattr(fn, "func", fn)
    found: dict[str, Any] = {"name": _callable_name(fn)}
    call = vars(type(target)).get("__call__")  # a callable object: the code of its class's __call__
    code = getattr(target, "__code__", None) or getattr(call, "__code__", None)
    if code is not None:
        found["code"] = hashlib.sha256(code.co_code + repr(code.co_consts).encode()).hexdigest()[:16]
    if target is not fn:  # a functools.partial: its bound arguments
        found["partial"] = _describe_value([list(fn.args), dict(fn.keywords)])
    cells = getattr(target, "__closure__", None) or ()
    if cells:
        found["closure"] = _describe_value([c.cell_contents for c in cells])
    if not hasattr(target, "__code__") and hasattr(target, "__dict__"):  # a callable object: its state
        found["state"] = _describe_value(dict(vars(target)))
    return found


def _describe_value(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        data = value.detach().cpu().contiguous()
        digest = hashlib.sha256(data.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
        return f"tensor{list(data.shape)}:{data.dtype}:{digest[:16]}"
    if isinstance(value, (list, tuple)):
        return [_describe_value(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _describe_value(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if hasattr(value, "steps") or (hasattr(value, "site") and hasattr(value, "edit")):
        return _describe_intervene(value)
    return _callable_name(value) if callable(value) else f"{type(value).__qualname__}"


def _describe_intervene(intervene: Any) -> Any:
    if intervene is None:
        return None
    items = getattr(intervene, "steps", intervene)
    items = items if isinstance(items, (list, tuple)) else [items]
    found = []
    for step in items:
        site, edit = getattr(step, "site", None), getattr(step, "edit", None)
        if site is None:
            raise InvalidArgumentError(f"intervene= takes tl.when(site, edit), a list of them, or a loaded recipe; "
                                       f"got {type(step).__name__}")
        if hasattr(edit, "params") and hasattr(edit, "name"):
            what: Any = {"helper": edit.name, "params": _describe_value(edit.params())}
        else:
            what = _describe_value(edit)
        found.append([site if isinstance(site, str) else site.describe(), what])
    return found
