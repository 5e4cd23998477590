"""``tl.feature_stats(..., backend="ray")`` on a local two-CPU Ray started inside the test: the same shard
files (records and per-shard statistics) and the same merged statistics as the local backend."""

from __future__ import annotations

import pathlib

import pytest
import torch
from conftest import ToySAE
from test_features_workflows import ROWS, SITE, hand_stats, hooked_codes

import torchlens as tl

ray = pytest.importorskip("ray", reason="the Ray backend needs ray (the torchlens[ray] extra)")
transformers = pytest.importorskip("transformers")

HERE = pathlib.Path(__file__).resolve().parent
OPTIONS = {"batch_size": 4, "shard_size": 4000, "progress": False, "top_k": 4, "context": (2, 1), "store": 8}


@pytest.fixture(scope="module")
def local_ray():
    # Workers unpickle ToySAE from the test module by name, so they need the tests folder on their path.
    ray.init(num_cpus=2, log_to_driver=False, include_dashboard=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(HERE), "TORCHLENS_PROGRESS": "0"}})
    yield
    ray.shutdown()


def test_ray_gives_the_local_files_and_statistics(local_ray, tiny_gpt2, tmp_path):
    path = tmp_path / "model"
    tiny_gpt2.model.save_pretrained(path)
    sae = ToySAE()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each Ray worker: float sums then agree bit for bit
    try:
        local = tl.feature_stats(tiny_gpt2.model, ROWS, {SITE: sae}, out=tmp_path / "local", **OPTIONS)
    finally:
        torch.set_num_threads(threads)
    remote = tl.feature_stats(str(path), ROWS, {SITE: sae}, out=tmp_path / "ray", backend="ray", num_workers=2,
                              **OPTIONS)
    assert remote.dataset.num_shards == local.dataset.num_shards > 2
    for shard in local.dataset.manifest["shards"]:
        assert (tmp_path / "ray" / shard["file"]).read_bytes() == (tmp_path / "local" / shard["file"]).read_bytes()
    for field in ("count", "total", "max", "top_value", "top_row", "top_position", "top_tokens"):
        assert torch.equal(getattr(remote[SITE], field), getattr(local[SITE], field)), field
    want = hand_stats(hooked_codes(tiny_gpt2.model, sae, ROWS), ROWS, top_k=4, context=(2, 1))
    assert torch.equal(remote[SITE].count, want["count"])
