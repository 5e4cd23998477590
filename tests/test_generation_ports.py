"""Generation code a researcher ports, checked against a plain ``model.generate`` with forward hooks.

Each test is a snippet the main generation tests do not cover (a batch whose rows stop at different
steps, a fork of a generation asked for its per-step scores), run through ``tl.generate`` and its
forks and compared with the same edit applied by a hook that counts the model's calls.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import assert_model_clean, hook_state, refused

import torchlens as tl
from torchlens.errors import GenerationStrategyError, SiteNotInStepError, ValueNotSavedError

BLOCK = "transformer.h.1"


def hooked(model, vector: torch.Tensor | None, steps: range, seed: int | None = None, **kwargs):
    """``model.generate(**kwargs)`` with ``vector`` added to ``BLOCK``'s output at the model calls in ``steps``."""
    calls = [0]
    handles = [model.register_forward_hook(lambda m, a, k, o: calls.__setitem__(0, calls[0] + 1), with_kwargs=True)]
    if vector is not None:
        handles.append(model.get_submodule(BLOCK).register_forward_hook(
            lambda m, i, o: o + vector if calls[0] in steps else None))
    try:
        if seed is not None:
            torch.manual_seed(seed)
        return model.generate(**kwargs)
    finally:
        for h in handles:
            h.remove()


def vector_for(model, scale: float, seed: int = 3) -> torch.Tensor:
    return torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(seed)) * scale


# Two prompts of the tiny GPT-2. Greedy decoding repeats token 6 on row 0 and token 12 on row 1;
# sampling with seed 1 draws token 14 first on row 0. With that token as eos_token_id, row 0 stops at
# step 0 (then is padded with 0) while row 1 runs on, and a vector of norm 40 added to block 1 at step 2
# changes row 1's text (checked once by hand).
ROWS = torch.tensor([[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]])
ROW_0_STOPS = {"greedy": ({"do_sample": False, "eos_token_id": 6}, None),
               "sampling": ({"do_sample": True, "eos_token_id": 14}, 1)}


@pytest.mark.parametrize("how", list(ROW_0_STOPS))
def test_a_fork_of_a_batch_keeps_a_row_that_already_stopped_padded(tiny_gpt2, how):
    """A row that chose its end-of-sequence token before the edited step stays finished in the fork,
    as in a hooked ``generate``: padded, not decoded again from its last (pad) token."""
    model = tiny_gpt2.model
    options, seed = ROW_0_STOPS[how]
    kwargs = dict(max_new_tokens=8, pad_token_id=0, **options)
    gen = tl.generate(model, ROWS, seed=seed, **kwargs)
    vector = vector_for(model, 40.0)
    want = hooked(model, vector, range(2, 3), seed=seed, input_ids=ROWS, **kwargs)
    assert torch.equal(gen.sequences, hooked(model, None, range(0), seed=seed, input_ids=ROWS, **kwargs))
    assert bool((gen.sequences[0, 7:] == 0).all())  # row 0 stopped at step 0
    before = hook_state(model)
    fork = gen.fork().do(tl.at_step(BLOCK, 2), tl.add(vector))
    assert_model_clean(model, before)
    assert torch.equal(fork.sequences, want), (fork.sequences, want)
    assert not torch.equal(fork.sequences, gen.sequences)  # the edit did change the text
    assert "chose an end-of-sequence token before step 2" in fork.record.how


def test_a_fork_of_a_batch_with_a_stopping_criterion_regenerates_and_says_why(tiny_gpt2):
    """A stopping criterion may end a row on a condition the tokens do not show: the fork regenerates."""
    import transformers

    class StopRow0AtStep1(transformers.StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            done = torch.zeros(input_ids.shape[0], dtype=torch.bool)
            done[0] = input_ids.shape[1] >= ROWS.shape[1] + 2
            return done

    model = tiny_gpt2.model
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0,
                  stopping_criteria=transformers.StoppingCriteriaList([StopRow0AtStep1()]))
    gen = tl.generate(model, ROWS, **kwargs)
    vector = vector_for(model, 40.0)
    fork = gen.fork().do(tl.at_step(BLOCK, 3), tl.add(vector))
    assert torch.equal(fork.sequences, hooked(model, vector, range(3, 4), input_ids=ROWS, **kwargs))
    assert bool((fork.sequences[0, 8:] == 0).all())
    assert "['stopping_criteria'] may have ended a row" in fork.record.how


def test_a_fork_whose_rows_run_on_still_replays_from_the_parent(tiny_gpt2):
    """Without a finished row (no end-of-sequence token chosen) the fork resumes from the parent's cache."""
    model = tiny_gpt2.model
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    gen = tl.generate(model, ROWS, **kwargs)
    vector = vector_for(model, 40.0)
    fork = gen.fork().do(tl.at_step(BLOCK, 2), tl.add(vector))
    assert torch.equal(fork.sequences, hooked(model, vector, range(2, 3), input_ids=ROWS, **kwargs))
    assert fork.record.reused == [0, 1] and fork.record.fallback is None


def test_a_fork_answers_every_steps_scores_and_logits_as_generate_does(tiny_gpt2):
    """``return_dict_in_generate=True``: the fork's output holds one score and one logits row per step,
    those of a hooked ``generate`` (the resumed part and the steps shared with the parent)."""
    model, ids = tiny_gpt2.model, tiny_gpt2.args[0]
    kwargs = dict(max_new_tokens=6, do_sample=False, output_scores=True, output_logits=True,
                  return_dict_in_generate=True)
    gen = tl.generate(model, ids, **kwargs)
    vector = vector_for(model, 40.0)
    want = hooked(model, vector, range(2, 3), input_ids=ids, **kwargs)
    fork = gen.fork().do(tl.at_step(BLOCK, 2), tl.add(vector))
    assert torch.equal(fork.output.sequences, want.sequences)
    for name in ("scores", "logits"):
        got, expected = getattr(fork.output, name), getattr(want, name)
        assert len(got) == len(expected) == 6, name
        for k, (a, b) in enumerate(zip(got, expected)):
            assert torch.allclose(a, b, atol=1e-5, rtol=0), (name, k)
    assert len(gen.output.scores) == 6  # the parent's output is unchanged


def test_a_fork_of_several_return_sequences_equals_a_hooked_generate(tiny_gpt2):
    """``num_return_sequences=3``: the fork resumes the three expanded rows (not 3 x 3 of them)."""
    model, ids = tiny_gpt2.model, tiny_gpt2.args[0]
    kwargs = dict(max_new_tokens=6, do_sample=True, num_return_sequences=3)
    gen = tl.generate(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, seed=1, **kwargs)
    assert gen.sequences.shape == (3, 12)
    vector = vector_for(model, 40.0)
    want = hooked(model, vector, range(2, 3), seed=1, input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs)
    fork = gen.fork().do(tl.at_step(BLOCK, 2), tl.add(vector))
    assert torch.equal(fork.sequences, want)
    assert not torch.equal(fork.sequences, gen.sequences)
    assert fork.record.reused == [0, 1]  # resumed from the parent's cache, not regenerated


@pytest.fixture(scope="module")
def right_padding_tokenizer():
    """A word-level tokenizer of 'w0' .. 'w63' (w0 pads) that pads on the right, a tokenizer's default."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    core = Tokenizer(models.WordLevel({f"w{i}": i for i in range(64)}, unk_token="w0"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=core, pad_token="w0", padding_side="right")


def test_prompts_of_different_lengths_are_left_padded_for_generation(tiny_gpt2, right_padding_tokenizer):
    """A decoder-only model continues each row from its last token: text prompts are padded on the left
    whatever the tokenizer's ``padding_side`` (as nnsight's LanguageModel does), so each row's new tokens
    are those of its prompt generated alone."""
    model, tok = tiny_gpt2.model, right_padding_tokenizer
    prompts = ["w3 w17", "w5 w9 w11 w20 w2"]
    gen = tl.generate(model, prompts, tokenizer=tok, max_new_tokens=4, do_sample=False)
    alone = [model.generate(**tok(p, return_tensors="pt"), max_new_tokens=4, do_sample=False)[0, -4:]
             for p in prompts]
    assert torch.equal(gen.tokens, torch.stack(alone))
    assert tok.padding_side == "right"  # the tokenizer is left as it was
    assert gen.sequences[0, :3].tolist() == [0, 0, 0] and gen.sequences[0, 3:5].tolist() == [3, 17]


# -- an encoder-decoder model: generate runs the encoder once, before step 0 ------------------------------
def encoder_refusal(model, call):
    err = refused(model, call, SiteNotInStepError)
    assert "runs once, before step 0" in err.message and "encoder" in err.message
    assert "encoder_outputs" in err.remedy
    return err


def test_an_encoder_site_of_an_encoder_decoder_is_refused_with_the_way_to_edit_it(tiny_t5):
    """T5's ``generate`` calls the encoder outside the model calls that are steps: an edit, a ``save=``
    or a read of an encoder site names that and how to do it instead (not "the edit never fired")."""
    model, ids = tiny_t5.model, tiny_t5.args[0]
    vector = torch.ones(32)
    encoder_refusal(model, lambda: tl.generate(model, ids, max_new_tokens=2, do_sample=False,
                                               intervene=[("encoder.block.1", tl.add(vector))]))
    encoder_refusal(model, lambda: tl.generate(model, ids, max_new_tokens=2, do_sample=False,
                                               intervene=[(tl.at_step(tl.module("encoder.block.0"), 0),
                                                           tl.add(vector))]))
    encoder_refusal(model, lambda: tl.generate(model, ids, max_new_tokens=2, do_sample=False,
                                               save=["encoder.final_layer_norm"]))
    gen = tl.generate(model, ids, max_new_tokens=2, do_sample=False)
    encoder_refusal(model, lambda: gen.read("encoder.block.0"))
    assert set(gen.read("decoder.block.1")) == {0, 1}  # decoder sites are steps' sites as before


def test_the_remedy_for_an_encoder_edit_equals_a_hooked_generate(tiny_t5):
    """The refusal's remedy: run the encoder with the edit, generate from its output."""
    model, ids = tiny_t5.model, tiny_t5.args[0]
    vector = vector_for(model, 8.0)
    with torch.no_grad():
        encoded = tl.trace(model.get_encoder(), ids, intervene=tl.when("block.1", tl.add(vector))).raw_output
    gen = tl.generate(model, {"input_ids": ids, "encoder_outputs": encoded}, max_new_tokens=4, do_sample=False)
    handle = model.encoder.block[1].register_forward_hook(lambda m, i, o: (o[0] + vector, *o[1:]))
    try:
        want = model.generate(ids, max_new_tokens=4, do_sample=False, output_logits=True,
                              return_dict_in_generate=True)
    finally:
        handle.remove()
    plain = model.generate(ids, max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True)
    assert torch.equal(gen.sequences, want.sequences)
    for k, step in enumerate(gen.steps):
        assert torch.allclose(step.logits, want.logits[k], atol=1e-5, rtol=0), k
    assert not torch.allclose(gen.steps[0].logits, plain.logits[0], atol=1e-3)  # the edit did reach the decoder


# -- decoding options set in a GenerationConfig rather than as keywords -------------------------------------
def test_a_fork_counts_max_new_tokens_of_a_generation_config(tiny_gpt2):
    """``generation_config=GenerationConfig(max_new_tokens=5)``: the fork makes 5 new tokens in all, as a
    hooked generate does (it resumed with 5 more from the edited step)."""
    import transformers

    model, ids = tiny_gpt2.model, tiny_gpt2.args[0]
    config = transformers.GenerationConfig(max_new_tokens=5, do_sample=False)
    gen = tl.generate(model, ids, generation_config=config)
    vector = vector_for(model, 40.0)
    fork = gen.fork().do(tl.at_step(BLOCK, 2), tl.add(vector))
    want = hooked(model, vector, range(2, 3), input_ids=ids, generation_config=config)
    assert want.shape == (1, 11) and torch.equal(fork.sequences, want)
    assert fork.record.reused == [0, 1]


def test_a_fork_regenerates_when_a_generation_config_sets_min_new_tokens(tiny_gpt2):
    """``min_new_tokens`` in the generation config counts from the start of generate, as the keyword does:
    the fork regenerates (resumed, it would let the end-of-sequence token through too early)."""
    import transformers

    model, ids = tiny_gpt2.model, tiny_gpt2.args[0]
    config = transformers.GenerationConfig(max_new_tokens=6, min_new_tokens=5, eos_token_id=22, do_sample=False)
    gen = tl.generate(model, ids, generation_config=config)
    vector = vector_for(model, 40.0)
    fork = gen.fork().do(tl.at_step(BLOCK, 2), tl.add(vector))
    want = hooked(model, vector, range(2, 3), input_ids=ids, generation_config=config)
    assert torch.equal(fork.sequences, want)
    assert "['min_new_tokens'] count from the start of generate" in fork.record.how


def test_a_fork_regenerates_when_tokens_are_suppressed_at_the_beginning(tiny_gpt2):
    """``begin_suppress_tokens`` applies at the first new token only, counted from the start of generate:
    resumed at step 2 it would suppress token 22 there, the token the edit makes the model choose."""
    model, ids = tiny_gpt2.model, tiny_gpt2.args[0]
    kwargs = dict(max_new_tokens=5, do_sample=False, begin_suppress_tokens=[22])
    gen = tl.generate(model, ids, **kwargs)
    vector = vector_for(model, 40.0)
    fork = gen.fork().do(tl.at_step(BLOCK, 2), tl.add(vector))
    want = hooked(model, vector, range(2, 3), input_ids=ids, **kwargs)
    assert want[0, 8] == 22 and torch.equal(fork.sequences, want)


def test_classifier_free_guidance_is_refused_as_two_model_calls_per_token(tiny_gpt2):
    """``guidance_scale=1.5`` runs the model a second time per new token (the unconditional pass inside a
    logits processor): recorded, every other "step" was that pass and ``tl.at_step(site, 1)`` edited it."""
    model, ids = tiny_gpt2.model, tiny_gpt2.args[0]
    err = refused(model, lambda: tl.generate(model, ids, max_new_tokens=3, do_sample=False, guidance_scale=1.5),
                  GenerationStrategyError)
    assert "classifier-free guidance (guidance_scale=1.5)" in err.message and "loop=" in err.remedy
    import transformers

    config = transformers.GenerationConfig(max_new_tokens=3, do_sample=False, guidance_scale=2.0)
    refused(model, lambda: tl.generate(model, ids, generation_config=config), GenerationStrategyError)
    gen = tl.generate(model, ids, max_new_tokens=3, do_sample=False, guidance_scale=1.0)  # 1: no guidance
    assert len(gen.steps) == 3


def test_reading_a_step_that_save_did_not_keep_names_the_site_and_step(tiny_gpt2):
    """``save=tl.at_step(site, 1)`` keeps step 1 only: reading step 2 names the site and step 2, not an op label."""
    model, ids = tiny_gpt2.model, tiny_gpt2.args[0]
    gen = tl.generate(model, ids, max_new_tokens=3, do_sample=False, save=[tl.at_step("transformer.h.0", 1)])
    seen = []
    handle = model.transformer.h[0].register_forward_hook(lambda m, i, o: seen.append(o.detach().clone()))
    try:
        model.generate(ids, max_new_tokens=3, do_sample=False)
    finally:
        handle.remove()
    assert torch.equal(gen.read(tl.at_step("transformer.h.0", 1)), seen[1])
    with pytest.raises(ValueNotSavedError) as err:
        gen.read(tl.at_step("transformer.h.0", 2))
    assert "'transformer.h.0' at step 2 was recorded but not kept" in err.value.message
    assert "tl.at_step(site, 2)" in err.value.remedy


def test_a_tokenizers_batch_encoding_is_a_prompt(tiny_gpt2, right_padding_tokenizer):
    """``tok(prompts, return_tensors="pt", padding=True)`` (a BatchEncoding, a mapping but not a dict) is
    taken as ``{"input_ids": ..., "attention_mask": ...}``, as ``model.generate(**enc)`` and ``tl.trace`` take it."""
    model = tiny_gpt2.model
    tok = copy.deepcopy(right_padding_tokenizer)
    tok.padding_side = "left"
    enc = tok(["w3 w17", "w5 w9 w11 w20 w2"], return_tensors="pt", padding=True)
    assert not isinstance(enc, dict)
    gen = tl.generate(model, enc, max_new_tokens=4, do_sample=False, pad_token_id=0)
    want = model.generate(**enc, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(gen.sequences, want)
    vector = vector_for(model, 40.0)
    fork = gen.fork().do(tl.at_step(BLOCK, 2), tl.add(vector))
    assert torch.equal(fork.sequences, hooked(model, vector, range(2, 3), **enc, max_new_tokens=4, do_sample=False,
                                              pad_token_id=0))
