"""Text in on the TransformerLens-style workflows, and their bad inputs.

``activation_patching``, ``attribution_patching``, ``causal_trace``, ``logit_lens`` and
``accumulated_resid`` take prompts as strings with ``tokenizer=`` (or the model's ``tokenizer``
attribute), and equal the same calls on the token ids the tokenizer makes; token strings name
positions and subjects. Bad inputs raise named errors and leave the model as it was: text without
a tokenizer, a token string that occurs twice, a site the model's adapter does not have, an answer
id outside the vocabulary.
"""

from __future__ import annotations

import pytest
import torch
from conftest import assert_model_clean, hook_state
from test_adapters import FAMILIES
from test_text_inputs import PROMPT, gpt2_style_tokenizer

import torchlens as tl
from torchlens.errors import AmbiguousTokenError, SiteNotFoundError, TokenizerRequiredError, TokenNotFoundError

CORRUPT = "The city of France is in Paris"
METRIC = tl.patching.logit_diff(4, 7)


@pytest.fixture(scope="module")
def tok():
    return gpt2_style_tokenizer()


def _ids(tok, text: str) -> torch.Tensor:
    return torch.tensor([tok(text)["input_ids"]])


def test_patching_entry_points_take_text_with_tokenizer(tiny_gpt2, tok):
    model = tiny_gpt2.model
    before = hook_state(model)
    clean, corrupt = _ids(tok, PROMPT), _ids(tok, CORRUPT)
    got = tl.patching.activation_patching(PROMPT, CORRUPT, METRIC, model=model, tokenizer=tok,
                                          positions=[" Paris", -1])
    want = tl.patching.activation_patching(clean, corrupt, METRIC, model=model, positions=[3, -1])
    assert got.labels["position"] == [3, 6] and torch.equal(got.values, want.values)
    got = tl.patching.attribution_patching(PROMPT, CORRUPT, METRIC, model=model, tokenizer=tok, site="mlp")
    want = tl.patching.attribution_patching(clean, corrupt, METRIC, model=model, site="mlp")
    assert torch.equal(got.estimate, want.estimate)
    got = tl.patching.causal_trace(model, PROMPT, [" city", " of"], tokenizer=tok, samples=1, kinds=["mlp"])
    want = tl.patching.causal_trace(model, clean, [1, 2], samples=1, kinds=["mlp"])
    assert got["mlp"].notes["subject"] == [1, 2] and torch.equal(got["mlp"].values, want["mlp"].values)
    lens = tl.logit_lens(model, PROMPT, tokenizer=tok)
    assert torch.equal(lens.logits, tl.logit_lens(model, clean).logits)
    assert len(lens.top_tokens()[0]) == clean.shape[1]  # decodes with the tokenizer that tokenized the prompt
    assert tl.logit_lens(tl.trace(model, PROMPT, tokenizer=tok)).tokenizer is tok  # the trace's tokenizer
    assert torch.equal(tl.accumulated_resid(model, [PROMPT, CORRUPT], tokenizer=tok),
                       tl.accumulated_resid(model, torch.cat([clean, corrupt])))
    assert_model_clean(model, before)


def test_causal_trace_takes_the_models_tokenizer_attribute(tiny_gpt2, tok):
    model = tiny_gpt2.model
    model.tokenizer = tok
    try:
        got = tl.patching.causal_trace(model, PROMPT, " Paris", samples=1, kinds=["attn"], layers=[-1])
    finally:
        del model.tokenizer
    want = tl.patching.causal_trace(model, _ids(tok, PROMPT), [3], samples=1, kinds=["attn"], layers=[-1])
    assert torch.equal(got["attn"].values, want["attn"].values)


def test_text_without_a_tokenizer_names_how_to_pass_one(tiny_gpt2):
    model, ids = tiny_gpt2.model, tiny_gpt2.args[0]
    before = hook_state(model)
    for call in (lambda: tl.patching.activation_patching(PROMPT, CORRUPT, METRIC, model=model),
                 lambda: tl.patching.attribution_patching(PROMPT, CORRUPT, METRIC, model=model),
                 lambda: tl.patching.causal_trace(model, PROMPT, [1]),
                 lambda: tl.patching.causal_trace(model, ids, [" city"]),  # a token-string subject
                 lambda: tl.logit_lens(model, PROMPT),
                 lambda: tl.accumulated_resid(model, [PROMPT])):
        with pytest.raises(TokenizerRequiredError) as err:
            call()
        assert "tokenizer=" in err.value.remedy and "model.tokenizer" in err.value.remedy
        assert_model_clean(model, before)


def test_a_token_string_twice_or_absent_is_refused(tiny_gpt2, tok):
    model = tiny_gpt2.model
    before = hook_state(model)
    doubled = "The city of the city"
    with pytest.raises(AmbiguousTokenError, match=r"at positions \[1, 4\]") as err:
        tl.patching.causal_trace(model, doubled, [" city"], tokenizer=tok)
    assert err.value.remedy
    with pytest.raises(AmbiguousTokenError, match=r"at positions \[1, 4\]"):
        tl.patching.activation_patching(doubled, doubled, METRIC, model=model, tokenizer=tok, positions=" city")
    with pytest.raises(TokenNotFoundError, match="' mat' is not a token of the prompt"):
        tl.patching.causal_trace(model, PROMPT, " mat", tokenizer=tok)
    assert_model_clean(model, before)


def test_a_site_the_adapter_lacks_names_the_adapter_and_what_it_has():
    """GPT-NeoX's parallel residual has no resid_mid: every grid refuses it (no empty grid), naming
    the adapter, why, and the sites its blocks have."""
    model = FAMILIES["gpt_neox"].build()
    ids = torch.tensor([[1, 2, 3, 4]])
    before = hook_state(model)
    calls = (lambda: tl.patching.activation_patching(ids, ids, METRIC, model=model, site="resid_mid"),
             lambda: tl.patching.activation_patching(ids, ids, METRIC, model=model, site="resid_mid", layers=[0]),
             lambda: tl.patching.causal_trace(model, ids, [1], kinds=["resid_mid"]))
    for call in calls:
        with pytest.raises(SiteNotFoundError, match="gpt_neox") as err:
            call()
        message = str(err.value)
        assert "no resid_mid site" in message and "parallel" in message
        assert "['attn', 'mlp', 'resid_pre', 'resid_post']" in message and "resid_pre" in err.value.remedy
        assert_model_clean(model, before)


def test_an_answer_outside_the_vocabulary_is_refused(tiny_gpt2):
    model, ids = tiny_gpt2.model, tiny_gpt2.args[0]
    before = hook_state(model)
    vocab = model.config.vocab_size
    for call in (lambda: tl.patching.activation_patching(ids, ids, tl.patching.logit_diff(vocab, 1), model=model),
                 lambda: tl.patching.attribution_patching(ids, ids, tl.patching.logit_diff(1, [vocab]), model=model),
                 lambda: tl.patching.causal_trace(model, ids, [1], answer=vocab)):
        with pytest.raises(tl.errors.InvalidArgumentError, match=f"token id {vocab} is outside the vocabulary") as err:
            call()
        assert f"between 0 and {vocab - 1}" in err.value.remedy
        assert_model_clean(model, before)
