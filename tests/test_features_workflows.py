"""Feature workflows: streaming feature statistics over a dataset (``tl.feature_stats``).

The reference is a hand-written loop: a plain ``register_forward_hook`` read of the site with each
row run alone (no padding), ``sae.encode`` of it, and the statistics computed from every token's
dense activations in plain Python/torch.
"""

from __future__ import annotations

import pytest
import torch
from conftest import ToySAE, refused
from torch import nn

import torchlens as tl
from torchlens.errors import (
    DatasetFormatError,
    FeatureDtypeError,
    FeatureIndexError,
    FeatureWidthError,
    InvalidArgumentError,
    JobMismatchError,
    NotAFeatureDictionaryError,
)

# Ragged rows of the tiny GPT-2 (vocab 64, 16 positions): batches of 4 mix lengths 1..9.
ROWS = [[(7 * i + j) % 60 + 1 for j in range(1 + (i * 3) % 9)] for i in range(40)]
SITE = "transformer.h.0"
OPTIONS = {"batch_size": 4, "shard_size": 4000, "progress": False}


def hooked_codes(model, sae, rows, address=SITE):
    """Each row's ``[tokens, d_sae]`` activations: the site read by a forward hook, row alone, then encoded."""
    got = []
    handle = model.get_submodule(address).register_forward_hook(
        lambda mod, args, out: got.append(out[0] if isinstance(out, tuple) else out))
    try:
        with torch.no_grad():
            for row in rows:
                model(torch.tensor([row]))
                got[-1] = sae.encode(got[-1][0])
    finally:
        handle.remove()
    return got


def hand_stats(codes, rows, top_k, context):
    """Frequency, mean, max and top contexts, computed from every token's dense activations."""
    left, right = context
    flat = torch.cat(codes)
    where = [(r, p) for r, c in enumerate(codes) for p in range(c.shape[0])]
    top = []
    for f in range(flat.shape[1]):
        order = sorted(range(flat.shape[0]), key=lambda i: -float(flat[i, f]))[:top_k]
        found = []
        for i in order:
            if float(flat[i, f]) <= 0:
                break
            r, p = where[i]
            window = [rows[r][q] for q in range(p - left, p + right + 1) if 0 <= q < len(rows[r])]
            found.append((r, p, float(flat[i, f]), window))
        top.append(found)
    return {"tokens": flat.shape[0], "count": (flat > 0).sum(0), "mean": flat.double().mean(0),
            "max": flat.amax(0), "top": top}


@pytest.fixture(scope="module")
def sae():
    return ToySAE()


@pytest.fixture(scope="module")
def reference(tiny_gpt2, sae):
    codes = hooked_codes(tiny_gpt2.model, sae, ROWS)
    return codes, hand_stats(codes, ROWS, top_k=5, context=(3, 1))


@pytest.fixture(scope="module")
def job(tiny_gpt2, sae, tmp_path_factory):
    out = tmp_path_factory.mktemp("stats") / "job"
    return tl.feature_stats(tiny_gpt2.model, ROWS, {SITE: sae}, out=out, top_k=5, context=(3, 1), store=100,
                            **OPTIONS)


def test_statistics_equal_a_hand_written_hooks_loop(job, reference):
    _, want = reference
    got = job[SITE]
    assert got.tokens == want["tokens"] == sum(len(r) for r in ROWS)
    assert torch.equal(got.count, want["count"])
    assert 0 < int((got.count > 0).sum()) < got.count.numel()  # some features fire, some never do
    torch.testing.assert_close(got.mean, want["mean"], atol=1e-6, rtol=0)
    torch.testing.assert_close(got.frequency, want["count"].double() / want["tokens"])
    torch.testing.assert_close(got.max, want["max"], atol=1e-6, rtol=0)
    for f in range(got.count.numel()):
        contexts = got.top_contexts(f)
        assert [(c["row"], c["position"], c["tokens"]) for c in contexts] == \
            [(r, p, w) for r, p, _, w in want["top"][f]], f"feature {f}"
        assert [c["value"] for c in contexts] == pytest.approx([v for _, _, v, _ in want["top"][f]], abs=1e-6)


def test_sparse_records_read_back_as_the_dense_activations(job, reference):
    codes, _ = reference
    ds = job.dataset
    assert isinstance(ds, tl.ActivationDataset) and ds.num_shards > 1
    want = torch.cat(codes)
    torch.testing.assert_close(job.dense(SITE), want, atol=1e-6, rtol=0)
    active = torch.cat([job.sparse(SITE, k)["active"] for k in range(ds.num_shards)])
    assert torch.equal(active.long(), (want > 0).sum(1))
    record = ds[7]  # the per-token record: row, position, token, then indices + values (rows 0, 1 hold 5 tokens)
    assert (len(ROWS[0]), len(ROWS[1])) == (1, 4)
    assert int(record["row"]) == 2 and int(record["position"]) == 2 and int(record["token"]) == ROWS[2][2]
    fired = record[f"{SITE}.index"] >= 0
    torch.testing.assert_close(record[f"{SITE}.value"][fired], want[7][record[f"{SITE}.index"][fired].long()])


def test_a_small_store_keeps_the_largest_features_and_exact_statistics(tiny_gpt2, sae, reference, tmp_path):
    codes, want = reference
    got = tl.feature_stats(tiny_gpt2.model, ROWS, {SITE: sae}, out=tmp_path / "j", top_k=5, context=(3, 1),
                           store=4, **OPTIONS)
    assert torch.equal(got[SITE].count, want["count"])  # statistics see every feature, not the stored 4
    s = got.sparse(SITE, 0)
    dense = torch.cat(codes)[: s["index"].shape[0]]
    assert int(s["active"].max()) > 4
    torch.testing.assert_close(s["value"], dense.topk(4, dim=1).values.clamp(min=0), atol=1e-6, rtol=0)


def test_reopening_merges_the_same_statistics_and_resuming_refuses_another_sae(job, tiny_gpt2, sae):
    again = tl.load_feature_stats(job.dataset.path, verify=True)
    for field in ("count", "total", "max", "top_value", "top_row", "top_position", "top_tokens"):
        assert torch.equal(getattr(again[SITE], field), getattr(job[SITE], field)), field
    rerun = tl.feature_stats(tiny_gpt2.model, ROWS, {SITE: sae}, out=job.dataset.path, top_k=5, context=(3, 1),
                             store=100, **OPTIONS)  # the finished job: resumed, nothing recomputed
    assert torch.equal(rerun[SITE].count, job[SITE].count)
    with pytest.raises(JobMismatchError) as err:
        tl.feature_stats(tiny_gpt2.model, ROWS, {SITE: ToySAE(seed=1)}, out=job.dataset.path, top_k=5,
                         context=(3, 1), store=100, **OPTIONS)
    assert "dictionaries" in err.value.differences


def test_several_sites_at_once(tiny_gpt2, sae, tmp_path):
    other = ToySAE(seed=2, d_sae=40)
    got = tl.feature_stats(tiny_gpt2.model, ROWS[:9], {SITE: sae, "transformer.h.1": other}, out=tmp_path / "j",
                           top_k=2, context=0, **OPTIONS)
    for address, dictionary in ((SITE, sae), ("transformer.h.1", other)):
        want = hand_stats(hooked_codes(tiny_gpt2.model, dictionary, ROWS[:9], address), ROWS[:9], top_k=2,
                          context=(0, 0))
        assert torch.equal(got[address].count, want["count"])
        torch.testing.assert_close(got[address].max, want["max"], atol=1e-6, rtol=0)


# -- bad input: a typed error with a remedy, the model unchanged -------------------------------


def test_an_sae_of_another_width_is_refused_naming_both(tiny_gpt2, tmp_path):
    err = refused(tiny_gpt2.model, lambda: tl.feature_stats(tiny_gpt2.model, ROWS, {SITE: ToySAE(d_in=16)},
                                                             out=tmp_path / "j", **OPTIONS), FeatureWidthError)
    assert err.d_in == 16 and err.site_width == 32
    assert not list((tmp_path / "j").glob("shard-*"))


def test_an_sae_of_another_dtype_is_refused_saying_which(tiny_gpt2, tmp_path):
    err = refused(tiny_gpt2.model, lambda: tl.feature_stats(tiny_gpt2.model, ROWS, {SITE: ToySAE().double()},
                                                             out=tmp_path / "j", **OPTIONS), FeatureDtypeError)
    assert err.which == "dtype"


def test_a_module_without_encode_isrefused(tiny_gpt2, tmp_path):
    refused(tiny_gpt2.model, lambda: tl.feature_stats(tiny_gpt2.model, ROWS, {SITE: nn.Linear(32, 8)},
                                                       out=tmp_path / "j", **OPTIONS), NotAFeatureDictionaryError)


@pytest.mark.parametrize("kwargs", [{"top_k": 0}, {"store": -1}, {"context": (1, -2)}, {"context": "wide"}])
def test_bad_arguments_arerefused(tiny_gpt2, sae, tmp_path, kwargs):
    refused(tiny_gpt2.model, lambda: tl.feature_stats(tiny_gpt2.model, ROWS, {SITE: sae}, out=tmp_path / "j",
                                                       **kwargs, **OPTIONS), InvalidArgumentError)


def test_features_must_be_a_dict_of_sites(tiny_gpt2, sae, tmp_path):
    refused(tiny_gpt2.model, lambda: tl.feature_stats(tiny_gpt2.model, ROWS, [sae], out=tmp_path / "j", **OPTIONS),
             InvalidArgumentError)


def test_a_feature_out_of_range_isrefused(job):
    with pytest.raises(FeatureIndexError) as err:
        job[SITE].top_contexts(100)
    assert err.value.d_sae == 100 and err.value.remedy


def test_another_kind_of_job_is_not_feature_statistics(tiny_gpt2, tmp_path):
    tl.cache_activations(tiny_gpt2.model, ROWS[:4], [SITE], out=tmp_path / "c", **OPTIONS)
    with pytest.raises(DatasetFormatError) as err:
        tl.load_feature_stats(tmp_path / "c")
    assert err.value.remedy
