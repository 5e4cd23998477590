"""``tl.debug.compare``: alignment, first divergence at the edited site, and the numbers, by value.

Differences reported by compare are checked against hand computations on the model's
own submodules (``max_abs`` of ``scale(2)`` is ``max |y|``), never only against TorchLens.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import torchlens as tl
from torchlens.errors import InvalidArgumentError

IDS = torch.tensor([[1, 2, 3, 4, 5]])


@pytest.fixture(scope="module")
def clean(gpt2):
    return tl.trace(gpt2, IDS)


def test_a_trace_against_itself_and_a_recapture_has_no_difference(gpt2, clean):
    for other in (clean, tl.trace(gpt2, IDS)):
        report = tl.debug.compare(clean, other)
        assert report.same and not report and report.first_divergence is None
        assert report.only_in_a == report.only_in_b == []
        assert len(report.diffs) == len(clean.ops) + len(clean.calls)
        assert all(d.max_abs == 0.0 and not d.diverged for d in report.diffs)
        assert "no differences" in str(report)


def test_replayed_module_edit_diverges_first_at_that_module(gpt2, clean):
    fork = clean.fork("edited").do(tl.module("transformer.h.1.mlp"), tl.scale(0.5))
    report = tl.debug.compare(clean, fork)
    first = report.first_divergence
    assert (first.kind, first.key, first.label, first.func) == ("module", "transformer.h.1.mlp:1",
                                                                "transformer.h.1.mlp", "GPT2MLP")
    assert "edited" in first.note
    # the source line is the model line that produced the module's output
    out_op = clean.ops[clean["transformer.h.1.mlp"].record.out_refs[0].index]
    assert first.source == out_op.source and "modeling_gpt2.py" in first.source
    y = clean["transformer.h.1.mlp"].out
    assert first.max_abs == pytest.approx(float((y * 0.5 - y).abs().max()), rel=1e-6)
    assert first.max_rel == pytest.approx(0.5, rel=1e-6)
    # everything that ran before the edit agrees exactly
    before = report.diffs[: report.diffs.index(first)]
    assert before and all(not d.diverged and d.max_abs == 0.0 for d in before)
    assert report.diverged[-1].label == "<root>"


def test_replayed_op_edit_diverges_first_at_that_op(mlp, x):
    trace = tl.trace(mlp, x)
    relu = trace.find_sites(tl.func("relu")).first().label
    fork = trace.fork().do(relu, tl.zero_ablate())
    report = tl.debug.compare(trace, fork)
    first = report.first_divergence
    assert (first.kind, first.label, first.func) == ("op", relu, "relu")
    with torch.no_grad():
        h = torch.relu(mlp.fc1(x))
        after = mlp.fc2(torch.zeros_like(h)) - mlp.fc2(h)
    assert first.max_abs == pytest.approx(float(h.abs().max()), rel=1e-6)
    assert first.source.endswith(f":{trace[relu].record._lineno}")
    last = next(d for d in report.diffs if d.label == "fc2")
    assert last.max_abs == pytest.approx(float(after.abs().max()), rel=1e-5)


def test_capture_time_edits_diverge_at_the_edited_site(gpt2, clean):
    at_module = tl.trace(gpt2, IDS, intervene=tl.when(tl.module("transformer.h.0.mlp"), tl.scale(0.5)))
    report = tl.debug.compare(clean, at_module)
    assert report.first_divergence.key == "transformer.h.0.mlp:1"
    assert report.only_in_b == ["edit_1"] and report.only_in_a == []
    tanh = clean.find_sites(tl.func("tanh")).first().label
    at_op = tl.trace(gpt2, IDS, intervene=tl.when(tanh, tl.zero_ablate()))
    first = tl.debug.compare(clean, at_op).first_divergence
    assert (first.kind, first.label, first.note) == ("op", tanh, "edited")
    assert first.max_abs == pytest.approx(float(clean[tanh].out.abs().max()), rel=1e-6)
    # the same edit on both sides: nothing differs
    assert tl.debug.compare(at_op, tl.trace(gpt2, IDS, intervene=tl.when(tanh, tl.zero_ablate()))).same


def test_different_inputs_diverge_at_the_input(gpt2, clean):
    report = tl.debug.compare(clean, tl.trace(gpt2, torch.tensor([[1, 2, 3, 4, 6]])))
    first = report.first_divergence
    assert (first.kind, first.label) == ("op", "input_0")
    assert first.max_abs == 1.0


def test_tolerances_decide_what_diverges(mlp, x):
    trace = tl.trace(mlp, x)
    fork = trace.fork().do("fc1", lambda a: a + 1e-4)
    assert tl.debug.compare(trace, fork).first_divergence.label == "fc1"
    loose = tl.debug.compare(trace, fork, atol=1e-3)
    assert loose.same and max(d.max_abs for d in loose.diffs) == pytest.approx(1e-4, rel=1e-2)
    assert tl.debug.compare(trace, fork, atol=0, rtol=1.0).same


def test_ops_and_modules_only_in_one(mlp, x):
    torch.manual_seed(0)
    deeper = nn.Sequential()
    deeper.fc1, deeper.act, deeper.fc2 = mlp.fc1, mlp.act, mlp.fc2
    deeper.extra = nn.Tanh()
    report = tl.debug.compare(tl.trace(mlp, x), tl.trace(deeper, x))
    assert report.only_in_b == ["tanh_1", "extra:1"] and report.only_in_a == []
    assert report.first_divergence is None or report.first_divergence.kind == "module"
    assert not report.same


def test_loaded_traces_compare_like_the_originals(gpt2, clean, tmp_path):
    fork = clean.fork().do(tl.module("transformer.h.0"), tl.scale(0.0))
    loaded_clean = tl.load_trace(clean.save(tmp_path / "c"))
    loaded_fork = tl.load_trace(fork.save(tmp_path / "f"))
    assert tl.debug.compare(clean, loaded_clean).same
    a, b = tl.debug.compare(clean, fork), tl.debug.compare(loaded_clean, loaded_fork)
    assert a.first_divergence.key == b.first_divergence.key == "transformer.h.0:1"
    assert [d.max_abs for d in a.diffs] == [d.max_abs for d in b.diffs]


def test_unsaved_values_are_reported_not_compared(gpt2):
    part = tl.trace(gpt2, IDS, save=tl.module("transformer.h.1"))
    report = tl.debug.compare(part, part)
    skipped = [d for d in report.diffs if d.note == "not saved"]
    assert skipped and all(d.max_abs is None and not d.diverged for d in skipped)
    assert report.same


def test_table_and_machine_readable_form(gpt2, clean):
    fork = clean.fork("edited").do(tl.module("transformer.h.1"), tl.scale(2.0))
    report = tl.debug.compare(clean, fork)
    text = report.table(limit=3)
    lines = text.splitlines()
    assert lines[0].startswith("compare 'trace' vs 'edited'") and "first divergence: module transformer.h.1" in text
    assert "┏" in text and "┃ site" in text and "└" in text
    assert sum(line.startswith("│") for line in lines) == 3 and "more diverging site" in lines[-1]
    data = report.to_dict()
    json.dumps(data, allow_nan=False)  # strict JSON
    assert data["same"] is False and data["first_divergence"]["key"] == "transformer.h.1:1"
    assert data["n_compared"] == len(data["diffs"]) and data["n_diverged"] == len(report.diverged)
    block = clean["transformer.h.1"].out
    block = block if isinstance(block, torch.Tensor) else block[0]
    assert data["first_divergence"]["shape_a"] == data["first_divergence"]["shape_b"] == list(block.shape)
    assert "2 diverge" not in repr(report) and repr(report).startswith("<Comparison")


def test_shape_changes_are_infinite_differences(mlp, x):
    a = tl.trace(mlp, x)
    b = tl.trace(mlp, x[:2])
    report = tl.debug.compare(a, b)
    first = report.first_divergence
    assert first.label == "input_0" and first.note == "shape" and first.max_abs == float("inf")
    assert report.to_dict()["first_divergence"]["max_abs"] == "inf"


def test_bad_arguments(mlp, x):
    trace = tl.trace(mlp, x)
    with pytest.raises(InvalidArgumentError):
        tl.debug.compare(trace, torch.zeros(1))
    with pytest.raises(InvalidArgumentError):
        tl.debug.compare(trace, trace, atol=-1)
