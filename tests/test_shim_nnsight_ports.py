"""Research snippets ported by the one-line import change, run with real nnsight 0.8 and the shim.

Each snippet is one a researcher writes beyond nnsight's own suite (an edit at one generation step,
steering every new token through a persistent edit, batches whose rows stop at different steps,
several return sequences, a cross-prompt patch during generation, an encoder-decoder's encoder edited
while generating) and runs on copies of one random-weight model with both libraries; the values
must agree (``check`` of tests/test_shim_nnsight.py: atol 1e-5, and no hook left behind).
"""

from __future__ import annotations

import torch
from conftest import build_tiny_t5
from test_shim_nnsight import check, gpt2, llama, local_tokenizer


def generating(idiom, make_model=gpt2):
    return check(idiom, make_model=make_model, wrap="TransformersModel", tokenizer=local_tokenizer())


def test_an_edit_at_one_generation_step_only():
    def idiom(nnsight, model):
        with model.generate("The Eiffel Tower", max_new_tokens=4, do_sample=False) as tracer:
            logits = nnsight.save([])
            for step in tracer.iter[:4]:
                if step == 1:
                    model.transformer.h[0].output[:, -1] = 0
                logits.append(model.lm_head.output[0, -1])
            ids = tracer.result.save()
        return logits, ids

    logits, ids = generating(idiom)
    assert len(logits) == 4 and ids.shape[1] == 3 + 4


def test_steering_every_new_token_through_a_persistent_edit():
    def idiom(nnsight, model):
        vector = torch.linspace(-2, 2, 32)
        with model.edit() as (tracer, steered):
            with tracer.iter[1:]:
                steered.transformer.h[1].output[:] += vector
        with steered.generate("The Eiffel Tower", max_new_tokens=4, do_sample=False) as tracer:
            ids = tracer.result.save()
        with model.generate("The Eiffel Tower", max_new_tokens=4, do_sample=False) as tracer:
            plain = tracer.result.save()
        return ids, plain

    ids, plain = generating(idiom)
    assert not torch.equal(ids, plain)  # the edit steered the copy, and only the copy


def test_a_batch_whose_rows_stop_at_different_steps():
    def idiom(nnsight, model):
        with model.generate(max_new_tokens=4, do_sample=False, eos_token_id=7) as tracer:
            with tracer.invoke(["The Eiffel Tower is in", "hello"]):
                logits = nnsight.save([])
                with tracer.all():
                    logits.append(model.lm_head.output[:, -1])
            with tracer.invoke():  # after the unbounded .all(): tracer.result in its own invoke
                ids = tracer.result.save()
        return logits, ids

    logits, ids = generating(idiom)
    assert len(logits) >= 2 and ids.shape[0] == 2


def test_sampled_return_sequences_read_at_every_step():
    def idiom(nnsight, model):
        torch.manual_seed(1)
        with model.generate(max_new_tokens=3, do_sample=True, num_return_sequences=2, top_k=10) as tracer:
            with tracer.invoke("The Eiffel Tower"):
                hidden = nnsight.save([])
                with tracer.all():
                    hidden.append(model.transformer.h[1].output[:, -1])
            with tracer.invoke():
                ids = tracer.result.save()
        return hidden, ids

    hidden, ids = generating(idiom)
    assert ids.shape[0] == 2 and len(hidden) == 3 and hidden[1].shape[0] == 2


def test_a_cross_prompt_patch_during_generation():
    def idiom(nnsight, model):
        with model.generate(max_new_tokens=3, do_sample=False) as tracer:
            barrier = tracer.barrier(2)
            with tracer.invoke("The Eiffel Tower is in"):
                clean = model.transformer.h[0].output[:, -1, :]
                barrier()
            with tracer.invoke("hello world cat dog sat"):
                barrier()
                model.transformer.h[0].output[:, -1, :] = clean
            with tracer.invoke():
                ids = tracer.result.save()
        return ids

    generating(idiom)


def test_steering_a_padded_llama_batch_at_its_last_positions():
    def idiom(nnsight, model):
        with model.generate(max_new_tokens=3, do_sample=False) as tracer:
            with tracer.invoke(["The Eiffel Tower is in", "hello"]):
                hidden = nnsight.save([])
                with tracer.all():
                    model.model.layers[0].output[:, -1] += 2.0
                    hidden.append(model.model.layers[1].output)
            with tracer.invoke():
                ids = tracer.result.save()
        return hidden, ids

    hidden, _ = generating(idiom, make_model=llama)
    assert len(hidden) == 3


def test_an_encoder_edited_while_an_encoder_decoder_generates():
    """nnsight edits T5's encoder inside ``generate`` (it runs once, before the decoder steps)."""
    def idiom(nnsight, model):
        with model.generate(max_new_tokens=3, do_sample=False) as tracer:
            with tracer.invoke("The Eiffel Tower is in"):
                model.encoder.block[1].output[0][:] += 5  # a T5 block returns a tuple
                hidden = nnsight.save([])
                with tracer.all():
                    hidden.append(model.decoder.block[1].output[0])
            with tracer.invoke():
                ids = tracer.result.save()
        return hidden, ids

    hidden, _ = generating(idiom, make_model=build_tiny_t5)
    assert len(hidden) == 3
