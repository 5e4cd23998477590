"""Per-feature direct logit attribution (``tl.features.feature_logit_attrs``).

References: a hand computation from plain forward-hook reads (the site's value, the last block's
output for the final LayerNorm's scale, ``ln_f.weight`` and ``W_U``); TransformerLens 3.9's
``cache.apply_ln_to_stack`` on a ``HookedTransformer`` with the same weights; and the identity that
every feature's attribution plus the decoder bias's and the reconstruction error's sum to the
attribution of the site's value itself.
"""

from __future__ import annotations

import pytest
import torch
from conftest import ToySAE, hook_reads, refused, saelens_sae
from tl_oracle import hooked_gpt2, randomized_norms
from torch import nn

import torchlens as tl
from torchlens.errors import FeatureIndexError, FeatureWidthError, InvalidArgumentError, NotAFeatureDictionaryError

SITE, LAST = "transformer.h.0", "transformer.h.1"
IDS = torch.tensor([[1, 2, 3, 4, 5, 6], [9, 8, 7, 6, 5, 4]])


@pytest.fixture(scope="module")
def model(tiny_gpt2):
    return randomized_norms(tiny_gpt2.model)  # ln_f weight/bias away from 1/0: a forgotten one shows


@pytest.fixture(scope="module")
def trace(model):
    return tl.trace(model, IDS)


@pytest.fixture(scope="module")
def sae():
    return ToySAE()


def site_read(model, address):
    """``address``'s output (a tuple's first tensor) for ``IDS``, read with a plain forward hook."""
    value = hook_reads(model, (IDS,))[0][address][0]
    return value[0] if isinstance(value, tuple) else value


def hand_dla(model, sae, correct, wrong=None, position=-1):
    """``[d_sae, batch]``: f_i * centred(W_dec[i]) / ln_f scale . (ln_f.weight * (W_U[correct] - W_U[wrong]))."""
    x, last = site_read(model, SITE), site_read(model, LAST)
    f = sae.encode(x)[:, position].detach()  # [batch, d_sae]
    r = last[:, position]
    centred = r - r.mean(-1, keepdim=True)
    scale = (centred.pow(2).mean(-1) + model.transformer.ln_f.eps).sqrt()  # [batch]
    w_u = model.lm_head.weight
    direction = w_u[correct] - (w_u[wrong] if wrong is not None else 0)  # [batch, d] or [d]
    direction = (direction * model.transformer.ln_f.weight).expand(IDS.shape[0], -1)
    w_dec = sae.W_dec.detach()
    unit = (w_dec - w_dec.mean(-1, keepdim=True)) @ direction.T  # [d_sae, batch]
    return (f.T * unit / scale).detach()


def test_each_feature_equals_a_hand_computation(model, trace, sae):
    got = tl.features.feature_logit_attrs(trace, SITE, sae, 5)
    want = hand_dla(model, sae, 5)
    assert got.shape == (100, 2)
    assert int((want != 0).sum()) > 10 and bool((want == 0).any())  # some features active, some not
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_logit_difference_per_row_answers_and_a_subset(model, trace, sae):
    correct, wrong = torch.tensor([5, 7]), torch.tensor([11, 3])
    got = tl.features.feature_logit_attrs(trace, SITE, sae, correct, wrong, position=2)
    torch.testing.assert_close(got, hand_dla(model, sae, correct, wrong, position=2), atol=1e-5, rtol=1e-5)
    few = tl.features.feature_logit_attrs(trace, SITE, sae, correct, wrong, position=2, features=[40, 3, -1])
    torch.testing.assert_close(few, got[[40, 3, 99]])


def test_features_bias_and_error_sum_to_the_sites_own_attribution(trace, sae):
    every = tl.features.feature_logit_attrs(trace, SITE, sae, 5, 9, position=None)  # [d_sae, batch, pos]
    x = trace[SITE].out
    x = x[0] if isinstance(x, tuple) else x
    error = x - sae.decode(sae.encode(x))
    parts = torch.stack([sae.b_dec.expand_as(x), error]).detach()
    rest = tl.logit_attrs(trace, parts, 5, 9, position=None)
    whole = tl.logit_attrs(trace, x[None], 5, 9, position=None)[0]
    torch.testing.assert_close(every.sum(0) + rest.sum(0), whole, atol=1e-5, rtol=1e-5)


def test_matches_transformerlens_final_norm_on_the_same_weights(model, trace, sae):
    pytest.importorskip("transformer_lens", reason="transformer_lens (the test extra) is not installed")
    hooked = hooked_gpt2(model)
    _, cache = hooked.run_with_cache(IDS)
    x = cache["blocks.0.hook_resid_post"]
    f = sae.encode(x)[:, -1].detach()  # [batch, d_sae]
    stack = (f.T[:, :, None] * sae.W_dec.detach()[:, None, :])[:, :, None, :]  # [d_sae, batch, 1, d]
    scaled = cache.apply_ln_to_stack(stack.expand(-1, -1, IDS.shape[1], -1), layer=-1)[:, :, -1]
    want = (scaled * hooked.ln_final.w * (hooked.W_U[:, 5] - hooked.W_U[:, 9])).sum(-1).detach()
    got = tl.features.feature_logit_attrs(trace, SITE, sae, 5, 9)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_an_attached_trace_and_its_forks_give_their_own_features(model, trace, sae):
    attached = tl.trace(model, IDS, features={SITE: sae})
    plain = tl.features.feature_logit_attrs(trace, SITE, sae, 5, 9)
    torch.testing.assert_close(tl.features.feature_logit_attrs(attached, SITE, sae, 5, 9), plain)
    k = int(plain[:, 0].abs().argmax())
    fork = attached.fork().do(f"{SITE}.features", tl.features.ablate(k, positions=-1))
    edited = tl.features.feature_logit_attrs(fork, SITE, sae, 5, 9)
    assert torch.equal(edited[k], torch.zeros(2)) and bool(plain[k, 0] != 0)
    torch.testing.assert_close(tl.features.feature_activations(fork, SITE, sae), fork[f"{SITE}.features"].out)
    # the other features keep their activations; their attribution follows the fork's own final-norm scale
    f = fork[f"{SITE}.features"].out[:, -1].detach()
    last = fork[LAST].out
    r = (last[0] if isinstance(last, tuple) else last)[:, -1]
    scale = ((r - r.mean(-1, keepdim=True)).pow(2).mean(-1) + model.transformer.ln_f.eps).sqrt()
    direction = (model.lm_head.weight[5] - model.lm_head.weight[9]) * model.transformer.ln_f.weight
    w_dec = sae.W_dec.detach()
    want = f.T * ((w_dec - w_dec.mean(-1, keepdim=True)) @ direction)[:, None] / scale
    torch.testing.assert_close(edited, want.detach(), atol=1e-5, rtol=1e-5)


def test_a_saelens_sae_as_it_is(model, trace):
    pytest.importorskip("sae_lens", reason="sae-lens (the test extra) is not installed")
    sae = saelens_sae(d_in=32, d_sae=48)
    got = tl.features.feature_logit_attrs(trace, SITE, sae, 5)
    torch.testing.assert_close(got, hand_dla(model, sae, 5), atol=1e-5, rtol=1e-5)


def test_feature_activations_are_the_encoded_site(model, trace, sae):
    want = sae.encode(site_read(model, SITE)).detach()
    torch.testing.assert_close(tl.features.feature_activations(trace, SITE, sae), want)


# -- bad input ---------------------------------------------------------------------------------


def test_bad_inputs_are_refused_and_change_nothing(model, trace, sae):
    err = refused(model, lambda: tl.features.feature_logit_attrs(trace, SITE, ToySAE(d_in=16), 5),
                   FeatureWidthError)
    assert (err.d_in, err.site_width) == (16, 32)
    err = refused(model, lambda: tl.features.feature_logit_attrs(trace, SITE, sae, 5, features=[100]),
                   FeatureIndexError)
    assert err.d_sae == 100
    refused(model, lambda: tl.features.feature_logit_attrs(trace, SITE, sae, 64), InvalidArgumentError)
    refused(model, lambda: tl.features.feature_logit_attrs(trace, SITE, nn.Linear(32, 4), 5),
             NotAFeatureDictionaryError)
    refused(model, lambda: tl.features.feature_logit_attrs(trace, SITE, sae, 5, position=6), InvalidArgumentError)


def test_a_dictionary_off_the_residual_stream_isrefused(model, trace):
    """The MLP's hidden layer (width 128) does not write the residual stream: no direct path to the logits."""
    err = refused(model, lambda: tl.features.feature_logit_attrs(trace, "transformer.h.0.mlp.c_fc",
                                                                  ToySAE(d_in=128), 5), FeatureWidthError)
    assert "residual" in str(err) and (err.d_in, err.site_width) == (128, 32)  # both widths: its own, the stream's
