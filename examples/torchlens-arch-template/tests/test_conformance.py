"""The conformance kit on every configuration this package claims, as its CI runs it."""

import pytest
import torch
from torchlens_arch_template import ToyConfig, ToyForCausalLM

import torchlens as tl
from torchlens.testing import check_model

IDS = torch.tensor([[1, 5, 2, 7, 3, 9]])


def build(**sizes) -> ToyForCausalLM:
    torch.manual_seed(0)
    return ToyForCausalLM(ToyConfig(**sizes)).eval()


def test_the_entry_point_adapter_serves_the_family():
    view = tl.arch(build())
    assert view.adapter == "toyarch" and view.n_layers == 2 and view.resolve("blocks.1.mlp") == "stack.1.ffn"


@pytest.mark.parametrize("sizes", [{}, {"n_layers": 3, "n_heads": 2}, {"n_layers": 1, "d_model": 8}])
def test_the_family_conforms(torchlens_conformance, sizes):
    report = torchlens_conformance(build(**sizes), IDS, adapter="toyarch")
    n = sizes.get("n_layers", 2)
    assert f"replay blocks.{n - 1}.mlp" in report.names() and f"facets blocks.{n - 1}.attn" in report.names()


def test_a_report_lists_every_check():
    report = check_model(build(), IDS, adapter="toyarch")
    assert report.ok, report.summary()
    assert report.names()[:3] == ["capture equals a plain forward", "capture leaves the model unchanged", "validate"]
    assert "site blocks.0.resid_mid == blocks.0.resid_pre + blocks.0.attn" in report.names()
