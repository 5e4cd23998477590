"""tl.features.as_dictionary / load_sae: one view of any SAE, checked against SAELens on the same weights."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import LinearSAE, saelens_sae
from torch import nn

import torchlens as tl
from torchlens.errors import (
    FeatureDictionaryFormatError,
    FeatureDtypeError,
    FeatureIndexError,
    FeatureSiteError,
    FeatureWidthError,
    NotAFeatureDictionaryError,
    TorchLensError,
)

sae_lens = pytest.importorskip("sae_lens")


def test_plain_module_is_read_through_its_linears() -> None:
    torch.manual_seed(0)
    sae = LinearSAE()
    d = tl.features.as_dictionary(sae)
    assert (d.d_in, d.d_sae) == (8, 32)
    assert d.W_dec.shape == (32, 8)
    assert torch.equal(d.W_dec, sae.decoder.weight.T)
    x = torch.randn(2, 5, 8)
    assert torch.equal(d.encode(x), torch.relu(sae.encoder(x)))
    f = d.encode(x)
    assert torch.equal(d.decode(f), sae.decoder(f))
    assert d.dtype == torch.float32 and d.device == torch.device("cpu")
    assert tl.features.as_dictionary(d) is d  # wrapping twice is the same wrapper


@pytest.mark.parametrize("arch", ["standard", "jumprelu", "topk"])
def test_saelens_sae_as_it_is(arch) -> None:
    extra = {"k": 4} if arch == "topk" else {}
    sae = saelens_sae(arch, **extra)
    d = tl.features.as_dictionary(sae)
    assert (d.d_in, d.d_sae) == (8, 32)
    assert d.W_dec is sae.W_dec
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    assert torch.equal(d.encode(x), sae.encode(x))
    if arch != "standard":
        assert (d.encode(x) == 0).any() and (d.encode(x) != 0).any()


@pytest.mark.parametrize("arch,extra", [("standard", {}), ("jumprelu", {}), ("topk", {"k": 5}),
                                        ("topk", {"k": 5, "rescale_acts_by_decoder_norm": True})])
def test_load_sae_matches_saelens_loading_the_same_folder(tmp_path, arch, extra) -> None:
    sae = saelens_sae(arch, seed=3, **extra)
    sae.save_model(tmp_path)
    ours = tl.features.load_sae(tmp_path)
    theirs = type(sae).load_from_disk(tmp_path)
    assert isinstance(ours.module, tl.features.SavedSAE)
    assert (ours.d_in, ours.d_sae) == (8, 32)
    x = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(2))
    f = ours.encode(x)
    assert torch.equal(f, theirs.encode(x))
    assert torch.equal(ours.decode(f), theirs.decode(f))
    assert torch.equal(ours.W_dec, theirs.W_dec)


def test_load_sae_dtype_override(tmp_path) -> None:
    saelens_sae().save_model(tmp_path)
    d = tl.features.load_sae(tmp_path, dtype=torch.float64)
    assert d.dtype == torch.float64 and d.W_dec.dtype == torch.float64


# -- bad input: named errors, nothing changed ---------------------------------------------------------


def test_module_without_encode_decode_is_refused() -> None:
    lin = nn.Linear(4, 4)
    before = {k: v.clone() for k, v in lin.state_dict().items()}
    with pytest.raises(NotAFeatureDictionaryError) as err:
        tl.features.as_dictionary(lin)
    assert "encode" in str(err.value) and "decode" in str(err.value) and err.value.remedy
    assert isinstance(err.value, TorchLensError) and isinstance(err.value, TypeError)
    assert all(torch.equal(v, lin.state_dict()[k]) for k, v in before.items())

    class EncodeOnly(nn.Module):
        def encode(self, x):
            return x

    with pytest.raises(NotAFeatureDictionaryError) as err:
        tl.features.as_dictionary(EncodeOnly())
    assert "no decode method" in str(err.value) and "no encode" not in str(err.value)


def test_check_input_names_width_dtype_device() -> None:
    d = tl.features.as_dictionary(saelens_sae())
    with pytest.raises(FeatureWidthError) as err:
        d.check_input(torch.zeros(2, 6), site="blocks.1")
    assert "d_in=8" in str(err.value) and "width 6" in str(err.value) and "blocks.1" in str(err.value)
    assert (err.value.d_in, err.value.site_width) == (8, 6)
    with pytest.raises(FeatureDtypeError) as err:
        d.check_input(torch.zeros(2, 8, dtype=torch.float64), site="blocks.1")
    assert err.value.which == "dtype" and "float64" in str(err.value) and "float32" in str(err.value)
    with pytest.raises(FeatureDtypeError) as err:
        d.check_input(torch.zeros(2, 8, device="meta"), site="blocks.1")
    assert err.value.which == "device" and "meta" in str(err.value)
    with pytest.raises(FeatureSiteError) as err:
        d.check_input((torch.zeros(2, 8), None), site="blocks.1")
    assert "tuple" in str(err.value)
    d.check_input(torch.zeros(3, 8), site="blocks.1")  # fits: no error


def test_feature_index_out_of_range() -> None:
    d = tl.features.as_dictionary(saelens_sae())
    assert d.check_feature(3) == [3] and d.check_feature([0, -1]) == [0, 31]
    assert d.check_feature(torch.tensor([1, 2])) == [1, 2]
    for bad in (32, -33, [1, 40]):
        with pytest.raises(FeatureIndexError) as err:
            d.check_feature(bad)
        assert "d_sae=32" in str(err.value) and err.value.remedy


def test_load_sae_bad_folders(tmp_path) -> None:
    with pytest.raises(FeatureDictionaryFormatError):
        tl.features.load_sae(tmp_path / "nothing")
    sae = saelens_sae()
    sae.save_model(tmp_path)
    cfg = json.loads((tmp_path / "cfg.json").read_text())
    for change in ({"architecture": "gated"}, {"normalize_activations": "layer_norm"}, {"d_sae": 31}):
        (tmp_path / "cfg.json").write_text(json.dumps({**cfg, **change}))
        with pytest.raises(FeatureDictionaryFormatError) as err:
            tl.features.load_sae(tmp_path)
        assert err.value.remedy
    (tmp_path / "cfg.json").write_text("{not json")
    with pytest.raises(FeatureDictionaryFormatError):
        tl.features.load_sae(tmp_path)
