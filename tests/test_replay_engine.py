"""The replay engine (``torchlens.edit._engine``): one walk, a chain of strategies, each refusal a
recorded decision.

Each strategy that declares it cannot recompute an op (or take a fork) leaves ``(strategy, reason)``
in the fork's replay record (``fork.edits[-1].replay.decisions``), a slower strategy does the work,
and the fork's values are still a plain forward hook's. With ``TORCHLENS_STRICT_FALLBACKS=1`` a
declared refusal raises ``ReplayFallbackError`` instead and leaves the forks as they were.
"""

from __future__ import annotations

import pytest
import torch
from conftest import edited_forward, hooked_forward, scale_row_edit, scale_row_hook

import torchlens as tl
from torchlens.core.steps import REPLAY, Step
from torchlens.edit._fallbacks import STRICT_ENV
from torchlens.edit.reads import OutputRead, replay_read
from torchlens.edit.replay import replay_forks

ATOL = 1e-6


class _Flipped(torch.nn.Module):
    """``outer(flip(relu(inner(x))))``: ``flip`` has no slicing rule."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inner, self.outer = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.outer(torch.flip(torch.relu(self.inner(x)), [-1]))


class _GatedOnFirst(torch.nn.Module):
    """Scales its output by a number read (into Python) from the first position."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inner, self.outer = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        h = torch.relu(self.inner(x))
        return self.outer(h) * float(h[0, 0].sum())


def _x() -> torch.Tensor:
    return torch.randn(1, 6, 8, generator=torch.Generator().manual_seed(1))


def _scale_features(first: int, k: float):
    def edit(act, *, ctx=None):
        act = act.clone()
        act[..., first:] *= k  # every position: changed rows along the feature axis
        return act

    return edit


def _op(trace, name: str):
    return next(op for op in trace.ops if op.func_name == name)


def _untouched(fork) -> bool:
    state = fork.fork_state()
    return not state.values and not state.subst and not state.overrides and not state.recipe


def test_rows_declares_an_op_without_a_rule_and_whole_recomputes_it():
    model, x = _Flipped().eval(), _x()
    trace = tl.trace(model, x)
    fork = trace.fork().do("inner", scale_row_edit(5, 2.0))
    log = fork.edits[-1].replay
    flip = _op(trace, "flip")
    assert log.decisions == [("rows", f"op {flip.label} (flip): no slicing rule for flip")]
    assert log.chosen["whole"] >= 1 and log.chosen["rows"] >= 1  # relu sliced, flip (and after it) whole
    assert (flip.label, "flip", "fallback", None, "no slicing rule for flip") in log.entries
    assert torch.allclose(fork.output, edited_forward(model, "inner", scale_row_hook(5, 2.0), (x,)), atol=ATOL)


def test_an_op_handed_on_mid_run_is_counted_once_by_the_strategy_that_finished_it(monkeypatch):
    """``rows`` finds, running relu, that its rows do not fit (forced here): it hands the op on,
    ``whole`` recomputes it, and the record counts relu once, for ``whole``."""
    from torchlens.edit._replay_run import Replayer

    model, x = _Flipped().eval(), _x()
    trace = tl.trace(model, x)
    relu = _op(trace, "relu")
    plain = trace.fork().do("inner", scale_row_edit(5, 2.0)).edits[-1].replay.chosen
    fits = Replayer.finish_rows
    monkeypatch.setattr(Replayer, "finish_rows",
                        lambda self, op, *a, **k: op.index != relu.index and fits(self, op, *a, **k))
    fork = trace.fork().do("inner", scale_row_edit(5, 2.0))
    log = fork.edits[-1].replay
    assert ("rows", f"op {relu.label} (relu): its rule's rows do not fit the recorded value") in log.decisions
    assert plain == {"rows": 1, "whole": 2}  # relu sliced; flip and outer whole
    assert log.chosen == {"whole": 3}
    assert [e[2] for e in log.entries if e[0] == relu.label] == ["mapped"]  # whole, its changed rows known
    assert torch.allclose(fork.output, edited_forward(model, "inner", scale_row_hook(5, 2.0), (x,)), atol=ATOL)


def test_row_batch_declares_calls_that_do_not_line_up_and_each_fork_runs_its_own():
    model, x = _Flipped().eval(), _x()
    trace = tl.trace(model, x)
    forks = [trace.fork(), trace.fork()]
    edits = [scale_row_edit(5, 2.0), _scale_features(6, 3.0)]  # rows along positions, rows along features
    steps = [Step(f.bind("inner", strings_as_modules=True), e, REPLAY) for f, e in zip(forks, edits)]
    got = replay_forks(forks, steps, one_pass=False)
    relu = _op(trace, "relu")
    why = ("row batch", f"op {relu.label} (relu): the forks cut other ops or axes")
    assert all(why in r.log.decisions for r in got)
    assert [e[:4] for e in got[0].log.entries if e[0] == relu.label] == [(relu.label, "relu", "rows", (1, 5, 6))]
    assert [e[:4] for e in got[1].log.entries if e[0] == relu.label] == [(relu.label, "relu", "rows", (2, 6, 8))]
    hooks = [scale_row_hook(5, 2.0), _scale_features(6, 3.0)]
    for fork, hook in zip(forks, hooks):
        assert torch.allclose(fork.output, edited_forward(model, "inner", hook, (x,)), atol=ATOL)


def test_sweep_declares_a_whole_value_edit_and_that_fork_goes_on_in_the_same_walk():
    model, x = _Flipped().eval(), _x()
    trace = tl.trace(model, x)
    pairs = [("inner", scale_row_edit(5, 2.0)), ("inner", scale_row_edit(5, -1.0)), ("inner", tl.scale(0.5))]
    forks = trace.forks(pairs)
    records = [f.edits[-1].replay for f in forks]
    assert records[2].decisions[0] == ("sweep", "its edit changes the whole value (or its shape or dtype), not rows "
                                                "of it")
    assert "sweep" not in records[2].chosen and all("sweep" in r.chosen for r in records[:2])
    hooks = [scale_row_hook(5, 2.0), scale_row_hook(5, -1.0), lambda o: o * 0.5]
    for fork, hook in zip(forks, hooks):
        assert torch.allclose(fork.output, edited_forward(model, "inner", hook, (x,)), atol=ATOL)


def test_read_declares_an_op_that_is_not_a_final_linear():
    model, x = _Flipped().eval(), _x()
    trace = tl.trace(model, x)
    relu = _op(trace, "relu")
    fork = trace.fork()
    got = replay_read(fork, Step(fork.bind("inner", strings_as_modules=True), scale_row_edit(5, 2.0), REPLAY),
                      OutputRead(relu.index, 1, 5, None))
    assert ("read", f"op {relu.label} (relu): partial read: not a linear that nothing else reads") \
        in fork.edits[-1].replay.decisions
    want = torch.relu(edited_forward(model.inner, "", scale_row_hook(5, 2.0), (x,)))[:, 5]
    assert torch.allclose(got, want, atol=ATOL)


def test_a_changed_guard_is_a_recorded_re_execution():
    model, x = _GatedOnFirst().eval(), _x()
    trace = tl.trace(model, x)
    with pytest.warns(tl.errors.ReplayFellBack):
        fork = trace.fork().do("inner", scale_row_edit(0, 2.0))
    log = fork.edits[-1].replay
    assert len(log.decisions) == 1 and log.decisions[0][0] == "replay"
    assert log.decisions[0][1].startswith("the edit changes a guard: the edit changes a value the forward branched on")
    assert log.chosen == {"re-execution": 1} and fork.edits[-1].how.startswith("re-executed")
    assert torch.allclose(fork.output, edited_forward(model, "inner", scale_row_hook(0, 2.0), (x,)), atol=ATOL)


def test_strict_fallbacks_raise_at_a_declared_refusal_and_leave_the_forks_as_they_were(monkeypatch):
    model, x = _Flipped().eval(), _x()
    trace = tl.trace(model, x)
    monkeypatch.setenv(STRICT_ENV, "1")
    fork = trace.fork()
    with pytest.raises(tl.errors.ReplayFallbackError, match="no slicing rule for flip") as info:
        fork.do("inner", scale_row_edit(5, 2.0))
    assert info.value.strategy == "rows" and _untouched(fork) and not fork.edits
    forks = [trace.fork(), trace.fork()]
    steps = [Step(f.bind("inner", strings_as_modules=True), e, REPLAY)
             for f, e in zip(forks, [scale_row_edit(5, 2.0), _scale_features(6, 3.0)])]
    with pytest.raises(tl.errors.ReplayFallbackError) as info:
        replay_forks(forks, steps, one_pass=False)
    assert info.value.strategy == "row batch" and all(_untouched(f) for f in forks)


def test_an_error_in_one_fork_is_handed_back_in_its_place_and_the_others_go_on():
    model, x = _Flipped().eval(), _x()
    trace = tl.trace(model, x)

    def broken(act, *, ctx):
        raise ValueError("edit bug")

    forks = [trace.fork() for _ in range(3)]
    edits = [scale_row_edit(5, 2.0), broken, scale_row_edit(3, 2.0)]
    steps = [Step(f.bind("inner", strings_as_modules=True), e, REPLAY) for f, e in zip(forks, edits)]
    got = replay_forks(forks, steps, one_pass=False)
    assert isinstance(got[1], ValueError) and _untouched(forks[1])
    for fork, p in ((forks[0], 5), (forks[2], 3)):
        assert torch.allclose(fork.output, hooked_forward(model, {"inner": scale_row_hook(p, 2.0)}, (x,)), atol=ATOL)


@pytest.mark.parametrize("how", ["forks", "do", "sweep"])
def test_replayed_forks_and_their_trace_are_freed_without_the_garbage_collector(how):
    """The engine holds its strategies and they hold it: after a replay nothing of that cycle may
    keep the forks (and through them the trace's recorded values) alive until the next GC pass."""
    import gc
    import weakref

    model, x = _Flipped().eval(), _x()
    want = edited_forward(model, "inner", scale_row_hook(5, 2.0), (x,))
    gc.collect()
    gc.disable()
    try:
        trace = tl.trace(model, x)
        if how == "forks":
            forks = trace.forks([("inner", scale_row_edit(5, 2.0)), ("inner", tl.scale(0.5))])
        elif how == "do":
            forks = [trace.fork().do("inner", scale_row_edit(5, 2.0))]
        else:
            with trace.sweep():
                forks = [trace.fork().do("inner", scale_row_edit(5, 2.0)), trace.fork().do("inner", tl.scale(0.5))]
        assert torch.allclose(forks[0].output, want, atol=ATOL)
        alive = [weakref.ref(trace), *map(weakref.ref, forks)]
        del trace, forks
        assert [r() is None for r in alive] == [True] * len(alive)
    finally:
        gc.enable()
