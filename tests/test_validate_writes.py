"""Validate and replay through writes into shared memory: a buffer made by ``new_empty`` and filled
through slice ``copy_`` (latent attention), a write into a view followed by reads of other regions of
the same memory (multi-axis rotary), ``x[1:] += y`` (AltUp); and a model's own randomness.

Every replay is compared with a forward whose edit a plain ``register_forward_hook`` made (or, for
an op-level edit, the real forward re-executed with the edit), never with TorchLens's own replay.
"""

from __future__ import annotations

import pytest
import torch
from conftest import LatentFill, OwnRandom, ReturnsState, SliceIAdd, ViewWriteRead, edited_forward, tiny_hf
from hypothesis import HealthCheck, given, settings
from test_exact_values import PROGRAMS, GrammarNet, _input

import torchlens as tl
from torchlens.errors import ReplayNotExactError

X = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(0))


def halve(value):
    return value * 0.5


def _built(kind):
    torch.manual_seed(0)
    return {"latent": LatentFill, "latent_out": lambda: LatentFill(returns_buffer=True), "view_write": ViewWriteRead,
            "slice_iadd": SliceIAdd}[kind]().eval()


@pytest.mark.parametrize("kind", ["latent", "latent_out", "view_write", "slice_iadd"])
def test_writes_through_views_validate_ok_and_replay_equals_a_hooked_forward(kind):
    model = _built(kind)
    trace = tl.trace(model, X)
    with torch.no_grad():
        assert torch.equal(trace.output, model(X))  # the capture is the plain forward, bit for bit
    assert trace.stale_positions(), "the construct writes memory other recorded tensors view"
    report = tl.validate(trace)
    assert report.status == "OK", report.summary()
    assert not report.divergences and not report.unstable and report.output_max_abs_error == 0.0
    assert report.n_checked + len(report.unchecked) == len(trace.ops)
    recorded = trace.output.clone()
    fork = trace.fork().do("mlp", lambda a, ctx: a * 0.5)
    want = edited_forward(model, "mlp", halve, (X,))
    assert [e.how for e in fork.edits] == ["replayed"]  # pushed down the recorded graph, not re-executed
    assert torch.allclose(fork.output, want, atol=1e-6)
    assert not torch.allclose(want, recorded, atol=1e-3)  # the edit reaches the output through the writes
    assert torch.equal(trace.output, recorded)  # the parent trace is as it was


def test_the_filled_buffer_reads_as_produced_and_its_readers_see_the_writes():
    """The op that allocated the buffer keeps what it produced (its memory before the writes); the
    buffer's readers saw it filled: the replayed reader equals the concatenation the writes made."""
    model = _built("latent")
    trace = tl.trace(model, X)
    fork = trace.fork().do("nope", lambda a, ctx: a + 1.0)
    k_nope, k_rot = fork["nope"].out, model.rope(model.mlp(X)).detach().expand(2, 3, 2)
    reader = next(op for op in trace.ops if op.func_name == "linear" and op.module == "out")
    assert torch.allclose(fork.value(reader.index), torch.nn.functional.linear(
        torch.cat([k_nope, k_rot], -1), model.out.weight, model.out.bias), atol=1e-6)


def test_two_writes_into_one_view_reach_every_later_reader():
    """``thw`` is written twice; ``freq`` is read between the writes and after both (a copied record
    whose memory the second write reaches too): validate checks each read against the forward."""
    model = _built("view_write")
    trace = tl.trace(model, X)
    writes = [op.label for op in trace.ops if op.func_name == "setitem"]
    assert len(writes) == 2
    report = tl.validate(trace)
    assert report.ok, report.summary()


def test_a_write_replay_cannot_lay_out_again_is_named_by_validate_and_refused_by_replay():
    """A write through a view that reinterprets the bytes (``view(torch.int32)``): validate says the
    reader is not checked, naming the write; replay refuses by name and leaves the fork unchanged."""
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    model = ReturnsState(overwrite=True, reinterpret=True).eval()

    class Reads(torch.nn.Module):  # reads the state after the write
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, x):
            out, held = self.inner(x)
            return out + held.t.sum(-1)

    wrapper = Reads().eval()
    trace = tl.trace(wrapper, x)
    report = tl.validate(trace)
    assert report.status == "NOT FULLY CHECKED" and not report.divergences, report.summary()
    written = [u for u in report.unchecked if u.kind == "written through a view"]
    assert len(written) == 1 and "zero_" in written[0].reason and "reinterprets the dtype" in written[0].reason
    fork = trace.fork()
    with pytest.raises(ReplayNotExactError, match="zero_") as err:
        fork.do("inner.fc1", tl.scale(2.0))
    assert "model=model, inputs=x" in err.value.remedy
    assert fork.edits == [] and torch.equal(fork.output, trace.output)
    real = trace.fork().do("inner.fc1", tl.scale(2.0), model=wrapper, inputs=x)  # the remedy
    assert torch.allclose(real.output, edited_forward(wrapper, "inner.fc1", lambda o: o * 2, (x,)), atol=1e-6)


def test_a_loaded_trace_keeps_no_write_layout_and_refuses_by_name(tmp_path):
    model = _built("latent")
    loaded = tl.load_trace(tl.trace(model, X).save(tmp_path / "t"))
    report = tl.validate(loaded, rerun=False)
    assert report.status == "NOT FULLY CHECKED" and not report.divergences, report.summary()
    assert any(u.kind == "written through a view" and "loaded from disk" in u.reason for u in report.unchecked)
    with pytest.raises(ReplayNotExactError, match="loaded from disk"):
        loaded.fork().do("mlp", tl.scale(0.5))


def test_the_models_own_randomness_is_reported_as_such_and_replay_through_it_refuses():
    torch.manual_seed(0)
    model = OwnRandom().eval()
    with pytest.warns(tl.errors.RandomOpsWarning, match="the model's forward itself draws random numbers"):
        trace = tl.trace(model, X)
    report = tl.validate(trace)
    assert report.status == "NOT FULLY CHECKED" and not report.divergences and not report.unstable
    random = [u for u in report.unchecked if u.kind == "random"]
    assert [u.label for u in random] == ["randn_1", "rand_like_1"]
    assert all("the model's own randomness" in u.reason for u in random)
    assert "draws random numbers" in report.output_not_compared
    fork = trace.fork()
    with pytest.raises(ReplayNotExactError, match="rand_like_1"):  # downstream of the MLP: a new draw
        fork.do("mlp", tl.scale(0.5))
    assert fork.edits == [] and torch.equal(fork.output, trace.output)


# -- the transformers families the constructs come from (tiny random configs, CPU) ---------------------


@pytest.mark.parametrize("kind,upstream", [
    ("deepseek_v3", "model.layers.0.self_attn.kv_b_proj"),  # feeds the buffer expand_kv fills by slice copy_
    ("gemma3n", "model.layers.0.mlp"),  # feeds corrected_predictions[1:] += first_prediction
])
def test_transformers_families_validate_ok_and_replay_upstream_of_the_write_equals_hooks(kind, upstream):
    model, ids = tiny_hf(kind)
    trace = tl.trace(model, ids)
    with torch.no_grad():
        assert torch.equal(trace.output.logits, model(ids).logits)
    assert trace.stale_positions()
    report = tl.validate(trace)
    assert report.status == "OK", report.summary()
    for site in dict.fromkeys([upstream, "model.layers.0.mlp"]):
        fork = trace.fork().do(site, lambda a, ctx: a * 0.5)
        want = edited_forward(model, site, halve, (ids,))
        assert [e.how for e in fork.edits] == ["replayed"]
        assert torch.allclose(fork.output.logits, want.logits, atol=1e-5)
        assert not torch.allclose(want.logits, trace.output.logits, atol=1e-4)


def test_qwen3_5_rotary_written_through_a_view_replays_an_edit_upstream_of_the_write():
    """Qwen 3.5's rotary writes frequencies of two axes into a view of the first one's, then reads
    the others: an edit of the sines before the write, replayed, equals the real forward re-executed
    with the same edit; validate is OK."""
    model, ids = tiny_hf("qwen3_5")
    trace = tl.trace(model, ids)
    with torch.no_grad():
        assert torch.equal(trace.output.logits, model(ids).logits)
    assert trace.stale_positions()
    report = tl.validate(trace)
    assert report.status == "OK", report.summary()
    sin = next(op.label for op in trace.ops if op.func_name == "sin")
    replayed = trace.fork().do(sin, lambda a, ctx: a * 0.5)
    real = trace.fork().do(sin, lambda a, ctx: a * 0.5, model=model, inputs=ids)
    assert [e.how for e in replayed.edits] == ["replayed"]
    assert torch.allclose(replayed.output.logits, real.output.logits, atol=1e-5)
    assert not torch.allclose(real.output.logits, trace.output.logits, atol=1e-4)
    fork = trace.fork().do("model.layers.0.mlp", lambda a, ctx: a * 0.5)
    assert torch.allclose(fork.output.logits, edited_forward(model, "model.layers.0.mlp", halve, (ids,)).logits,
                          atol=1e-5)


def test_reformer_randomness_is_reported_as_its_own_not_as_divergence():
    model, ids = tiny_hf("reformer")
    with pytest.warns(tl.errors.RandomOpsWarning):
        trace = tl.trace(model, ids)
    report = tl.validate(trace)
    assert report.status == "NOT FULLY CHECKED" and not report.divergences and not report.errors, report.summary()
    random = [u for u in report.unchecked if u.kind == "random"]
    assert random and all("the model's own randomness" in u.reason for u in random)


# -- random programs of in-place writes through views ---------------------------------------------------


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(PROGRAMS)
def test_random_programs_of_writes_through_views_validate_without_divergence(program):
    """Programs of producers and in-place writes through views (slices, transposes, rows, tuple
    elements, ``out=``, ``_foreach_add_``): every op validate re-issues agrees with the forward; an op
    it does not re-issue is an input, uninitialised memory, or a read of a write it names."""
    model = GrammarNet(program)
    with torch.no_grad():
        trace = tl.trace(model, _input())
        report = tl.validate(trace, rerun=False)  # the model changes its own input: a second forward differs
    assert not report.divergences and not report.unstable and not report.errors, report.summary()
    assert {u.kind for u in report.unchecked} <= {"input", "uninitialised", "written through a view", "not replayable"}
    assert all("share memory" in u.reason for u in report.unchecked if u.kind == "not replayable")
    assert report.n_checked + len(report.unchecked) == len(trace.ops)


@settings(max_examples=120, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(PROGRAMS)
def test_random_programs_replay_an_upstream_edit_as_a_hooked_forward_or_refuse_by_name(program):
    """The same programs, led by a module whose output the fork halves: the replayed output equals a
    forward whose hook halves it, or replay refuses with a typed error (a changed guard, such as the
    indices ``topk`` chose; a write it cannot lay out again) and leaves the fork as it was."""
    model = GrammarNet([("scale", 0, 0), *program])
    with torch.no_grad():
        trace = tl.trace(model, _input())
        want = edited_forward(model, "scale", halve, (_input(),))
    fork = trace.fork()
    try:
        fork.do("scale", lambda a, ctx: a * 0.5, replay="strict")
    except ReplayNotExactError:
        assert fork.edits == []
        return
    got = [t for t in fork.output if isinstance(t, torch.Tensor)]
    assert len(got) == len(want) and all(torch.allclose(a, b, atol=1e-5) for a, b in zip(got, want))
