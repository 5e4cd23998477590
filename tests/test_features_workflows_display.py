"""Feature displays: a feature's activation over tokens as a notebook text heat-map, top features per
position, and a feature's max-activating contexts; values against ``sae.encode`` of a hook read."""

from __future__ import annotations

import re
from html import unescape

import pytest
import torch
from conftest import ToySAE
from test_features_workflows import ROWS, SITE
from test_features_workflows_dla import IDS, site_read

import torchlens as tl
from torchlens.errors import FeatureIndexError, FeatureWidthError, InvalidArgumentError

SPAN = re.compile(r'<span title="([^"]*)" style="background:rgba\(230,81,0,([0-9.]+)\);[^"]*">([^<]*)</span>')


class Words:
    """A tokenizer stand-in: id ``i`` decodes to ``w<i>`` (any object with decode(ids) is taken)."""

    def decode(self, ids, **kwargs):
        return "".join(f"w{int(i)}" for i in ids)


@pytest.fixture(scope="module")
def sae():
    return ToySAE()


@pytest.fixture(scope="module")
def trace(tiny_gpt2):
    return tl.trace(tiny_gpt2.model, IDS)


def test_feature_text_shades_each_token_by_its_activation(tiny_gpt2, trace, sae):
    want = sae.encode(site_read(tiny_gpt2.model, SITE))[1].detach()  # row 1, [pos, d_sae]
    feature = int(want.amax(0).argmax())
    shown = tl.features.feature_text(trace, SITE, sae, feature, row=1, tokenizer=Words())
    torch.testing.assert_close(shown.values, want[:, feature])
    assert shown.tokens == [f"w{i}" for i in IDS[1].tolist()]
    spans = SPAN.findall(shown._repr_html_())
    assert [unescape(text) for _, _, text in spans] == shown.tokens
    alphas = torch.tensor([float(a) for _, a, _ in spans])
    torch.testing.assert_close(alphas, (want[:, feature] / want[:, feature].max()).clamp(min=0), atol=1e-3, rtol=0)
    assert [unescape(tip) for tip, _, _ in spans][2] == f"position 2: {float(want[2, feature]):.4g}"


def test_token_strings_default_to_ids_and_can_be_given(trace, sae):
    assert tl.features.feature_text(trace, SITE, sae, 0).tokens == [str(i) for i in IDS[0].tolist()]
    given = list("abcdef")
    assert tl.features.feature_text(trace, SITE, sae, 0, tokens=given).tokens == given


def test_top_features_per_position(tiny_gpt2, trace, sae):
    want = sae.encode(site_read(tiny_gpt2.model, SITE))[0].detach().topk(3, dim=-1)
    shown = tl.features.top_features(trace, SITE, sae, k=3)
    assert torch.equal(shown.indices, want.indices)
    torch.testing.assert_close(shown.values, want.values)
    html = shown._repr_html_()
    assert html.count("<tr><td>") == IDS.shape[1]
    assert f"feature {int(want.indices[0, 0])}: {float(want.values[0, 0]):.4g}" in unescape(html)


def test_context_text_shades_the_activating_token(tiny_gpt2, sae, tmp_path):
    stats = tl.feature_stats(tiny_gpt2.model, ROWS[:12], {SITE: sae}, out=tmp_path / "j", top_k=3, context=(2, 1),
                             batch_size=4, progress=False)[SITE]
    feature = int(stats.max.argmax())
    shown = tl.features.context_text(stats, feature, tokenizer=Words())
    contexts = stats.top_contexts(feature)
    assert [c["value"] for c in shown.contexts] == [c["value"] for c in contexts] and contexts
    rows = shown._repr_html_().split("<tr><td>")[1:]
    first = SPAN.findall(rows[0])
    at = min(2, contexts[0]["position"])
    assert [unescape(t) for _, _, t in first] == [f"w{i}" for i in contexts[0]["tokens"]]
    assert [float(a) for _, a, _ in first] == [1.0 if j == at else 0.0 for j in range(len(first))]


def test_bad_inputs_are_refused(trace, sae):
    with pytest.raises(FeatureIndexError):
        tl.features.feature_text(trace, SITE, sae, 100)
    with pytest.raises(FeatureWidthError):
        tl.features.top_features(trace, SITE, ToySAE(d_in=16))
    for call in (lambda: tl.features.top_features(trace, SITE, sae, k=0),
                 lambda: tl.features.feature_text(trace, SITE, sae, 1, row=2),
                 lambda: tl.features.feature_text(trace, SITE, sae, 1, tokens=["a"])):
        with pytest.raises(InvalidArgumentError) as err:
            call()
        assert err.value.remedy
