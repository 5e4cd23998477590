"""Accumulated residual and logit lens against TransformerLens 3.9's HookedTransformer, same weights.

Tiny GPT-2 (fused and eager attention) and a GQA Llama, norms with random weights and biases,
batch 2. TransformerLens's ``accumulated_resid(apply_ln=True)`` (the final norm on each row),
its ``apply_ln_to_stack`` (the final residual's cached scale) and ``unembed`` of the former
(the logit lens) are the references, to 1e-5.
"""

from __future__ import annotations

import pytest
import torch
from conftest import assert_model_clean, build_tiny_bert_mlm, build_tiny_gemma3, eager_copy, hook_state
from tl_oracle import hooked_gpt2, hooked_llama, randomized_norms

import torchlens as tl
from torchlens.errors import InvalidArgumentError, SiteNotFoundError, UnsupportedModelError

ATOL = 1e-5


def _batch(case, vocab: int) -> torch.Tensor:
    ids = case.args[0]
    return torch.cat([ids, (ids * 7 + 3) % vocab])


@pytest.fixture(scope="module", params=["gpt2_sdpa", "gpt2_eager", "llama_gqa"])
def pair(request):
    """(our model, HookedTransformer on its weights, ids of batch 2)."""
    pytest.importorskip("transformer_lens", reason="transformer_lens (the test extra) is not installed")
    if request.param.startswith("gpt2"):
        case = request.getfixturevalue("tiny_gpt2")
        model = randomized_norms(case.model)
        if request.param == "gpt2_eager":
            model = eager_copy(model)
        return model, hooked_gpt2(model), _batch(case, model.config.vocab_size)
    case = request.getfixturevalue("tiny_llama")
    assert case.model.config.num_key_value_heads < case.model.config.num_attention_heads  # GQA
    model = randomized_norms(case.model)
    return model, hooked_llama(model), _batch(case, model.config.vocab_size)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a - b).abs().max())


def test_accumulated_resid_matches_transformerlens(pair):
    model, hooked, ids = pair
    trace = tl.trace(model, ids)
    with torch.no_grad():
        _, cache = hooked.run_with_cache(ids)
        want, want_labels = cache.accumulated_resid(return_labels=True)
        want_ln = cache.accumulated_resid(apply_ln=True)
        want_scaled = cache.apply_ln_to_stack(want)  # the cached final-norm scale, no weight or bias
    got, labels = tl.accumulated_resid(trace, return_labels=True)
    assert labels == want_labels and got.shape[0] == tl.arch(model).n_layers + 1
    assert _max_diff(got, want) < ATOL
    assert _max_diff(tl.accumulated_resid(trace, apply_ln=True), want_ln) < ATOL
    assert _max_diff(tl.accumulated_resid(trace, apply_ln="per_row"), want_ln) < ATOL
    got_scaled = tl.accumulated_resid(trace, apply_ln="final_scale")
    assert _max_diff(got_scaled, want_scaled) < ATOL
    # the two conventions differ on every row but the last (whose scale is its own) once weights are not 1/0
    assert _max_diff(got_scaled[:-1], want_ln[:-1]) > 1e-2
    # pos_slice as TransformerLens's: an int drops the position axis
    assert _max_diff(tl.accumulated_resid(trace, pos_slice=-1), cache.accumulated_resid(pos_slice=-1)) < ATOL
    # a tuple is a slice's arguments in TransformerLens (positions 1 to 3), not the positions 1 and 4
    assert _max_diff(tl.accumulated_resid(trace, pos_slice=(1, 4)), cache.accumulated_resid(pos_slice=(1, 4))) < ATOL
    assert _max_diff(tl.accumulated_resid(trace, pos_slice=(3,)), cache.accumulated_resid(pos_slice=(3,))) < ATOL
    assert _max_diff(tl.accumulated_resid(trace, apply_ln="final_scale", pos_slice=[0, 2]),
                     cache.apply_ln_to_stack(cache.accumulated_resid(pos_slice=[0, 2]), pos_slice=[0, 2])) < ATOL


def test_logit_lens_last_row_is_the_models_soft_capped_logits():
    """Gemma-3 soft-caps its LM head's output (final_logit_softcapping): the lens applies the same cap to every
    row, so its last row is still the model's logits (it differed by 0.07 here, silently, before)."""
    model = build_tiny_gemma3(final_logit_softcapping=5.0)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(5)  # logits well past the cap, so a forgotten cap shows
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    trace = tl.trace(model, ids)
    lens = tl.logit_lens(trace)
    assert lens.softcap == 5.0 and float(lens.logits.abs().max()) <= 5.0
    assert _max_diff(lens.logits[-1], trace.output.logits) < ATOL
    with torch.no_grad():
        raw = model.lm_head(model.model.norm(trace["blocks.0.resid_post"].out))
    assert _max_diff(lens.logits[1], torch.tanh(raw / 5.0) * 5.0) < ATOL
    uncapped = tl.logit_lens(tl.trace(build_tiny_gemma3(), ids))
    assert uncapped.softcap is None and _max_diff(uncapped.logits[-1], build_tiny_gemma3()(ids).logits) < ATOL


def test_logit_lens_reads_rows_through_the_whole_lm_head_transform():
    """BERT's LM head computes LayerNorm(gelu(dense(x))) before the decoder: the lens applied the LayerNorm alone
    (its last row 0.65 off the model's logits, silently). It reads each row through cls.predictions.transform,
    so the last row is the model's logits; the final-norm scale (a LayerNorm of the final residual) is refused."""
    model = build_tiny_bert_mlm()
    ids = torch.tensor([[2, 5, 7, 9, 3]])
    trace = tl.trace(model, ids)
    lens = tl.logit_lens(trace)
    assert lens.norm == "cls.predictions.transform"
    assert _max_diff(lens.logits[-1], trace.output.logits) < ATOL
    with torch.no_grad():
        by_hand = model.cls.predictions.decoder(model.cls.predictions.transform(trace["blocks.0.resid_post"].out))
    assert _max_diff(lens.logits[1], by_hand) < ATOL
    assert _max_diff(tl.accumulated_resid(trace, apply_ln=True)[1],
                     model.cls.predictions.transform(trace["blocks.0.resid_post"].out).detach()) < ATOL
    with pytest.raises(UnsupportedModelError, match="BertPredictionHeadTransform"):
        tl.accumulated_resid(trace, apply_ln="final_scale")


def test_logit_lens_matches_transformerlens(pair):
    model, hooked, ids = pair
    trace = tl.trace(model, ids)
    with torch.no_grad():
        logits, cache = hooked.run_with_cache(ids)
        want = hooked.unembed(cache.accumulated_resid(apply_ln=True))
    lens = tl.logit_lens(trace)
    assert lens.labels == cache.accumulated_resid(return_labels=True)[1]
    assert _max_diff(lens.logits, want) < ATOL
    assert _max_diff(lens.logits[-1], logits) < ATOL  # the final row is the model's output
    # layers= counts rows like Python: 0 the embeddings, -1 the final residual
    part = tl.logit_lens(trace, layers=[0, -1])
    assert part.layers == [0, tl.arch(model).n_layers] and _max_diff(part.logits, want[[0, -1]]) < ATOL


def test_model_and_inputs_equal_a_trace_and_rows_are_the_block_boundaries(tiny_gpt2):
    model, ids = tiny_gpt2.model, tiny_gpt2.args[0]
    trace = tl.trace(model, ids)
    with torch.no_grad():
        hidden = model(ids, output_hidden_states=True).hidden_states  # embeddings, then each block's output
    stack = tl.accumulated_resid(model, ids)
    assert stack.shape[0] == len(hidden) == tl.arch(model).n_layers + 1
    # transformers applies ln_f to its last hidden state; the rows before it are the raw boundaries
    assert all(torch.equal(stack[i], hidden[i]) for i in range(len(hidden) - 1))
    assert torch.allclose(model.transformer.ln_f(stack[-1]), hidden[-1], atol=1e-6)
    assert torch.equal(tl.logit_lens(model, ids).logits, tl.logit_lens(trace).logits)
    assert torch.equal(tl.accumulated_resid(trace, layers=[-1, 0]), stack[[2, 0]])


def test_bad_inputs_raise_named_errors_and_change_nothing(tiny_gpt2):
    model, ids = tiny_gpt2.model, tiny_gpt2.args[0]
    trace = tl.trace(model, ids)
    before = hook_state(model)
    with pytest.raises(InvalidArgumentError, match="apply_ln"):
        tl.accumulated_resid(trace, apply_ln="ln_final")
    with pytest.raises(InvalidArgumentError, match="pos_slice"):
        tl.accumulated_resid(trace, pos_slice="last")
    # a position outside the prompt is refused, never wrapped to another position (it was: [6] read position 2)
    n = ids.shape[-1]
    for bad in ([n], [-n - 1], [0, n + 3], n, -n - 1):
        with pytest.raises(InvalidArgumentError, match=f"{n} positions"):
            tl.accumulated_resid(trace, pos_slice=bad)
    assert torch.equal(tl.accumulated_resid(trace, pos_slice=[-1, 0]),
                       tl.accumulated_resid(trace)[:, :, [n - 1, 0]])
    assert torch.equal(tl.accumulated_resid(trace, pos_slice=slice(1, n + 5)), tl.accumulated_resid(trace)[:, :, 1:])
    with pytest.raises(InvalidArgumentError, match="takes a trace"):
        tl.accumulated_resid(model)
    with pytest.raises(InvalidArgumentError, match="norm="):
        tl.accumulated_resid(trace, apply_ln=True, norm=5)
    with pytest.raises(UnsupportedModelError, match="LayerNorm and RMSNorm") as unsupported:
        tl.accumulated_resid(trace, apply_ln="final_scale", norm="transformer.h.1.mlp")
    assert "apply_ln=True" in unsupported.value.remedy
    with pytest.raises(SiteNotFoundError, match="3 layer boundaries") as err:
        tl.accumulated_resid(trace, layers=[3])
    assert err.value.length == 3
    assert_model_clean(model, before)
