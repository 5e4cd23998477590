"""TransformerLens hook names typed where TorchLens expects a site, against ``HookedTransformer`` on the same weights.

Each family adapter declares the TransformerLens names that hold the same tensor as one of its canonical
sites (``ArchView.transformerlens``); those resolve, for reads (``trace[...]``), capture-time edits
(``tl.when``) and forks. Every other name in TransformerLens's cache raises ``SiteNotFoundError`` whose
remedy says how TorchLens reads it: never another tensor in its place. Tiny GPT-2 (norms and biases
random) and a grouped-query Llama, batch 2; the twin is ``tl_oracle``'s (TransformerLens's own weight
conversion, no processing).
"""

from __future__ import annotations

import pytest
import torch
from conftest import build_tiny_neox, refused
from tl_oracle import hooked_gpt2, hooked_llama, hooked_neox, randomized_norms

import torchlens as tl
from torchlens.errors import SiteNotFoundError

pytestmark = pytest.mark.filterwarnings("ignore:HookedTransformer is deprecated:DeprecationWarning")
pytest.importorskip("transformer_lens", reason="transformer_lens (the test extra) is not installed")

ATOL = 1e-5


@pytest.fixture(scope="module", params=["gpt2", "llama_gqa", "neox_parallel", "neox_serial"])
def twin(request):
    """(our model, HookedTransformer on its weights, ids of batch 2, TransformerLens's cache, our trace)."""
    if request.param == "gpt2":
        model = randomized_norms(request.getfixturevalue("tiny_gpt2").model, seed=3, biases=True)
        hooked = hooked_gpt2(model)
    elif request.param.startswith("neox"):
        model = randomized_norms(build_tiny_neox(request.param == "neox_parallel"), seed=3, biases=True)
        hooked = hooked_neox(model)
    else:
        model = randomized_norms(request.getfixturevalue("tiny_llama").model, seed=3)
        hooked = hooked_llama(model)
    vocab = model.config.vocab_size
    ids = torch.tensor([[5, 17, 3, 42, 9, 11], [1, 2, 3, 4, 5, 6]]) % vocab
    with torch.no_grad():
        logits, cache = hooked.run_with_cache(ids)
        assert torch.allclose(logits, model(ids).logits, atol=ATOL)
    return model, hooked, ids, cache, tl.trace(model, ids)


def test_declared_names_read_transformerlens_values(twin):
    model, _, _, cache, trace = twin
    declared = tl.arch(model).transformerlens
    assert set(declared) == {"hook_resid_pre", "hook_resid_mid", "hook_resid_post", "hook_mlp_out", "hook_embed"}
    names = [n for n in cache.keys() if n.rpartition(".")[2] in declared and n.count(".") <= 2]
    parallel = getattr(model.config, "use_parallel_residual", False)  # no hook_resid_mid in either library
    assert len(names) == (3 if parallel else 4) * model.config.num_hidden_layers + 1
    for name in names:
        ours = trace[name].out
        assert ours.shape == cache[name].shape, name
        assert torch.allclose(ours, cache[name], atol=ATOL), name


def test_every_other_transformerlens_name_is_refused_with_how_to_read_it(twin):
    model, _, _, cache, trace = twin
    declared = tl.arch(model).transformerlens
    others = [n for n in cache.keys() if not (n.rpartition(".")[2] in declared and n.count(".") <= 2)]
    assert "blocks.0.attn.hook_pattern" in others and "ln_final.hook_normalized" in others
    for name in others:
        with pytest.raises(SiteNotFoundError) as err:
            trace[name]
        assert "TransformerLens hook name" in str(err.value) and err.value.remedy, name
        assert name not in trace
    # the remedy names the TorchLens spelling and the shape difference
    with pytest.raises(SiteNotFoundError) as err:
        trace["blocks.1.attn.hook_z"]
    assert "facets.head_out" in err.value.remedy and "[batch, position, head, d_head]" in err.value.remedy
    with pytest.raises(SiteNotFoundError) as err:
        trace["blocks.1.hook_resid_post.hook_sae_acts_post"]  # SAELens's sub-hook
    assert "features={'blocks.1': sae}" in err.value.remedy and "'blocks.1.features'" in err.value.remedy
    with pytest.raises(SiteNotFoundError) as err:
        trace["blocks.1.attn.hook_z.hook_sae_acts_post"]  # an SAE on z: no module output holds z here
    assert "no such site holds TransformerLens's hook_z" in err.value.remedy


def test_facets_hold_what_the_remedies_say(twin):
    """The remedy's translations, checked: head_out is hook_z with heads first; q and k are what the kernel
    receives (hook_rot_q / hook_rot_k on rotary Llama), k and v not repeated for grouped-query attention."""
    model, _, _, cache, trace = twin
    facets = trace.find_sites(tl.module("blocks.1.attn")).first().facets
    rotary = "blocks.1.attn.hook_rot_q" in cache
    pairs = {"head_out": "hook_z", "q": "hook_rot_q" if rotary else "hook_q",
             "k": "hook_rot_k" if rotary else "hook_k", "v": "hook_v"}
    for facet, hook in pairs.items():
        ours, theirs = getattr(facets, facet), cache[f"blocks.1.attn.{hook}"]
        assert torch.allclose(ours, theirs.transpose(1, 2), atol=ATOL), facet
    assert facets.k.shape[1] == tl.arch(model).n_kv_heads == theirs.shape[2]  # v: no repeat on either side
    assert torch.allclose(facets.pattern, cache["blocks.1.attn.hook_pattern"], atol=ATOL)


def test_edits_through_transformerlens_names_equal_run_with_hooks(twin):
    model, hooked, ids, _, trace = twin

    def double_row(p):
        def edit(act, **_):
            act = act.clone()
            act[:, p] = act[:, p] * 2
            return act
        return edit

    for name in ("blocks.1.hook_resid_pre", "blocks.0.hook_resid_mid", "blocks.0.hook_mlp_out",
                 "blocks.1.hook_resid_post"):
        if name not in hooked.mod_dict:  # a parallel residual has no resid_mid, in either library
            with pytest.raises(SiteNotFoundError, match="parallel"):
                tl.trace(model, ids, intervene=tl.when(name, double_row(2)))
            continue
        with torch.no_grad():
            theirs = hooked.run_with_hooks(ids, fwd_hooks=[(name, lambda act, hook: double_row(2)(act))])
        during = tl.trace(model, ids, intervene=tl.when(name, double_row(2)))
        after = trace.fork().do(name, double_row(2))
        assert torch.allclose(during.output.logits, theirs, atol=ATOL), name
        assert torch.allclose(after.output.logits, theirs, atol=ATOL), name


def test_refused_names_leave_the_model_unchanged(twin):
    model, _, ids, _, _ = twin
    refused(model, lambda: tl.trace(model, ids, intervene=tl.when("blocks.0.attn.hook_pattern",
                                                                  lambda a, **_: a)), SiteNotFoundError)
    refused(model, lambda: tl.arch(model).selector("blocks.0.hook_attn_out"), SiteNotFoundError)


def test_grids_given_a_transformerlens_site_name_say_which_kind_it_is(tiny_gpt2):
    model, ids = tiny_gpt2.model, tiny_gpt2.args[0]
    clean, corrupted = tl.trace(model, ids), tl.trace(model, (ids + 1) % model.config.vocab_size)
    metric = tl.patching.logit_diff(3, 4)
    for given, kind in (("hook_attn_out", "site='attn'"), ("blocks.1.hook_resid_pre", "site='resid_pre', layers=[1]"),
                        ("mlp_out", "site='mlp'"), ("blocks.0.attn.hook_z", "site='heads', layers=[0]"),
                        ("blocks.1.mlp", "site='mlp', layers=[1]")):
        err = refused(model, lambda given=given: tl.patching.activation_patching(clean, corrupted, metric, site=given),
                      tl.errors.InvalidArgumentError)
        assert err.remedy.startswith(kind), (given, err.remedy)
    err = refused(model, lambda: tl.patching.attribution_patching(clean, corrupted, metric, site="z"),
                  tl.errors.InvalidArgumentError)
    assert err.remedy.startswith("site='heads'")
    err = refused(model, lambda: tl.patching.activation_patching(clean, corrupted, metric, site="q"),
                  tl.errors.InvalidArgumentError)
    assert "one of" in err.remedy


def test_eager_scores_hold_the_models_mask_value_as_documented(twin):
    """docs/facets.md: eager scores are the softmax's real input (masked: finfo.min), the fused facet's are -inf as
    TransformerLens's hook_attn_scores; both give TransformerLens's pattern and unmasked scores."""
    from conftest import eager_copy

    model, _, ids, cache, trace = twin
    eager = tl.trace(eager_copy(model), ids).find_sites(tl.module("blocks.0.attn")).first().facets
    fused = trace.find_sites(tl.module("blocks.0.attn")).first().facets
    theirs = cache["blocks.0.attn.hook_attn_scores"]
    masked = theirs.isneginf()
    assert masked.any() and torch.equal(fused.scores.isneginf(), masked)
    assert torch.all(eager.scores[masked] == torch.finfo(eager.scores.dtype).min)
    for facets in (eager, fused):
        assert torch.allclose(facets.scores[~masked], theirs[~masked], atol=ATOL)
        assert torch.allclose(facets.pattern, cache["blocks.0.attn.hook_pattern"], atol=ATOL)
    with pytest.raises(AttributeError):
        getattr(eager, "q")  # noqa: B009 - the read is the test
