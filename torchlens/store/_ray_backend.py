"""``backend="ray"``: Ray actors build the model and write shards; the driver plans and commits.

Each actor builds its own model from the picklable factory (or a copy of the module) and
runs whole planned shards with :func:`run_shard`, writing them into the job directory (on a
cluster, ``out`` must be a filesystem every node sees). The driver keeps at most two shards
in flight per actor (memory stays bounded) and commits each result to the manifest. Actors
restart when their process dies and Ray retries the shard they held: a shard is written
under a temporary name and renamed, so a retried shard is neither lost nor duplicated.
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterator
from typing import Any

import torch

from ..errors import OptionalDependencyError, TorchLensError
from ._batches import RawBatch, ShardPlan
from ._runner import Job, build_model, model_identity, probe, run_shard

__all__ = ["RayExecutor", "ShardWorker"]

IN_FLIGHT_PER_WORKER = 2


class ShardWorker:
    """The body of one Ray actor: a model, and shards to run on it."""

    def __init__(self, model: Any, job: Job, out: str, threads: int) -> None:
        torch.set_num_threads(threads)
        self.model = build_model(model)
        self.job = job
        self.out = pathlib.Path(out)

    def identity(self) -> dict[str, Any]:
        return model_identity(self.model)

    def columns(self, first: RawBatch) -> dict[str, Any]:
        return probe(self.job, self.model, first)[0]

    def run(self, plan: ShardPlan, columns: dict[str, Any]) -> dict[str, Any]:
        return run_shard(self.job, self.model, plan, self.out, columns)


def _ray() -> Any:
    try:
        import ray  # optional heavy dependency: the torchlens[ray] extra
    except ImportError:
        raise OptionalDependencyError("backend='ray' needs Ray, which is not installed",
                                      remedy="pip install 'torchlens[ray]', or use backend='local'.") from None
    return ray


class RayExecutor:
    """Shards on a pool of Ray actors (connecting to ``address``, or a local Ray, if none is running)."""

    def __init__(self, model: Any, job: Job, out: pathlib.Path, *, num_workers: int, threads: int,
                 address: str | None) -> None:
        ray = self.ray = _ray()
        self.started = False
        if not ray.is_initialized():
            ray.init(address=address, log_to_driver=False)
            self.started = True
        out.mkdir(parents=True, exist_ok=True)
        remote = ray.remote(num_cpus=threads, max_restarts=-1, max_task_retries=-1)(ShardWorker)
        spec = ray.put(model) if isinstance(model, torch.nn.Module) else model  # one copy in the object store
        self.actors = [remote.remote(spec, job, str(out.resolve()), threads) for _ in range(num_workers)]

    def _get(self, ref: Any) -> Any:
        try:
            return self.ray.get(ref)
        except self.ray.exceptions.RayTaskError as exc:
            cause = getattr(exc, "cause", None)
            if isinstance(cause, TorchLensError):  # the worker's typed error, not Ray's wrapper
                raise cause from None
            raise

    def start(self, first: RawBatch, need_columns: bool) -> tuple[dict[str, Any], dict[str, Any] | None]:
        identities = [self._get(a.identity.remote()) for a in self.actors]
        if any(i != identities[0] for i in identities):
            raise TorchLensError("the Ray workers built different models from the same factory",
                                 remedy="Make the factory deterministic (load a checkpoint, or seed before building).")
        columns = self._get(self.actors[0].columns.remote(first)) if need_columns else None
        return identities[0], columns

    def map(self, plans: Iterator[ShardPlan], columns: dict[str, Any]) -> Iterator[dict[str, Any]]:
        pending: dict[Any, int] = {}
        load = [0] * len(self.actors)
        limit = IN_FLIGHT_PER_WORKER * len(self.actors)
        exhausted = False
        while pending or not exhausted:
            while not exhausted and len(pending) < limit:
                plan = next(plans, None)
                if plan is None:
                    exhausted = True
                    break
                k = min(range(len(self.actors)), key=load.__getitem__)
                pending[self.actors[k].run.remote(plan, columns)] = k
                load[k] += 1
            if not pending:
                break
            ready, _ = self.ray.wait(list(pending), num_returns=1)
            for ref in ready:
                load[pending.pop(ref)] -= 1
                yield self._get(ref)

    def close(self) -> None:
        for actor in getattr(self, "actors", []):
            self.ray.kill(actor)
        self.actors = []
        if self.started:
            self.ray.shutdown()
