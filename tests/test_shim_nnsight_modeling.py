"""torchlens_shims.nnsight: rename= aliases, envoys= by alias, model loading steps, per-field batching.

Values are compared with plain ``register_forward_hook`` reads and hook edits of the same
random-weight model (``tiny_gpt2`` from conftest), or with a plain forward of the batch the
invokes should add up to; every bad input raises its named error and leaves the model as it was.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torchlens_shims.nnsight as shim
import transformers
from torchlens_shims.nnsight import errors
from torchlens_shims.nnsight.intervention.aliasing import path_ends_with, spellings
from torchlens_shims.nnsight.intervention.envoy import Envoy
from torchlens_shims.nnsight.intervention.eproperty import eproperty
from torchlens_shims.nnsight.modeling.mixins.meta import MetaDevice

from tests.conftest import edited_forward, hook_reads, hook_state

GPT2_RENAME = {"attn": "self_attn", "attn.c_proj": "attn.o_proj", "mlp.c_proj": "mlp.down_proj", "h.0": "first"}


@pytest.fixture
def gpt2_module(tiny_gpt2):
    return copy.deepcopy(tiny_gpt2.model)


@pytest.fixture
def ids(tiny_gpt2):
    return tiny_gpt2.args[0]


# -- rename= -------------------------------------------------------------------------------------------


def test_dotted_aliases_bind_on_their_prefix_and_serve_the_real_module(gpt2_module, ids):
    model = shim.NNsight(gpt2_module, rename=GPT2_RENAME)
    block = model.transformer.h[0]
    assert block.attn.o_proj is block.attn.c_proj and block.mlp.down_proj is block.mlp.c_proj
    assert block._aliases == {"self_attn": "attn"} and block.attn._aliases == {"o_proj": "c_proj"}
    # a dotted key binds on the envoy it resolves from: `h.0` from `transformer`, not the root
    assert model.transformer.first is block and "first" not in model.__dict__
    with torch.no_grad(), model.trace(ids):
        via_alias = model.transformer.first.self_attn.o_proj.output.save()
        model.transformer.h[1].mlp.down_proj.output[:] = 0
        logits = model.output.logits.save()
    reads, _ = hook_reads(gpt2_module, (ids,))
    assert torch.equal(via_alias, reads["transformer.h.0.attn.c_proj"][0])
    expected = edited_forward(gpt2_module, "transformer.h.1.mlp.c_proj", torch.zeros_like, (ids,))
    assert torch.equal(logits, expected.logits)


def test_spellings_compose_through_ancestors_and_wildcards_match_one_component():
    rename = {"transformer.h": "layers", "attn": "self_attn", "attn.c_proj": "attn.o_proj"}
    found = spellings(rename, "model.transformer.h.0.attn.c_proj")
    assert found[0] == "model.transformer.h.0.attn.c_proj" and len(found) == len(set(found))
    assert sorted(found) == sorted([
        "model.transformer.h.0.attn.c_proj",
        "model.layers.0.attn.c_proj",
        "model.transformer.h.0.self_attn.c_proj",
        "model.layers.0.self_attn.c_proj",
        "model.transformer.h.0.attn.o_proj",
        "model.transformer.h.0.self_attn.o_proj",
        "model.layers.0.attn.o_proj",
        "model.layers.0.self_attn.o_proj",
    ])
    # the root's own name is no part of a key: `model.transformer` names nothing
    assert spellings({"model.transformer": "backbone"}, "model.transformer") == ["model.transformer"]
    assert path_ends_with("model.layers.0", "layers.*") and path_ends_with("model.h.0.mlp", ".mlp")
    assert not path_ends_with("model.layers", "layers.*")
    assert not path_ends_with("model.layers.0.attn", "layers.*")


@pytest.mark.parametrize("rename", [{"attn.c_proj": "mlp.o_proj"}, {"*.h": "*.layers"}])
def test_a_dotted_alias_whose_prefix_is_no_ancestor_raises(gpt2_module, ids, rename):
    before = hook_state(gpt2_module)
    with pytest.raises(errors.RenameError, match="names no ancestor") as raised:
        shim.NNsight(gpt2_module, rename=rename)
    assert isinstance(raised.value, ValueError) and raised.value.remedy
    assert hook_state(gpt2_module) == before
    with torch.no_grad(), shim.NNsight(gpt2_module).trace(ids):  # and it still traces
        pass


# -- envoys= keys written in an alias's spelling -----------------------------------------------------------


class Hidden(Envoy):
    """A block's hidden states (the first element of its output, or the output itself)."""

    @eproperty(key="output")
    def hidden(self, value):
        return value[0] if isinstance(value, tuple) else value


def test_an_envoys_key_in_alias_spelling_picks_the_class_of_the_module_it_names(gpt2_module, ids):
    class Other(Envoy):
        pass

    model = shim.NNsight(
        gpt2_module,
        rename={"transformer.h": "layers", "mlp": "ffn"},
        envoys={"layers.*": Hidden, "ffn": Other, "c_fc": Other, "mlp.c_fc": Envoy},
    )
    assert all(type(block) is Hidden for block in model.layers)
    assert type(model.transformer.h) is Envoy and type(model.transformer.ln_f) is Envoy
    assert type(model.layers[0].ffn) is Other
    # a native match stands over a match through an alias
    assert type(model.layers[0].mlp.c_fc) is Other
    with torch.no_grad(), model.trace(ids):
        hidden = model.layers[1].hidden.save()
    reads, _ = hook_reads(gpt2_module, (ids,))
    block_out = reads["transformer.h.1"][0]
    assert torch.equal(hidden, block_out[0] if isinstance(block_out, tuple) else block_out)


# -- loading steps: _load_meta / _load, dispatch ------------------------------------------------------------


def test_a_subclass_builds_through_its_own_loaders_and_dispatch_keeps_stored_edits(tiny_gpt2, ids):
    weights = copy.deepcopy(tiny_gpt2.model)
    calls = []

    class Offline(shim.TransformersModel):
        def _load_meta(self, repo_id, *args, **kwargs):
            calls.append(("meta", repo_id))
            return transformers.GPT2LMHeadModel(weights.config)

        def _load(self, repo_id, *args, **kwargs):
            calls.append(("load", repo_id))
            return copy.deepcopy(weights)

    model = Offline("local/tiny-gpt2", task="text-generation")
    assert calls == [("meta", "local/tiny-gpt2")] and model.dispatched is False
    assert {p.device.type for p in model._module.parameters()} == {"meta"}
    with model.edit(inplace=True):
        model.transformer.h[0].mlp.output[:] = 0
    with torch.no_grad(), model.trace(ids):
        logits = model.output.logits.save()
    assert calls[-1] == ("load", "local/tiny-gpt2") and model.dispatched is True
    assert model.transformer.h[0]._module is model._module.transformer.h[0]
    assert model.generator.path == "model.generator"
    expected = edited_forward(weights, "transformer.h.0.mlp", torch.zeros_like, (ids,))
    assert torch.equal(logits, expected.logits)


def test_meta_device_puts_new_tensors_on_meta():
    with MetaDevice():
        made = (torch.zeros(2), torch.nn.Linear(2, 2).weight, torch.ones(1, device="cpu"))
    assert all(t.device.type == "meta" for t in made)


def _attention_weights(model, ids):
    with torch.no_grad(), model.trace(ids):
        weights = model.transformer.h[0].attn.output[1].save()
    return weights


def test_the_attention_implementation_switches_and_serves_what_transformers_returns(gpt2_module, ids):
    model = shim.TransformersModel(gpt2_module, task="text-generation")
    assert model.attn_implementation == "sdpa" and _attention_weights(model, ids) is None
    model._remoteable_set_env({"attn_implementation": "eager"})
    assert model.attn_implementation == "eager" and model._remoteable_get_env() == {"attn_implementation": "eager"}
    weights = _attention_weights(model, ids)
    reads, _ = hook_reads(gpt2_module, (ids,))  # the same module, now eager, read with a plain hook
    assert torch.equal(weights, reads["transformer.h.0.attn"][0][1])
    assert torch.allclose(weights.sum(-1), torch.ones(weights.shape[:-1]))
    model._remoteable_set_env({})  # no key: nothing asked, nothing changes
    assert model.attn_implementation == "eager"
    before = hook_state(gpt2_module)
    with pytest.raises(errors.AttentionImplementationError) as raised:
        model.set_attn_implementation("no-such-attention")
    assert raised.value.remedy and model.attn_implementation == "eager"
    assert hook_state(gpt2_module) == before
    model.set_attn_implementation("sdpa")
    assert _attention_weights(model, ids) is None


# -- pretokenized invokes: each field with its rows, padded with its own value ---------------------------------


def _received(model, *invokes):
    with torch.no_grad(), model.trace() as tracer:
        for args, kwargs in invokes:
            with tracer.invoke(*args, **kwargs):
                pass
        with tracer.invoke():
            received = model.inputs[1].save()
            output = model.output.save()
    return received, output


def test_per_example_fields_beside_the_ids_travel_with_their_rows(tiny_gpt2, ids):
    torch.manual_seed(0)
    module = transformers.GPT2ForQuestionAnswering(tiny_gpt2.model.config).eval()
    model = shim.TransformersModel(module, task="question-answering")
    rows = torch.cat([ids, ids.flip(-1)])
    _, output = _received(
        model,
        ((rows[:1],), {"start_positions": torch.tensor([1]), "end_positions": torch.tensor([2])}),
        ((rows[1:],), {"start_positions": torch.tensor([0]), "end_positions": torch.tensor([3])}),
    )
    with torch.no_grad():
        expected = module(input_ids=rows, start_positions=torch.tensor([1, 0]), end_positions=torch.tensor([2, 3]))
    assert torch.equal(output.start_logits, expected.start_logits)
    torch.testing.assert_close(output.loss, expected.loss)


def test_each_field_is_padded_with_its_own_value(gpt2_module):
    model = shim.TransformersModel(gpt2_module, task="text-generation")  # no tokenizer: right padding
    embeds = gpt2_module.get_input_embeddings()(torch.tensor([[2, 5, 6]])).detach() + 1.0
    received, _ = _received(
        model,
        ((), {"inputs_embeds": embeds[:, :1], "special_tokens_mask": [[0]], "global_attention_mask": [[1]]}),
        ((), {"inputs_embeds": embeds, "special_tokens_mask": [[0, 0, 0]], "global_attention_mask": [[1, 1, 1]]}),
    )
    assert torch.equal(received["inputs_embeds"][0, 0], embeds[0, 0]) and not received["inputs_embeds"][0, 1:].any()
    assert received["special_tokens_mask"].tolist() == [[0, 1, 1], [0, 0, 0]]
    assert received["global_attention_mask"].tolist() == [[1, 0, 0], [1, 1, 1]]
    assert received["attention_mask"].tolist() == [[1, 0, 0], [1, 1, 1]]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"labels": torch.tensor([[1, 2, 3, 4]])}, "`labels` has 1 rows, but `input_ids` has 2"),
        ({"token_type_ids": torch.tensor([[0, 1, 1]])}, "`token_type_ids` has 3 positions for a row of 4"),
        ({"position_ids": torch.tensor([[0, 1], [0, 1]])}, "`position_ids` has 2 positions for a row of 4"),
    ],
)
def test_a_field_that_does_not_fit_the_ids_raises_input_field_error(gpt2_module, kwargs, message):
    model = shim.TransformersModel(gpt2_module, task="text-generation")
    rows = torch.tensor([[2, 5, 6, 3], [2, 7, 6, 3]])
    before = hook_state(gpt2_module)
    with pytest.raises(errors.InputFieldError, match=message) as raised:
        with model.trace(rows, **kwargs):
            pass
    assert isinstance(raised.value, ValueError) and raised.value.remedy
    assert hook_state(gpt2_module) == before
    with torch.no_grad(), model.trace(rows):
        logits = model.output.logits.save()
    with torch.no_grad():
        assert torch.equal(logits, gpt2_module(rows).logits)


# -- a custom envoy's view across generation steps --------------------------------------------------------------


class Heads(Envoy):
    """The MLP output split into two heads, ``[batch, heads, seq, head_dim]``; edits go back."""

    @eproperty(key="output")
    def heads(self, value):
        b, s, h = value.shape
        return value.view(b, s, 2, h // 2).transpose(1, 2)

    @heads.transform
    def heads(self, value, raw):
        b, n, s, d = value.shape
        return value.transpose(1, 2).reshape(b, s, n * d)


def test_a_view_is_read_anew_at_every_generation_step(gpt2_module, ids):
    mlp_cls = type(gpt2_module.transformer.h[0].mlp)
    model = shim.TransformersModel(gpt2_module, task="text-generation", envoys={mlp_cls: Heads})
    mlp = model.transformer.h[0].mlp
    options = {"max_new_tokens": 3, "min_new_tokens": 3, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad(), model.generate(ids, **options) as tracer:
        views = shim.save([])
        for _ in tracer.iter[:3]:
            views.append(mlp.heads)
    seen = []
    handle = gpt2_module.transformer.h[0].mlp.register_forward_hook(lambda m, a, out: seen.append(out.clone()))
    try:
        with torch.no_grad():
            gpt2_module.generate(ids, **options)
    finally:
        handle.remove()
    assert [view.shape[2] for view in views] == [ids.shape[1], 1, 1]
    for view, out in zip(views, seen):
        assert torch.equal(view.transpose(1, 2).reshape(out.shape), out)
