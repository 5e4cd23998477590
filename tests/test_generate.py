"""``tl.generate``: per-step traces of a real generation, step sites, edits during generation.

References are plain: ``model.generate`` with the same arguments, forward hooks that count the
model's calls (call ``k`` is step ``k``), and hand-written decoding loops.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import SmallMLP, assert_model_clean, hook_state

import torchlens as tl
from torchlens.errors import (
    EmptyGenerationError,
    GenerationStrategyError,
    NoGenerateError,
    PositionNotInStepError,
    SiteNotInStepError,
    StepEditShapeError,
    StepNotFoundError,
    StepSiteOutsideGenerationError,
)

MODELS = {"tiny_gpt2": ("transformer.h.0", "transformer.h.1.mlp", "transformer.ln_f"),
          "tiny_llama": ("model.layers.0", "model.layers.1.self_attn", "model.norm")}


@pytest.fixture(params=list(MODELS))
def lm(request):
    """A tiny causal LM (GPT-2, Llama with rotary and GQA), its prompt and three sites."""
    case = request.getfixturevalue(request.param)
    return case.model, case.args[0], MODELS[request.param]


def hooked_generate(model, address: str, edit: Callable[[Any], Any] | None = None, steps=None, **kwargs):
    """``model.generate`` with a forward hook on ``address`` counting the model's calls: returns the
    generate output and the hook's value at each call (after ``edit``, applied at ``steps``)."""
    module = model.get_submodule(address)
    calls, seen = [0], []

    def count(mod, args, kwargs_, out):
        calls[0] += 1

    def hook(mod, args, out):
        k = calls[0]  # the model's call this module call belongs to (counted as the model returns)
        if edit is not None and (steps is None or k in steps):
            out = edit(out)
        seen.append(out.detach().clone() if isinstance(out, torch.Tensor) else out[0].detach().clone())
        return out

    handles = [module.register_forward_hook(hook), model.register_forward_hook(count, with_kwargs=True)]
    try:
        out = model.generate(**kwargs)
    finally:
        for h in handles:
            h.remove()
    return out, seen


def add_first(vector: torch.Tensor) -> Callable[[Any], Any]:
    """A hook edit adding ``vector`` to a module's output (its first tensor)."""
    def edit(out):
        if isinstance(out, tuple):
            return (out[0] + vector, *out[1:])
        return out + vector
    return edit


# -- step 1: the generation itself ----------------------------------------------------------


@pytest.mark.parametrize("kwargs", [{}, {"cache_implementation": "static"}, {"use_cache": False}],
                         ids=["dynamic_cache", "static_cache", "no_cache"])
def test_tokens_equal_plain_generate_and_model_is_left_clean(lm, kwargs):
    model, ids, _ = lm
    want = model.generate(ids, max_new_tokens=6, do_sample=False, **kwargs)
    before = hook_state(model)
    gen = tl.generate(model, ids, max_new_tokens=6, do_sample=False, **kwargs)
    assert_model_clean(model, before)
    assert torch.equal(gen.sequences, want)
    assert torch.equal(gen.tokens, want[:, ids.shape[1]:])
    assert len(gen.steps) == 6 and len(gen) == 6
    for k, step in enumerate(gen.steps):
        assert torch.equal(step.token, want[:, ids.shape[1] + k])
    p = ids.shape[1]
    if kwargs.get("use_cache", True):
        assert [s.positions for s in gen.steps] == [range(0, p)] + [range(p + k - 1, p + k) for k in range(1, 6)]
    else:
        assert [s.positions for s in gen.steps] == [range(0, p + k) for k in range(6)]


def test_step_logits_equal_generates_raw_logits(lm):
    model, ids, _ = lm
    want = model.generate(ids, max_new_tokens=5, do_sample=False, output_logits=True, return_dict_in_generate=True)
    gen = tl.generate(model, ids, max_new_tokens=5, do_sample=False)
    for k, step in enumerate(gen.steps):
        assert torch.allclose(step.logits.float(), want.logits[k], atol=1e-6, rtol=0)
        assert torch.equal(step.token, step.logits.argmax(-1))


def test_seeded_sampling_reproduces_generate_with_the_same_seed(lm):
    model, ids, _ = lm
    torch.manual_seed(7)
    want = model.generate(ids, max_new_tokens=6, do_sample=True, top_k=0)
    state = torch.get_rng_state()
    gen = tl.generate(model, ids, max_new_tokens=6, do_sample=True, top_k=0, seed=7)
    assert torch.equal(gen.sequences, want)
    assert torch.equal(torch.get_rng_state(), state), "seed= must leave the global RNG as it was"
    torch.manual_seed(7)
    again = tl.generate(model, ids, max_new_tokens=6, do_sample=True, top_k=0)  # seeded by the caller
    assert torch.equal(again.sequences, want)


def test_a_step_is_a_trace_with_ops_module_calls_and_sites(tiny_gpt2):
    model, ids = tiny_gpt2.model, tiny_gpt2.args[0]
    gen = tl.generate(model, ids, max_new_tokens=3, do_sample=False)
    step = gen.steps[2]
    assert isinstance(step.trace, tl.Trace)
    assert "transformer.h.0" in step.modules.addresses
    assert any(op.func_name == "linear" or op.func_name == "addmm" for op in step.ops)
    assert step["transformer.h.0"].out.shape == (1, 1, 32)
    assert gen.steps[-1] is gen.steps[2]
    assert "positions 7..7" in repr(step)  # prompt 6 tokens: step 2 reads position 6 + 2 - 1


def test_text_with_a_tokenizer(tiny_llama, word_tokenizer):
    model = tiny_llama.model
    prompt = "w3 w17 w42 w9"
    gen = tl.generate(model, prompt, tokenizer=word_tokenizer, max_new_tokens=4, do_sample=False)
    ids = word_tokenizer(prompt, return_tensors="pt")
    want = model.generate(**ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(gen.sequences, want)
    assert gen.text == word_tokenizer.batch_decode(want, skip_special_tokens=True)
    assert gen.prompt_length == 4


@pytest.fixture(scope="module")
def word_tokenizer():
    """A word-level tokenizer of 'w0' .. 'w127' (built in memory: no download)."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    core = Tokenizer(models.WordLevel({f"w{i}": i for i in range(128)}, unk_token="w0"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=core)


# -- a hand-written decoding loop ------------------------------------------------------------


def greedy_loop(n_new: int, cached: bool = True) -> Callable[[Any, torch.Tensor], torch.Tensor]:
    """A greedy decoding loop: ``n_new`` model calls, each choosing one token."""
    def loop(model, ids):
        seq, cache, step_in = ids, None, ids
        for _ in range(n_new):
            out = model(input_ids=step_in, cache=cache, use_cache=cached)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
            cache, step_in = (out.cache, nxt) if cached else (None, seq)
        return seq
    return loop


@pytest.mark.parametrize("cached", [True, False], ids=["kv_cache", "no_cache"])
def test_a_hand_written_loop_is_recorded_step_by_step(lm, cached):
    model, ids, sites = lm
    loop = greedy_loop(5, cached)
    seen = []
    handle = model.get_submodule(sites[0]).register_forward_hook(lambda m, i, o: seen.append(o.detach().clone()))
    try:
        with torch.no_grad():
            want = loop(model, ids)
    finally:
        handle.remove()
    before = hook_state(model)
    gen = tl.generate(model, ids, loop=loop)
    assert_model_clean(model, before)
    assert torch.equal(gen.sequences, want) and len(gen.steps) == 5
    got = gen.read(sites[0])
    assert sorted(got) == list(range(5))
    for k in range(5):
        assert torch.equal(got[k], seen[k])
    p = ids.shape[1]
    assert gen.steps[3].positions == (range(p + 2, p + 3) if cached else range(0, p + 3))


# -- step 2: sites that address steps --------------------------------------------------------


def test_reads_at_every_step_equal_call_counting_hooks(lm):
    model, ids, sites = lm
    gen = tl.generate(model, ids, max_new_tokens=6, do_sample=False)
    for site in sites:
        _, seen = hooked_generate(model, site, input_ids=ids, max_new_tokens=6, do_sample=False)
        got = gen.read(site)
        first = {k: v if isinstance(v, torch.Tensor) else v[0] for k, v in got.items()}
        assert sorted(first) == list(range(6)) and len(seen) == 6
        for k in range(6):
            assert torch.equal(first[k], seen[k]), (site, k)
        one = gen[tl.at_step(site, 4)]  # gen[...] is gen.read(...)
        assert torch.equal(one if isinstance(one, torch.Tensor) else one[0], seen[4])


def test_at_step_reads_one_step_a_range_and_an_open_range(tiny_llama):
    model, ids = tiny_llama.model, tiny_llama.args[0]
    site = "model.layers.1"
    gen = tl.generate(model, ids, max_new_tokens=6, do_sample=False)
    _, seen = hooked_generate(model, site, input_ids=ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(gen.read(tl.at_step(site, 2)), seen[2])
    assert sorted(gen.read(tl.at_step(site, range(1, 4)))) == [1, 2, 3]
    assert sorted(gen.read(tl.at_step(site, slice(3, None)))) == [3, 4, 5]
    assert sorted(gen.read(tl.at_step(site, [0, 5]))) == [0, 5]
    assert torch.equal(gen.read(tl.at_step(site, -1)), seen[5])


def test_block_output_at_an_absolute_position(lm):
    model, ids, sites = lm
    p = ids.shape[1]
    gen = tl.generate(model, ids, max_new_tokens=5, do_sample=False)
    _, seen = hooked_generate(model, sites[0], input_ids=ids, max_new_tokens=5, do_sample=False)
    # position 2 is a prompt token (step 0, row 2); position p + 2 the token chosen at step 2, read at step 3
    assert torch.equal(gen.read(tl.at_step(sites[0], 0), position=2), seen[0][:, 2])
    assert torch.equal(gen.read(tl.at_step(sites[0], 3), position=p + 2), seen[3][:, 0])
    assert list(gen.read(sites[0], position=p + 2)) == [3]  # only step 3 computed it
    assert gen.steps_computing(p + 2) == [3]
    with pytest.raises(PositionNotInStepError, match="computed at step"):
        gen.read(tl.at_step(sites[0], 1), position=p + 2)


def test_a_step_site_outside_a_generation_is_refused(tiny_gpt2):
    model, ids = tiny_gpt2.model, tiny_gpt2.args[0]
    before = hook_state(model)
    with pytest.raises(StepSiteOutsideGenerationError):
        tl.trace(model, ids, intervene=tl.when(tl.at_step("transformer.h.0", 1), tl.zero_ablate()))
    assert_model_clean(model, before)


# -- step 3: edits during generation ---------------------------------------------------------


@pytest.mark.parametrize("steps", [None, 2, range(1, 4), slice(1, None)], ids=["every", "step2", "range", "open"])
def test_edits_at_steps_equal_a_call_counting_hook(lm, steps):
    model, ids, sites = lm
    d = model.config.hidden_size
    vector = torch.randn(d, generator=torch.Generator().manual_seed(3)) * 4
    site = sites[0]
    when = None if steps is None else (range(steps, steps + 1) if isinstance(steps, int) else
                                       range(steps.start, 99) if isinstance(steps, slice) else steps)
    want, seen = hooked_generate(model, site, add_first(vector), when, input_ids=ids, max_new_tokens=6,
                                 do_sample=False, output_logits=True, return_dict_in_generate=True)
    plain = model.generate(ids, max_new_tokens=6, do_sample=False)
    before = hook_state(model)
    target = site if steps is None else tl.at_step(site, steps)
    gen = tl.generate(model, ids, max_new_tokens=6, do_sample=False, intervene=[(target, tl.add(vector))])
    assert_model_clean(model, before)
    assert torch.equal(gen.sequences, want.sequences)
    for k, step in enumerate(gen.steps):
        assert torch.allclose(step.logits.float(), want.logits[k], atol=1e-6, rtol=0), k
        assert torch.allclose(gen.read(tl.at_step(site, k)), seen[k], atol=1e-6, rtol=0)
    if steps is None:  # the steering changed the text: the comparison is not vacuous
        assert not torch.equal(gen.sequences, plain)


def test_a_when_step_and_a_function_edit_at_one_step(tiny_gpt2):
    model, ids = tiny_gpt2.model, tiny_gpt2.args[0]
    site = "transformer.h.1"
    hook_edit = add_first(torch.full((32,), 2.0))
    want, _ = hooked_generate(model, site, hook_edit, range(3, 4), input_ids=ids, max_new_tokens=5,
                              do_sample=False, output_logits=True, return_dict_in_generate=True)
    gen = tl.generate(model, ids, max_new_tokens=5, do_sample=False,
                      intervene=tl.when(tl.at_step(site, 3), lambda act, *, ctx: hook_edit(act)))
    assert torch.equal(gen.sequences, want.sequences)
    for k in range(5):
        assert torch.allclose(gen.steps[k].logits, want.logits[k], atol=1e-6, rtol=0)
    assert gen.steps[3].trace.edits and not gen.steps[2].trace.edits


def test_a_function_edit_is_told_its_step(lm):
    """``ctx.step`` is the generation step an edit runs in (the model's call index a counting hook sees),
    at every step, in a fork's resumed steps too; a helper keeps its own type."""
    model, ids, sites = lm
    site = sites[0]
    vector = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(5))
    seen: list[int | None] = []

    def by_step(act, *, ctx):
        seen.append(ctx.step)
        return add_first(vector * (ctx.step + 1))(act)

    calls = [0]

    def hook(mod, args, out):
        return add_first(vector * (calls[0] + 1))(out)

    handles = [model.get_submodule(site).register_forward_hook(hook),
               model.register_forward_hook(lambda m, a, k, o: calls.__setitem__(0, calls[0] + 1), with_kwargs=True)]
    try:
        want = model.generate(ids, max_new_tokens=5, do_sample=False, output_logits=True, return_dict_in_generate=True)
    finally:
        for h in handles:
            h.remove()
    gen = tl.generate(model, ids, max_new_tokens=5, do_sample=False, intervene=tl.when(site, by_step))
    assert seen == [0, 1, 2, 3, 4]
    assert torch.equal(gen.sequences, want.sequences)
    for k in range(5):
        assert torch.allclose(gen.steps[k].logits, want.logits[k], atol=1e-6, rtol=0), k
    seen.clear()
    fork = gen.fork().do(tl.at_step(site, 3), lambda act, *, ctx: seen.append(("fork", ctx.step)) or act * 1.5)
    assert ("fork", 3) in seen and all(s in (3, 4, ("fork", 3)) for s in seen)  # the resumed steps only
    assert fork.record.edited == [3, 4]  # (the parent's every-step edit applies at 4 as well)
    seen.clear()
    trace = tl.trace(model, ids, intervene=tl.when(site, lambda act, *, ctx: seen.append(ctx.step) or act))
    assert seen == [None] and trace.edits  # outside a generation: no step


def test_seeded_sampling_with_a_steering_vector_equals_the_hooked_run(tiny_llama):
    model, ids = tiny_llama.model, tiny_llama.args[0]
    vector = torch.randn(64, generator=torch.Generator().manual_seed(5)) * 3
    torch.manual_seed(11)
    want, _ = hooked_generate(model, "model.layers.0", add_first(vector), None, input_ids=ids, max_new_tokens=6,
                              do_sample=True)
    gen = tl.generate(model, ids, max_new_tokens=6, do_sample=True, seed=11,
                      intervene=[("model.layers.0", tl.add(vector))])
    assert torch.equal(gen.sequences, want)


# -- bad input: typed errors, the model left as it was ----------------------------------------


def test_a_step_beyond_the_generation_says_how_many_steps(tiny_gpt2):
    model, ids = tiny_gpt2.model, tiny_gpt2.args[0]
    gen = tl.generate(model, ids, max_new_tokens=3, do_sample=False)
    with pytest.raises(StepNotFoundError, match="3 step") as err:
        gen.steps[3]
    assert err.value.n_steps == 3 and err.value.remedy
    with pytest.raises(StepNotFoundError, match="3 step"):
        gen.read(tl.at_step("transformer.h.0", 5))
    with pytest.raises(StepNotFoundError):
        gen.read(tl.at_step("transformer.h.0", range(1, 6)))
    before = hook_state(model)
    with pytest.raises(StepNotFoundError, match="at most 3 step"):
        tl.generate(model, ids, max_new_tokens=3, intervene=[(tl.at_step("transformer.h.0", 4), tl.zero_ablate())])
    assert_model_clean(model, before)


def test_max_new_tokens_zero_is_refused(tiny_gpt2):
    model, ids = tiny_gpt2.model, tiny_gpt2.args[0]
    before = hook_state(model)
    with pytest.raises(EmptyGenerationError, match="max_new_tokens=0") as err:
        tl.generate(model, ids, max_new_tokens=0)
    assert err.value.remedy
    assert_model_clean(model, before)


def test_a_model_without_generate_needs_a_loop(mlp_input):
    model = SmallMLP().eval()
    before = hook_state(model)
    with pytest.raises(NoGenerateError, match="no generate") as err:
        tl.generate(model, mlp_input)
    assert "loop=" in err.value.remedy
    assert_model_clean(model, before)


def test_a_loop_that_never_calls_the_model_is_refused(tiny_gpt2):
    model, ids = tiny_gpt2.model, tiny_gpt2.args[0]
    with pytest.raises(EmptyGenerationError, match="never called"):
        tl.generate(model, ids, loop=lambda m, x: x)


@pytest.mark.parametrize("kwargs", [{"num_beams": 2}, {"num_beams": 2, "do_sample": True},
                                    {"penalty_alpha": 0.6, "top_k": 4}], ids=["beam", "beam_sample", "contrastive"])
def test_beam_search_and_other_strategies_are_refused_by_name(tiny_gpt2, kwargs):
    model, ids = tiny_gpt2.model, tiny_gpt2.args[0]
    before = hook_state(model)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    config = model.generation_config.to_dict()
    with pytest.raises(GenerationStrategyError, match="greedy decoding and sampling") as err:
        tl.generate(model, ids, max_new_tokens=3, **kwargs)
    # the error names the strategy it refused and the remedy what is supported
    mode = "beam" if "num_beams" in kwargs else "contrastive"
    assert mode in err.value.mode and mode in str(err.value)
    assert "loop=" in err.value.remedy and "greedy" in err.value.remedy and "sampling" in err.value.remedy
    assert_model_clean(model, before)
    assert model.generation_config.to_dict() == config
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())
    # and the model still generates as before, with a supported strategy
    assert torch.equal(tl.generate(model, ids, max_new_tokens=3, do_sample=False).sequences,
                       model.generate(ids, max_new_tokens=3, do_sample=False))


def test_an_edit_that_fits_the_prompt_pass_only_names_the_step_and_shapes(tiny_gpt2):
    model, ids = tiny_gpt2.model, tiny_gpt2.args[0]
    before = hook_state(model)
    prompt_shaped = torch.zeros(1, ids.shape[1], 32)
    with pytest.raises(StepEditShapeError, match=r"at step 1 \(1 position") as err:
        tl.generate(model, ids, max_new_tokens=3, intervene=[("transformer.h.0", prompt_shaped)])
    assert err.value.step == 1 and err.value.activation_shape == (1, 1, 32)
    assert isinstance(err.value, tl.EditShapeError)
    assert_model_clean(model, before)
    ok = tl.generate(model, ids, max_new_tokens=3, intervene=[(tl.at_step("transformer.h.0", 0), prompt_shaped)])
    assert len(ok.steps) == 3


def test_an_interrupt_mid_generation_leaves_the_model_clean(tiny_gpt2):
    model, ids = tiny_gpt2.model, tiny_gpt2.args[0]
    calls = [0]

    def interrupted(model, ids):
        for _ in range(5):
            model(input_ids=ids)
            calls[0] += 1
            if calls[0] == 2:
                raise KeyboardInterrupt
        return ids

    before = hook_state(model)
    with pytest.raises(KeyboardInterrupt):
        tl.generate(model, ids, loop=interrupted)
    assert_model_clean(model, before)
    assert calls[0] == 2


def test_a_hook_on_the_model_itself_fires_once_per_step(tiny_gpt2):
    model, ids = tiny_gpt2.model, tiny_gpt2.args[0]
    calls = []
    handle = model.register_forward_hook(lambda m, a, kw, o: calls.append(kw["input_ids"].shape[1]), with_kwargs=True)
    try:
        before = hook_state(model)
        tl.generate(model, ids, max_new_tokens=4, do_sample=False)
        assert_model_clean(model, before)
    finally:
        handle.remove()
    assert calls == [ids.shape[1], 1, 1, 1]


# -- step 4: save= bounds what a long generation keeps ---------------------------------------


def test_save_keeps_only_the_requested_site_at_every_step(lm):
    model, ids, sites = lm
    gen = tl.generate(model, ids, max_new_tokens=6, do_sample=False, save=sites[0])
    full = tl.generate(model, ids, max_new_tokens=6, do_sample=False)
    _, seen = hooked_generate(model, sites[0], input_ids=ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(gen.sequences, full.sequences)
    for k, step in enumerate(gen.steps):
        call = step.trace.module_call(sites[0])
        produced = {step.trace.ops[r.index].label for r in call.out_refs if r is not None}
        kept = {op.label for op in step.trace.ops if op.saved and not op.is_input}
        assert kept == produced, k
        assert len(step.trace.ops) == len(full.steps[k].trace.ops)  # the graph is still recorded
        assert torch.equal(gen.read(tl.at_step(sites[0], k)), seen[k])
    other = next(op for op in gen.steps[1].trace.ops if not op.saved)
    with pytest.raises(tl.errors.ValueNotSavedError):
        _ = other.out


def test_module_reads_with_a_module_engine_keep_no_op_graph(lm):
    model, ids, sites = lm
    vector = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    want, seen = hooked_generate(model, sites[0], add_first(vector), range(2, 99), input_ids=ids, max_new_tokens=5,
                                 do_sample=False, output_logits=True, return_dict_in_generate=True)
    gen = tl.generate(model, ids, max_new_tokens=5, do_sample=False, save=[sites[0]], backend="hooks",
                      intervene=[(tl.at_step(sites[0], slice(2, None)), tl.add(vector))])
    assert torch.equal(gen.sequences, want.sequences)
    for k, step in enumerate(gen.steps):
        assert len(step.trace.ops) == 0
        assert torch.allclose(gen.read(tl.at_step(sites[0], k)), seen[k], atol=1e-6, rtol=0)
        assert torch.allclose(step.logits.float(), want.logits[k], atol=1e-6, rtol=0)


def test_save_at_steps_keeps_the_site_at_those_steps_only(lm):
    model, ids, sites = lm
    gen = tl.generate(model, ids, max_new_tokens=6, do_sample=False,
                      save=[tl.at_step(sites[0], [1, 4]), tl.at_step(sites[1], slice(3, None))])
    _, seen = hooked_generate(model, sites[0], input_ids=ids, max_new_tokens=6, do_sample=False)
    _, seen_inner = hooked_generate(model, sites[1], input_ids=ids, max_new_tokens=6, do_sample=False)
    for k, step in enumerate(gen.steps):
        kept = {op.label for op in step.trace.ops if op.saved and not op.is_input}
        want = set()
        for site, steps in ((sites[0], (1, 4)), (sites[1], range(3, 6))):
            if k in steps:
                call = step.trace.module_call(site)
                want |= {step.trace.ops[r.index].label for r in call.out_refs if r is not None}
        assert kept == want, k
    assert torch.equal(gen.read(tl.at_step(sites[0], 4)), seen[4])
    inner = gen.read(tl.at_step(sites[1], 5))  # a module returning a tuple (attention: output, weights)
    assert torch.equal(inner[0] if isinstance(inner, tuple) else inner, seen_inner[5])
    with pytest.raises(tl.errors.ValueNotSavedError):
        gen.read(tl.at_step(sites[0], 2))


def test_save_at_a_step_from_the_end_or_beyond_the_steps_is_refused(tiny_gpt2):
    model, ids = tiny_gpt2.model, tiny_gpt2.args[0]
    before = hook_state(model)
    with pytest.raises(tl.errors.InvalidArgumentError, match="count from 0"):
        tl.generate(model, ids, max_new_tokens=2, save=tl.at_step("transformer.h.0", -1))
    with pytest.raises(StepNotFoundError, match="at most 2 step"):
        tl.generate(model, ids, max_new_tokens=2, save=tl.at_step("transformer.h.0", 5))
    assert_model_clean(model, before)


@pytest.mark.parametrize("cached", [True, False], ids=["kv_cache", "no_cache"])
def test_an_edit_at_an_absolute_position_applies_where_that_position_is_computed(tiny_gpt2, cached):
    model, ids = tiny_gpt2.model, tiny_gpt2.args[0]
    vector = torch.full((32,), 3.0)
    p = ids.shape[1] + 2  # the token chosen at step 2, computed at step 3 with a cache
    gen = tl.generate(model, ids, max_new_tokens=6, do_sample=False, use_cache=cached,
                      intervene=[("transformer.h.1", tl.add(vector, positions=[p]))])
    calls, starts = [0], []

    def count(m, a, k, o):
        calls[0] += 1

    def pre(m, a, k):
        cache = k.get("cache", k.get("past_key_values"))
        starts.append(cache.get_seq_length() if cached and cache is not None else 0)

    def edit(m, i, o):
        row = p - starts[-1]
        if 0 <= row < o.shape[1]:
            o = o.clone()
            o[:, row] += vector
            return o
        return None

    handles = [model.register_forward_pre_hook(pre, with_kwargs=True),
               model.register_forward_hook(count, with_kwargs=True),
               model.transformer.h[1].register_forward_hook(edit)]
    try:
        want = model.generate(ids, max_new_tokens=6, do_sample=False, use_cache=cached)
    finally:
        for h in handles:
            h.remove()
    assert torch.equal(gen.sequences, want)
    edited = [k for k, step in enumerate(gen.steps) if step.trace.edits]
    assert edited == ([3] if cached else [3, 4, 5])  # with a cache one step computes p; without, every later one


# -- step 5: a fork of a step-k edit, replayed (test_generate_replay.py) -----------------------------------------


def hooked_edits(model, edits: dict[str, tuple[Callable[[Any], Any], range]], **kwargs):
    """``model.generate`` with forward hooks editing each ``address`` at the model calls in its range."""
    calls = [0]
    handles = [model.register_forward_hook(lambda m, a, k, o: calls.__setitem__(0, calls[0] + 1), with_kwargs=True)]
    for address, (edit, steps) in edits.items():
        handles.append(model.get_submodule(address).register_forward_hook(
            lambda m, i, o, edit=edit, steps=steps: edit(o) if calls[0] in steps else None))
    try:
        return model.generate(**kwargs)
    finally:
        for h in handles:
            h.remove()


@pytest.mark.parametrize("cache", [{}, {"cache_implementation": "static"}], ids=["dynamic_cache", "static_cache"])
def test_a_fork_of_a_step_k_edit_resumes_from_the_cache_and_equals_a_hooked_generate(lm, cache):
    model, ids, sites = lm
    vector = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(3)) * 4
    gen = tl.generate(model, ids, max_new_tokens=8, do_sample=False, **cache)
    parent_tokens, parent_read = gen.sequences.clone(), gen.read(tl.at_step(sites[0], 5))
    want = hooked_edits(model, {sites[0]: (add_first(vector), range(3, 4))}, input_ids=ids, max_new_tokens=8,
                        do_sample=False, output_logits=True, return_dict_in_generate=True, **cache)
    before = hook_state(model)
    fork = gen.fork().do(tl.at_step(sites[0], 3), tl.add(vector))
    assert_model_clean(model, before)
    assert torch.equal(fork.sequences, want.sequences)
    assert not torch.equal(fork.sequences, gen.sequences)  # the edit changed the text
    for k, step in enumerate(fork.steps):
        assert torch.allclose(step.logits.float(), want.logits[k], atol=1e-6, rtol=0), k
    p = ids.shape[1]
    assert [s.positions for s in fork.steps] == [range(0, p)] + [range(p + k - 1, p + k) for k in range(1, 8)]
    record = fork.record
    assert record.reused == [0, 1, 2] and record.edited == [3] and record.fallback is None
    assert sorted(record.replayed + record.regenerated) == [4, 5, 6, 7]
    assert record.how.startswith("replayed from step 3")
    differs = (want.sequences != gen.sequences)[0].nonzero()[0].item()
    assert record.diverged_at == differs and record.diverged_step == differs - p
    assert fork.steps[1].trace is gen.steps[1].trace  # shared, not re-run
    assert torch.equal(gen.sequences, parent_tokens)  # the parent is unchanged
    assert torch.equal(gen.read(tl.at_step(sites[0], 5)), parent_read)


def test_a_fork_that_keeps_every_token_says_the_text_did_not_diverge(tiny_llama):
    model, ids = tiny_llama.model, tiny_llama.args[0]
    gen = tl.generate(model, ids, max_new_tokens=6, do_sample=False)
    small = torch.full((64,), 1e-3)
    fork = gen.fork().do(tl.at_step("model.layers.1", 2), tl.add(small))
    want = hooked_edits(model, {"model.layers.1": (add_first(small), range(2, 3))}, input_ids=ids, max_new_tokens=6,
                        do_sample=False, output_logits=True, return_dict_in_generate=True)
    assert torch.equal(fork.sequences, gen.sequences) and torch.equal(fork.sequences, want.sequences)
    assert fork.record.diverged_at is None and fork.record.edited == [2] and fork.record.replayed == [3, 4, 5]
    assert fork.record.regenerated == []
    assert not torch.equal(fork.steps[2].logits, gen.steps[2].logits)  # the edit did land
    for k, step in enumerate(fork.steps):
        assert torch.allclose(step.logits, want.logits[k], atol=1e-6, rtol=0)


def test_a_fork_of_a_seeded_sampling_redraws_as_the_hooked_run_with_the_same_seed(lm):
    model, ids, sites = lm
    vector = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(4)) * 4
    gen = tl.generate(model, ids, max_new_tokens=7, do_sample=True, top_k=0, seed=5)
    fork = gen.fork().do(tl.at_step(sites[0], 4), tl.add(vector))
    torch.manual_seed(5)
    want = hooked_edits(model, {sites[0]: (add_first(vector), range(4, 5))}, input_ids=ids, max_new_tokens=7,
                        do_sample=True, top_k=0)
    assert torch.equal(fork.sequences, want)
    assert torch.equal(fork.sequences[:, :ids.shape[1] + 4], gen.sequences[:, :ids.shape[1] + 4])
    assert fork.record.how.startswith("replayed from step 4")


def test_forks_chain_and_an_every_step_edit_regenerates_from_the_prompt(tiny_gpt2):
    model, ids = tiny_gpt2.model, tiny_gpt2.args[0]
    gen = tl.generate(model, ids, max_new_tokens=6, do_sample=False)
    a, b = torch.full((32,), 3.0), torch.full((32,), -2.0)
    fork = gen.fork().do(tl.at_step("transformer.h.1", range(2, 4)), tl.add(a)).do("transformer.h.0", tl.add(b))
    want = hooked_edits(model, {"transformer.h.1": (add_first(a), range(2, 4)), "transformer.h.0": (add_first(b),
                                range(0, 99))}, input_ids=ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(fork.sequences, want)
    # an edit at every step: each step is captured with it (from the prompt), none can be replayed
    assert fork.record.reused == [] and fork.record.replayed == []
    assert sorted(fork.record.edited + fork.record.regenerated) == list(range(6))
    assert len(fork.edits) == 2 and len(gen.edits) == 0


def test_a_fork_of_a_loop_regenerates_from_the_prompt(tiny_gpt2):
    model, ids = tiny_gpt2.model, tiny_gpt2.args[0]
    loop = greedy_loop(5)
    gen = tl.generate(model, ids, loop=loop)
    vector = torch.full((32,), 5.0)
    fork = gen.fork().do(tl.at_step("transformer.h.1", 2), tl.add(vector))
    calls = [0]
    handles = [model.register_forward_hook(lambda m, a, k, o: calls.__setitem__(0, calls[0] + 1), with_kwargs=True),
               model.transformer.h[1].register_forward_hook(lambda m, i, o: o + vector if calls[0] == 2 else None)]
    try:
        with torch.no_grad():
            want = loop(model, ids)
    finally:
        for h in handles:
            h.remove()
    assert torch.equal(fork.sequences, want)
    assert fork.record.how == "regenerated from the prompt: a decoding loop runs from its inputs"
    assert fork.record.regenerated == [0, 1, 2, 3, 4]


def test_a_fork_edit_beyond_the_steps_is_refused(tiny_gpt2):
    model, ids = tiny_gpt2.model, tiny_gpt2.args[0]
    gen = tl.generate(model, ids, max_new_tokens=3, do_sample=False)
    before = hook_state(model)
    with pytest.raises(StepNotFoundError, match="3 step"):
        gen.fork().do(tl.at_step("transformer.h.0", 5), tl.zero_ablate())
    assert_model_clean(model, before)


# -- patching across generations ---------------------------------------------------------------


def test_patch_from_a_generation_reads_the_same_step_of_it(tiny_llama):
    model, clean_ids = tiny_llama.model, tiny_llama.args[0]
    corrupt_ids = clean_ids.clone()
    corrupt_ids[0, 2] = 11
    site = "model.layers.0"
    clean = tl.generate(model, clean_ids, max_new_tokens=6, do_sample=False)
    corrupt = tl.generate(model, corrupt_ids, max_new_tokens=6, do_sample=False)
    _, clean_seen = hooked_generate(model, site, input_ids=clean_ids, max_new_tokens=6, do_sample=False)
    want = hooked_edits(model, {site: (lambda out: clean_seen[3].clone(), range(3, 4))}, input_ids=corrupt_ids,
                        max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True)
    fork = corrupt.fork().do(tl.at_step(site, 3), tl.patch_from(clean))
    assert torch.equal(fork.sequences, want.sequences)
    assert torch.equal(fork.read(tl.at_step(site, 3)), clean_seen[3])
    for k, step in enumerate(fork.steps):
        assert torch.allclose(step.logits, want.logits[k], atol=1e-6, rtol=0)
    # the last block patched at every step: the corrupted run then chooses the clean run's tokens
    every = tl.generate(model, corrupt_ids, max_new_tokens=6, do_sample=False,
                        intervene=[("model.layers.1", tl.patch_from(clean))])
    assert torch.equal(every.tokens, clean.tokens) and not torch.equal(corrupt.tokens, clean.tokens)


def embeds_after_the_prompt(n_new: int) -> Callable[[Any, torch.Tensor], torch.Tensor]:
    """A GPT-2 greedy loop that embeds new tokens itself: ``transformer.wte`` runs in the prompt pass only."""
    def loop(model, ids):
        out = model(input_ids=ids, use_cache=True)
        seq = ids
        for _ in range(n_new - 1):
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
            out = model(inputs_embeds=model.transformer.wte(nxt), cache=out.cache, use_cache=True)
        return torch.cat([seq, out.logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return loop


def test_a_site_of_the_prompt_pass_only_names_the_steps_it_ran_at(tiny_gpt2):
    model, ids = tiny_gpt2.model, tiny_gpt2.args[0]
    loop = embeds_after_the_prompt(4)
    gen = tl.generate(model, ids, loop=loop)
    assert len(gen.steps) == 4 and gen.steps[2].positions == range(ids.shape[1] + 1, ids.shape[1] + 2)
    assert gen.steps_running("transformer.wte") == [0]
    with pytest.raises(SiteNotInStepError, match=r"did not run at step 1; it ran at step\(s\) \[0\]") as err:
        gen.read("transformer.wte")
    assert "tl.at_step" in err.value.remedy
    assert gen.read(tl.at_step("transformer.wte", 0)).shape == (1, ids.shape[1], 32)
    before = hook_state(model)
    with pytest.raises(SiteNotInStepError, match="at step 1") as err:
        tl.generate(model, ids, loop=loop, intervene=[("transformer.wte", tl.scale(2.0))])
    assert isinstance(err.value, tl.EditNotAppliedError) and err.value.step == 1
    assert_model_clean(model, before)
    edited = tl.generate(model, ids, loop=loop, intervene=[(tl.at_step("transformer.wte", 0), tl.scale(2.0))])
    assert len(edited.steps) == 4


def test_a_generation_shows_its_tokens_and_steps_in_a_notebook(tiny_llama, word_tokenizer):
    model = tiny_llama.model
    gen = tl.generate(model, "w3 w17 w42 w9", tokenizer=word_tokenizer, max_new_tokens=3, do_sample=False)
    html = gen._repr_html_()
    anchor = f"tl-gen-{id(gen):x}-step"
    for k in range(3):  # each token links to the row of the step that chose it
        assert (f'<a href="#{anchor}-{k}" title="step {k}: position {4 + k}">'
                f"<b>{word_tokenizer.decode(gen.tokens[:, k])}</b></a>") in html
        assert f'<tr id="{anchor}-{k}"><td>{k}</td><td>{gen.steps[k].positions.start}..' in html
    assert html.count("<tr id=") == 3 and "4 tokens" in html
    assert "<table" in gen.steps[1]._repr_html_()


def test_drawing_a_step_names_its_ops_and_module_calls(tiny_gpt2):
    model, ids = tiny_gpt2.model, tiny_gpt2.args[0]
    gen = tl.generate(model, ids, max_new_tokens=3, do_sample=False,
                      intervene=[(tl.at_step("transformer.h.0", 2), tl.zero_ablate())])
    for k in (0, 2):
        step = gen.steps[k]
        dot = step.draw(depth=None).dot
        assert dot == gen.draw(k, depth=None).dot == step.to_dot(depth=None)
        assert f'label="step {k} (GPT2LMHeadModel): {len(step.trace.ops)} ops, {len(step.trace.calls)} module calls"' \
            in dot
        for op in step.trace.ops:  # every op the step recorded is a node, with the step's own shapes
            if not op.is_input:
                assert f'"{op.label}" [label="{op.label}\\n' in dot
        for call in step.trace.calls:
            if call.address:
                assert f'label="{call.address} ({type(model.get_submodule(call.address)).__name__})"' in dot
    # the prompt pass computes every prompt position, step 2 one: the shapes drawn say so
    p = ids.shape[1]
    assert f"1×{p}×" in gen.steps[0].to_dot(depth=None) and f"1×{p}×" not in gen.steps[2].to_dot(depth=None)
    # the edit at step 2 is marked (red) in step 2's picture only
    assert "#e53935" in gen.steps[2].to_dot(depth=None) and "#e53935" not in gen.steps[1].to_dot(depth=None)


def test_drawing_a_step_beyond_the_generation_is_refused_with_the_number_of_steps(tiny_gpt2, tmp_path):
    model, ids = tiny_gpt2.model, tiny_gpt2.args[0]
    gen = tl.generate(model, ids, max_new_tokens=3, do_sample=False)
    for k in (3, -4):
        with pytest.raises(StepNotFoundError, match="3 step") as err:
            gen.draw(k, tmp_path / "step.dot")
        assert err.value.n_steps == 3 and err.value.remedy
    assert not (tmp_path / "step.dot").exists()
    drawn = gen.draw(-1, tmp_path / "step.dot")
    assert drawn.path.read_text() == gen.steps[2].to_dot()
    assert tl.draw(gen.steps[1]).dot == gen.steps[1].to_dot()  # tl.draw takes a step as it takes a trace
    with pytest.raises(tl.errors.InvalidArgumentError, match="generation step"):
        tl.draw(gen)  # the whole generation: which step is not said


def test_a_left_padded_batch_and_a_dict_output_equal_plain_generate(tiny_llama):
    model = tiny_llama.model
    ids = torch.tensor([[0, 0, 3, 17, 42], [5, 9, 100, 5, 77]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    inputs = {"input_ids": ids, "attention_mask": mask}
    want = model.generate(**inputs, max_new_tokens=5, do_sample=False, return_dict_in_generate=True,
                          output_logits=True)
    _, seen = hooked_generate(model, "model.layers.1", input_ids=ids, attention_mask=mask, max_new_tokens=5,
                              do_sample=False)
    passed = {"plain": [], "ours": []}  # generate reads the forward's signature to choose what it passes
    for who in passed:
        handle = model.register_forward_pre_hook(lambda m, a, kw, who=who: passed[who].append(sorted(kw)),
                                                 with_kwargs=True)
        try:
            if who == "plain":
                model.generate(**inputs, max_new_tokens=5, do_sample=False)
            else:
                gen = tl.generate(model, inputs, max_new_tokens=5, do_sample=False, return_dict_in_generate=True)
        finally:
            handle.remove()
    assert passed["ours"] == passed["plain"] and "position_ids" in passed["plain"][0]
    assert torch.equal(gen.sequences, want.sequences) and gen.output.sequences is gen.sequences
    assert gen.steps[0].positions == range(0, 5) and gen.steps[2].positions == range(6, 7)
    for k, step in enumerate(gen.steps):
        assert torch.equal(step.token, want.sequences[:, 5 + k])
        assert torch.allclose(step.logits, want.logits[k], atol=1e-6, rtol=0)
        assert torch.equal(gen.read(tl.at_step("model.layers.1", k)), seen[k])


def test_compare_two_generations_names_the_first_differing_step_op_and_token(tiny_llama):
    model, ids = tiny_llama.model, tiny_llama.args[0]
    gen = tl.generate(model, ids, max_new_tokens=6, do_sample=False)
    vector = torch.randn(64, generator=torch.Generator().manual_seed(3)) * 4
    fork = gen.fork().do(tl.at_step("model.layers.1", 2), tl.add(vector))
    diff = gen.compare(fork)
    assert str(tl.debug.compare(gen, fork)) == str(diff)  # the public entry point compares generations too
    assert diff.first_step_differs == 2 and diff.logit_max_abs[:2] == [0.0, 0.0] and diff.logit_max_abs[2] > 0
    assert diff.diverged_at == fork.record.diverged_at is not None
    p = diff.diverged_at
    assert diff.tokens == (gen.sequences[:, p].tolist(), fork.sequences[:, p].tolist())
    assert not diff.step_comparison.same and "model.layers.1" in str(diff.step_comparison.first_divergence)
    assert f"position {p}" in str(diff) and not diff.same
    same = gen.compare(tl.generate(model, ids, max_new_tokens=6, do_sample=False))
    assert same.same and same.step_comparison is None and "same text" in str(same)
    with pytest.raises(tl.errors.InvalidArgumentError, match="differ in length"):
        gen.compare(tl.generate(model, ids[:, :4], max_new_tokens=6, do_sample=False))


def test_an_interrupt_inside_a_step_of_generate_leaves_the_model_clean(tiny_llama):
    model, ids = tiny_llama.model, tiny_llama.args[0]

    def interrupt(act, *, ctx):
        raise KeyboardInterrupt

    before = hook_state(model)
    with pytest.raises(KeyboardInterrupt):
        tl.generate(model, ids, max_new_tokens=5, intervene=[(tl.at_step("model.layers.1.mlp", 2), interrupt)])
    assert_model_clean(model, before)
    assert torch.equal(tl.generate(model, ids, max_new_tokens=3, do_sample=False).sequences,
                       model.generate(ids, max_new_tokens=3, do_sample=False))


def test_a_forward_the_user_put_in_the_instance_slot_is_given_back(tiny_gpt2):
    import copy

    model, ids = copy.deepcopy(tiny_gpt2.model), tiny_gpt2.args[0]
    calls = [0]
    own = model.forward

    def counted(*args, **kwargs):
        calls[0] += 1
        return own(*args, **kwargs)

    model.forward = counted
    want = model.generate(ids, max_new_tokens=4, do_sample=False)
    calls[0] = 0
    gen = tl.generate(model, ids, max_new_tokens=4, do_sample=False)
    assert model.__dict__["forward"] is counted and calls[0] == 4  # it ran once per step, inside the capture
    assert torch.equal(gen.sequences, want)
