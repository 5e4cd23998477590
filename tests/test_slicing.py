"""Sliced replay: an edit recomputes only the rows it can reach, and agrees with full replay and
with a re-executed forward whose edit is a plain forward hook.

Tolerance: recomputing some rows of a matmul instead of all of them changes BLAS blocking,
so sliced and full replay agree to float32 rounding, not bit for bit: ``ATOL = 1e-5`` on
logits of the tiny models (observed differences are ~1e-7).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import edited_forward

import torchlens as tl
from torchlens.core.steps import REPLAY, Step
from torchlens.edit._regions import WHOLE, Rows, diff_region
from torchlens.edit._slicing import _hidden_from_earlier, _map_shape
from torchlens.edit.replay import replay_step
from torchlens.errors import GuardChangedError

ATOL = 1e-5


def _at_position(p: int, k: float = 3.0):
    """A hook edit scaling the hidden state (first tensor of the output) at position ``p``."""

    def edit(out):
        first = out[0] if isinstance(out, tuple) else out
        first = first.clone()
        first[:, p] *= k
        return (first, *out[1:]) if isinstance(out, tuple) else first

    return edit


def _tl_edit(p: int, k: float = 3.0):
    hook = _at_position(p, k)
    return lambda act, *, ctx: hook(act)


def _full_replay(trace, site: str, edit):
    fork = trace.fork()
    replay_step(fork, Step(fork.bind(site, strings_as_modules=True), edit, REPLAY), sliced=False)
    return fork


@pytest.mark.parametrize("case_name", ["tiny_gpt2", "tiny_llama"])
def test_sliced_equals_full_replay_and_reexecution_at_every_position(case_name, request):
    case = request.getfixturevalue(case_name)
    trace = tl.trace(case.model, *case.args)
    seq = case.args[0].shape[1]
    for p in range(seq):
        sliced = trace.fork().do(case.block, _tl_edit(p))
        full = _full_replay(trace, case.block, _tl_edit(p))
        want = edited_forward(case.model, case.block, _at_position(p), case.args).logits
        assert torch.allclose(sliced.output.logits, want, atol=ATOL), p
        assert torch.allclose(full.output.logits, want, atol=ATOL), p
        log = sliced.edits[-1].replay
        assert log.sliced and not log.fallbacks, log.fallbacks
        # every row-recomputed op downstream starts at the edited position (or later)
        starts = {e[3][1] for e in log.entries if e[2] == "rows"}
        assert (min(starts) >= p and log.n_sliced > 0) if p else not starts  # position 0 reaches every row
        # the recorded rows before p are reused, bit for bit
        assert torch.equal(sliced.output.logits[:, :p], trace.output.logits[:, :p])
        assert full.edits[-1].replay.n_sliced == 0


def test_edit_at_last_position_recomputes_one_row_per_op(tiny_gpt2):
    trace = tl.trace(tiny_gpt2.model, *tiny_gpt2.args)
    last = tiny_gpt2.args[0].shape[1] - 1
    fork = trace.fork().do("transformer.h.0", _tl_edit(last))
    rows = [e for e in fork.edits[-1].replay.entries if e[2] == "rows"]
    assert rows and all(e[3][1] == last for e in rows)
    assert {e[1] for e in rows} >= {"addmm", "scaled_dot_product_attention", "layer_norm", "linear"}


def test_op_level_edit_and_check(tiny_llama):
    trace = tl.trace(tiny_llama.model, *tiny_llama.args)
    fork = trace.fork().do(tl.func("silu"), _tl_edit(4), check=True)  # check=True compares with re-execution
    log = fork.edits[-1].replay
    assert log.n_sliced > 0 and not log.fallbacks
    full = _full_replay(trace, tl.func("silu"), _tl_edit(4))
    assert torch.allclose(fork.output.logits, full.output.logits, atol=ATOL)


def test_noncausal_attention_falls_back_and_says_so(minilm):
    trace = tl.trace(minilm.model, **minilm.kwargs)
    fork = trace.fork().do(minilm.block, _tl_edit(3))
    want = edited_forward(minilm.model, minilm.block, _at_position(3), (), minilm.kwargs)
    assert torch.allclose(fork.output.last_hidden_state, want.last_hidden_state, atol=ATOL)
    reasons = [r for _, name, r in fork.edits[-1].replay.fallbacks if name == "scaled_dot_product_attention"]
    assert reasons and all("not causal" in r for r in reasons)


def test_guards_still_refuse_a_changed_routing(tiny_mixtral):
    model, ids = tiny_mixtral.model, tiny_mixtral.args[0]
    trace = tl.trace(model, ids)
    with pytest.raises(GuardChangedError):
        trace.fork().do("model.layers.0.self_attn", tl.scale(0.5), replay="strict")
    before = len(trace.edits)
    fork = trace.fork().do("model.layers.0.self_attn", tl.scale(1.001), replay="strict")
    want = edited_forward(model, "model.layers.0.self_attn", lambda o: (o[0] * 1.001, *o[1:]), (ids,)).logits
    assert torch.allclose(fork.output.logits, want, atol=ATOL)
    assert len(trace.edits) == before  # the refused fork left the trace untouched


def test_fallback_after_changed_guard_is_recorded(tiny_mixtral):
    trace = tl.trace(tiny_mixtral.model, tiny_mixtral.args[0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fork = trace.fork().do("model.layers.0.self_attn", tl.scale(0.5), replay="fallback")
    assert fork.edits[-1].how.startswith("re-executed")


# -- the rules on their own ------------------------------------------------------------------


def test_diff_region_picks_the_axis_with_the_largest_unchanged_share():
    old = torch.zeros(1, 6, 4)
    new = old.clone()
    new[0, 4:, 1] = 1.0
    assert diff_region(old, new) == Rows(1, 4)
    assert diff_region(old, old.clone()) is None
    assert diff_region(old, torch.ones(1, 6, 4)) is WHOLE
    nan = torch.full((2, 3), float("nan"))
    assert diff_region(nan, nan.clone()) is None
    assert diff_region(old, torch.zeros(1, 6, 5)) is WHOLE


def test_map_shape_follows_views():
    assert _map_shape((1, 6, 32), Rows(1, 4), (6, 32)) == Rows(0, 4)
    assert _map_shape((6, 96), Rows(0, 4), (1, 6, 96)) == Rows(1, 4)
    assert _map_shape((1, 6, 32), Rows(1, 4), (1, 6, 2, 16)) == Rows(1, 4)
    assert _map_shape((3, 6, 32), Rows(1, 4), (3, 6, 2, 16)) == Rows(1, 4)
    assert _map_shape((3, 6, 32), Rows(1, 4), (18, 32)) is WHOLE  # rows of every batch element: not a suffix


def test_attention_visibility_rule():
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    assert _hidden_from_earlier(None, True, 5, 5, 2) == ""
    assert "not causal" in _hidden_from_earlier(None, False, 5, 5, 2)
    assert _hidden_from_earlier(causal, False, 5, 5, 2) == ""
    assert "not causal" in _hidden_from_earlier(torch.ones(5, 5, dtype=torch.bool), False, 5, 5, 2)
    additive = torch.zeros(5, 5).masked_fill(~causal, torch.finfo(torch.float32).min)
    assert _hidden_from_earlier(additive, False, 5, 5, 2) == ""
