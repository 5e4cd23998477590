"""``trace.forks(...)``: many forks of one trace replayed together, their row recomputations
stacked into one call per op. Each fork must equal the same edit replayed alone and a
re-executed forward whose edit is a plain forward hook.

Tolerance: stacking rows changes BLAS blocking like slicing does: ``ATOL = 1e-5`` on logits
of the tiny models (as tests/test_slicing.py).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import BranchyNet, eager_copy, edited_forward, hooked_forward, scale_row_edit, scale_row_hook

import torchlens as tl
from torchlens.errors import GuardChangedError, InvalidArgumentError, ReplayFellBack, SiteNotFoundError
from torchlens.patching import activation_patching, logit_diff

ATOL = 1e-5


def _blocks(case) -> list[str]:
    prefix = "transformer.h" if case.name == "tiny_gpt2" else "model.layers"
    return [f"{prefix}.{i}" for i in range(len(case.model.get_submodule(prefix)))]


@pytest.mark.parametrize("case_name", ["tiny_gpt2", "tiny_llama"])
def test_every_fork_equals_its_edit_alone_and_a_hooked_forward(case_name, request):
    case = request.getfixturevalue(case_name)
    trace = tl.trace(case.model, *case.args)
    seq = case.args[0].shape[1]
    # a sweep over blocks and positions: forks start at different ops and different rows
    cells = [(b, p, 0.5 + i) for i, b in enumerate(_blocks(case)) for p in (0, seq // 2, seq - 1)]
    forks = trace.forks([(b, scale_row_edit(p, k)) for b, p, k in cells])
    assert len(forks) == len(cells)
    stacked = 0
    for fork, (b, p, k) in zip(forks, cells):
        want = edited_forward(case.model, b, scale_row_hook(p, k), case.args).logits
        alone = trace.fork().do(b, scale_row_edit(p, k)).output.logits
        assert torch.allclose(fork.output.logits, want, atol=ATOL), (b, p)
        assert torch.allclose(fork.output.logits, alone, atol=ATOL), (b, p)
        log = fork.edits[-1].replay
        assert not log.fallbacks
        stacked += sum(1 for e in log.entries if e[4].startswith("stacked with"))
    assert stacked > 0  # rows of several forks really ran as one call
    # the original trace is untouched
    assert torch.equal(trace.output.logits, edited_forward(case.model, _blocks(case)[0], lambda o: o, case.args).logits)


def test_eager_attention_forks_equal_their_edits_alone(tiny_gpt2):
    model = eager_copy(tiny_gpt2.model)
    trace = tl.trace(model, *tiny_gpt2.args)
    cells = [(b, p) for b in _blocks(tiny_gpt2) for p in (2, 4, 5)]
    forks = trace.forks([(b, scale_row_edit(p, 2.0)) for b, p in cells])
    for fork, (b, p) in zip(forks, cells):
        want = edited_forward(model, b, scale_row_hook(p, 2.0), tiny_gpt2.args).logits
        assert torch.allclose(fork.output.logits, want, atol=ATOL), (b, p)
        assert not fork.edits[-1].replay.fallbacks


def test_last_position_sweep_stacks_one_row_per_fork_per_op(tiny_gpt2):
    trace = tl.trace(tiny_gpt2.model, *tiny_gpt2.args)
    last = tiny_gpt2.args[0].shape[1] - 1
    blocks = _blocks(tiny_gpt2)
    forks = trace.forks([(b, scale_row_edit(last, 0.0)) for b in blocks])
    first = forks[0].edits[-1].replay.entries
    # the fork edited at block 0 recomputes the last row of the LM head together with every other fork
    head = [e for e in first if e[1] == "linear" and e[3] == (1, last, last + 1)]
    assert head and head[-1][4] == f"stacked with {len(blocks) - 1} other fork(s)"
    for fork, b in zip(forks, blocks):
        want = edited_forward(tiny_gpt2.model, b, scale_row_hook(last, 0.0), tiny_gpt2.args).logits
        assert torch.allclose(fork.output.logits, want, atol=ATOL)
        assert torch.equal(fork.output.logits[:, :last], trace.output.logits[:, :last])  # earlier rows reused


def test_a_fork_of_several_edits_equals_them_chained_and_two_hooks(tiny_gpt2):
    model, args = tiny_gpt2.model, tiny_gpt2.args
    trace = tl.trace(model, *args)
    two = [("transformer.h.0", scale_row_edit(2, 2.0)), ("transformer.h.1", scale_row_edit(4, 0.5))]
    one, both, again = trace.forks([("transformer.h.1", scale_row_edit(4, 0.5)), two, two[:1]])
    chained = trace.fork().do(*two[0]).do(*two[1])
    want = hooked_forward(model, {"transformer.h.0": scale_row_hook(2, 2.0), "transformer.h.1": scale_row_hook(4, 0.5)},
                          args).logits
    assert len(both.edits) == 2 and len(one.edits) == 1 and len(again.edits) == 1
    assert torch.allclose(both.output.logits, want, atol=ATOL)
    assert torch.allclose(both.output.logits, chained.output.logits, atol=ATOL)
    assert torch.allclose(one.output.logits,
                          edited_forward(model, "transformer.h.1", scale_row_hook(4, 0.5), args).logits, atol=ATOL)


def test_batch_size_and_names(tiny_gpt2):
    trace = tl.trace(tiny_gpt2.model, *tiny_gpt2.args)
    edits = [(b, scale_row_edit(1, 2.0)) for b in _blocks(tiny_gpt2)]
    one = trace.forks(edits, batch_size=1, names=[f"cell{i}" for i in range(len(edits))])
    every = trace.forks(edits)
    assert [f.name for f in one] == [f"cell{i}" for i in range(len(edits))]
    for a, b in zip(one, every):
        assert torch.allclose(a.output.logits, b.output.logits, atol=ATOL)
        assert not any(e[4] for e in a.edits[-1].replay.entries if e[2] == "rows")  # alone: nothing stacked


def test_guard_change_in_one_fork_falls_back_alone():
    torch.manual_seed(0)
    model, x = BranchyNet().eval(), torch.randn(2, 4)
    trace = tl.trace(model, x)
    with pytest.warns(ReplayFellBack):
        flipped, kept = trace.forks([("fc1", tl.scale(-5.0)), ("fc1", tl.scale(2.0))])
    assert flipped.edits[-1].how.startswith("re-executed")
    assert torch.allclose(flipped.output, edited_forward(model, "fc1", lambda o: o * -5, (x,)), atol=1e-6)
    assert kept.edits[-1].how == "replayed"
    assert torch.allclose(kept.output, edited_forward(model, "fc1", lambda o: o * 2, (x,)), atol=1e-6)
    before = trace.output.clone()
    with pytest.raises(GuardChangedError):
        trace.forks([("fc1", tl.scale(2.0)), ("fc1", tl.scale(-5.0))], replay="strict")
    assert torch.equal(trace.output, before)


@pytest.mark.parametrize("bad, kwargs", [
    (["transformer.h.0"], {}),  # not a pair
    ([[]], {}),  # an empty list of pairs
    ([[("transformer.h.0", tl.scale(2.0)), "transformer.h.1"]], {}),  # a list with a non-pair
    ([("transformer.h.0", tl.scale(2.0), 1)], {}),  # a triple
    ([("transformer.h.0", tl.scale(2.0))], {"names": ["a", "b"]}),
    ([("transformer.h.0", tl.scale(2.0))], {"batch_size": 0}),
    ([("transformer.h.0", tl.scale(2.0))], {"batch_size": True}),
    ([("transformer.h.0", tl.scale(2.0))], {"replay": "sometimes"}),
])
def test_bad_arguments_raise_and_change_nothing(tiny_gpt2, bad, kwargs):
    trace = tl.trace(tiny_gpt2.model, *tiny_gpt2.args)
    before = trace.output.logits.clone()
    with pytest.raises(InvalidArgumentError):
        trace.forks(bad, **kwargs)
    assert torch.equal(trace.output.logits, before)


@pytest.mark.parametrize("site", ["transformer.h.9", tl.func("no_such_fn")])
def test_unknown_site_raises_before_any_fork_changes(tiny_gpt2, site):
    trace = tl.trace(tiny_gpt2.model, *tiny_gpt2.args)
    before = trace.output.logits.clone()
    with pytest.raises(SiteNotFoundError):
        trace.forks([("transformer.h.0", tl.scale(2.0)), (site, tl.scale(2.0))])
    assert torch.equal(trace.output.logits, before)


def test_patching_batches_equal_one_cell_at_a_time(tiny_gpt2):
    model, (ids,) = tiny_gpt2.model, tiny_gpt2.args
    corrupted = ids.flip(1)
    metric = logit_diff(int(ids[0, -1]), int(corrupted[0, -1]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        one = activation_patching(ids, corrupted, metric, model=model, batch_size=1)
        many = activation_patching(ids, corrupted, metric, model=model, batch_size=7)
    assert torch.allclose(one.values, many.values, atol=ATOL)
    with pytest.raises(InvalidArgumentError):
        activation_patching(ids, corrupted, metric, model=model, batch_size=0)
