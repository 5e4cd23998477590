"""``tl.validate``: replays the whole recorded graph and reports where it disagrees.

It must pass on every zoo model, report the first diverging op with its fields, and flag
a model whose control flow depends on an activation instead of passing it.
"""

from __future__ import annotations

import torch
from conftest import BranchyNet, RandnNet
from torch import nn

import torchlens as tl


def test_validate_passes_on_every_zoo_model(zoo_case, zoo_traces):
    case, trace = zoo_traces(zoo_case.name)
    report = tl.validate(trace)
    assert report.ok, report.summary()
    assert report.first_divergence is None and report.divergences == [] and report.unstable == []
    assert report.n_ops == len(trace.ops)
    assert report.n_checked == len([op for op in trace.ops if not op.is_input])
    assert report.output_max_abs_error == 0.0
    assert report.summary().startswith("validate: OK")
    assert trace.validate().ok  # the method form


def test_validate_reports_the_first_divergence_with_its_fields():
    torch.manual_seed(0)
    model, x = RandnNet().eval(), torch.randn(3, 4)
    trace = tl.trace(model, x)
    report = tl.validate(trace, rerun=False)
    assert not report.ok
    first = report.first_divergence
    assert first.label == "randn_1" and first.func_name == "randn"
    assert first.max_abs_error > 0.1
    assert first.source.endswith(f":{RandnNet.forward.__code__.co_firstlineno + 2}")
    labels = [d.label for d in report.divergences]
    assert labels[0] == "randn_1" and "linear_2" in labels  # and what it fed
    text = report.summary()
    assert "NOT OK" in text and "randn_1" in text and first.source in text
    assert str(report) == text


def test_validate_with_a_stricter_or_looser_tolerance(tiny_gpt2, zoo_traces):
    case, trace = zoo_traces("tiny_gpt2")
    assert tl.validate(trace, atol=0.0).n_checked == len(trace.ops) - 1
    assert tl.validate(trace, atol=1.0, rerun=False).ok


def test_a_data_dependent_branch_is_a_guard_note_not_a_failure():
    torch.manual_seed(0)
    model, x = BranchyNet().eval(), torch.randn(2, 4)
    trace = tl.trace(model, x)
    report = tl.validate(trace)
    assert report.ok and report.divergences == [] and report.unstable == []  # the capture is exact
    (guard,) = report.guards
    line = BranchyNet.forward.__code__.co_firstlineno + 2
    assert f"conftest.py:{line}" in guard and "bool()" in guard and "saw True" in guard
    assert "1 guard(s)" in report.summary() and "OK" in report.summary() and "NOT OK" not in report.summary()


def test_a_branch_on_the_input_alone_is_not_unstable():
    class InputBranch(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 2)

        def forward(self, x):
            if x.sum() > 0:  # decided by the input: no edit of an activation can flip it
                return self.fc(x)
            return self.fc(-x)

    torch.manual_seed(0)
    model, x = InputBranch().eval(), torch.randn(2, 4)
    report = tl.validate(tl.trace(model, x))
    assert report.ok, report.summary()


def test_validate_refuses_a_trace_with_unsaved_values(small_mlp, mlp_input):
    trace = tl.trace(small_mlp, mlp_input, save="fc2")
    report = tl.validate(trace)
    assert not report.ok and report.errors and "save=" in report.errors[0]
