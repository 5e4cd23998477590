"""``gen.fork().do(tl.at_step(site, k), edit)`` replays the steps after a step-``k`` edit.

The reference is a plain ``model.generate`` with the same edit applied by a forward hook that
counts the model's calls (call ``k`` is step ``k``): the fork's tokens equal it (greedy, and
seeded sampling with the same seed), its logits to float rounding. Each test also asserts which
path the fork took (``fork.record``), and that the blocks below the edit did not run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import assert_model_clean, hook_state

import torchlens as tl

# (stack of blocks, inner module of block 0 that runs only when block 0 runs, the norm before block 1's
# attention: an edit there changes block 1's KV rows, read by every later step; the seed of a vector of
# norm 40 added there at step 3 that changes the token sampled (seed 5) at step 3, checked once by hand)
STACKS = {"tiny_gpt2": ("transformer.h", "transformer.h.0.attn", "transformer.h.1.ln_1", 4),
          "tiny_llama": ("model.layers", "model.layers.0.self_attn", "model.layers.1.input_layernorm", 5)}


@pytest.fixture(params=list(STACKS))
def lm(request):
    case = request.getfixturevalue(request.param)
    return case.model, case.args[0], *STACKS[request.param][:3]


@pytest.fixture
def changing_seed(request) -> int:
    return STACKS[request.node.callspec.params["lm"]][3]


def add_first(vector: torch.Tensor) -> Callable[[Any], Any]:
    def edit(out):
        return (out[0] + vector, *out[1:]) if isinstance(out, tuple) else out + vector
    return edit


def hooked(model, edits: dict[str, tuple[torch.Tensor, range]], reads: tuple[str, ...] = (), seed: int | None = None,
           **kwargs):
    """``model.generate`` with ``edits`` added at the steps given by a call-counting hook; also what
    each module in ``reads`` returned at each step ``{address: [value per step]}``."""
    calls, seen = [0], {a: [] for a in reads}
    handles = [model.register_forward_hook(lambda m, a, k, o: calls.__setitem__(0, calls[0] + 1), with_kwargs=True)]
    for address, (vector, steps) in edits.items():
        handles.append(model.get_submodule(address).register_forward_hook(
            lambda m, i, o, v=vector, s=steps: add_first(v)(o) if calls[0] in s else None))
    for address in reads:
        handles.append(model.get_submodule(address).register_forward_hook(
            lambda m, i, o, a=address: seen[a].append((o[0] if isinstance(o, tuple) else o).detach().clone())))
    try:
        if seed is not None:
            torch.manual_seed(seed)
        out = model.generate(**kwargs, output_logits=True, return_dict_in_generate=True)
    finally:
        for h in handles:
            h.remove()
    return out, seen


class Calls:
    """Counts the calls of one module while ``with`` is open."""

    def __init__(self, model, address: str) -> None:
        self.module, self.n = model.get_submodule(address), 0

    def __enter__(self):
        self.handle = self.module.register_forward_pre_hook(lambda m, a: setattr(self, "n", self.n + 1))
        return self

    def __exit__(self, *exc):
        self.handle.remove()


def vector_for(model, scale: float, seed: int = 3) -> torch.Tensor:
    return torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("cache", [{}, {"cache_implementation": "static"}], ids=["dynamic_cache", "static_cache"])
def test_a_kept_token_is_replayed_from_the_records_and_equals_a_hooked_generate(lm, cache):
    model, ids, stack, below, norm = lm
    block, n = f"{stack}.1", 8
    gen = tl.generate(model, ids, max_new_tokens=n, do_sample=False, **cache)
    vector = vector_for(model, 1e-3)
    want, seen = hooked(model, {norm: (vector, range(3, 4))}, reads=(block, f"{stack}.0"), input_ids=ids,
                        max_new_tokens=n, do_sample=False, **cache)
    before = hook_state(model)
    with Calls(model, below) as lower:
        fork = gen.fork().do(tl.at_step(norm, 3), tl.add(vector))
    assert_model_clean(model, before)
    record = fork.record
    assert record.fallback is None and record.how == "replayed from step 3"
    assert record.reused == [0, 1, 2] and record.edited == [3] and record.replayed == [4, 5, 6, 7]
    assert record.regenerated == [] and record.diverged_at is None
    assert f"{stack}.0..0 read from the parent's records" in record.layers
    assert lower.n == 0  # block 0 never ran: every step from 3 on read it from the parent
    assert torch.equal(fork.sequences, want.sequences) and torch.equal(fork.sequences, gen.sequences)
    for k, step in enumerate(fork.steps):
        assert torch.allclose(step.logits, want.logits[k], atol=1e-6, rtol=0), k
    assert not torch.equal(fork.steps[6].logits, gen.steps[6].logits)  # the changed KV rows were read
    assert fork.steps[5].replayed and not fork.steps[3].replayed
    # the edited step's trace is the parent's with the edit pushed down it (sliced replay)
    assert [e.how for e in fork.steps[3].trace.edits] == ["replayed"]
    assert torch.allclose(fork.read(tl.at_step(block, 3)), seen[block][3], atol=1e-6, rtol=0)
    # a replayed step's trace is captured when read: its values are what the hooks saw at that call
    for k in (5, 7):
        assert torch.allclose(fork.read(tl.at_step(block, k)), seen[block][k], atol=1e-6, rtol=0)
        assert torch.equal(fork.read(tl.at_step(f"{stack}.0", k)), seen[f"{stack}.0"][k])
    assert torch.equal(gen.sequences, want.sequences) and not gen.steps[5].replayed  # the parent is unchanged


@pytest.mark.parametrize("cache", [{}, {"cache_implementation": "static"}], ids=["dynamic_cache", "static_cache"])
def test_a_changed_token_regenerates_for_real_from_there(lm, cache):
    model, ids, stack, below, _ = lm
    block, n = f"{stack}.1", 8
    gen = tl.generate(model, ids, max_new_tokens=n, do_sample=False, **cache)
    vector = vector_for(model, 40.0)
    want, seen = hooked(model, {block: (vector, range(2, 3))}, reads=(f"{stack}.0",), input_ids=ids,
                        max_new_tokens=n, do_sample=False, **cache)
    with Calls(model, below) as lower:
        fork = gen.fork().do(tl.at_step(block, 2), tl.add(vector))
    record, p = fork.record, ids.shape[1]
    assert torch.equal(fork.sequences, want.sequences)
    d = record.diverged_step
    assert d is not None and record.diverged_at == p + d
    assert not torch.equal(fork.sequences[:, p + d], gen.sequences[:, p + d])
    assert record.edited == [2] and record.replayed == list(range(3, d + 1))
    assert record.regenerated == list(range(d + 1, n)) and record.regenerated  # the text did change
    assert f"step {d + 1} reads a token the parent did not choose: regenerated from there on" in record.how
    assert lower.n == len(record.regenerated)  # block 0 ran again once the token differed, not before
    for k, step in enumerate(fork.steps):
        assert torch.allclose(step.logits, want.logits[k], atol=1e-6, rtol=0), k
    last = n - 1
    assert torch.equal(fork.read(tl.at_step(f"{stack}.0", last)), seen[f"{stack}.0"][last])


@pytest.mark.parametrize("scale", [1e-3, 40.0], ids=["token_kept", "token_changes"])
def test_seeded_sampling_redraws_as_the_hooked_run_with_the_same_seed(lm, scale, changing_seed):
    model, ids, stack, _, norm = lm
    n = 8
    gen = tl.generate(model, ids, max_new_tokens=n, do_sample=True, top_k=0, seed=5)
    vector = vector_for(model, scale, seed=changing_seed)
    fork = gen.fork().do(tl.at_step(norm, 3), tl.add(vector))
    want, _ = hooked(model, {norm: (vector, range(3, 4))}, seed=5, input_ids=ids, max_new_tokens=n, do_sample=True,
                     top_k=0)
    assert torch.equal(fork.sequences, want.sequences)
    for k, step in enumerate(fork.steps):
        assert torch.allclose(step.logits, want.logits[k], atol=1e-6, rtol=0), k
        # each step redrew from the RNG state the hooked run's step drew from
        assert torch.equal(step.rng_state, gen.steps[k].rng_state) or k > 3 and fork.record.diverged_step is not None
    record = fork.record
    assert record.edited == [3] and record.fallback is None
    if scale < 1:
        assert record.replayed == [4, 5, 6, 7] and torch.equal(fork.sequences, gen.sequences)
    else:  # the changed distribution drew another token at step 3: step 4 on regenerated
        assert record.diverged_step == 3 and record.replayed == [] and record.regenerated == [4, 5, 6, 7]


def test_an_edit_of_the_prompt_step_replays_every_later_step(tiny_llama):
    model, ids = tiny_llama.model, tiny_llama.args[0]
    gen = tl.generate(model, ids, max_new_tokens=6, do_sample=False)
    vector = vector_for(model, 1e-3)
    fork = gen.fork().do(tl.at_step("model.layers.1", 0), tl.add(vector))
    want, _ = hooked(model, {"model.layers.1": (vector, range(0, 1))}, input_ids=ids, max_new_tokens=6,
                     do_sample=False)
    assert torch.equal(fork.sequences, want.sequences)
    assert fork.record.reused == [] and fork.record.edited == [0] and fork.record.replayed == [1, 2, 3, 4, 5]
    for k, step in enumerate(fork.steps):
        assert torch.allclose(step.logits, want.logits[k], atol=1e-6, rtol=0), k


def test_an_edit_of_the_first_block_replays_with_every_block_run(tiny_gpt2):
    model, ids = tiny_gpt2.model, tiny_gpt2.args[0]
    gen = tl.generate(model, ids, max_new_tokens=6, do_sample=False)
    vector = vector_for(model, 1e-3)
    fork = gen.fork().do(tl.at_step("transformer.h.0.mlp", 2), tl.add(vector))
    want, _ = hooked(model, {"transformer.h.0.mlp": (vector, range(2, 3))}, input_ids=ids, max_new_tokens=6,
                     do_sample=False)
    assert torch.equal(fork.sequences, want.sequences)
    assert fork.record.replayed == [3, 4, 5] and fork.record.layers == "every block recomputed"
    for k, step in enumerate(fork.steps):
        assert torch.allclose(step.logits, want.logits[k], atol=1e-6, rtol=0), k


def test_a_range_of_steps_is_captured_where_it_applies_and_replayed_after(tiny_gpt2):
    model, ids = tiny_gpt2.model, tiny_gpt2.args[0]
    gen = tl.generate(model, ids, max_new_tokens=8, do_sample=False)
    vector = vector_for(model, 1e-3)
    fork = gen.fork().do(tl.at_step("transformer.h.1", range(2, 4)), tl.add(vector))
    want, _ = hooked(model, {"transformer.h.1": (vector, range(2, 4))}, input_ids=ids, max_new_tokens=8,
                     do_sample=False)
    assert torch.equal(fork.sequences, want.sequences)
    assert fork.record.edited == [2, 3] and fork.record.replayed == [4, 5, 6, 7]
    for k, step in enumerate(fork.steps):
        assert torch.allclose(step.logits, want.logits[k], atol=1e-6, rtol=0), k


def test_a_fork_of_a_fork_replays_from_the_first_forks_records(tiny_llama):
    model, ids = tiny_llama.model, tiny_llama.args[0]
    gen = tl.generate(model, ids, max_new_tokens=7, do_sample=False)
    a, b = vector_for(model, 1e-3, seed=1), vector_for(model, 1e-3, seed=2)
    fork = gen.fork().do(tl.at_step("model.layers.1", 2), tl.add(a)).do(tl.at_step("model.layers.1.mlp", 4),
                                                                         tl.add(b))
    want, seen = hooked(model, {"model.layers.1": (a, range(2, 3)), "model.layers.1.mlp": (b, range(4, 5))},
                        reads=("model.layers.1",), input_ids=ids, max_new_tokens=7, do_sample=False)
    assert torch.equal(fork.sequences, want.sequences)
    assert fork.record.reused == [0, 1, 2, 3] and fork.record.edited == [4] and fork.record.replayed == [5, 6]
    # the second do read block 0 through the first do's steps from gen's records: no step was captured to read it
    assert not any(step._record.materialized for step in fork.steps[2:])
    for k, step in enumerate(fork.steps):
        assert torch.allclose(step.logits, want.logits[k], atol=1e-6, rtol=0), k
    assert torch.allclose(fork.read(tl.at_step("model.layers.1", 3)), seen["model.layers.1"][3], atol=1e-6, rtol=0)


def test_without_a_kv_cache_the_fork_re_executes_and_says_why(tiny_gpt2):
    model, ids = tiny_gpt2.model, tiny_gpt2.args[0]
    gen = tl.generate(model, ids, max_new_tokens=5, do_sample=False, use_cache=False)
    vector = vector_for(model, 1e-3)
    fork = gen.fork().do(tl.at_step("transformer.h.1", 2), tl.add(vector))
    want, _ = hooked(model, {"transformer.h.1": (vector, range(2, 3))}, input_ids=ids, max_new_tokens=5,
                     do_sample=False, use_cache=False)
    assert torch.equal(fork.sequences, want.sequences)
    assert fork.record.replayed == [] and fork.record.regenerated == [0, 1, 2, 3, 4]
    assert fork.record.fallback == "the step received no KV cache to resume from"
    assert fork.record.how.startswith("regenerated from the prompt")


def test_a_parent_that_kept_no_block_output_replays_every_block_and_says_why(tiny_gpt2):
    model, ids = tiny_gpt2.model, tiny_gpt2.args[0]
    gen = tl.generate(model, ids, max_new_tokens=6, do_sample=False, save="transformer.h.1")
    vector = vector_for(model, 1e-3)
    with Calls(model, "transformer.h.0.attn") as lower:
        fork = gen.fork().do(tl.at_step("transformer.h.1", 2), tl.add(vector))
    want, seen = hooked(model, {"transformer.h.1": (vector, range(2, 3))}, reads=("transformer.h.1",),
                        input_ids=ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(fork.sequences, want.sequences)
    assert fork.record.replayed == [3, 4, 5] and lower.n == 4  # every block ran at every step
    assert fork.record.layers == ("every block recomputed (the parent did not keep the output of transformer.h.0 "
                                  "(save=) at step 2)")
    assert torch.allclose(fork.read(tl.at_step("transformer.h.1", 4)), seen["transformer.h.1"][4], atol=1e-6,
                          rtol=0)


# an edit at step 2 of the norm before block 1's attention that keeps the token of step 2 but changes that of
# step 3 (its KV row changes what step 3 attends to): (scale, vector seed), found once by hand
LATER_CHANGE = {"tiny_gpt2": (100.0, 3), "tiny_llama": (4.0, 5)}


def test_a_token_that_changes_after_replayed_steps_trips_the_guard_there(lm, request):
    model, ids, stack, below, norm = lm
    scale, seed = LATER_CHANGE[request.node.callspec.params["lm"]]
    gen = tl.generate(model, ids, max_new_tokens=8, do_sample=False)
    vector = vector_for(model, scale, seed=seed)
    want, seen = hooked(model, {norm: (vector, range(2, 3))}, reads=(f"{stack}.0",), input_ids=ids, max_new_tokens=8,
                        do_sample=False)
    with Calls(model, below) as lower:
        fork = gen.fork().do(tl.at_step(norm, 2), tl.add(vector))
    record = fork.record
    assert torch.equal(fork.sequences, want.sequences) and record.diverged_step == 3
    assert record.edited == [2] and record.replayed == [3] and record.regenerated == [4, 5, 6, 7]
    assert lower.n == 4  # block 0 read from the parent at steps 2 and 3, run at 4..7
    for k, step in enumerate(fork.steps):
        assert torch.allclose(step.logits, want.logits[k], atol=1e-6, rtol=0), k
    # the regenerated steps read block 0's KV rows that replay copied from the parent
    assert torch.allclose(fork.read(tl.at_step(f"{stack}.0", 6)), seen[f"{stack}.0"][6], atol=1e-6, rtol=0)


def test_showing_a_fork_captures_none_of_its_replayed_steps(tiny_gpt2):
    model, ids = tiny_gpt2.model, tiny_gpt2.args[0]
    gen = tl.generate(model, ids, max_new_tokens=6, do_sample=False)
    fork = gen.fork().do(tl.at_step("transformer.h.1.ln_1", 2), tl.add(vector_for(model, 1e-3)))
    html, text = fork._repr_html_(), repr(fork.steps[4])
    assert html.count("edited, captured when read") == 1 and html.count("replayed, captured when read") == 3
    assert "replayed, captured when read" in text
    assert not any(step._record.materialized for step in fork.steps[2:])
    assert len(fork.steps[4].trace.ops) == len(gen.steps[4].trace.ops)  # reading it captures it
    assert "captured when read" not in repr(fork.steps[4])


def test_an_edit_of_the_last_step_runs_it_from_the_edited_block(tiny_llama):
    model, ids = tiny_llama.model, tiny_llama.args[0]
    gen = tl.generate(model, ids, max_new_tokens=5, do_sample=False)
    vector = vector_for(model, 3.0)
    with Calls(model, "model.layers.0.self_attn") as lower:
        fork = gen.fork().do(tl.at_step("model.layers.1", 4), tl.add(vector))
    want, _ = hooked(model, {"model.layers.1": (vector, range(4, 5))}, input_ids=ids, max_new_tokens=5,
                     do_sample=False)
    assert torch.equal(fork.sequences, want.sequences) and lower.n == 0
    assert fork.record.edited == [4] and fork.record.replayed == [] and fork.record.regenerated == []
    assert torch.allclose(fork.steps[4].logits, want.logits[4], atol=1e-6, rtol=0)


def test_an_edit_that_does_not_fit_a_step_is_refused_and_the_model_left_clean(tiny_gpt2):
    model, ids = tiny_gpt2.model, tiny_gpt2.args[0]
    gen = tl.generate(model, ids, max_new_tokens=6, do_sample=False)
    before = hook_state(model)
    with pytest.raises(tl.errors.StepEditShapeError, match="at step 3"):
        gen.fork().do(tl.at_step("transformer.h.1", 3), tl.add(torch.ones(5)))
    assert_model_clean(model, before)
    assert all("forward" not in block.__dict__ for block in model.transformer.h)  # no block left stood in for
    fork = gen.fork().do(tl.at_step("transformer.h.1", 3), tl.add(vector_for(model, 1e-3)))  # it still forks
    assert fork.record.edited == [3] and fork.record.fallback is None
