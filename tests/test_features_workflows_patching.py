"""Patching over features: ``tl.patching.feature_patching`` (exact) and ``feature_attribution_patching``.

References: a plain forward of the corrupted prompt whose site hook splices the SAE by hand
(``x + decode(f') - decode(f)``, ``f'`` with one feature restored from the clean run); gradients
read with a hook and ``retain_grad``; on a linear model (linear decoder, linear downstream) the
estimate equals exact patching cell for cell, and on GPT-2 it tracks exact patching of a sample.
"""

from __future__ import annotations

import pytest
import torch
from conftest import ToySAE, assert_model_clean, hook_state

import torchlens as tl
from torchlens.errors import FeatureIndexError, FeatureWidthError, InvalidArgumentError

SITE = "transformer.h.0"
CLEAN = torch.tensor([[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]])
CORRUPT = torch.tensor([[1, 2, 30, 4, 5, 6], [7, 8, 40, 10, 11, 12]])
METRIC = tl.patching.logit_diff(5, 9)


def site_output(out):
    return out[0] if isinstance(out, tuple) else out


def hand_patched(model, sae, address, feature, position, clean_ids, corrupt_ids, metric):
    """The metric of the corrupted run with ``feature`` (at ``position``, None: all) restored, spliced by hand."""
    seen = {}
    h = model.get_submodule(address).register_forward_hook(lambda m, a, o: seen.setdefault("x", site_output(o)))
    with torch.no_grad():
        model(clean_ids)
    h.remove()
    donor = sae.encode(seen["x"])

    def splice(m, a, o):
        x = site_output(o)
        f = sae.encode(x)
        g = f.clone()
        where = slice(None) if position is None else position
        g[:, where, feature] = donor[:, where, feature]
        return x + (sae.decode(g) - sae.decode(f))

    h = model.get_submodule(address).register_forward_hook(splice)
    with torch.no_grad():
        value = float(metric(model(corrupt_ids)))
    h.remove()
    return value


def hand_attribution(model, sae, address, clean_ids, corrupt_ids, metric):
    """``[position, d_sae]``: (f_clean - f_corrupt) * (d metric / d site) @ W_dec.T, summed over the batch."""
    seen = {}

    def keep(m, a, o):
        x = site_output(o)
        seen.setdefault("x", x)
        if x.requires_grad:
            x.retain_grad()

    h = model.get_submodule(address).register_forward_hook(keep)
    with torch.no_grad():
        model(clean_ids)
    clean_x = seen.pop("x")
    value = metric(model(corrupt_ids))
    h.remove()
    value.backward()
    grad = seen["x"].grad @ sae.W_dec.T
    delta = sae.encode(clean_x) - sae.encode(seen["x"])
    model.zero_grad(set_to_none=True)
    return (delta * grad).sum(0).detach()


@pytest.fixture(scope="module")
def sae():
    return ToySAE()


def test_exact_feature_patching_equals_a_hand_splice(tiny_gpt2, sae):
    model = tiny_gpt2.model
    got = tl.patching.feature_patching(CLEAN, CORRUPT, METRIC, model=model, site=SITE, sae=sae,
                                       features=[0, 7, 12, 40, 98], positions=[2, 4, -1])
    assert got.dims == ("feature", "position") and got.labels["position"] == [2, 4, 5]
    assert got.values.shape == (5, 3)
    for i, f in enumerate([0, 7, 12, 40, 98]):
        for j, p in enumerate([2, 4, 5]):
            want = hand_patched(model, sae, SITE, f, p, CLEAN, CORRUPT, METRIC)
            assert got.values[i, j] == pytest.approx(want, abs=1e-5), (f, p)
    # feature 98 never fires (dead), and positions 0, 1 are the same in both prompts: nothing to run there
    assert got.notes["skipped"] >= 3
    whole = tl.patching.feature_patching(CLEAN, CORRUPT, METRIC, model=model, site=SITE, sae=sae, features=[7, 40])
    assert whole.dims == ("feature",)
    assert whole.values.tolist() == pytest.approx(
        [hand_patched(model, sae, SITE, f, None, CLEAN, CORRUPT, METRIC) for f in (7, 40)], abs=1e-5)


def test_attribution_equals_gradients_read_with_hooks(tiny_gpt2, sae):
    model = tiny_gpt2.model
    before = hook_state(model)
    got = tl.patching.feature_attribution_patching(CLEAN, CORRUPT, METRIC, model=model, site=SITE, sae=sae,
                                                   positions=list(range(6)))
    assert_model_clean(model, before)
    assert all(p.grad is None for p in model.parameters())  # autograd.grad: no parameter's .grad touched
    want = hand_attribution(model, sae, SITE, CLEAN, CORRUPT, METRIC)  # [position, d_sae]
    torch.testing.assert_close(got.estimate, want.T, atol=1e-5, rtol=1e-4)
    assert torch.equal(got.estimate[:, :2], torch.zeros(100, 2))  # positions before the corruption: no change
    torch.testing.assert_close(got.values, got.estimate + got.corrupted)
    whole = tl.patching.feature_attribution_patching(CLEAN, CORRUPT, METRIC, model=model, site=SITE, sae=sae)
    torch.testing.assert_close(whole.estimate, want.sum(0), atol=1e-5, rtol=1e-4)


def test_attribution_is_exact_on_a_linear_model(linear_toy):
    model, clean = linear_toy.model, linear_toy.args[0]
    corrupt = clean.clone()
    corrupt[0, 1] = 12
    sae = ToySAE(d_in=8, d_sae=24, bias=0.0)
    metric = tl.patching.logit_diff(4, 6)
    estimate = tl.patching.feature_attribution_patching(clean, corrupt, metric, model=model, site="blocks.1",
                                                        sae=sae, positions=[1, 3])
    exact = tl.patching.feature_patching(clean, corrupt, metric, model=model, site="blocks.1", sae=sae,
                                         positions=[1, 3])
    assert int((estimate.estimate != 0).sum()) > 5
    torch.testing.assert_close(estimate.values, exact.values, atol=1e-4, rtol=1e-4)


def test_attribution_tracks_exact_patching_of_a_sample_on_gpt2(tiny_gpt2, sae):
    model = tiny_gpt2.model
    estimate = tl.patching.feature_attribution_patching(CLEAN, CORRUPT, METRIC, model=model, site=SITE, sae=sae)
    sample = estimate.estimate.abs().topk(12).indices.tolist()  # the features the estimate ranks first
    exact = tl.patching.feature_patching(CLEAN, CORRUPT, METRIC, model=model, site=SITE, sae=sae, features=sample)
    a, b = estimate.estimate[sample], exact.values - exact.corrupted
    assert float(torch.corrcoef(torch.stack([a, b]))[0, 1]) > 0.8
    assert bool((a.sign() == b.sign()).float().mean() >= 0.75)


def test_traces_captured_with_the_features_attached_are_taken(tiny_gpt2, sae):
    model = tiny_gpt2.model
    clean = tl.trace(model, CLEAN, features={SITE: sae})
    corrupt = tl.trace(model, CORRUPT)
    got = tl.patching.feature_patching(clean, corrupt, METRIC, site=SITE, sae=sae, features=[7], positions=[2])
    assert float(got.values[0, 0]) == pytest.approx(hand_patched(model, sae, SITE, 7, 2, CLEAN, CORRUPT, METRIC),
                                                    abs=1e-5)


# -- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize("call,error", [
    (lambda m, s: tl.patching.feature_patching(CLEAN, CORRUPT, METRIC, model=m, site=SITE, sae=ToySAE(d_in=16)),
     FeatureWidthError),
    (lambda m, s: tl.patching.feature_attribution_patching(CLEAN, CORRUPT, METRIC, model=m, site=SITE,
                                                           sae=ToySAE(d_in=16)), FeatureWidthError),
    (lambda m, s: tl.patching.feature_patching(CLEAN, CORRUPT, METRIC, model=m, site=SITE, sae=s, features=[100]),
     FeatureIndexError),
    (lambda m, s: tl.patching.feature_attribution_patching(CLEAN, CORRUPT, lambda out: 1.0, model=m, site=SITE,
                                                           sae=s), InvalidArgumentError),
    (lambda m, s: tl.patching.feature_patching(CLEAN, CORRUPT[:, :4], METRIC, model=m, site=SITE, sae=s),
     InvalidArgumentError),
    (lambda m, s: tl.patching.feature_patching(CLEAN, CORRUPT, METRIC, model=m, site=SITE, sae=s, positions=[6]),
     InvalidArgumentError),
    (lambda m, s: tl.patching.feature_patching(CLEAN, CORRUPT, METRIC, site=SITE, sae=s), InvalidArgumentError),
])
def test_bad_inputs_are_refused_and_change_nothing(tiny_gpt2, sae, call, error):
    model = tiny_gpt2.model
    before, params = hook_state(model), {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(error) as err:
        call(model, sae)
    assert err.value.remedy
    assert_model_clean(model, before)
    assert all(torch.equal(v, params[k]) for k, v in model.state_dict().items())
