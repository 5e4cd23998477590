"""``with trace.sweep():``: forks edited in a plain loop are queued and replayed together.

Every fork must equal the same edit replayed alone (``trace.fork().do``) and a re-executed
forward whose edit is a plain forward hook; the queue is replayed at the end of the block or
at the first read of a queued fork. Tolerance as tests/test_sweep.py (stacking rows changes
BLAS blocking).
"""

from __future__ import annotations

import pytest
import torch
from conftest import edited_forward, hooked_forward, scale_row_edit, scale_row_hook

import torchlens as tl
from torchlens.errors import EditShapeError, EmptySelectionError, InvalidArgumentError

ATOL = 1e-5


def _blocks(case) -> list[str]:
    prefix = "transformer.h" if case.name == "tiny_gpt2" else "model.layers"
    return [f"{prefix}.{i}" for i in range(len(case.model.get_submodule(prefix)))]


def _untouched(fork) -> bool:
    state = fork.fork_state()
    return not state.values and not state.subst and not state.overrides and not state.recipe


def _zero_last(out):
    first = out[0] if isinstance(out, tuple) else out
    first = first.clone()
    first[:, -1] = 0
    return (first, *out[1:]) if isinstance(out, tuple) else first


@pytest.mark.parametrize("case_name", ["tiny_gpt2", "tiny_llama"])
def test_a_loop_of_forks_in_a_sweep_block_equals_each_fork_alone_and_a_hooked_forward(case_name, request):
    case = request.getfixturevalue(case_name)
    trace = tl.trace(case.model, *case.args)
    seq = case.args[0].shape[1]
    blocks = _blocks(case)
    # several edit kinds: a row of the last position, a middle row, a whole value scaled, a row zeroed
    cells = [(b, scale_row_edit(seq - 1, 0.5 + i), scale_row_hook(seq - 1, 0.5 + i)) for i, b in enumerate(blocks)]
    cells += [(b, scale_row_edit(seq // 2, 2.0), scale_row_hook(seq // 2, 2.0)) for b in blocks]
    cells += [(blocks[-1], tl.scale(0.5), lambda o: _scaled(o, 0.5))]
    cells += [(b, lambda act, *, ctx: _zero_last(act), _zero_last) for b in blocks]
    with trace.sweep() as block:
        forks = [trace.fork().do(b, edit) for b, edit, _ in cells]
        assert block.queued == len(cells)
    assert block.queued == 0
    for fork, (b, edit, hook) in zip(forks, cells):
        alone = trace.fork().do(b, edit)
        want = edited_forward(case.model, b, hook, case.args).logits
        assert torch.allclose(fork.output.logits, want, atol=ATOL), b
        assert torch.allclose(fork.output.logits, alone.output.logits, atol=ATOL), b
        assert [e[:4] for e in fork.edits[-1].replay.entries] == [e[:4] for e in alone.edits[-1].replay.entries]
    # the forks of one row went together: their replay logs say they were stacked
    last = forks[: len(blocks)]
    assert all(any(e[4].startswith("stacked with") for e in f.edits[-1].replay.entries) for f in last[1:])
    # the trace itself is untouched
    assert torch.equal(trace.output.logits, edited_forward(case.model, blocks[0], lambda o: o, case.args).logits)


def _scaled(out, k):
    return (out[0] * k, *out[1:]) if isinstance(out, tuple) else out * k


def test_several_edits_on_one_fork_and_an_op_site_are_queued_in_order(tiny_gpt2):
    model, (ids,) = tiny_gpt2.model, tiny_gpt2.args
    trace = tl.trace(model, ids)
    op = next(o.label for o in trace.ops if o.module == "transformer.h.1.mlp.c_fc" and o.func_name == "addmm")
    with trace.sweep() as block:
        two = trace.fork().do("transformer.h.0", scale_row_edit(-1, 3.0)).do("transformer.h.1", tl.scale(0.5))
        by_op = trace.fork().do(op, tl.scale(0.0))
        other = trace.fork().do("transformer.h.1", scale_row_edit(-1, 2.0))
        assert block.queued == 3
    chained = trace.fork().do("transformer.h.0", scale_row_edit(-1, 3.0)).do("transformer.h.1", tl.scale(0.5))
    want = hooked_forward(model, {"transformer.h.0": scale_row_hook(-1, 3.0),
                                  "transformer.h.1": lambda o: _scaled(o, 0.5)}, (ids,)).logits
    assert torch.allclose(two.output.logits, want, atol=ATOL)
    assert torch.allclose(two.output.logits, chained.output.logits, atol=ATOL)
    assert [e.site for e in two.edits] == [e.site for e in chained.edits]
    assert torch.allclose(by_op.output.logits, trace.fork().do(op, tl.scale(0.0)).output.logits, atol=ATOL)
    assert torch.allclose(other.output.logits, edited_forward(model, "transformer.h.1", scale_row_hook(-1, 2.0),
                                                              (ids,)).logits, atol=ATOL)


def test_reading_a_queued_fork_inside_the_block_replays_the_queue(tiny_gpt2):
    model, (ids,) = tiny_gpt2.model, tiny_gpt2.args
    trace = tl.trace(model, ids)
    with trace.sweep() as block:
        a = trace.fork().do("transformer.h.0", scale_row_edit(-1, 3.0))
        b = trace.fork().do("transformer.h.1", scale_row_edit(-1, 3.0))
        logits = a.output.logits  # forces the queue: both forks now hold their edits
        assert block.queued == 0
        assert len(b.__dict__["changes"].recipe) == 1  # replayed with a, not at its own read
        c = trace.fork().do("transformer.h.1", scale_row_edit(-1, 0.5))
        assert block.queued == 1
        out = c["transformer.h.1"].out  # reading a site of a queued fork forces it too
        assert block.queued == 0
        want = scale_row_hook(-1, 0.5)(trace["transformer.h.1"].out)
        assert torch.allclose(out[0] if isinstance(out, tuple) else out,
                              want[0] if isinstance(want, tuple) else want, atol=ATOL)
    for fork, (address, k) in ((a, ("transformer.h.0", 3.0)), (b, ("transformer.h.1", 3.0)),
                               (c, ("transformer.h.1", 0.5))):
        want = edited_forward(model, address, scale_row_hook(-1, k[1] if isinstance(k, tuple) else k), (ids,))
        assert torch.allclose(fork.output.logits, want.logits, atol=ATOL), address
    assert torch.allclose(logits, edited_forward(model, "transformer.h.0", scale_row_hook(-1, 3.0), (ids,)).logits,
                          atol=ATOL)


def test_an_exception_in_the_block_leaves_the_trace_usable_and_the_queue_replays_on_read(tiny_gpt2):
    model, (ids,) = tiny_gpt2.model, tiny_gpt2.args
    trace = tl.trace(model, ids)
    with pytest.raises(KeyError), trace.sweep() as block:
        forks = [trace.fork().do(b, scale_row_edit(-1, 2.0)) for b in ("transformer.h.0", "transformer.h.1")]
        raise KeyError("user code failed")
    assert trace._sweeping is None and block.queued == 2
    fresh = trace.fork().do("transformer.h.0", tl.scale(0.5))  # outside any block: replayed at once
    assert fresh.__dict__["_deferred"] is None and len(fresh.__dict__["changes"].recipe) == 1
    for fork, b in zip(forks, ("transformer.h.0", "transformer.h.1")):
        want = edited_forward(model, b, scale_row_hook(-1, 2.0), (ids,)).logits
        assert torch.allclose(fork.output.logits, want, atol=ATOL)
    assert block.queued == 0
    with trace.sweep():  # a new block opens on the same trace
        again = trace.fork().do("transformer.h.1", scale_row_edit(-1, 2.0))
    assert torch.allclose(again.output.logits, forks[1].output.logits, atol=ATOL)
    assert torch.equal(trace.output.logits, edited_forward(model, "transformer.h.0", lambda o: o, (ids,)).logits)


def test_a_failing_queued_edit_raises_at_its_forks_read_and_leaves_it_as_it_was(tiny_gpt2):
    model, (ids,) = tiny_gpt2.model, tiny_gpt2.args
    trace = tl.trace(model, ids)
    with trace.sweep():
        good = trace.fork().do("transformer.h.0", scale_row_edit(-1, 2.0))
        bad = trace.fork().do("transformer.h.1", torch.zeros(3))  # the wrong shape: fails when replayed
        good.output  # noqa: B018 - forces the queue; good's read does not raise bad's error
        with pytest.raises(EditShapeError):
            bad.output  # noqa: B018
        # raised once: the block's end does not raise it again
    assert _untouched(bad)  # raised once; the fork is as it was
    assert torch.equal(bad.output.logits, trace.output.logits)
    want = edited_forward(model, "transformer.h.0", scale_row_hook(-1, 2.0), (ids,)).logits
    assert torch.allclose(good.output.logits, want, atol=ATOL)


def test_an_unread_failing_edit_raises_when_the_block_ends(tiny_gpt2):
    model, (ids,) = tiny_gpt2.model, tiny_gpt2.args
    trace = tl.trace(model, ids)
    with pytest.raises(EditShapeError), trace.sweep():
        good = trace.fork().do("transformer.h.0", scale_row_edit(-1, 2.0))
        bad = trace.fork().do("transformer.h.1", torch.zeros(3))
    assert _untouched(bad) and trace._sweeping is None
    want = edited_forward(model, "transformer.h.0", scale_row_hook(-1, 2.0), (ids,)).logits
    assert torch.allclose(good.output.logits, want, atol=ATOL)


def test_nested_blocks_on_one_trace_raise_and_the_outer_block_goes_on(tiny_gpt2):
    model, (ids,) = tiny_gpt2.model, tiny_gpt2.args
    trace = tl.trace(model, ids)
    with trace.sweep() as outer:
        a = trace.fork().do("transformer.h.0", scale_row_edit(-1, 2.0))
        with pytest.raises(InvalidArgumentError, match="already in a sweep block"), trace.sweep():
            pass
        with pytest.raises(InvalidArgumentError, match="entered once"), outer:
            pass
        assert trace._sweeping is outer and outer.queued == 1
        # a fork's own forks may have their own block (a block of the trace queues only its forks)
        with a.sweep() as inner:
            b = a.fork().do("transformer.h.1", scale_row_edit(-1, 0.5))  # forking a replays the outer queue
            assert outer.queued == 0 and inner.queued == 1
    want = hooked_forward(model, {"transformer.h.0": scale_row_hook(-1, 2.0),
                                  "transformer.h.1": scale_row_hook(-1, 0.5)}, (ids,)).logits
    assert torch.allclose(b.output.logits, want, atol=ATOL)
    assert torch.allclose(a.output.logits, edited_forward(model, "transformer.h.0", scale_row_hook(-1, 2.0),
                                                           (ids,)).logits, atol=ATOL)


def test_bad_edits_raise_at_do_inside_the_block_and_queue_nothing(tiny_gpt2):
    model, (ids,) = tiny_gpt2.model, tiny_gpt2.args
    trace = tl.trace(model, ids)
    with trace.sweep() as block:
        fork = trace.fork()
        with pytest.raises(InvalidArgumentError, match="replay="):
            fork.do("transformer.h.0", tl.scale(2.0), replay="sometimes")
        with pytest.raises(EmptySelectionError):
            fork.do(tl.module("transformer.h.0") & tl.func("conv2d"), tl.scale(2.0))
        with pytest.raises(tl.errors.SiteNotFoundError):
            fork.do("transformer.h.99", tl.scale(2.0))
        assert block.queued == 0
    assert _untouched(fork)
    with pytest.raises(InvalidArgumentError, match="batch_size"):
        trace.sweep(batch_size=0)


def test_do_with_model_and_inputs_runs_at_once_inside_the_block(tiny_gpt2):
    model, (ids,) = tiny_gpt2.model, tiny_gpt2.args
    trace = tl.trace(model, ids)
    with trace.sweep() as block:
        fork = trace.fork().do("transformer.h.0", tl.scale(0.5), model=model, inputs=ids)
        assert block.queued == 0 and fork.__dict__["_deferred"] is None
    assert torch.allclose(fork.output.logits, edited_forward(model, "transformer.h.0", lambda o: _scaled(o, 0.5),
                                                             (ids,)).logits, atol=ATOL)


def test_batch_size_replays_the_queue_in_chunks_with_the_same_values(tiny_gpt2):
    model, (ids,) = tiny_gpt2.model, tiny_gpt2.args
    trace = tl.trace(model, ids)
    blocks = ["transformer.h.0", "transformer.h.1"] * 2
    with trace.sweep(batch_size=2):
        forks = [trace.fork().do(b, scale_row_edit(-1, 1.5 + i)) for i, b in enumerate(blocks)]
    for i, (fork, b) in enumerate(zip(forks, blocks)):
        want = edited_forward(model, b, scale_row_hook(-1, 1.5 + i), (ids,)).logits
        assert torch.allclose(fork.output.logits, want, atol=ATOL), b


def test_a_loop_of_row_edits_in_a_block_takes_the_one_pass_sweep_with_no_fallback(tiny_gpt2, monkeypatch):
    """With declared fallbacks raising, the loop still replays: every fork went through the one-pass sweep."""
    from torchlens.edit._fallbacks import STRICT_ENV

    model, (ids,) = tiny_gpt2.model, tiny_gpt2.args
    trace = tl.trace(model, ids)
    monkeypatch.setenv(STRICT_ENV, "1")
    blocks = ["transformer.h.0", "transformer.h.1"]
    with trace.sweep():
        forks = [trace.fork().do(b, scale_row_edit(-1, 0.25)) for b in blocks]
    for fork, b in zip(forks, blocks):
        assert fork.edits[-1].replay.decisions == []
        assert torch.allclose(fork.output.logits, edited_forward(model, b, scale_row_hook(-1, 0.25), (ids,)).logits,
                              atol=ATOL)
    # a whole-value edit is a declared fallback: strict, replaying the queue raises (here at the block's
    # end) and the forks wait again, untouched
    with pytest.raises(tl.errors.ReplayFallbackError, match="whole value"), trace.sweep() as block:
        whole = trace.fork().do(blocks[0], tl.scale(0.5))
        other = trace.fork().do(blocks[1], scale_row_edit(-1, 0.25))
    assert block.queued == 2 and whole.__dict__["changes"].values == {} and other.__dict__["changes"].values == {}
    monkeypatch.delenv(STRICT_ENV)
    assert torch.allclose(whole.output.logits, trace.fork().do(blocks[0], tl.scale(0.5)).output.logits, atol=ATOL)
    assert whole.edits[-1].replay.decisions == [
        ("sweep", "its edit changes the whole value (or its shape or dtype), not rows of it")]
    assert torch.allclose(other.output.logits, forks[1].output.logits, atol=ATOL)
