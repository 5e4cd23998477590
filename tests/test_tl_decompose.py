"""Residual decomposition and direct logit attribution, cross-checked against TransformerLens 3.9.

The same random weights (layer norms and biases randomised, so a forgotten scale or bias shows)
are loaded into ``transformers`` and into TransformerLens's ``HookedTransformer`` through
TransformerLens's own weight conversion, with no folding or centring; the decomposed residual,
each head's output and the direct logit attribution of every component must agree to 1e-5.
"""

from __future__ import annotations

import pytest
import torch

import torchlens as tl
from tests.conftest import assert_model_clean, eager_copy, hook_state
from tests.tl_oracle import hooked_gpt2, hooked_llama, randomized_norms


def _need_transformer_lens() -> None:
    pytest.importorskip("transformer_lens", reason="transformer_lens is not installed (pip install "
                        "'transformer-lens>=3.9,<4')")


pytestmark = pytest.mark.filterwarnings("ignore:HookedTransformer is deprecated:DeprecationWarning")

IDS = torch.tensor([[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]])
ANSWER, WRONG = torch.tensor([3, 40]), torch.tensor([9, 2])
ATOL = 1e-5


def _randomise(model: torch.nn.Module, seed: int = 7) -> torch.nn.Module:
    """Norm weights away from 1, every bias away from 0 (seeded), so a dropped scale or bias shows."""
    return randomized_norms(model, seed, biases=True)


@pytest.fixture(scope="module", params=["sdpa", "eager"])
def gpt2_pair(request, tiny_gpt2):
    _need_transformer_lens()
    hf = _randomise(tiny_gpt2.model)
    if request.param == "eager":
        hf = eager_copy(hf)
    with torch.no_grad():
        _, cache = hooked_gpt2(hf).run_with_cache(IDS)
        _, folded = hooked_gpt2(hf, fold_ln=True).run_with_cache(IDS)
    return hf, tl.trace(hf, IDS), cache, folded


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a - b).abs().max().detach())


@pytest.mark.parametrize("layer", [0, 1, 2, None])
def test_decompose_resid_matches_transformer_lens(gpt2_pair, layer):
    hf, trace, cache, _ = gpt2_pair
    ours, labels = tl.decompose_resid(trace, layer)
    theirs, their_labels = cache.decompose_resid(layer=layer, return_labels=True)
    assert labels == their_labels
    assert _max_diff(ours, theirs) < ATOL
    want = cache[f"blocks.{layer}.hook_resid_pre"] if layer not in (None, 2) else cache["blocks.1.hook_resid_post"]
    assert _max_diff(ours.sum(0), want) < ATOL


@pytest.mark.parametrize("layer", [0, 1])
def test_mlp_input_adds_the_block_attention(gpt2_pair, layer):
    _, trace, cache, _ = gpt2_pair
    ours, labels = tl.decompose_resid(trace, layer, mlp_input=True)
    theirs, their_labels = cache.decompose_resid(layer=layer, mlp_input=True, return_labels=True)
    assert labels == their_labels and labels[-1] == f"{layer}_attn_out"
    assert _max_diff(ours, theirs) < ATOL
    assert _max_diff(ours.sum(0), cache[f"blocks.{layer}.hook_resid_mid"]) < ATOL


@pytest.mark.parametrize("mode", ["attn", "mlp"])
def test_modes_match_transformer_lens(gpt2_pair, mode):
    _, trace, cache, _ = gpt2_pair
    ours, labels = tl.decompose_resid(trace, mode=mode)
    theirs, their_labels = cache.decompose_resid(mode=mode, return_labels=True)
    assert labels == their_labels
    assert _max_diff(ours, theirs) < ATOL


@pytest.mark.parametrize("layer", [1, 2])
def test_heads_match_stack_head_results_and_sum_to_the_residual(gpt2_pair, layer):
    hf, trace, cache, _ = gpt2_pair
    ours, labels = tl.decompose_resid(trace, layer, heads=True)
    theirs, their_labels = cache.stack_head_results(layer=layer, return_labels=True)
    rows = [i for i, name in enumerate(labels) if name.startswith("L")]
    assert [labels[i] for i in rows] == their_labels
    assert _max_diff(ours[rows], theirs) < ATOL
    for i in range(layer):  # the output projection's bias, its own component
        bias = ours[labels.index(f"{i}_attn_bias")]
        assert _max_diff(bias, hf.transformer.h[i].attn.c_proj.bias.expand_as(bias)) == 0
    assert _max_diff(ours.sum(0), cache[f"blocks.{layer - 1}.hook_resid_post"]) < ATOL


def test_logit_attrs_of_every_component_and_head_match_transformer_lens(gpt2_pair):
    hf, trace, cache, folded = gpt2_pair
    ours, labels = tl.decompose_resid(trace, heads=True)
    # components from the unfolded model (folding moves each head's value bias into b_O), attributed by
    # the folded one (whose W_U holds the final norm's weight, as its logit_attrs expects)
    theirs, their_labels = cache.get_full_resid_decomposition(expand_neurons=False, return_labels=True)
    # TransformerLens's full decomposition: heads, MLPs, embed, pos_embed, then one summed bias
    by_label = dict(zip(their_labels, theirs.unbind(0)))
    attrs = tl.logit_attrs(trace, ours, tokens=ANSWER, incorrect_tokens=WRONG)

    def theirs_of(name: str) -> torch.Tensor:
        return folded.logit_attrs(by_label[name][None, :, -1], tokens=ANSWER, incorrect_tokens=WRONG,
                                  pos_slice=-1)[0]

    for i, name in enumerate(labels):
        if name.endswith("_attn_bias"):
            continue
        assert _max_diff(attrs[i], theirs_of(name)) < ATOL, name
    # their 'bias' is every output projection's bias together; ours has one per block
    biases = [i for i, name in enumerate(labels) if name.endswith("_attn_bias")]
    assert len(biases) == 2 and _max_diff(attrs[biases].sum(0), theirs_of("bias")) < ATOL
    assert attrs.shape == (len(labels), 2)


def test_logit_attrs_of_the_decomposition_match_logit_attrs_of_transformer_lens(gpt2_pair):
    _, trace, _, folded = gpt2_pair
    ours, _ = tl.decompose_resid(trace)
    theirs = folded.decompose_resid(return_labels=False)
    for tokens, wrong in ((5, None), (ANSWER, None), (ANSWER, WRONG)):
        got = tl.logit_attrs(trace, ours, tokens=tokens, incorrect_tokens=wrong)
        want = folded.logit_attrs(theirs[:, :, -1], tokens=tokens if isinstance(tokens, int) else tokens,
                                  incorrect_tokens=wrong, pos_slice=-1)
        assert _max_diff(got, want) < ATOL


def test_apply_ln_to_stack_matches_transformer_lens(gpt2_pair):
    _, trace, cache, _ = gpt2_pair
    ours, _ = tl.decompose_resid(trace, 1)
    theirs = cache.decompose_resid(layer=1)
    assert _max_diff(tl.apply_ln_to_stack(trace, ours), cache.apply_ln_to_stack(theirs, layer=-1)) < ATOL


@pytest.mark.parametrize("layer", [0, 1])
def test_apply_ln_to_stack_at_a_block_matches_transformer_lens(gpt2_pair, layer):
    """TransformerLens's ``layer=k`` scales a stack by block k's first norm (``mlp_input``: its pre-MLP norm) as it
    scaled that block's input; ``accumulated_resid(layer=k, apply_ln=True)`` and ``decompose_resid(layer=k,
    apply_ln=True)`` do so. A ported call gets those values, not the final norm's."""
    _, trace, cache, _ = gpt2_pair
    acc = tl.accumulated_resid(trace, layers=range(layer + 1))
    want = cache.accumulated_resid(layer=layer, apply_ln=True)
    assert _max_diff(tl.apply_ln_to_stack(trace, acc, layer=layer), want) < ATOL
    assert _max_diff(tl.apply_ln_to_stack(trace, acc, layer=layer), tl.apply_ln_to_stack(trace, acc)) > 1e-3
    stack, _ = tl.decompose_resid(trace, layer, mlp_input=True)
    want = cache.decompose_resid(layer=layer, mlp_input=True, apply_ln=True)
    assert _max_diff(tl.apply_ln_to_stack(trace, stack, layer=layer, mlp_input=True), want) < ATOL
    # None, -1 and n_layers are the final norm, as in TransformerLens
    final = tl.apply_ln_to_stack(trace, stack)
    for same in (None, -1, 2):
        assert torch.equal(tl.apply_ln_to_stack(trace, stack, layer=same), final)


def test_attributions_sum_to_the_model_logits(gpt2_pair):
    """Hand check, no TransformerLens: every component's attribution plus the norm's and unembedding's
    constant is the model's own logit, at every position."""
    hf, trace, _, _ = gpt2_pair
    stack = tl.decompose_resid(trace, heads=True)
    attrs = tl.logit_attrs(trace, stack, tokens=ANSWER, position=None)  # [component, batch, position]
    with torch.no_grad():
        logits = hf(IDS).logits
        const = hf.transformer.ln_f.bias @ hf.lm_head.weight.T
    want = logits[torch.arange(2), :, ANSWER] - const[ANSWER][:, None]
    assert _max_diff(attrs.sum(0), want) < ATOL


# -- a grouped-query Llama ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_pair(tiny_llama):
    _need_transformer_lens()
    hf = _randomise(tiny_llama.model)
    ids = torch.tensor([[3, 17, 42, 9, 100, 5, 77], [8, 1, 64, 33, 2, 90, 12]])
    with torch.no_grad():
        hooked = hooked_llama(hf)
        logits, cache = hooked.run_with_cache(ids)
        if _max_diff(logits, hf(ids).logits) > 1e-4:
            pytest.skip("TransformerLens's Llama conversion does not reproduce this transformers Llama's logits")
        hooked.process_weights_(fold_ln=True, center_writing_weights=False, center_unembed=False)
        _, folded = hooked.run_with_cache(ids)
    return hf, ids, tl.trace(hf, ids), cache, folded


def test_gqa_llama_decomposition_heads_and_logit_attrs_match_transformer_lens(llama_pair):
    hf, ids, trace, cache, folded = llama_pair
    ours, labels = tl.decompose_resid(trace, heads=True)
    assert "pos_embed" not in labels  # rotary: no position embedding component
    rows = [i for i, name in enumerate(labels) if name.startswith("L")]
    heads, head_labels = cache.stack_head_results(return_labels=True)
    assert [labels[i] for i in rows] == head_labels
    assert _max_diff(ours[rows], heads) < ATOL
    assert _max_diff(ours.sum(0), cache["blocks.1.hook_resid_post"]) < ATOL
    plain, plain_labels = tl.decompose_resid(trace)
    theirs, their_labels = cache.decompose_resid(return_labels=True)
    assert plain_labels == their_labels and _max_diff(plain, theirs) < ATOL
    for layer in (0, 1):  # RMSNorm: no centring, block layer's input_layernorm scale
        acc = tl.accumulated_resid(trace, layers=range(layer + 1))
        assert _max_diff(tl.apply_ln_to_stack(trace, acc, layer=layer),
                         cache.accumulated_resid(layer=layer, apply_ln=True)) < ATOL
        stack, _ = tl.decompose_resid(trace, layer, mlp_input=True)
        assert _max_diff(tl.apply_ln_to_stack(trace, stack, layer=layer, mlp_input=True),
                         cache.decompose_resid(layer=layer, mlp_input=True, apply_ln=True)) < ATOL
    answer, wrong = torch.tensor([5, 99]), torch.tensor([7, 0])
    got = tl.logit_attrs(trace, plain, tokens=answer, incorrect_tokens=wrong)
    want = folded.logit_attrs(folded.decompose_resid()[:, :, -1], tokens=answer, incorrect_tokens=wrong, pos_slice=-1)
    assert _max_diff(got, want) < ATOL


# -- bad input --------------------------------------------------------------------------------------


def test_layer_out_of_range_raises_and_leaves_the_model(tiny_gpt2):
    before = hook_state(tiny_gpt2.model)
    trace = tl.trace(tiny_gpt2.model, *tiny_gpt2.args)
    for layer in (3, -4):
        with pytest.raises(tl.SiteNotFoundError, match="layer boundar") as info:
            tl.decompose_resid(trace, layer)
        assert info.value.remedy
    assert tl.decompose_resid(trace, -1).labels == tl.decompose_resid(trace).labels  # -1: the final boundary
    assert_model_clean(tiny_gpt2.model, before)


def test_answer_outside_the_vocabulary_raises(tiny_gpt2):
    before = hook_state(tiny_gpt2.model)
    trace = tl.trace(tiny_gpt2.model, *tiny_gpt2.args)
    stack = tl.decompose_resid(trace)
    for tokens, wrong in ((64, None), (-1, None), (3, [64])):
        with pytest.raises(tl.errors.InvalidArgumentError, match="outside the vocabulary") as info:
            tl.logit_attrs(trace, stack, tokens=tokens, incorrect_tokens=wrong)
        assert info.value.remedy
    with pytest.raises(tl.errors.InvalidArgumentError, match="one id per batch row"):
        tl.logit_attrs(trace, stack, tokens=[1, 2])  # two answers for one row
    with pytest.raises(tl.errors.InvalidArgumentError, match="the stack must be"):
        tl.logit_attrs(trace, stack.stack[:, :, :3], tokens=1)  # not this trace's positions
    with pytest.raises(tl.errors.InvalidArgumentError, match="mode= is one of"):
        tl.decompose_resid(trace, mode="heads")
    assert_model_clean(tiny_gpt2.model, before)


def test_components_the_adapter_lacks_are_named(tiny_gpt2, monkeypatch):
    """An adapter without MLP sites: asking for MLP outputs names the adapter and what it has."""
    from torchlens.analysis import residual_decompose
    from torchlens.arch import Layout, ResidualAdd

    model = tiny_gpt2.model
    attn_only = Layout(blocks="h", attn="attn", mlp=None, resid_mid=ResidualAdd(1), embed="wte",
                       embed_out="drop", unembed="lm_head").view(model, "attn-only", n_heads=2, head_dim=16,
                                                                   d_model=32)
    before = hook_state(model)
    trace = tl.trace(model, *tiny_gpt2.args)
    monkeypatch.setattr(residual_decompose, "arch", lambda m: attn_only)
    for mode in ("all", "mlp"):
        with pytest.raises(tl.SiteNotFoundError, match=r"'attn-only' adapter has no MLP site .*it has \['embed', "
                           r"'blocks.0.attn'\]") as info:
            tl.decompose_resid(trace, mode=mode)
        assert info.value.remedy
    stack, labels = tl.decompose_resid(trace, mode="attn")  # what it has still works
    assert labels == ["embed", "0_attn_out", "1_attn_out"]
    assert_model_clean(model, before)


def test_a_post_norm_model_is_refused(minilm):
    """BERT adds a LayerNorm after each sublayer: its components cannot sum to the residual."""
    before = hook_state(minilm.model)
    trace = tl.trace(minilm.model, *minilm.args, **minilm.kwargs)
    with pytest.raises(tl.UnsupportedModelError, match="do not sum to its residual stream") as info:
        tl.decompose_resid(trace, 1)
    assert info.value.remedy
    assert_model_clean(minilm.model, before)


def test_transformerlens_page_maps_the_decomposition_calls():
    """The migration table maps each TransformerLens call to a TorchLens call that exists."""
    import pathlib
    import re

    page = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "coming-from-transformerlens.md").read_text()
    rows = {line.split(" | ")[0]: line.split(" | ")[1] for line in page.splitlines() if line.startswith("| `cache.")}
    for theirs, ours in (("decompose_resid", "tl.decompose_resid"), ("stack_head_results", "heads=True"),
                         ("logit_attrs", "tl.logit_attrs"), ("apply_ln_to_stack", "tl.apply_ln_to_stack")):
        mapped = [v for k, v in rows.items() if f"cache.{theirs}" in k]
        assert mapped and all(ours in v for v in mapped), theirs
    for name in re.findall(r"\btl\.(decompose_resid|logit_attrs|apply_ln_to_stack)\b", page):
        assert callable(getattr(tl, name))


# -- every family an adapter covers ------------------------------------------------------------------

PRE_NORM = ["gpt2", "gpt_neox", "gpt_neox_serial", "llama", "mistral", "qwen2"]


@pytest.mark.parametrize("family", PRE_NORM)
def test_attributions_sum_to_the_logits_in_every_pre_norm_family(family):
    """Hand check through each adapter (parallel and serial NeoX, GQA, head_dim apart from width): every
    component and head, through the final norm and the unembedding, plus the norm's and unembedding's
    constant, is the model's own logit at every position."""
    from tests.test_adapters import FAMILIES
    from torchlens.analysis.logit_lens import find_final_norm

    model = _randomise(FAMILIES[family].build())
    ids = torch.tensor([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]])
    before = hook_state(model)
    trace = tl.trace(model, ids)
    stack, labels = tl.decompose_resid(trace, heads=True)
    assert sum(name.startswith("L0H") for name in labels) == tl.arch(model).n_heads
    answer = torch.tensor([3, 11])
    attrs = tl.logit_attrs(trace, stack, tokens=answer, position=None)
    with torch.no_grad():
        logits = model(ids).logits
        norm = model.get_submodule(find_final_norm(trace))
        const = tl.arch(model).module("unembed")(norm(torch.zeros(1, stack.size(-1))))[0]  # beta @ W_U + b_U
    want = logits[torch.arange(2), :, answer] - const[answer][:, None]
    assert _max_diff(attrs.sum(0), want) < 1e-4
    assert_model_clean(model, before)


def test_a_norm_after_a_sublayer_is_refused():
    """Gemma-3 norms each sublayer's output before adding it: no component sum is the residual, so the
    decomposition refuses rather than return components that do not add up (BERT: the test above)."""
    from tests.test_adapters import FAMILIES

    model = FAMILIES["gemma3_text"].build()
    before = hook_state(model)
    trace = tl.trace(model, torch.tensor([[1, 2, 3, 4]]))
    with pytest.raises(tl.UnsupportedModelError, match="do not sum to its residual stream") as info:
        tl.decompose_resid(trace, 1)
    assert repr(tl.arch(model).adapter) in str(info.value)
    assert info.value.remedy
    assert_model_clean(model, before)
