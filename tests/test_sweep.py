"""``trace.forks`` on fresh forks: one pass over the recorded graph per group of forks whose
edits change the same rows, every op run once on their stacked rows (``torchlens.edit._sweep``).

Each swept fork must recompute the same ops and rows as the same edit replayed alone, hold
the same values there, and give the logits of a re-executed forward whose edit is a plain
forward hook. Tolerance as tests/test_fork_batch.py: stacking rows changes BLAS blocking,
``ATOL = 1e-5`` on the tiny models.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import eager_copy, edited_forward, hooked_forward, scale_row_edit, scale_row_hook
from conftest import leaves as tl_leaves

import torchlens as tl
from torchlens.core.steps import REPLAY, Step
from torchlens.edit import _sweep_group
from torchlens.edit._fallbacks import STRICT_ENV
from torchlens.edit._replay_run import Replayer
from torchlens.edit.replay import replay_forks

ATOL = 1e-5


def _blocks(case) -> list[str]:
    prefix = "transformer.h" if case.name == "tiny_gpt2" else "model.layers"
    return [f"{prefix}.{i}" for i in range(len(case.model.get_submodule(prefix)))]


def _steps(forks, pairs):
    return [Step(f.bind(site, strings_as_modules=True), edit, REPLAY) for f, (site, edit) in zip(forks, pairs)]


def _swept(trace, pairs):
    forks = [trace.fork() for _ in pairs]
    return forks, replay_forks(forks, _steps(forks, pairs))


def _all_swept(got) -> bool:
    """Every fork replayed, each op the edit reached by the sweep strategy, nothing declined."""
    return all(isinstance(r, Replayer) and set(r.log.chosen) == {"sweep"} and not r.log.decisions for r in got)


def _broken(act, *, ctx):
    raise ValueError("edit bug")


def _untouched(fork) -> bool:
    state = fork.fork_state()
    return not state.values and not state.subst and not state.overrides and not state.recipe


@pytest.mark.parametrize("where", ["last", "middle"])
@pytest.mark.parametrize("case_name", ["tiny_gpt2", "tiny_llama"])
def test_each_swept_fork_equals_its_edit_alone_op_by_op_and_a_hooked_forward(case_name, where, request):
    case = request.getfixturevalue(case_name)
    trace = tl.trace(case.model, *case.args)
    seq = case.args[0].shape[1]
    p = seq - 1 if where == "last" else seq // 2
    blocks = _blocks(case)
    sites = blocks * 2  # two forks per block, each its own scale
    pairs = [(b, scale_row_edit(p, 0.5 + i)) for i, b in enumerate(sites)]
    forks, got = _swept(trace, pairs)
    assert len(got) == len(forks) and _all_swept(got)
    for i, (fork, (b, edit)) in enumerate(zip(forks, pairs)):
        _assert_like_alone(case, trace, fork, b, edit, scale_row_hook(p, 0.5 + i), len(forks) - 1)
    assert torch.equal(trace.output.logits, edited_forward(case.model, blocks[0], lambda o: o, case.args).logits)


def _assert_like_alone(case, trace, fork, site, edit, hook, others: int, same_ops: bool = True) -> None:
    """``fork`` (swept with ``others`` other forks) recomputed the same ops and rows as ``edit``
    replayed alone (``same_ops``; a fork that joined a stack holding more rows recomputed those
    too), holds the same values there, and its logits are a hooked forward's."""
    alone = trace.fork().do(site, edit)
    want = edited_forward(case.model, site, hook, case.args).logits
    assert torch.allclose(fork.output.logits, want, atol=ATOL), site
    assert torch.allclose(fork.output.logits, alone.output.logits, atol=ATOL), site
    mine, theirs = fork.edits[-1].replay.entries, alone.edits[-1].replay.entries
    if same_ops:
        assert [e[:4] for e in mine] == [e[:4] for e in theirs]
        # each op the edit reached counted once, by the strategy that finished it (one handed on: not twice)
        counted = fork.edits[-1].replay.chosen
        assert sum(counted.values()) == sum(alone.edits[-1].replay.chosen.values()), counted
    else:
        assert [e[0] for e in mine] == [e[0] for e in theirs]
    if others:
        assert any(e[4] == f"stacked with {others} other fork(s)" for e in mine)
    index = {op.label: op.index for op in trace.ops}
    for label, *_ in mine:  # every recomputed value, multi-output ones included
        a, b_ = tl_leaves(fork.value(index[label])), tl_leaves(alone.value(index[label]))
        assert len(a) == len(b_) and all(torch.allclose(x, y, atol=ATOL) for x, y in zip(a, b_)), label


@pytest.mark.parametrize("case_name", ["tiny_gpt2", "tiny_llama"])
def test_a_grid_of_layers_and_positions_is_swept_in_one_group_per_position(case_name, request):
    """Forks whose edits change other rows are not stacked together: each position's forks
    walk the graph as one group, and every fork equals its edit alone and a hooked forward."""
    case = request.getfixturevalue(case_name)
    trace = tl.trace(case.model, *case.args)
    seq = case.args[0].shape[1]
    positions = [seq - 1, 1, seq // 2]
    blocks = _blocks(case)
    cells = [(b, p, 0.5 + i) for i, (p, b) in enumerate((p, b) for p in positions for b in blocks)]
    pairs = [(b, scale_row_edit(p, k)) for b, p, k in cells]
    forks, got = _swept(trace, pairs)
    assert _all_swept(got)
    for fork, (b, edit), (_, p, k) in zip(forks, pairs, cells):
        _assert_like_alone(case, trace, fork, b, edit, scale_row_hook(p, k), len(blocks) - 1)
    # trace.forks goes the same way
    for fork, (b, p, k) in zip(trace.forks(pairs), cells):
        want = edited_forward(case.model, b, scale_row_hook(p, k), case.args).logits
        assert torch.allclose(fork.output.logits, want, atol=ATOL), (b, p)


@pytest.mark.parametrize("batched", [True, False])
@pytest.mark.parametrize("case_name", ["tiny_gpt2", "tiny_llama"])
def test_eager_attention_is_swept_its_scores_whole_until_the_mask(case_name, batched, request, monkeypatch):
    """Eager attention's scores ``q @ k.T`` change in a corner (later keys reach earlier
    queries until the causal mask): they are computed whole (every fork one batch entry of one
    call; or, where that does not apply, once per fork), and once the mask restores the
    corner's block their rows join the stack again, as replay alone decides."""
    if not batched:
        monkeypatch.setattr(_sweep_group.SweepGroup, "_scores", lambda self, op, forks, stacks: None)
    case = request.getfixturevalue(case_name)
    case = dataclasses.replace(case, model=eager_copy(case.model))
    trace = tl.trace(case.model, *case.args)
    seq = case.args[0].shape[1]
    blocks = _blocks(case)
    cells = [(b, p, 0.5 + i) for i, (p, b) in enumerate((p, b) for p in (seq - 1, seq // 2) for b in blocks * 2)]
    pairs = [(b, scale_row_edit(p, k)) for b, p, k in cells]
    forks, got = _swept(trace, pairs)
    assert _all_swept(got)
    for fork, (b, edit), (_, p, k) in zip(forks, pairs, cells):
        _assert_like_alone(case, trace, fork, b, edit, scale_row_hook(p, k), 2 * len(blocks) - 1)
        entries = fork.edits[-1].replay.entries
        if b == blocks[0]:  # the next block's eager attention: its scores computed for every fork at once
            assert "softmax" in {e[1] for e in entries}
            assert any(e[1] == "matmul" and e[3] is None and e[4].startswith("stacked") for e in entries) == batched


def _scale_features(first: int, k: float):
    """A forward-hook edit scaling features ``first:`` of the hidden state at every position."""

    def edit(out):
        hidden = (out[0] if isinstance(out, tuple) else out).clone()
        hidden[..., first:] *= k  # every position: the next linear layer changes every value whole
        return (hidden, *out[1:]) if isinstance(out, tuple) else hidden

    return edit


@pytest.mark.parametrize("case_name", ["tiny_gpt2", "tiny_llama"])
def test_forks_changing_whole_values_run_once_on_all_of_them(case_name, request):
    """Edits reaching every position (a head's patch) make every later value whole: the forks'
    whole values are stacked and each op still runs once on all of them."""
    case = request.getfixturevalue(case_name)
    trace = tl.trace(case.model, *case.args)
    blocks = _blocks(case)
    cells = [(b, 0.5 + i) for i, b in enumerate(blocks * 2)]
    pairs = [(b, lambda act, *, ctx, k=k: _scale_features(5, k)(act)) for b, k in cells]
    forks, got = _swept(trace, pairs)
    assert _all_swept(got)
    for fork, (b, edit), (_, k) in zip(forks, pairs, cells):
        # a later block's fork joins the whole values the first block's forks made there
        _assert_like_alone(case, trace, fork, b, edit, _scale_features(5, k), len(forks) - 1, b == blocks[0])
        assert any(e[2] == "full" for e in fork.edits[-1].replay.entries)  # whole values downstream


def test_an_edit_that_raises_leaves_its_fork_untouched_and_the_others_swept(tiny_gpt2):
    trace = tl.trace(tiny_gpt2.model, *tiny_gpt2.args)
    pairs = [("transformer.h.0", scale_row_edit(5)), ("transformer.h.1", _broken),
             ("transformer.h.1", scale_row_edit(5))]
    forks, got = _swept(trace, pairs)
    assert _all_swept([got[0], got[2]])
    assert isinstance(got[1], ValueError) and str(got[1]) == "edit bug"  # handed back as that fork's error
    assert _untouched(forks[1])
    for fork, (site, _) in zip((forks[0], forks[2]), (pairs[0], pairs[2])):
        want = edited_forward(tiny_gpt2.model, site, scale_row_hook(5), tiny_gpt2.args).logits
        assert torch.allclose(fork.output.logits, want, atol=ATOL)
    with pytest.raises(ValueError, match="edit bug"):  # the general path reports it
        trace.forks(pairs)


def test_every_edit_raising_leaves_every_fork_untouched(tiny_gpt2):
    trace = tl.trace(tiny_gpt2.model, *tiny_gpt2.args)
    forks, got = _swept(trace, [("transformer.h.0", _broken), ("transformer.h.1", _broken)])
    assert [type(r) for r in got] == [ValueError, ValueError] and all(_untouched(f) for f in forks)


class _TwoLayers(torch.nn.Module):
    """Two position-wise layers, ``inner`` then ``outer``; subclasses say how they are used."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inner, self.outer = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)


class _GatedOnFirst(_TwoLayers):
    """Scales its output by a number read (into Python) from the first position."""

    def forward(self, x):
        h = torch.relu(self.inner(x))
        return self.outer(h) * float(h[0, 0].sum())


def test_a_group_meeting_a_changed_data_read_is_restored_and_the_others_stay_swept():
    model = _GatedOnFirst().eval()
    x = torch.randn(1, 6, 8, generator=torch.Generator().manual_seed(1))
    trace = tl.trace(model, x)
    cells = [(0, 2.0), (0, 3.0), (5, 2.0), (5, -1.0)]
    pairs = [("inner", scale_row_edit(p, k)) for p, k in cells]
    forks, got = _swept(trace, pairs)
    assert [type(r) for r in got[:2]] == [tl.errors.GuardChangedError] * 2 and _all_swept(got[2:])
    assert _untouched(forks[0]) and _untouched(forks[1])  # their edit changes what the forward read
    for fork, (p, k) in zip(forks[2:], cells[2:]):
        assert torch.allclose(fork.output, edited_forward(model, "inner", scale_row_hook(p, k), (x,)), atol=1e-6)
    with pytest.warns(Warning):  # trace.forks re-executes the two the recorded graph cannot replay
        done = trace.forks(pairs)
    for fork, (p, k) in zip(done, cells):
        assert torch.allclose(fork.output, edited_forward(model, "inner", scale_row_hook(p, k), (x,)), atol=1e-6)


def test_only_fresh_forks_of_one_trace_are_swept(tiny_gpt2):
    trace = tl.trace(tiny_gpt2.model, *tiny_gpt2.args)
    other = tl.trace(tiny_gpt2.model, *tiny_gpt2.args)
    edit = scale_row_edit(5)
    want = edited_forward(tiny_gpt2.model, "transformer.h.0", scale_row_hook(5), tiny_gpt2.args).logits
    forks = [trace.fork(), other.fork()]
    got = replay_forks(forks, _steps(forks, [("transformer.h.0", edit)] * 2))
    for fork, r in zip(forks, got):  # one walk per trace: a sweep of one fork declines it
        assert r.log.decisions == [("sweep", "a one-pass sweep takes two forks or more")]
        assert "sweep" not in r.log.chosen
        assert torch.allclose(fork.output.logits, want, atol=ATOL)
    edited = trace.fork().do("transformer.h.0", edit)
    forks = [edited, trace.fork()]
    got = replay_forks(forks, _steps(forks, [("transformer.h.1", edit)] * 2))
    why = ("sweep", "a one-pass sweep takes fresh forks of one trace, without grad or in-place overwrites")
    assert [r.log.decisions for r in got] == [[why], [why]] and len(edited.recipe) == 2
    both = {"transformer.h.0": scale_row_hook(5), "transformer.h.1": scale_row_hook(5)}
    assert torch.allclose(edited.output.logits, hooked_forward(tiny_gpt2.model, both, tiny_gpt2.args).logits,
                          atol=ATOL)


def test_a_swept_fork_edited_again_equals_both_edits_chained_and_two_hooks(tiny_gpt2):
    model, args = tiny_gpt2.model, tiny_gpt2.args
    trace = tl.trace(model, *args)
    forks, got = _swept(trace, [("transformer.h.0", scale_row_edit(5, 2.0)), ("transformer.h.1", scale_row_edit(5))])
    assert _all_swept(got)
    both = forks[0].do("transformer.h.1", scale_row_edit(3, 0.5))
    chained = trace.fork().do("transformer.h.0", scale_row_edit(5, 2.0)).do("transformer.h.1", scale_row_edit(3, 0.5))
    want = hooked_forward(model, {"transformer.h.0": scale_row_hook(5, 2.0), "transformer.h.1": scale_row_hook(3, 0.5)},
                          args).logits
    assert torch.allclose(both.output.logits, want, atol=ATOL)
    assert torch.allclose(both.output.logits, chained.output.logits, atol=ATOL)
    index = {op.label: op.index for op in trace.ops}
    for label, *_ in chained.edits[-1].replay.entries:
        a, b = tl_leaves(both.value(index[label])), tl_leaves(chained.value(index[label]))
        assert all(torch.allclose(x, y, atol=ATOL) for x, y in zip(a, b)), label


def _decoder(kind: str):
    import transformers

    torch.manual_seed(0)
    common = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=64)
    configs = {
        "mistral": lambda: transformers.MistralConfig(num_key_value_heads=2, **common),
        "gpt_neox": lambda: transformers.GPTNeoXConfig(**common),
        "opt": lambda: transformers.OPTConfig(hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                                              vocab_size=64, word_embed_proj_dim=32),
        "gptj": lambda: transformers.GPTJConfig(n_embd=32, n_layer=2, n_head=4, vocab_size=64, rotary_dim=4),
    }
    config = configs[kind]()
    config._attn_implementation = "sdpa"
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    blocks = [name for name, m in model.named_modules() if isinstance(m, torch.nn.ModuleList)][0]
    return model, [f"{blocks}.{i}" for i in range(2)]


@pytest.mark.parametrize("kind", ["mistral", "gpt_neox", "opt", "gptj"])
def test_other_decoders_sweep_and_equal_their_edits_alone_and_hooks(kind):
    # rotary embeddings (cat of halves, stack of interleaved pairs), fused qkv, grouped keys, learned positions
    model, blocks = _decoder(kind)
    ids = torch.tensor([[3, 17, 42, 9, 60, 5, 33]])
    trace = tl.trace(model, ids)
    pairs = [(b, scale_row_edit(6, 0.5 + i)) for i, b in enumerate(blocks * 2)]
    forks, got = _swept(trace, pairs)
    assert _all_swept(got)
    for i, (fork, (b, _)) in enumerate(zip(forks, pairs)):
        alone = trace.fork().do(b, scale_row_edit(6, 0.5 + i))
        want = edited_forward(model, b, scale_row_hook(6, 0.5 + i), (ids,)).logits
        assert torch.allclose(alone.output.logits, want, atol=ATOL), b
        assert torch.allclose(fork.output.logits, want, atol=ATOL), b
        assert not alone.edits[-1].replay.fallbacks


class _FirstAndLast(_TwoLayers):
    """Reads the first and the last position after two position-wise layers."""

    def forward(self, x):
        h = self.outer(torch.relu(self.inner(x)))
        return torch.cat([h[:, 0:1], h[:, -1:]], 1)


def test_an_op_reading_only_rows_no_edit_changed_is_skipped():
    model = _FirstAndLast().eval()
    x = torch.randn(1, 6, 8, generator=torch.Generator().manual_seed(1))
    trace = tl.trace(model, x)
    pairs = [("inner", scale_row_edit(5, k)) for k in (2.0, -1.0, 0.0)]
    forks, got = _swept(trace, pairs)
    assert _all_swept(got)
    for fork, k in zip(forks, (2.0, -1.0, 0.0)):
        want = edited_forward(model, "inner", scale_row_hook(5, k), (x,))
        assert torch.allclose(fork.output, want, atol=1e-6)
        assert torch.equal(fork.output[:, 0], trace.output[:, 0])  # the first position was never recomputed
        assert "getitem" in [e[1] for e in fork.edits[-1].replay.entries]  # the last position's slice was


# -- declared fallbacks -----------------------------------------------------------------------------


def test_a_fork_the_sweep_declines_says_why_in_its_replay_record_and_equals_a_hooked_forward(tiny_gpt2):
    model, args = tiny_gpt2.model, tiny_gpt2.args
    trace = tl.trace(model, *args)
    pairs = [("transformer.h.0", scale_row_edit(5)), ("transformer.h.1", scale_row_edit(5)),
             ("transformer.h.1", tl.scale(0.5))]  # the last changes the whole value: not rows
    forks = trace.forks(pairs)
    assert forks[0].edits[-1].replay.decisions == [] and forks[1].edits[-1].replay.decisions == []
    assert forks[2].edits[-1].replay.decisions == [
        ("sweep", "its edit changes the whole value (or its shape or dtype), not rows of it")]
    hooks = [scale_row_hook(5), scale_row_hook(5), lambda o: o * 0.5 if torch.is_tensor(o) else (o[0] * 0.5, *o[1:])]
    for fork, (site, _), hook in zip(forks, pairs, hooks):
        assert torch.allclose(fork.output.logits, edited_forward(model, site, hook, args).logits, atol=ATOL)


def test_strict_fallbacks_make_a_declared_fallback_raise_and_the_fast_path_pass(tiny_gpt2, monkeypatch):
    model, args = tiny_gpt2.model, tiny_gpt2.args
    trace = tl.trace(model, *args)
    monkeypatch.setenv(STRICT_ENV, "1")
    rows = [("transformer.h.0", scale_row_edit(5)), ("transformer.h.1", scale_row_edit(5))]
    for fork, (site, _) in zip(trace.forks(rows), rows):  # swept in one pass: nothing fell back
        assert torch.allclose(fork.output.logits, edited_forward(model, site, scale_row_hook(5), args).logits,
                              atol=ATOL)
    forks = [trace.fork() for _ in range(3)]
    pairs = [*rows, ("transformer.h.1", tl.scale(0.5))]
    steps = _steps(forks, pairs)
    with pytest.raises(tl.errors.ReplayFallbackError, match="whole value") as info:
        replay_forks(forks, steps)
    assert info.value.strategy == "sweep" and all(_untouched(f) for f in forks)
    monkeypatch.setenv(STRICT_ENV, "0")
    got = replay_forks(forks, steps)
    assert _all_swept(got[:2]) and got[2].log.decisions == [
        ("sweep", "its edit changes the whole value (or its shape or dtype), not rows of it")]


def test_an_unexpected_error_inside_the_sweep_propagates_and_restores_every_fork(tiny_gpt2, monkeypatch):
    def bug(self, op, forks):
        raise RuntimeError("a bug in a stacked rule")

    monkeypatch.setattr(_sweep_group.SweepGroup, "_stacked_rule", bug)
    trace = tl.trace(tiny_gpt2.model, *tiny_gpt2.args)
    forks = [trace.fork() for _ in range(2)]
    steps = _steps(forks, [("transformer.h.0", scale_row_edit(5)), ("transformer.h.1", scale_row_edit(5))])
    with pytest.raises(RuntimeError, match="a bug in a stacked rule"):
        replay_forks(forks, steps)
    assert all(_untouched(f) for f in forks)
    with pytest.raises(RuntimeError, match="a bug in a stacked rule"):  # not hidden by a slower path
        trace.forks([("transformer.h.0", scale_row_edit(5)), ("transformer.h.1", scale_row_edit(5))])


class _Recurrent(torch.nn.Module):
    """A linear layer, an LSTM (one op with three outputs: the sequence and both states), then
    ``aminmax`` (two 0-dim outputs, no rows to stack by) scaling the result."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.lstm, self.out = torch.nn.Linear(6, 8), torch.nn.LSTM(8, 8, batch_first=True), \
            torch.nn.Linear(8, 4)

    def forward(self, x):
        h, _ = self.lstm(torch.relu(self.inp(x)))
        low, high = torch.aminmax(h)
        return self.out(h) * (high - low)


def test_forks_through_an_lstm_stack_its_outputs_and_decline_values_without_rows():
    """The LSTM's new outputs (every one whole) are stacked output by output; ``aminmax``'s 0-dim
    outputs cannot be: each fork keeps its own, the sweep says why, and every fork equals a hooked
    forward and its edit replayed alone (the sweep crashed concatenating the LSTM's tuples)."""
    model, x = _Recurrent().eval(), torch.randn(1, 5, 6, generator=torch.Generator().manual_seed(2))
    trace = tl.trace(model, x)
    pairs = [("inp", scale_row_edit(3, 2.0)), ("inp", scale_row_edit(3, -1.0)), ("inp", scale_row_edit(1, 0.5))]
    forks, got = _swept(trace, pairs)
    lstm = next(op for op in trace.ops if "lstm" in op.func_name)
    aminmax = next(op for op in trace.ops if op.func_name == "aminmax")
    for fork, run, (site, edit), hook in zip(forks, got, pairs, (scale_row_hook(3, 2.0), scale_row_hook(3, -1.0),
                                                                  scale_row_hook(1, 0.5))):
        assert isinstance(run, Replayer)
        assert torch.allclose(fork.output, edited_forward(model, site, hook, (x,)), atol=ATOL)
        alone = trace.fork().do(site, edit)
        assert torch.allclose(fork.output, alone.output, atol=ATOL)
        assert all(torch.allclose(a, b, atol=ATOL) for a, b in zip(fork.value(lstm.index), alone.value(lstm.index)))
        assert ("sweep", f"op {aminmax.label} (aminmax): its new value has no rows to stack by (not tensors of "
                         "rows); they go on alone") in run.log.decisions
    # the sweep ran the LSTM once per fork (no rule slices it) and kept the outputs stacked: no decision before aminmax
    assert [e for e in got[0].log.entries if e[0] == lstm.label] == [
        (lstm.label, "lstm", "fallback", None, "no slicing rule for lstm (several outputs)")]
    assert len(got[0].log.decisions) == 1 and got[0].log.chosen["sweep"] >= 2
