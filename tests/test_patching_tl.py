"""Attribution patching's raw estimate against TransformerLens 3.9's recipe on the same weights.

The HookedTransformer is built offline from the tiny GPT-2's weights (a config written out by
hand, TransformerLens's own ``convert_gpt2_weights``, no folding or centring); the layer norms'
weights and biases are drawn at random first, so a mistake in either implementation shows.
TransformerLens's recipe: cache the clean run, then a forward and backward on the corrupted run
with hooks keeping ``blocks.L.hook_resid_pre`` and its gradient; estimate =
``((clean - corrupted) * grad).sum(-1)``.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import torchlens as tl

CLEAN = torch.tensor([[1, 2, 3, 4, 5, 6]])
CORRUPT = torch.tensor([[1, 2, 11, 4, 5, 6]])
GOOD, BAD = 3, 11


def _hooked_gpt2(hf_model):
    """A HookedTransformer computing the same function as ``hf_model`` (a GPT2LMHeadModel)."""
    try:
        from transformer_lens import HookedTransformer, HookedTransformerConfig
        from transformer_lens.pretrained.weight_conversions import convert_gpt2_weights
    except ImportError as err:  # the test extra installs it; a bare environment may not have it
        pytest.skip(f"transformer_lens cannot be imported ({err})")
    c = hf_model.config
    cfg = HookedTransformerConfig(
        n_layers=c.n_layer, d_model=c.n_embd, n_heads=c.n_head, d_head=c.n_embd // c.n_head, d_mlp=4 * c.n_embd,
        d_vocab=c.vocab_size, n_ctx=c.n_positions, act_fn="gelu_new", normalization_type="LN",
        eps=c.layer_norm_epsilon, positional_embedding_type="standard", default_prepend_bos=False,
        device="cpu",
    )
    with warnings.catch_warnings():  # 3.9 announces HookedTransformer's removal in 4.0 (the test extra pins <4)
        warnings.simplefilter("ignore", DeprecationWarning)
        model = HookedTransformer(cfg)
    model.load_state_dict(convert_gpt2_weights(hf_model, cfg), strict=False)
    return model.eval()


@pytest.fixture(scope="module")
def gpt2_pair(tiny_gpt2):
    """The tiny GPT-2 with random layer-norm weights and biases, and its HookedTransformer twin."""
    model = copy.deepcopy(tiny_gpt2.model)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".ln_" in name or name.startswith("transformer.ln_f"):
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.3 * torch.randn(p.shape, generator=g))
    return model, _hooked_gpt2(model)


def _tl_attribution(ht) -> torch.Tensor:
    """TransformerLens's attribution-patching recipe over ``blocks.L.hook_resid_pre``: [layer, position]."""
    def metric(logits):
        return logits[0, -1, GOOD] - logits[0, -1, BAD]

    names = [f"blocks.{layer}.hook_resid_pre" for layer in range(ht.cfg.n_layers)]
    _, clean_cache = ht.run_with_cache(CLEAN)
    acts, grads = {}, {}

    def keep_act(act, hook):
        acts[hook.name] = act.detach()

    def keep_grad(grad, hook):
        grads[hook.name] = grad.detach()

    ht.reset_hooks()
    for name in names:
        ht.add_hook(name, keep_act, "fwd")
        ht.add_hook(name, keep_grad, "bwd")
    try:
        metric(ht(CORRUPT)).backward()
    finally:
        ht.reset_hooks()
        ht.zero_grad(set_to_none=True)
    return torch.stack([((clean_cache[n] - acts[n]) * grads[n]).sum(-1)[0] for n in names])


def test_attribution_patching_raw_estimate_equals_transformer_lens_recipe(gpt2_pair):
    """``result.estimate`` is TransformerLens's raw estimate per layer × position (1e-5);
    ``result.values`` is the corrupted metric plus it."""
    model, ht = gpt2_pair
    with torch.no_grad():  # the twin computes the same function, so the comparison is about attribution
        assert torch.allclose(ht(CLEAN), model(CLEAN).logits, atol=1e-5)
    want = _tl_attribution(ht)
    result = tl.patching.attribution_patching(CLEAN, CORRUPT, tl.patching.logit_diff(GOOD, BAD), model=model)
    assert result.estimate is not None and result.estimate.shape == want.shape == (2, 6)
    assert want.abs().max() > 1e-3  # a grid that is not all zeros
    assert torch.allclose(result.estimate, want, atol=1e-5), (result.estimate - want).abs().max()
    assert torch.allclose(result.values, result.corrupted + result.estimate, atol=1e-6)
    with torch.no_grad():
        logits = ht(CORRUPT)
    assert abs(result.corrupted - float(logits[0, -1, GOOD] - logits[0, -1, BAD])) < 1e-5
