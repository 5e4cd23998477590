"""Patching grids and attribution patching against TransformerLens 3.9 on the same weights.

The HookedTransformer is built offline by ``tests/tl_oracle.py`` (a config written out by hand,
TransformerLens's own weight conversion, no folding or centring) from a model whose norms have
random weights and biases, so a mistake in either implementation shows. Tiny GPT-2 with fused
(SDPA) and eager attention, and a grouped-query Llama; batch 2, one answer pair per prompt.

References:

- exact grids: TransformerLens's ``patching`` module (``get_act_patch_resid_pre`` / ``_resid_mid``
  / ``_attn_out`` / ``_mlp_out``, ``get_act_patch_attn_head_out_all_pos`` / ``_by_pos``), and
  ``generic_activation_patch`` with ``layer_pos_patch_setter`` for ``resid_post`` (the module has
  no shortcut for it);
- attribution patching: TransformerLens's recipe, written with its hooks: cache the clean run,
  then a forward and backward on the corrupted run keeping each hook's value and gradient;
  estimate = ``((clean - corrupted) * grad)`` summed over the features, the batch (and, for heads,
  the positions): ``hook_resid_pre``, ``hook_resid_post``, ``hook_attn_out``, ``hook_mlp_out``,
  ``hook_z``.
"""

from __future__ import annotations

import contextlib
import io
import warnings

import pytest
import torch
from conftest import build_tiny_neox, eager_copy
from tl_oracle import hooked_gpt2, hooked_llama, hooked_neox, randomized_norms

import torchlens as tl

pytestmark = pytest.mark.filterwarnings("ignore:HookedTransformer is deprecated:DeprecationWarning")

ATOL = 1e-5
GOOD, BAD = [3, 40], [9, 2]  # one answer pair per prompt of the batch


def _prompts(ids: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Clean and corrupted batches of 2: the corrupted prompts differ at two positions."""
    clean = torch.cat([ids, (ids * 7 + 3) % vocab])
    corrupted = clean.clone()
    corrupted[:, 2] = (corrupted[:, 2] + 11) % vocab
    corrupted[:, -2] = (corrupted[:, -2] + 5) % vocab
    return clean, corrupted


@pytest.fixture(scope="module", params=["gpt2_sdpa", "gpt2_eager", "llama_gqa"])
def pair(request):
    """(our model, HookedTransformer on its weights, clean ids, corrupted ids), batch 2."""
    pytest.importorskip("transformer_lens", reason="transformer_lens (the test extra) is not installed")
    if request.param.startswith("gpt2"):
        case = request.getfixturevalue("tiny_gpt2")
        model = randomized_norms(case.model, seed=7)
        if request.param == "gpt2_eager":
            model = eager_copy(model)
        hooked = hooked_gpt2(model)
    else:
        case = request.getfixturevalue("tiny_llama")
        assert case.model.config.num_key_value_heads < case.model.config.num_attention_heads  # GQA
        model = randomized_norms(case.model, seed=7)
        hooked = hooked_llama(model)
    clean, corrupted = _prompts(case.args[0], model.config.vocab_size)
    with torch.no_grad():  # the twin computes the same function, so every comparison below is about patching
        assert torch.allclose(hooked(clean), model(clean).logits, atol=ATOL)
    return model, hooked, clean, corrupted


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a.float() - b.float()).abs().max())


def _quiet(fn, *args, **kwargs):
    """A TransformerLens patching call without its progress bar on stderr."""
    with contextlib.redirect_stderr(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


def _tl_grid(hooked, clean: torch.Tensor, corrupted: torch.Tensor, metric, site: str,
             by_pos: bool = False) -> torch.Tensor:
    from transformer_lens import patching

    _, cache = hooked.run_with_cache(clean)
    if site == "resid_post":
        return _quiet(patching.generic_activation_patch, hooked, corrupted, cache, metric,
                      patch_setter=patching.layer_pos_patch_setter, activation_name="resid_post",
                      index_axis_names=("layer", "pos"))
    fn = {"resid_pre": patching.get_act_patch_resid_pre, "resid_mid": patching.get_act_patch_resid_mid,
          "attn": patching.get_act_patch_attn_out, "mlp": patching.get_act_patch_mlp_out,
          "heads": patching.get_act_patch_attn_head_out_by_pos if by_pos
          else patching.get_act_patch_attn_head_out_all_pos}[site]
    return _quiet(fn, hooked, corrupted, cache, metric)


@pytest.mark.parametrize("site", ["resid_pre", "resid_mid", "resid_post", "attn", "mlp", "heads"])
def test_activation_patching_grid_equals_transformer_lens(pair, site):
    model, hooked, clean, corrupted = pair
    metric = tl.patching.logit_diff(GOOD, BAD)
    want = _tl_grid(hooked, clean, corrupted, metric, site)
    got = tl.patching.activation_patching(clean, corrupted, metric, model=model, site=site)
    assert got.dims == (("layer", "head") if site == "heads" else ("layer", "position"))
    assert (want - want.mean()).abs().max() > 20 * ATOL  # a grid whose cells differ by more than the tolerance
    assert _max_diff(got.values, want) < ATOL, (site, _max_diff(got.values, want))
    with torch.no_grad():
        assert abs(got.corrupted - float(metric(hooked(corrupted)))) < ATOL
        assert abs(got.clean - float(metric(hooked(clean)))) < ATOL


def test_head_by_position_grid_equals_transformer_lens(pair):
    """Each head's output at one position: TransformerLens's [layer, pos, head] is our [layer, head, position]."""
    model, hooked, clean, corrupted = pair
    metric = tl.patching.logit_diff(GOOD, BAD)
    want = _tl_grid(hooked, clean, corrupted, metric, "heads", by_pos=True)
    got = tl.patching.activation_patching(clean, corrupted, metric, model=model, site="heads",
                                          positions=list(range(clean.shape[1])))
    assert got.dims == ("layer", "head", "position")
    assert _max_diff(got.values, want.permute(0, 2, 1)) < ATOL


TL_HOOK = {"resid_pre": "hook_resid_pre", "resid_post": "hook_resid_post", "attn": "hook_attn_out",
           "mlp": "hook_mlp_out", "heads": "attn.hook_z"}


def _tl_attribution(hooked, clean: torch.Tensor, corrupted: torch.Tensor, metric, site: str) -> torch.Tensor:
    """TransformerLens's attribution-patching recipe: [layer, position], or [layer, head] for heads."""
    names = [f"blocks.{layer}.{TL_HOOK[site]}" for layer in range(hooked.cfg.n_layers)]
    _, clean_cache = hooked.run_with_cache(clean)
    acts, grads = {}, {}

    def keep_act(act, hook):
        acts[hook.name] = act.detach()

    def keep_grad(grad, hook):
        grads[hook.name] = grad.detach()

    hooked.reset_hooks()
    for name in names:
        hooked.add_hook(name, keep_act, "fwd")
        hooked.add_hook(name, keep_grad, "bwd")
    try:
        metric(hooked(corrupted)).backward()
    finally:
        hooked.reset_hooks()
        hooked.zero_grad(set_to_none=True)
    rows = []
    for n in names:
        attribution = (clean_cache[n] - acts[n]) * grads[n]  # [batch, pos, d] or [batch, pos, head, d_head]
        rows.append(attribution.sum((0, 1, 3)) if site == "heads" else attribution.sum((0, 2)))
    return torch.stack(rows)


@pytest.mark.parametrize("site", ["resid_pre", "resid_post", "attn", "mlp", "heads"])
def test_attribution_patching_raw_estimate_equals_transformer_lens_recipe(pair, site):
    """``result.estimate`` is TransformerLens's raw estimate per cell; ``result.values`` is the corrupted
    metric plus it."""
    model, hooked, clean, corrupted = pair
    metric = tl.patching.logit_diff(GOOD, BAD)
    want = _tl_attribution(hooked, clean, corrupted, metric, site)
    result = tl.patching.attribution_patching(clean, corrupted, metric, model=model, site=site)
    assert result.estimate is not None and result.estimate.shape == want.shape
    assert want.abs().max() > 20 * ATOL  # a grid that is not all zeros
    assert _max_diff(result.estimate, want) < ATOL, (site, _max_diff(result.estimate, want))
    assert torch.allclose(result.values, result.corrupted + result.estimate, atol=1e-6)
    with torch.no_grad():
        assert abs(result.corrupted - float(metric(hooked(corrupted)))) < ATOL


@pytest.mark.parametrize("parallel", [True, False], ids=["parallel", "serial"])
def test_gpt_neox_grids_decomposition_and_lens_match_transformerlens(parallel):
    """GPT-NeoX (partial rotary; the parallel residual, and the serial one) against HookedTransformer: the
    patching grids (layer x position, layer x head), the decomposition and head stack, the accumulated
    residual through the final norm (and through block 1's norm) and the logit lens."""
    model = randomized_norms(build_tiny_neox(parallel), seed=3, biases=True)
    hooked = hooked_neox(model)
    clean, corrupted = _prompts(torch.tensor([[5, 17, 3, 42, 9, 11]]), model.config.vocab_size)
    with torch.no_grad():
        logits, cache = hooked.run_with_cache(clean)
        assert _max_diff(logits, model(clean).logits) < ATOL
    ours, theirs = tl.trace(model, clean), tl.trace(model, corrupted)

    def metric_tl(out):
        return (out[:, -1, 3] - out[:, -1, 4]).mean()

    def patched(hook, index):
        def restore(act, hook):
            act = act.clone()
            act[index] = cache[hook.name][index]
            return act
        with torch.no_grad():
            return float(metric_tl(hooked.run_with_hooks(corrupted, fwd_hooks=[(hook, restore)])))

    metric = lambda out: metric_tl(out.logits)  # noqa: E731 - a custom metric, no declared read
    for site, hook in (("resid_pre", "hook_resid_pre"), ("attn", "hook_attn_out"), ("mlp", "hook_mlp_out")):
        grid = tl.patching.activation_patching(ours, theirs, metric, site=site, positions=[2, -1])
        want = torch.tensor([[patched(f"blocks.{layer}.{hook}", (slice(None), p)) for p in (2, 5)]
                             for layer in range(2)])
        assert _max_diff(grid.values, want) < ATOL, site
    grid = tl.patching.activation_patching(ours, theirs, metric, site="heads")
    want = torch.tensor([[patched(f"blocks.{layer}.attn.hook_z", (slice(None), slice(None), h)) for h in range(4)]
                         for layer in range(2)])
    assert _max_diff(grid.values, want) < ATOL
    stack, labels = tl.decompose_resid(ours)
    want, want_labels = cache.decompose_resid(return_labels=True)
    assert labels == want_labels and _max_diff(stack, want) < ATOL
    heads, head_labels = tl.decompose_resid(ours, heads=True)
    rows = [i for i, name in enumerate(head_labels) if name.startswith("L")]
    assert _max_diff(heads[rows], cache.stack_head_results()) < ATOL
    assert _max_diff(tl.accumulated_resid(ours, apply_ln=True), cache.accumulated_resid(apply_ln=True)) < ATOL
    assert _max_diff(tl.apply_ln_to_stack(ours, tl.accumulated_resid(ours, layers=range(2)), layer=1),
                     cache.accumulated_resid(layer=1, apply_ln=True)) < ATOL
    with torch.no_grad():
        assert _max_diff(tl.logit_lens(ours).logits, hooked.unembed(cache.accumulated_resid(apply_ln=True))) < ATOL
