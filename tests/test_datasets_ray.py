"""``backend="ray"`` on a local two-CPU Ray started inside the test: same files as the local backend,
also when a worker process is SIGKILLed mid-run."""

from __future__ import annotations

import functools
import os
import pathlib
import signal

import pytest
import torch

import torchlens as tl

ray = pytest.importorskip("ray")
transformers = pytest.importorskip("transformers")

HERE = pathlib.Path(__file__).resolve().parent
ROWS = [[(7 * i + j) % 60 + 1 for j in range(1 + (i * 3) % 9)] for i in range(40)]
SITES = ["transformer.h.0", "transformer.h.1"]
OPTIONS = {"batch_size": 4, "shard_size": 4000, "progress": False}


def snapshot(path: pathlib.Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def local_ray():
    # Workers import this module (the factories below) by name, so they need the tests folder on their path.
    ray.init(num_cpus=2, log_to_driver=False, include_dashboard=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(HERE), "TORCHLENS_PROGRESS": "0"}})
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def tiny_gpt2_path(tiny_gpt2, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_gpt2")
    tiny_gpt2.model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def local_run(tiny_gpt2, tmp_path_factory):
    out = tmp_path_factory.mktemp("local") / "job"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each Ray worker: float sums then agree bit for bit
    try:
        tl.cache_activations(tiny_gpt2.model, ROWS, SITES, out=out, **OPTIONS)
    finally:
        torch.set_num_threads(threads)
    return out


def dying_factory(path: str, marker: str):
    """Build the model; the first process to build it SIGKILLs itself during its third forward."""
    model = transformers.GPT2LMHeadModel.from_pretrained(path).eval()
    if not os.path.exists(marker):
        calls = [0]

        def hook(mod, args, output):
            calls[0] += 1
            if calls[0] == 3 and not os.path.exists(marker):
                pathlib.Path(marker).write_text(str(os.getpid()))
                os.kill(os.getpid(), signal.SIGKILL)

        model.transformer.h[1].register_forward_hook(hook)
    return model


def test_ray_matches_local_from_a_pretrained_path(local_ray, tiny_gpt2_path, local_run, tmp_path):
    out = tmp_path / "job"
    ds = tl.cache_activations(str(tiny_gpt2_path), ROWS, SITES, out=out, backend="ray", num_workers=2, **OPTIONS)
    assert ds.num_shards >= 4
    assert snapshot(out) == snapshot(local_run)


def test_killed_worker_loses_nothing(local_ray, tiny_gpt2_path, local_run, tmp_path):
    marker = tmp_path / "killed.pid"
    factory = functools.partial(dying_factory, str(tiny_gpt2_path), str(marker))
    out = tmp_path / "job"
    ds = tl.cache_activations(factory, ROWS, SITES, out=out, backend="ray", num_workers=2, **OPTIONS)
    assert marker.exists(), "no worker was killed"
    assert int(marker.read_text()) != os.getpid()
    assert snapshot(out) == snapshot(local_run)
    rows = ds.tensor("row")
    assert torch.equal(rows, torch.tensor([i for i, r in enumerate(ROWS) for _ in r]))  # none lost, none twice
