"""``tl.validate``: replays the whole recorded graph and reports where it disagrees.

It must pass on every zoo model, report the first diverging op with its fields, and flag
a model whose control flow depends on an activation instead of passing it.
"""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch
from conftest import BranchyNet, RandnNet
from torch import nn

import torchlens as tl
from torchlens import cli
from torchlens.errors import FunctionsNotResolved, ReplayNotExactError


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


def test_validate_reports_the_first_divergence_with_its_fields(small_mlp, mlp_input):
    trace = tl.trace(small_mlp, mlp_input)
    relu = next(op for op in trace.ops if op.func_name == "relu")
    relu.out[0, 0] += 0.5  # a recorded value the run did not produce
    report = tl.validate(trace, rerun=False)
    assert not report.ok and not report.agrees and report.status == "NOT OK"
    first = report.first_divergence
    assert (first.label, first.func_name, first.source) == (relu.label, "relu", relu.source)
    assert abs(first.max_abs_error - 0.5) < 1e-6
    assert [d.label for d in report.divergences] == [relu.label]  # its readers replay from the recomputed value
    text = report.summary()
    assert text.startswith("validate: NOT OK") and relu.label in text and first.source in text
    assert str(report) == text


def test_the_models_own_randomness_is_reported_as_such_not_as_a_divergence():
    torch.manual_seed(0)
    model, x = RandnNet().eval(), torch.randn(3, 4)
    trace = tl.trace(model, x)
    report = tl.validate(trace)
    assert report.divergences == [] and report.unstable == [] and report.errors == [] and report.agrees
    assert not report.ok and not report.fully_checked and report.status == "NOT FULLY CHECKED"
    (random,) = [u for u in report.unchecked if not u.by_design]
    assert (random.label, random.kind) == ("randn_1", "random")
    assert f"conftest.py:{RandnNet.forward.__code__.co_firstlineno + 2}" in random.reason
    assert "draws random numbers" in random.reason
    # every other op (fc2 reads the recorded noise) is re-issued and agrees
    assert report.n_checked == len(trace.ops) - 2 and [u.label for u in report.unchecked] == ["input_0", "randn_1"]
    assert report.output_max_abs_error is None and "randn_1" in report.output_not_compared
    text = report.summary()
    assert text.startswith("validate: NOT FULLY CHECKED") and "randn_1" in text and "NOT OK" not in text


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
    # every op is accounted for: re-issued and compared, or listed with why not
    assert report.n_checked + len(report.unchecked) == len(trace.ops)
    assert report.status == "NOT OK" and {u.kind for u in report.unchecked} == {"input", "not saved"}


# -- saved traces: every op re-issued and compared, or listed with why not --------------------


def _saved(case, path):
    tl.trace(case.model, *case.args).save(path)
    return json.loads((path / "manifest.json").read_text())


def test_an_untouched_saved_trace_validates_ok_with_its_counts(tiny_gpt2, tmp_path, capsys):
    manifest = _saved(tiny_gpt2, tmp_path / "t")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn about
        loaded = tl.load_trace(tmp_path / "t")
    report = tl.validate(loaded)
    n = len(manifest["ops"])
    assert report.ok and report.fully_checked and report.agrees and report.status == "OK"
    assert (report.n_ops, report.n_checked) == (n, n - 1)
    assert [(u.label, u.kind) for u in report.unchecked] == [("input_0", "input")]
    assert report.summary().splitlines()[0] == f"validate: OK — {n - 1}/{n} ops replayed (not replayed: 1 input)"
    assert cli.main(["validate", str(tmp_path / "t")]) == cli.EXIT_OK == 0
    assert capsys.readouterr().out.startswith("validate: OK")


def test_functions_not_on_the_allow_list_are_named_at_load_and_not_checked(tiny_gpt2, tmp_path, capsys):
    manifest = _saved(tiny_gpt2, tmp_path / "t")
    picked = [op for op in manifest["ops"] if op["func"] == "torch.addmm"][:2]
    labels = [op["label"] for op in picked]
    for op in picked:
        op["func"] = "os.system"
    (tmp_path / "t" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.warns(FunctionsNotResolved) as caught:
        loaded = tl.load_trace(tmp_path / "t")
    (warning,) = caught
    assert all(f"{label} (os.system)" in str(warning.message) for label in labels) and "2 function(s)" in \
        str(warning.message)
    report = tl.validate(loaded)
    n = len(manifest["ops"])
    assert report.agrees and report.divergences == [] and report.errors == []
    assert not report.ok and not report.fully_checked and report.status == "NOT FULLY CHECKED"
    assert (report.n_ops, report.n_checked) == (n, n - 3)
    missing = [u for u in report.unchecked if not u.by_design]
    assert [(u.label, u.kind) for u in missing] == [(label, "unresolved") for label in labels]
    assert all("'os.system' is not on the allow-list" in u.reason for u in missing)
    text = report.summary()
    assert text.splitlines()[0] == f"validate: NOT FULLY CHECKED — {n - 3}/{n} ops replayed " \
                                   "(not replayed: 1 input; 2 unresolved)"
    assert all(label in text for label in labels)
    html = report._repr_html_()
    assert "NOT FULLY CHECKED" in html and all(label in html for label in labels)
    with pytest.raises(ReplayNotExactError):  # what validate warns about: a fork through them refuses
        loaded.fork().do(loaded.input_layers[0], lambda ids: ids.flip(-1))  # ids stay int64 ids
    assert cli.main(["validate", str(tmp_path / "t")]) == cli.EXIT_NOT_FULLY_CHECKED == 4
    out, err = capsys.readouterr()
    assert out.startswith("validate: NOT FULLY CHECKED") and all(label in out for label in labels)
    assert err.startswith("torchlens validate: warning: this saved trace names 2 function(s)")
    # a re-save keeps the names it could not resolve, and loading it warns again
    loaded.save(tmp_path / "again")
    again = json.loads((tmp_path / "again" / "manifest.json").read_text())
    assert [op["func"] for op in again["ops"] if op["label"] in labels] == ["os.system", "os.system"]
    with pytest.warns(FunctionsNotResolved):
        tl.load_trace(tmp_path / "again")


def test_cli_validate_exit_code_is_one_when_something_diverges(small_mlp, mlp_input, tmp_path, capsys):
    tl.trace(small_mlp, mlp_input).save(tmp_path / "t")
    loaded = tl.load_trace(tmp_path / "t")
    relu = next(op for op in loaded.ops if op.func_name == "relu")
    relu.out[0, 0] += 0.5
    shutil.rmtree(tmp_path / "t")
    loaded.save(tmp_path / "t")
    assert cli.main(["validate", str(tmp_path / "t")]) == cli.EXIT_CHECK_FAILED == 1
    assert capsys.readouterr().out.startswith("validate: NOT OK")


class RandomLoop(nn.Module):
    """Eval mode, yet draws random numbers: loops over the positive entries of a fresh randn."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        for i in (torch.randn(16) > 0).nonzero():
            x = self.fc(x) * i.float() / (1 + i.item())
        return x


def _random_loop_trace():
    torch.manual_seed(0)
    model = RandomLoop().eval()
    trace = tl.trace(model, torch.ones(1, 4))  # its draw has 12 positive entries
    torch.manual_seed(2)  # validated under another seed
    return trace


def test_a_guard_on_the_models_own_randomness_gives_a_report_naming_the_random_op():
    trace = _random_loop_trace()
    report = tl.validate(trace)
    assert report.divergences == [] and report.unstable == [] and report.errors == []
    assert report.status == "NOT FULLY CHECKED" and not report.ok
    assert [(u.label, u.kind) for u in report.unchecked] == [("input_0", "input"), ("randn_1", "random")]
    assert report.n_checked == len(trace.ops) - 2
    # the nonzero indices and each .item() read reproduce from the recorded draw
    positive = (trace["randn_1"].out > 0).nonzero().flatten().tolist()
    assert len(positive) == 12
    assert [g.split(" saw ")[1] for g in report.guards[:-1]] == [str(i) for i in positive]
    assert report.guards[-1].startswith("nonzero indices of nonzero_1")
    assert "randn_1" in report.output_not_compared and report.output_max_abs_error is None
    assert "randn_1" in report.summary()


def test_a_path_that_changes_under_validation_is_reported_not_an_index_error():
    trace = _random_loop_trace()
    randn = trace.ops[1]
    assert randn.label == "randn_1" and int((randn.out > 0).sum()) == 12
    randn.out[randn.out > 0] = -1.0  # a corrupted record: the loop over its positive entries runs 0 times
    report = tl.validate(trace, rerun=False)
    assert report.status == "NOT OK"
    assert [d.label for d in report.divergences][:2] == ["gt_1", "nonzero_1"]
    # each reader of an index the replayed loop no longer yields is named, in the graph and in the guards
    lost = [u for u in report.unchecked if u.kind == "failed"]
    assert [u.label for u in lost] == [f"float_{k}" for k in range(1, 13)]
    assert all(f"reads element {k} of unbind_1" in u.reason for k, u in enumerate(lost))
    lost_reads = [u for u in report.unstable if u.startswith("guard item()")]
    assert len(lost_reads) == 12 and all("which the replay no longer produces" in u for u in lost_reads)
    assert report.n_checked + len(report.unchecked) == len(trace.ops)


def test_uninitialised_memory_is_left_out_by_design():
    class Buffered(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            out = torch.empty(x.shape)
            out.copy_(self.fc(x))
            return out.relu()

    torch.manual_seed(0)
    trace = tl.trace(Buffered().eval(), torch.randn(2, 4))
    report = tl.validate(trace)
    assert report.ok and report.status == "OK" and report.output_max_abs_error == 0.0
    assert [(u.label, u.kind) for u in report.unchecked] == [("input_0", "input"), ("empty_1", "uninitialised")]
    assert report.n_checked == len(trace.ops) - 2


def test_dropout_left_on_by_training_mode_is_named_with_model_eval(tiny_gpt2):
    model, (ids,) = tiny_gpt2.model, tiny_gpt2.args
    model.train()
    try:
        trace = tl.trace(model, ids)
    finally:
        model.eval()
    report = tl.validate(trace)
    random = [u for u in report.unchecked if u.kind == "random"]
    assert [u.label for u in random] == [op.label for op in trace.ops if op.func_name in (
        "dropout", "scaled_dot_product_attention")]
    assert len(random) == 7 and all("call model.eval() before capturing" in u.reason for u in random)
    assert report.divergences == [] and report.agrees and report.status == "NOT FULLY CHECKED"
    assert report.n_checked == len(trace.ops) - 8 and report.output_max_abs_error is None


def test_a_capture_time_edit_validates_against_the_edited_forward_and_unsaved_it_is_not_checked(
        small_mlp, mlp_input, tmp_path):
    trace = tl.trace(small_mlp, mlp_input, intervene=tl.when("fc1", lambda out: out * 2))  # a plain function
    report = tl.validate(trace)
    assert report.ok and report.output_max_abs_error == 0.0 and report.n_checked == len(trace.ops) - 1
    trace.save(tmp_path / "t")
    loaded = tl.load_trace(tmp_path / "t")
    report = tl.validate(loaded)
    assert report.status == "NOT FULLY CHECKED" and report.agrees
    (edit,) = [u for u in report.unchecked if not u.by_design]
    assert (edit.label, edit.kind) == ("edit_1", "edit not saved") and "was not saved with the trace" in edit.reason
    assert report.n_checked == len(loaded.ops) - 2
