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
from conftest import eager_copy, edited_forward, scale_row_edit, scale_row_hook
from conftest import leaves as tl_leaves

import torchlens as tl
from torchlens.core.steps import REPLAY, Step
from torchlens.edit._regions import WHOLE, RowPatch, Rows, diff_region
from torchlens.edit._shape_rules import map_shape
from torchlens.edit._slicing import PADDED_ROWS, _hidden_from_earlier, rows_linear
from torchlens.edit.reads import OutputRead, replay_read
from torchlens.edit.replay import replay_step
from torchlens.errors import GuardChangedError, ReplayNotExactError

ATOL = 1e-5


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
        sliced = trace.fork().do(case.block, scale_row_edit(p))
        full = _full_replay(trace, case.block, scale_row_edit(p))
        want = edited_forward(case.model, case.block, scale_row_hook(p), case.args).logits
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


@pytest.mark.parametrize("case_name", ["tiny_gpt2", "tiny_llama"])
def test_eager_attention_is_sliced_and_exact_at_every_position(case_name, request):
    """Eager attention (matmul, mask, softmax, matmul): the scores change in a corner, the causal
    mask leaves only rows >= p changed, and the weighted sum keeps rows: nothing falls back."""
    case = request.getfixturevalue(case_name)
    model = eager_copy(case.model)
    trace = tl.trace(model, *case.args)
    assert trace.find_sites(tl.func("softmax"))  # the eager path really ran
    seq = case.args[0].shape[1]
    for p in range(1, seq):
        sliced = trace.fork().do(case.block, scale_row_edit(p))
        full = _full_replay(trace, case.block, scale_row_edit(p))
        want = edited_forward(model, case.block, scale_row_hook(p), case.args).logits
        assert torch.allclose(sliced.output.logits, want, atol=ATOL), p
        assert torch.allclose(full.output.logits, want, atol=ATOL), p
        log = sliced.edits[-1].replay
        assert not log.fallbacks, log.fallbacks
        rows = {e[1] for e in log.entries if e[2] == "rows"}
        assert {"softmax", "matmul"} <= rows, rows  # the weights and their product by v: rows >= p only
        assert torch.equal(sliced.output.logits[:, :p], trace.output.logits[:, :p])
        # every recomputed value equals the full replay's (the scores' corner included)
        for e in log.entries:
            i = trace.op_index(e[0])
            for a, b in zip(tl_leaves(sliced.value(i)), tl_leaves(full.value(i))):
                assert torch.allclose(a, b, atol=ATOL, equal_nan=True), e


def test_edit_at_last_position_recomputes_one_row_per_op(tiny_gpt2):
    trace = tl.trace(tiny_gpt2.model, *tiny_gpt2.args)
    last = tiny_gpt2.args[0].shape[1] - 1
    fork = trace.fork().do("transformer.h.0", scale_row_edit(last))
    rows = [e for e in fork.edits[-1].replay.entries if e[2] == "rows"]
    assert rows and all(e[3][1] == last for e in rows)
    assert {e[1] for e in rows} >= {"addmm", "scaled_dot_product_attention", "layer_norm", "linear"}


def test_op_level_edit_and_check(tiny_llama):
    trace = tl.trace(tiny_llama.model, *tiny_llama.args)
    fork = trace.fork().do(tl.func("silu"), scale_row_edit(4), check=True)  # check=True compares with re-execution
    log = fork.edits[-1].replay
    assert log.n_sliced > 0 and not log.fallbacks
    full = _full_replay(trace, tl.func("silu"), scale_row_edit(4))
    assert torch.allclose(fork.output.logits, full.output.logits, atol=ATOL)


def test_noncausal_attention_falls_back_and_says_so(minilm):
    trace = tl.trace(minilm.model, **minilm.kwargs)
    fork = trace.fork().do(minilm.block, scale_row_edit(3))
    want = edited_forward(minilm.model, minilm.block, scale_row_hook(3), (), minilm.kwargs)
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
    assert map_shape((1, 6, 32), Rows(1, 4), (6, 32)) == Rows(0, 4)
    assert map_shape((6, 96), Rows(0, 4), (1, 6, 96)) == Rows(1, 4)
    assert map_shape((1, 6, 32), Rows(1, 4), (1, 6, 2, 16)) == Rows(1, 4)
    assert map_shape((3, 6, 32), Rows(1, 4), (3, 6, 2, 16)) == Rows(1, 4)
    assert map_shape((3, 6, 32), Rows(1, 4), (18, 32)) is WHOLE  # rows of every batch element: not a suffix


def test_attention_visibility_rule():
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    assert _hidden_from_earlier(None, True, 5, 5, 2) == ""
    assert "not causal" in _hidden_from_earlier(None, False, 5, 5, 2)
    assert _hidden_from_earlier(causal, False, 5, 5, 2) == ""
    assert "not causal" in _hidden_from_earlier(torch.ones(5, 5, dtype=torch.bool), False, 5, 5, 2)
    additive = torch.zeros(5, 5).masked_fill(~causal, torch.finfo(torch.float32).min)
    assert _hidden_from_earlier(additive, False, 5, 5, 2) == ""


# -- unbuilt rows and partial reads (issue 17's speed paths) ----------------------------------


def test_recomputed_rows_stay_unbuilt_until_read_and_equal_full_replay(tiny_gpt2):
    trace = tl.trace(tiny_gpt2.model, *tiny_gpt2.args)
    last = tiny_gpt2.args[0].shape[1] - 1
    sliced = trace.fork().do("transformer.h.0", scale_row_edit(last))
    full = _full_replay(trace, "transformer.h.0", scale_row_edit(last))
    rows = [e[0] for e in sliced.edits[-1].replay.entries if e[2] == "rows"]
    indices = [trace.op_index(label) for label in rows]
    # the logits (read by nothing during replay) and the row-wise chains are not copied yet
    assert isinstance(sliced.value(_logits_op(trace), pending_ok=True), RowPatch)
    assert sum(isinstance(sliced.value(i, pending_ok=True), RowPatch) for i in indices) > len(indices) // 2
    for i in indices:  # built on read: the recorded rows before the edit, the recomputed ones after
        got, want = sliced.value(i), full.value(i)
        assert isinstance(got, torch.Tensor) and torch.allclose(got, want, atol=ATOL), trace.ops[i].label
    assert not any(isinstance(v, RowPatch) for v in sliced.fork_state().values.values())
    want = edited_forward(tiny_gpt2.model, "transformer.h.0", scale_row_hook(last), tiny_gpt2.args).logits
    assert torch.allclose(sliced.output.logits, want, atol=ATOL)


def test_a_second_edit_on_the_same_fork_reads_the_first_ones_rows(tiny_gpt2):
    trace = tl.trace(tiny_gpt2.model, *tiny_gpt2.args)
    fork = trace.fork().do("transformer.h.0", scale_row_edit(5)).do("transformer.h.1", scale_row_edit(3, 0.5))

    model = tiny_gpt2.model
    handles = [model.transformer.h[0].register_forward_hook(lambda m, i, o: scale_row_hook(5)(o)),
               model.transformer.h[1].register_forward_hook(lambda m, i, o: scale_row_hook(3, 0.5)(o))]
    try:
        with torch.no_grad():
            want = model(*tiny_gpt2.args).logits
    finally:
        for h in handles:
            h.remove()
    assert torch.allclose(fork.output.logits, want, atol=ATOL)


def _logits_op(trace) -> int:
    logits = trace.output.logits
    return next(r.index for r in trace.output_refs if r is not None and trace.value(r.index) is logits)


@pytest.mark.parametrize("case_name", ["tiny_gpt2", "tiny_llama"])
def test_partial_read_equals_full_replay_and_reexecution(case_name, request):
    case = request.getfixturevalue(case_name)
    trace = tl.trace(case.model, *case.args)
    seq = case.args[0].shape[1]
    cols = (3, 11)
    for p in range(seq):
        fork = trace.fork()
        step = Step(fork.bind(case.block, strings_as_modules=True), scale_row_edit(p), REPLAY)
        got = replay_read(fork, step, OutputRead(_logits_op(trace), 1, seq - 1, cols))
        full = _full_replay(trace, case.block, scale_row_edit(p)).output.logits[:, -1, list(cols)]
        want = edited_forward(case.model, case.block, scale_row_hook(p), case.args).logits[:, -1, list(cols)]
        assert got.shape == want.shape and torch.allclose(got, want, atol=ATOL), p
        assert torch.allclose(got, full, atol=ATOL), p
        log = fork.edits[-1].replay
        assert [e[1] for e in log.entries if e[2] == "read"] == ["linear"] and not log.fallbacks
        with pytest.raises(ReplayNotExactError, match="declared"):
            fork.output  # noqa: B018 - the rest of the logits was never computed: refused, not stale


def test_partial_read_falls_back_and_says_so_where_the_op_is_read_by_others(tiny_gpt2):
    trace = tl.trace(tiny_gpt2.model, *tiny_gpt2.args)
    lm_head = trace.ops[_logits_op(trace)]
    norm = next(i for i in reversed(range(lm_head.index)) if trace.ops[i].func_name == "layer_norm")
    fork = trace.fork()
    step = Step(fork.bind("transformer.h.0", strings_as_modules=True), scale_row_edit(2), REPLAY)
    got = replay_read(fork, step, OutputRead(norm, 1, 4, None))
    want = _full_replay(trace, "transformer.h.0", scale_row_edit(2)).value(norm)[:, 4]
    assert torch.allclose(got, want, atol=ATOL)
    decisions = fork.edits[-1].replay.decisions  # the read strategy's refusal, with its reason
    assert ("read", f"op {trace.ops[norm].label} (layer_norm): partial read: not a linear that nothing else reads") \
        in decisions
    assert torch.allclose(fork.output.logits,  # the op ran whole, so the fork stays readable
                          edited_forward(tiny_gpt2.model, "transformer.h.0", scale_row_hook(2), tiny_gpt2.args).logits,
                          atol=ATOL)


def test_a_fork_with_unbuilt_rows_saves_and_loads_its_values(tiny_gpt2, tmp_path):
    trace = tl.trace(tiny_gpt2.model, *tiny_gpt2.args)
    fork = trace.fork("last").do("transformer.h.0", scale_row_edit(5))
    mid = next(trace.op_index(e[0]) for e in fork.edits[-1].replay.entries if e[2] == "rows")
    assert isinstance(fork.value(mid, pending_ok=True), RowPatch)
    loaded = tl.load_trace(fork.save(tmp_path / "f"))
    assert torch.equal(loaded.value(mid), fork.value(mid))
    assert torch.equal(loaded.output.logits, fork.output.logits)
    want = edited_forward(tiny_gpt2.model, "transformer.h.0", scale_row_hook(5), tiny_gpt2.args).logits
    assert torch.allclose(loaded.output.logits, want, atol=ATOL)


def test_memory_held_by_a_fork_counts_its_unbuilt_rows_without_building_them(tiny_gpt2):
    from torchlens.analysis.summary import memory_held

    trace = tl.trace(tiny_gpt2.model, *tiny_gpt2.args)
    fork = trace.fork().do("transformer.h.0", scale_row_edit(5))
    held = fork.held_values()
    patches = [v for v in held if isinstance(v, list)]  # each RowPatch as [base, rows]
    assert patches and not any(isinstance(v, RowPatch) for v in held)

    def storages(values):
        found = {}
        for v in values:
            for t in (v if isinstance(v, list) else [v]):
                if isinstance(t, torch.Tensor):
                    found[(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())] = None
        return found

    # by hand: the trace's own storages, then every storage the fork adds (new rows included)
    own = storages([op._out for op in trace.ops if op.saved])
    added = {k: None for k in storages(held) if k not in own}
    assert memory_held(fork) == sum(n for _, n in own) + sum(n for _, n in added)
    assert sum(p[1].untyped_storage().nbytes() for p in patches) > 0
    assert sum(isinstance(v, list) for v in fork.held_values()) == len(patches)  # counting built nothing


# MKL picks its kernel by row count and size: 6..15 rows of a 768-wide product run another
# kernel than the full call (smaller products share one from 6 rows on, so they test nothing).
@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="rows are padded on MKL builds only")
def test_padded_linear_rows_equal_the_full_call_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(2, 40, 768, generator=g), torch.randn(768, 768, generator=g),
               torch.randn(768, generator=g))
    full = torch.nn.functional.linear(x, w, b)
    for start in range(33, 38):  # 2 x (40 - start) rows: 14, 12, 10, 8, 6 (padded to 16)
        rows = x.narrow(1, start, 40 - start)
        assert 2 * (40 - start) in PADDED_ROWS
        got = rows_linear(rows, w, b)
        assert got.shape == (2, 40 - start, 768)
        assert torch.equal(got, full[:, start:]), start
    for start in (20, 39):  # 40 and 2 rows: linear itself
        rows = x.narrow(1, start, 40 - start)
        assert torch.equal(rows_linear(rows, w, b), torch.nn.functional.linear(rows, w, b))
    small = x[:, :7].double()
    assert torch.equal(rows_linear(small, w.double()), torch.nn.functional.linear(small, w.double()))


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="rows are padded on MKL builds only")
def test_sliced_linear_rows_equal_full_replay_bit_for_bit():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(768, 768), torch.nn.GELU(), torch.nn.Linear(768, 768)).eval()
    x = torch.randn(1, 24, 768)
    trace = tl.trace(model, x)
    sliced = trace.fork().do("0", scale_row_edit(12))  # 12 rows of the second linear change
    full = _full_replay(trace, "0", scale_row_edit(12))
    entries = sliced.edits[-1].replay.entries
    assert [(e[1], e[2], e[3][1]) for e in entries] == [("gelu", "rows", 12), ("linear", "rows", 12)]
    assert torch.equal(sliced.output, full.output)
    want = edited_forward(model, "0", scale_row_hook(12), (x,))
    assert torch.allclose(sliced.output, want, atol=ATOL)


class _HeadScores(torch.nn.Module):
    """Per-head scores ``q @ k.T`` (batch, heads, seq, seq), q and k from their own projections."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.q, self.k = torch.nn.Linear(8, 16), torch.nn.Linear(8, 16)

    def forward(self, x):
        q = self.q(x).view(1, 6, 4, 4).transpose(1, 2)
        k = self.k(x).view(1, 6, 4, 4).transpose(1, 2)
        return q @ k.transpose(-1, -2)


def test_scores_of_heads_changed_from_one_head_on_read_the_same_heads_of_the_keys():
    """A matmul whose first factor changed along a batch axis (heads ``>= 2``) recomputes those
    heads against the same heads of the other factor (not all of them)."""
    model = _HeadScores().eval()
    x = torch.randn(1, 6, 8, generator=torch.Generator().manual_seed(2))
    trace = tl.trace(model, x)
    q = next(op.label for op in trace.ops if op.func_name == "transpose" and op.module == "")

    def heads(act, *, ctx):
        act = act.clone()
        act[:, 2:] *= 3.0
        return act

    fork = trace.fork().do(q, heads)
    q_val = model.q(x).view(1, 6, 4, 4).transpose(1, 2)
    q_val = torch.cat([q_val[:, :2], q_val[:, 2:] * 3.0], 1)
    want = q_val @ model.k(x).view(1, 6, 4, 4).transpose(1, 2).transpose(-1, -2)
    assert torch.allclose(fork.output, want, atol=ATOL)
    assert any(e[1] == "matmul" and e[2] == "rows" and e[3] == (1, 2, 4) for e in fork.edits[-1].replay.entries)
