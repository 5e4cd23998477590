"""Activation datasets (``tl.cache_activations`` / ``tl.map_dataset``): values, resumability, bad input.

References are plain ``register_forward_hook`` reads of each row run alone (no padding), a
plain forward, or hand-computed values; resumability is checked against an uninterrupted run
byte for byte, after a real SIGKILL of a child process.
"""

from __future__ import annotations

import errno
import json
import math
import os
import pathlib
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import torchlens as tl
from torchlens.errors import (
    DatasetError,
    DatasetFormatError,
    DatasetRowError,
    JobMismatchError,
    ShardWriteError,
    SiteNotFoundError,
    TokenizerRequiredError,
)
from torchlens.store import _shards
from torchlens.store import datasets as tl_datasets

# Ragged rows of the tiny GPT-2 (vocab 64, 16 positions): batches of 3 mix lengths 1..7.
ROWS = [[(3 * i + j) % 60 + 1 for j in range(1 + (i * 5) % 7)] for i in range(24)]
SITES = ["transformer.h.0", "transformer.h.1.mlp"]
SMALL_SHARD = 3000  # bytes: a handful of shards for 24 rows


def reads(model, rows, address):
    """``address``'s output for each row run alone, read with a plain forward hook."""
    got = []
    handle = model.get_submodule(address).register_forward_hook(
        lambda mod, args, out: got.append((out if isinstance(out, torch.Tensor) else out[0]).detach().clone()))
    try:
        with torch.no_grad():
            for row in rows:
                model(torch.tensor([row]))
    finally:
        handle.remove()
    return [g[0] for g in got]


def cache(model, out, rows=ROWS, **kwargs):
    kwargs = {"batch_size": 3, "shard_size": SMALL_SHARD, "progress": False, **kwargs}
    return tl.cache_activations(model, rows, SITES, out=out, **kwargs)


def snapshot(path: pathlib.Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def uninterrupted(tiny_gpt2, tmp_path_factory):
    """The reference job directory, written in one go."""
    out = tmp_path_factory.mktemp("ref") / "job"
    cache(tiny_gpt2.model, out)
    return out


@pytest.fixture(scope="module")
def word_tokenizer():
    """A word-level Hugging Face tokenizer built in-process (no hub)."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = "the cat sat on a mat dog ran far away and then slept".split()
    vocab = {"[PAD]": 0, "[UNK]": 1, **{w: i + 2 for i, w in enumerate(words)}}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="[PAD]", unk_token="[UNK]")


# -- values ------------------------------------------------------------------------------------


def test_real_tokens_match_plain_hooks_per_row(tiny_gpt2, uninterrupted):
    ds = tl.load_activations(uninterrupted, verify=True)
    assert len(ds) == sum(map(len, ROWS)) and ds.num_shards >= 4
    assert ds.manifest["tokens"] == sum(map(len, ROWS)) and ds.manifest["rows"] == len(ROWS)
    want_rows = torch.tensor([i for i, r in enumerate(ROWS) for _ in r])
    want_pos = torch.tensor([p for r in ROWS for p in range(len(r))])
    assert torch.equal(ds.tensor("row"), want_rows)
    assert torch.equal(ds.tensor("position"), want_pos)
    assert torch.equal(ds.tensor("token"), torch.tensor([t for r in ROWS for t in r]))
    for site in SITES:
        want = torch.cat(reads(tiny_gpt2.model, ROWS, site))
        torch.testing.assert_close(ds.tensor(site), want, atol=1e-5, rtol=0)
    item = ds[7]
    assert int(item["row"]) == int(want_rows[7]) and item["transformer.h.0"].shape == (32,)


def test_stop_early_skips_the_rest_of_the_model_and_stores_the_same_bytes(tiny_gpt2, uninterrupted, tmp_path):
    calls = []
    handle = tiny_gpt2.model.lm_head.register_forward_hook(lambda *a: calls.append(1))
    try:
        cache(tiny_gpt2.model, tmp_path / "again")  # stop_early=True is the default
        early = len(calls)
        cache(tiny_gpt2.model, tmp_path / "whole", stop_early=False)
    finally:
        handle.remove()
    batches = math.ceil(len(ROWS) / 3)
    assert early == 1  # the first batch runs whole (the run-twice check), the others stop at h.1.mlp
    assert len(calls) - early == batches
    assert snapshot(tmp_path / "again") == snapshot(uninterrupted)
    assert snapshot(tmp_path / "whole") == snapshot(uninterrupted)
    assert not tiny_gpt2.model.lm_head._forward_hooks and not tiny_gpt2.model.transformer.h[1].mlp._forward_hooks


def test_stop_early_is_off_for_op_sites(tiny_gpt2, tmp_path):
    calls = []
    handle = tiny_gpt2.model.lm_head.register_forward_hook(lambda *a: calls.append(1))
    try:
        site = tl.in_module("transformer.h.0.mlp.act") & tl.func("tanh")
        tl.cache_activations(tiny_gpt2.model, ROWS[:6], {"act": site}, out=tmp_path / "j", batch_size=3,
                             progress=False)
    finally:
        handle.remove()
    assert len(calls) == 2  # every forward ran whole


def test_shards_are_bounded_by_shard_size(uninterrupted):
    ds = tl.load_activations(uninterrupted)
    width = ds.manifest["record_bytes"]
    batch_max = max(sum(len(r) for r in ROWS[i:i + 3]) for i in range(0, len(ROWS), 3))
    for shard in ds.manifest["shards"]:
        assert shard["records"] * width < SMALL_SHARD + batch_max * width


def test_readable_without_torchlens(uninterrupted):
    """The documented layout: manifest.json lists shards; each is a plain safetensors file."""
    from safetensors.numpy import load_file

    manifest = json.loads((uninterrupted / "manifest.json").read_text())
    parts = [load_file(uninterrupted / s["file"]) for s in sorted(manifest["shards"], key=lambda s: s["index"])]
    site = torch.cat([torch.from_numpy(p["transformer.h.0"]) for p in parts])
    assert torch.equal(site, tl.load_activations(uninterrupted).tensor("transformer.h.0"))
    assert site.shape == (manifest["tokens"], *manifest["columns"]["transformer.h.0"]["shape"])


def test_dataloader_and_mean(uninterrupted):
    ds = tl.load_activations(uninterrupted)
    loader = torch.utils.data.DataLoader(ds, batch_size=10, shuffle=False)
    stacked = torch.cat([b["transformer.h.0"] for b in loader])
    assert torch.equal(stacked, ds.tensor("transformer.h.0"))
    torch.testing.assert_close(ds.mean("transformer.h.0"), stacked.double().mean(0).float())


def test_to_hf_dataset(uninterrupted, tmp_path):
    pytest.importorskip("datasets")
    ds = tl.load_activations(uninterrupted)
    hf = ds.to_hf(tmp_path / "arrow")
    assert len(hf) == len(ds)
    hf.set_format("torch")
    assert torch.equal(hf["transformer.h.0"][:], ds.tensor("transformer.h.0"))
    assert torch.equal(hf["row"][:], ds.tensor("row"))


def test_text_rows_with_a_tokenizer(tiny_gpt2, word_tokenizer, tmp_path):
    texts = ["the cat sat on a mat", "dog ran", "then the dog slept far away", "a cat"]
    ds = tl.cache_activations(tiny_gpt2.model, [{"text": t} for t in texts], ["transformer.h.0"],
                              tokenizer=word_tokenizer, out=tmp_path / "t", batch_size=3, progress=False)
    ids = [word_tokenizer(t)["input_ids"] for t in texts]
    assert torch.equal(ds.tensor("token"), torch.tensor([t for r in ids for t in r]))
    want = torch.cat(reads(tiny_gpt2.model, ids, "transformer.h.0"))
    torch.testing.assert_close(ds.tensor("transformer.h.0"), want, atol=1e-5, rtol=0)


def test_datasets_dataset_input(tiny_gpt2, tmp_path, uninterrupted):
    datasets = pytest.importorskip("datasets")
    data = datasets.Dataset.from_dict({"input_ids": ROWS})
    out = tmp_path / "hf"
    tl.cache_activations(tiny_gpt2.model, data, SITES, out=out, batch_size=3, shard_size=SMALL_SHARD, progress=False)
    assert snapshot(out) == snapshot(uninterrupted)


def test_op_site_uses_the_recorder(tiny_gpt2, tmp_path):
    """An op no module outputs (the tanh inside GELU), against a hand computation from hook reads."""
    site = tl.in_module("transformer.h.0.mlp.act") & tl.func("tanh")
    ds = tl.cache_activations(tiny_gpt2.model, ROWS[:6], {"tanh": site}, out=tmp_path / "op", batch_size=3,
                              progress=False)
    x = torch.cat(reads(tiny_gpt2.model, ROWS[:6], "transformer.h.0.mlp.c_fc"))
    want = torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3)))
    torch.testing.assert_close(ds.tensor("tanh"), want, atol=1e-5, rtol=0)


def test_intervene_matches_a_plain_hook_edit(tiny_gpt2, tmp_path):
    model = tiny_gpt2.model
    ds = tl.cache_activations(model, ROWS[:6], ["transformer.h.1"], out=tmp_path / "e", batch_size=3,
                              intervene=tl.when("transformer.h.0", tl.scale(0.5)), progress=False)
    handle = model.transformer.h[0].register_forward_hook(
        lambda mod, args, out: (out * 0.5) if isinstance(out, torch.Tensor) else (out[0] * 0.5, *out[1:]))
    try:
        want = torch.cat(reads(model, ROWS[:6], "transformer.h.1"))
    finally:
        handle.remove()
    torch.testing.assert_close(ds.tensor("transformer.h.1"), want, atol=1e-5, rtol=0)
    [(site, edit)] = ds.manifest["job"]["intervene"]
    assert "transformer.h.0" in site and edit == {"helper": "scale", "params": {"k": 0.5}}


def last_logit_and_loss(model, batch):
    """Per row: the logit of token 0 at the last real position, and the mean next-token loss."""
    logits = model(**batch.inputs(model)).logits
    last = batch.attention_mask.sum(1) - 1
    pick = logits[torch.arange(len(last)), last, 0]
    logp = logits[:, :-1].log_softmax(-1).gather(-1, batch.input_ids[:, 1:, None])[..., 0]
    mask = batch.attention_mask[:, 1:].float()
    loss = -(logp * mask).sum(1) / mask.sum(1).clamp(min=1)
    return {"logit0": pick, "loss": loss}


def test_map_dataset_per_row_metric(tiny_gpt2, tmp_path):
    model = tiny_gpt2.model
    ds = tl.map_dataset(model, ROWS, last_logit_and_loss, out=tmp_path / "m", batch_size=5, progress=False)
    assert len(ds) == len(ROWS) and torch.equal(ds.tensor("row"), torch.arange(len(ROWS)))
    with torch.no_grad():
        for i, row in enumerate(ROWS):
            logits = model(torch.tensor([row])).logits[0]
            torch.testing.assert_close(ds[i]["logit0"], logits[-1, 0], atol=1e-5, rtol=0)
            if len(row) > 1:
                want = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(row[1:]))
                torch.testing.assert_close(ds[i]["loss"], want, atol=1e-5, rtol=0)


def test_progress_bar_shows_tokens_per_second(tiny_gpt2, tmp_path, monkeypatch, capsys):
    pytest.importorskip("tqdm")
    from torchlens import _progress

    monkeypatch.setattr(_progress, "DELAY_SECONDS", 0)
    cache(tiny_gpt2.model, tmp_path / "p1", rows=ROWS[:6], progress=True)
    assert "tok/s" in capsys.readouterr().err
    cache(tiny_gpt2.model, tmp_path / "p2", rows=ROWS[:6], progress=False)
    assert capsys.readouterr().err == ""


# -- resumability -------------------------------------------------------------------------------

CHILD = textwrap.dedent("""
    import json, os, signal, sys
    import torch, transformers
    import torchlens as tl
    from torchlens.store import _shards, datasets as tl_datasets

    path, out, point, threads, rows_json = sys.argv[1:]
    torch.set_num_threads(int(threads))
    model = transformers.GPT2LMHeadModel.from_pretrained(path).eval()
    die = lambda: os.kill(os.getpid(), signal.SIGKILL)
    if point == "forward":  # in the middle of shard 2's batches
        calls = [0]
        def hook(mod, args, output):
            calls[0] += 1
            if calls[0] == 5:
                die()
        model.transformer.h[0].register_forward_hook(hook)  # h.1 never completes: the job stops after h.1.mlp
    elif point == "write":  # half-way through the bytes of the third shard file
        real, opened = _shards._open_for_write, [0]
        class Dying:
            def __init__(self, f):
                self.f = f
            def __enter__(self):
                return self
            def __exit__(self, *exc):
                self.f.close()
            def fileno(self):
                return self.f.fileno()
            def flush(self):
                self.f.flush()
            def write(self, data):
                self.f.write(bytes(data)[: len(data) // 2])
                self.f.flush()
                die()
        def opener(p):
            f = real(p)
            if p.name.startswith("shard-"):
                opened[0] += 1
                if opened[0] == 3:
                    return Dying(f)
            return f
        _shards._open_for_write = opener
    elif point == "commit":  # shard 1 renamed into place, not yet in the manifest
        real_commit, commits = tl_datasets.commit_manifest, [0]
        def commit(out, manifest):
            commits[0] += 1
            if commits[0] == 2:
                die()
            real_commit(out, manifest)
        tl_datasets.commit_manifest = commit
    tl.cache_activations(model, json.loads(rows_json), ["transformer.h.0", "transformer.h.1.mlp"], out=out,
                         batch_size=3, shard_size=3000, progress=False)
    print("finished without being killed")
""")


@pytest.fixture(scope="module")
def tiny_gpt2_path(tiny_gpt2, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_gpt2")
    tiny_gpt2.model.save_pretrained(path)
    return path


def run_child(script: pathlib.Path, model_path: pathlib.Path, out: pathlib.Path, point: str):
    """Run the job in a fresh process (``point``: where it kills itself, or "none" to finish).

    One thread: a multi-threaded BLAS may split a product differently under load (seen on CI),
    and byte equality across processes needs the forward itself to give the same bits."""
    script.write_text(CHILD)
    return subprocess.run([sys.executable, str(script), str(model_path), str(out), point,
                           "1", json.dumps(ROWS)], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, TORCHLENS_PROGRESS="0"))


@pytest.fixture(scope="module")
def uninterrupted_child(tiny_gpt2_path, tmp_path_factory):
    """The reference job, written in one go by a fresh process: the killed run, its resumption and
    this reference then all compute in processes started alike (no state left by other tests)."""
    where = tmp_path_factory.mktemp("ref_child")
    proc = run_child(where / "child.py", tiny_gpt2_path, where / "job", "none")
    assert proc.returncode == 0 and "finished without being killed" in proc.stdout, proc.stderr[-3000:]
    return where / "job"


@pytest.mark.parametrize("point", ["forward", "write", "commit"])
def test_sigkill_then_rerun_is_identical(point, tiny_gpt2_path, uninterrupted_child, tmp_path):
    uninterrupted = uninterrupted_child
    out = tmp_path / "job"
    proc = run_child(tmp_path / "child.py", tiny_gpt2_path, out, point)
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr[-3000:]
    before = snapshot(out)
    if point == "write":
        assert any(".tmp-" in name for name in before), "the kill should leave a half-written shard behind"
    committed = json.loads(before["manifest.json"])["shards"] if "manifest.json" in before else []
    assert len(committed) < len(json.loads((uninterrupted / "manifest.json").read_text())["shards"])
    resumed = run_child(tmp_path / "child.py", tiny_gpt2_path, out, "none")  # the same call again: resumes
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert snapshot(out) == snapshot(uninterrupted)


def test_disk_full_mid_shard_leaves_the_directory_resumable(tiny_gpt2, uninterrupted, tmp_path, monkeypatch):
    real, opened = _shards._open_for_write, [0]

    class Full:
        """A file on a disk that fills up after 100 bytes."""

        def __init__(self, f):
            self.f, self.n = f, 0

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, data):
            self.n += len(data)
            if self.n > 100:
                raise OSError(errno.ENOSPC, "No space left on device")
            self.f.write(data)

    def opener(p):
        f = real(p)
        if p.name.startswith("shard-"):
            opened[0] += 1
            if opened[0] == 3:
                return Full(f)
        return f

    out = tmp_path / "job"
    monkeypatch.setattr(_shards, "_open_for_write", opener)
    with pytest.raises(ShardWriteError) as info:
        cache(tiny_gpt2.model, out)
    assert info.value.errno == errno.ENOSPC and info.value.remedy
    names = sorted(p.name for p in out.iterdir())
    assert names == ["manifest.json", "shard-00000.safetensors", "shard-00001.safetensors"]
    assert [s["index"] for s in json.loads((out / "manifest.json").read_text())["shards"]] == [0, 1]
    monkeypatch.setattr(_shards, "_open_for_write", real)
    cache(tiny_gpt2.model, out)
    assert snapshot(out) == snapshot(uninterrupted)


def test_rerun_of_a_finished_job_changes_nothing(tiny_gpt2, uninterrupted):
    before = snapshot(uninterrupted)
    cache(tiny_gpt2.model, uninterrupted)
    assert snapshot(uninterrupted) == before


# -- a different job in the directory is refused, not mixed in -------------------------------------


@pytest.mark.parametrize("change", ["model", "arguments", "data", "fewer_rows"])
def test_changed_job_on_resume_is_refused(change, tiny_gpt2, uninterrupted, tmp_path):
    import shutil

    out = tmp_path / "job"
    shutil.copytree(uninterrupted, out)
    before = snapshot(out)
    model, rows, kwargs = tiny_gpt2.model, ROWS, {}
    if change == "model":
        import copy

        model = copy.deepcopy(model)
        with torch.no_grad():
            model.transformer.h[0].mlp.c_fc.weight[0, 0] += 1.0
    elif change == "arguments":
        kwargs = {"dtype": torch.float16}
    elif change == "data":
        rows = [list(reversed(r)) for r in ROWS]
    else:
        rows = ROWS[:3]
    with pytest.raises(JobMismatchError) as info:
        cache(model, out, rows=rows, **kwargs)
    assert info.value.remedy
    assert snapshot(out) == before
    if change == "arguments":
        assert info.value.differences == ["dtype"]


def test_overwrite_replaces_a_different_job(tiny_gpt2, uninterrupted, tmp_path):
    import shutil

    out = tmp_path / "job"
    shutil.copytree(uninterrupted, out)
    ds = cache(tiny_gpt2.model, out, rows=ROWS[:3], overwrite=True)
    assert ds.manifest["rows"] == 3 and len(ds) == sum(map(len, ROWS[:3]))


def test_directory_with_other_files_is_refused(tiny_gpt2, tmp_path):
    out = tmp_path / "job"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(JobMismatchError):
        cache(tiny_gpt2.model, out)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


# -- bad input: a typed error, and nothing written ---------------------------------------------------


def test_site_that_does_not_exist(tiny_gpt2, tmp_path):
    out = tmp_path / "job"
    with pytest.raises(SiteNotFoundError) as info:
        tl.cache_activations(tiny_gpt2.model, ROWS, ["transformer.h.9"], out=out, progress=False)
    assert "transformer.h" in str(info.value)
    assert not out.exists() or not any(out.iterdir())


@pytest.mark.parametrize("row, match", [
    (torch.tensor([0.5, 1.5]), "integer"),
    ({"label": 3}, "without 'input_ids'"),
    (None, "NoneType"),
    ([], "no tokens"),
    ([1, True], "non-negative integers"),
    ([1, -2], "non-negative"),
    (list(range(1, 20)), "at most 16"),
    ([1, 2, 99], "vocabulary has 64"),
])
def test_bad_rows(row, match, tiny_gpt2, tmp_path):
    out = tmp_path / "job"
    rows = [[1, 2, 3], row]
    with pytest.raises(DatasetRowError, match=match) as info:
        tl.cache_activations(tiny_gpt2.model, rows, SITES, out=out, batch_size=2, progress=False)
    assert info.value.remedy and info.value.row == 1
    assert not (out / "manifest.json").exists() and not list(out.glob("shard-*"))


def test_text_without_tokenizer(tiny_gpt2, tmp_path):
    out = tmp_path / "job"
    with pytest.raises(TokenizerRequiredError):
        tl.cache_activations(tiny_gpt2.model, ["the cat"], SITES, out=out, progress=False)
    assert not out.exists()


def test_values_that_are_not_per_token(tiny_gpt2, tmp_path):
    with pytest.raises(DatasetError, match="a record needs"):
        tl.map_dataset(tiny_gpt2.model, ROWS[:3], lambda m, b: {"x": torch.zeros(7)}, out=tmp_path / "j",
                       progress=False)


def test_bad_arguments(tiny_gpt2, tmp_path):
    with pytest.raises(tl.errors.InvalidArgumentError):
        cache(tiny_gpt2.model, tmp_path / "a", shard_size="lots")
    with pytest.raises(tl.errors.InvalidArgumentError):
        cache(tiny_gpt2.model, tmp_path / "b", backend="spark")
    with pytest.raises(tl.errors.InvalidArgumentError):
        tl.map_dataset(tiny_gpt2.model, ROWS, last_logit_and_loss, out=tmp_path / "c", per="column")


def test_corrupted_shard_fails_verification(uninterrupted, tmp_path):
    import shutil

    out = tmp_path / "job"
    shutil.copytree(uninterrupted, out)
    shard = out / "shard-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(DatasetFormatError, match="checksum"):
        tl.load_activations(out, verify=True)


def test_unfinished_job_is_not_read(tiny_gpt2, tmp_path, monkeypatch):
    def boom(*args, **kwargs):
        raise ShardWriteError("simulated")

    calls = [0]
    real = tl_datasets.commit_manifest

    def commit(out, manifest):
        calls[0] += 1
        if calls[0] == 2:
            boom()
        real(out, manifest)

    monkeypatch.setattr(tl_datasets, "commit_manifest", commit)
    with pytest.raises(ShardWriteError):
        cache(tiny_gpt2.model, tmp_path / "job")
    with pytest.raises(DatasetFormatError, match="unfinished"):
        tl.load_activations(tmp_path / "job")


def test_the_shared_run_keywords_are_checked_once_for_both_entry_points(tiny_gpt2, tmp_path):
    """``RunOptions`` holds and checks the keywords ``cache_activations`` and ``map_dataset`` share:
    a bad one raises the same error from either, nothing written."""
    for name, bad in (("batch_size", 0), ("num_workers", 1.5), ("threads_per_worker", True), ("max_length", 0),
                      ("dtype", "float16")):
        with pytest.raises(tl.errors.InvalidArgumentError, match=name) as a:
            cache(tiny_gpt2.model, tmp_path / "a", **{name: bad})
        with pytest.raises(tl.errors.InvalidArgumentError, match=name) as b:
            tl.map_dataset(tiny_gpt2.model, ROWS, last_logit_and_loss, out=tmp_path / "b", progress=False,
                           **{name: bad})
        assert str(a.value) == str(b.value)
        assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    options = tl_datasets.RunOptions.of(dict(out="x", batch_size=2, tokenizer=None, dtype=None, shard_size="1MB",
                                             max_length=None, text_column="text", add_special_tokens=True,
                                             backend="local", num_workers=1, threads_per_worker=1, ray_address=None,
                                             progress=False, overwrite=False, unrelated=object()))
    assert options.batch_size == 2 and options.shard_size == "1MB"
