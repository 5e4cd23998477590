"""Cross-check against SAELens's ``HookedSAETransformer`` on the same GPT-2 weights and the same SAE weights.

The GPT-2 is the tiny seeded one of ``conftest`` (random weights), mirrored into TransformerLens by
``tl_oracle.hooked_gpt2`` (TransformerLens's own weight conversion); the SAE is a seeded SAELens SAE,
attached by SAELens at ``blocks.1.hook_resid_post`` and by TorchLens at ``blocks.1`` (the block's output,
the same residual). Compared: feature activations, logits with a feature ablated (error term kept), and
logits with the SAE spliced without the error term; within 1e-5.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import saelens_sae
from tl_oracle import hooked_gpt2

import torchlens as tl

pytest.importorskip("sae_lens")
pytest.importorskip("transformer_lens")

HOOK = "blocks.1.hook_resid_post"
ATOL = 1e-5


@pytest.fixture(scope="module")
def pair(tiny_gpt2):
    from sae_lens import HookedSAETransformer

    hf, ids = tiny_gpt2.model, tiny_gpt2.args[0]
    ht = hooked_gpt2(hf)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        hs = HookedSAETransformer(ht.cfg)
    hs.load_state_dict(ht.state_dict(), strict=False)
    return hf, hs.eval(), ids


@pytest.fixture(scope="module", params=["standard", "jumprelu", "topk"])
def sae(request):
    extra = {"k": 6} if request.param == "topk" else {}
    s = saelens_sae(request.param, d_in=32, d_sae=64, seed=7, **extra)
    s.cfg.metadata.hook_name = HOOK
    return s


def _theirs(hs, ids, sae, *, use_error_term: bool, ablate: int | None = None):
    hooks = []
    if ablate is not None:
        def zero(acts, hook):
            acts[..., ablate] = 0.0
            return acts
        hooks = [(f"{HOOK}.hook_sae_acts_post", zero)]
    with torch.no_grad(), hs.saes(saes=[sae], use_error_term=use_error_term):
        logits, cache = hs.run_with_cache(ids) if not hooks else (hs.run_with_hooks(ids, fwd_hooks=hooks), None)
    return logits, cache


def test_models_agree_without_saes(pair) -> None:
    hf, hs, ids = pair
    with torch.no_grad():
        assert torch.allclose(hf(ids).logits, hs(ids), atol=ATOL)


def test_feature_activations(pair, sae) -> None:
    hf, hs, ids = pair
    _, cache = _theirs(hs, ids, sae, use_error_term=True)
    t = tl.trace(hf, ids, features={"blocks.1": sae})
    theirs = cache[f"{HOOK}.hook_sae_acts_post"]
    assert torch.allclose(t["blocks.1.features"].out, theirs, atol=ATOL)
    assert torch.equal(t["blocks.1.features"].out > 0, theirs > 0)  # the same features fire


def test_logits_with_a_feature_ablated(pair, sae) -> None:
    hf, hs, ids = pair
    t = tl.trace(hf, ids, features={"blocks.1": sae})
    feature = int(torch.argmax(t["blocks.1.features"].out[0, -1]))
    theirs, _ = _theirs(hs, ids, sae, use_error_term=True, ablate=feature)
    fork = t.fork().do("blocks.1.features", tl.features.ablate(feature))
    assert torch.allclose(fork.output.logits, theirs, atol=ATOL)
    with torch.no_grad():
        assert not torch.allclose(theirs, hf(ids).logits, atol=1e-4)  # the ablation changed the logits
    when = tl.trace(hf, ids, features={"blocks.1": sae},
                    intervene=tl.when("blocks.1.features", tl.features.ablate(feature)))
    assert torch.allclose(when.output.logits, theirs, atol=ATOL)


def test_logits_without_the_error_term(pair, sae) -> None:
    hf, hs, ids = pair
    theirs, _ = _theirs(hs, ids, sae, use_error_term=False)
    t = tl.trace(hf, ids, features={"blocks.1": tl.features.attach(sae, use_error_term=False)})
    assert torch.allclose(t.output.logits, theirs, atol=ATOL)
    with torch.no_grad():
        assert not torch.allclose(theirs, hf(ids).logits, atol=1e-4)


def test_gradient_at_the_features(pair, sae) -> None:
    """A backward from one logit reaches the features as in SAELens (error term without gradients)."""
    hf, hs, ids = pair
    with hs.saes(saes=[sae], use_error_term=True):
        _, cache = hs.run_with_cache(ids, names_filter=lambda n: n.endswith("hook_sae_acts_post"))
        grads = {}
        hs.add_hook(f"{HOOK}.hook_sae_acts_post", lambda t, hook: grads.setdefault("g", t), dir="bwd")
        hs(ids)[0, -1, 3].backward()
        hs.reset_hooks()
    t = tl.trace(hf, ids, features={"blocks.1": sae}, grad=True)
    t.output.logits[0, -1, 3].backward()
    ours = t.ops[t.lookup("blocks.1.features").index].grad
    assert torch.allclose(ours, grads["g"], atol=ATOL)
    assert ours.abs().sum() > 0
    for p in [*hf.parameters(), *hs.parameters(), *sae.parameters()]:
        p.grad = None


@pytest.mark.parametrize("norm", ["layer_norm", "constant_norm_rescale"])
def test_sae_normalising_at_run_time(pair, norm) -> None:
    """A SAELens SAE that normalises its input at run time, attached as it is: features, ablated logits and the
    SAE-only logits agree with SAELens; ``.recon`` is decode's output in the site's units, while SAELens's
    ``hook_sae_recons`` sits before the de-normalisation (docs/features.md)."""
    hf, hs, ids = pair
    s = saelens_sae("standard", d_in=32, d_sae=64, seed=7, normalize_activations=norm)
    s.cfg.metadata.hook_name = HOOK
    _, cache = _theirs(hs, ids, s, use_error_term=True)
    t = tl.trace(hf, ids, features={"blocks.1": s})
    assert torch.allclose(t["blocks.1.features"].out, cache[f"{HOOK}.hook_sae_acts_post"], atol=ATOL)
    with torch.no_grad():
        s.encode(cache[f"{HOOK}.hook_sae_input"])  # SAELens keeps this input's statistics for the decode
        denormalised = s.run_time_activation_norm_fn_out(cache[f"{HOOK}.hook_sae_recons"])
    assert torch.allclose(t["blocks.1.recon"].out, denormalised, atol=ATOL)
    assert not torch.allclose(t["blocks.1.recon"].out, cache[f"{HOOK}.hook_sae_recons"], atol=1e-2)
    assert torch.allclose(t["blocks.1.error"].out, cache[f"{HOOK}.hook_sae_error"], atol=ATOL)
    feature = int(torch.argmax(t["blocks.1.features"].out[0, -1]))
    tl.trace(hf, (ids + 1) % 64, features={"blocks.1": s})  # another input through the SAE before the fork
    theirs, _ = _theirs(hs, ids, s, use_error_term=True, ablate=feature)
    assert torch.allclose(t.fork().do("blocks.1.features", tl.features.ablate(feature)).output.logits, theirs,
                          atol=ATOL)
    theirs, _ = _theirs(hs, ids, s, use_error_term=False)
    alone = tl.trace(hf, ids, features={"blocks.1": tl.features.attach(s, use_error_term=False)})
    assert torch.allclose(alone.output.logits, theirs, atol=ATOL)
