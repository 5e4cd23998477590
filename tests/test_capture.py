"""``tl.trace``: the fields of every recorded op and module call, checked by value.

The custom models live in ``conftest.py``; their source lines are looked up with
``inspect`` so the ``source`` checks are exact. Reference values come from plain forward
hooks (cloned inside the hook: the value at that moment) or from hand computation.
"""

from __future__ import annotations

import copy
import inspect
import linecache
import os
import warnings

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    TINY_GPT2_IDS,
    ControlFlowNet,
    InPlaceNet,
    RaisingNet,
    SharedTwice,
    assert_equal_tree,
    assert_model_clean,
    build_tiny_gpt2,
    global_state,
    hook_reads,
    hook_state,
    hooked_forward,
)

import torchlens as tl
from torchlens.core.records import RANDOM
from torchlens.errors import (
    AmbiguousSiteError,
    RandomForwardError,
    RandomOpsWarning,
    TooManySitesError,
    ValueNotSavedError,
)


def _line_of(cls: type, fragment: str) -> str:
    """``file:line`` of the one line of ``cls.forward`` containing ``fragment``."""
    lines, start = inspect.getsourcelines(cls.forward)
    hits = [start + i for i, text in enumerate(lines) if fragment in text]
    assert len(hits) == 1, f"{fragment!r} found {len(hits)} times in {cls.__name__}.forward"
    return f"{cls.forward.__code__.co_filename}:{hits[0]}"


# -- op fields -------------------------------------------------------------------------------


def test_op_fields_of_a_model_with_in_place_ops(inplace_net):
    model, (x,) = inplace_net.model, inplace_net.args
    trace = tl.trace(model, x)
    ops = [op for op in trace.ops if not op.is_input]
    assert [(op.label, op.func_name, op.module, op.module_pass) for op in ops] == [
        ("linear_1", "linear", "fc1", 1),
        ("relu_1", "relu_", "", 1),
        ("linear_2", "linear", "fc2", 1),
        ("add_1", "add_", "", 1),
        ("setitem_1", "setitem", "", 1),
        ("linear_3", "linear", "fc3", 1),
    ]
    assert [op.source for op in ops] == [
        _line_of(InPlaceNet, "h = self.fc1(x)"),
        _line_of(InPlaceNet, "h.relu_()"),
        _line_of(InPlaceNet, "g = self.fc2(h)"),
        _line_of(InPlaceNet, "g += h"),
        _line_of(InPlaceNet, "g[:, :2] = 0.5"),
        _line_of(InPlaceNet, "return self.fc3(g)"),
    ]
    assert trace["relu_1"].parents == ["linear_1"]
    assert sorted(trace["relu_1"].children) == ["add_1", "linear_2"]
    assert trace["add_1"].parents == ["linear_2", "relu_1"]
    assert trace["setitem_1"].parents == ["add_1"] and trace["linear_3"].parents == ["setitem_1"]
    assert trace.input_layers == ["input_0"] and trace.output_layers == ["linear_3"]
    assert trace["linear_3"].children == []


def test_in_place_ops_do_not_change_recorded_values(inplace_net):
    model, (x,) = inplace_net.model, inplace_net.args
    trace = tl.trace(model, x)
    w = {name: p.detach() for name, p in model.named_parameters()}
    h = F.linear(x, w["fc1.weight"], w["fc1.bias"])
    assert (h < 0).any(), "the test needs negative pre-activations to see relu_ at work"
    relu = h.clamp(min=0)
    g = F.linear(relu, w["fc2.weight"], w["fc2.bias"])
    summed = g + relu
    assigned = summed.clone()
    assigned[:, :2] = 0.5
    assert torch.allclose(trace["linear_1"].out, h, atol=1e-6)  # before relu_ overwrote it
    assert torch.equal(trace["fc1"].out, trace["linear_1"].out)
    assert torch.allclose(trace["relu_1"].out, relu, atol=1e-6)
    assert torch.allclose(trace["linear_2"].out, g, atol=1e-6)  # before += overwrote it
    assert torch.equal(trace["fc2"].out, trace["linear_2"].out)
    assert torch.allclose(trace["add_1"].out, summed, atol=1e-6)  # before the slice assignment
    assert torch.allclose(trace["setitem_1"].out, assigned, atol=1e-6)
    assert torch.allclose(trace.output, F.linear(assigned, w["fc3.weight"], w["fc3.bias"]), atol=1e-6)
    # and those are exactly what plain hooks saw at that moment
    reads, _ = hook_reads(model, (x,))
    assert torch.equal(trace["fc1"].out, reads["fc1"][0]) and torch.equal(trace["fc2"].out, reads["fc2"][0])


def test_source_points_at_the_model_file_and_line(shared_twice, control_flow, tiny_gpt2):
    trace = tl.trace(shared_twice.model, *shared_twice.args)
    assert trace["linear_1"].source == _line_of(SharedTwice, "h = self.inp(x)")
    assert trace["linear_2"].source == _line_of(SharedTwice, "h = self.block(h)\n")
    assert trace["tanh_2"].source == trace["add_1"].source == _line_of(SharedTwice, "self.block(h) + h")
    trace = tl.trace(control_flow.model, *control_flow.args, **control_flow.kwargs)
    loop_line = _line_of(ControlFlowNet, "x = torch.tanh(self.step(x))")
    assert [op.source for op in trace.ops if op.func_name == "tanh"] == [loop_line] * 3
    assert trace.find_sites(tl.func("linear")).labels[-1] == trace.output_layers[0]
    assert trace[trace.output_layers[0]].source == _line_of(ControlFlowNet, "return self.head_a(x)")
    # in a library model the source is the library's model code, never torch or torchlens
    trace = tl.trace(tiny_gpt2.model, *tiny_gpt2.args)
    for op in trace.ops[1:]:
        path = op.source.rsplit(":", 1)[0]
        assert os.sep + "torch" + os.sep not in path and os.sep + "torchlens" + os.sep not in path, op
        assert "transformers" in path, op
    ln = trace.find_sites(tl.func("layer_norm") & tl.in_module("transformer.h.0.ln_1")).first()
    path, line = ln.source.rsplit(":", 1)
    assert "self.ln_1(" in linecache.getline(path, int(line))


def test_ops_no_module_owns_are_recorded(cnn, tuple_out):
    trace = tl.trace(cnn.model, *cnn.args)
    (add,) = trace.find_sites(tl.func("add") & tl.in_module(""))
    assert add.module == ""
    reads, _ = hook_reads(cnn.model, cnn.args)
    assert torch.equal(add.out, F.relu(reads["bn1"][0]) + reads["bn2"][0])
    flatten = trace.find_sites(tl.func("flatten")).first()
    assert torch.equal(flatten.out, reads["pool"][0].flatten(1))
    trace = tl.trace(tuple_out.model, *tuple_out.args)
    (mul,) = trace.find_sites(tl.func("mul"))
    a, b = reads_pair = hook_reads(tuple_out.model, tuple_out.args)[0]["pair"][0]
    assert torch.equal(mul.out, a * b) and mul.module == ""
    assert len(reads_pair) == 2


def test_getitem_cat_and_tensor_methods_are_ops():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            h = self.lin(x)
            first = h[:, :2]
            both = torch.cat([first, x[:, 2:]], dim=-1)
            return both.softmax(-1).sum(0)

    torch.manual_seed(0)
    model, x = Net().eval(), torch.randn(3, 4)
    trace = tl.trace(model, x)
    names = [op.func_name for op in trace.ops[1:]]
    assert names == ["linear", "getitem", "getitem", "cat", "softmax", "sum"]
    h = model.lin(x).detach()
    assert torch.equal(trace["getitem_1"].out, h[:, :2])
    assert torch.equal(trace["getitem_2"].out, x[:, 2:])
    assert trace["getitem_2"].parents == ["input_0"]
    assert trace["cat_1"].parents == ["getitem_1", "getitem_2"]
    assert torch.equal(trace["cat_1"].out, torch.cat([h[:, :2], x[:, 2:]], -1))
    assert torch.allclose(trace.output, torch.cat([h[:, :2], x[:, 2:]], -1).softmax(-1).sum(0))


# -- module calls, passes and lookups ---------------------------------------------------------


def test_multi_pass_module_has_address_colon_pass(shared_twice):
    model, args = shared_twice.model, shared_twice.args
    trace = tl.trace(model, *args)
    reads, _ = hook_reads(model, args)
    assert torch.equal(trace["block:1"].out, reads["block"][0])
    assert torch.equal(trace["block:2"].out, reads["block"][1])
    assert not torch.equal(trace["block:1"].out, trace["block:2"].out)
    assert trace["block:2"].pass_index == 2 and trace["block:2"].address == "block"
    assert trace["block:2"].op_labels == ["linear_3", "tanh_2"]
    assert [(op.module, op.module_pass) for op in trace.ops if op.label in ("linear_3", "tanh_2")] == [
        ("block.0", 2), ("block.1", 2)]
    with pytest.raises(AmbiguousSiteError) as err:
        trace["block"]
    assert err.value.passes == ["block:1", "block:2"] and err.value.remedy
    assert "block:1" in str(err.value) and "block:2" in str(err.value)
    assert "block" not in trace and "block:2" in trace and "block:3" not in trace
    assert trace["inp"].out is trace["inp:1"].out or torch.equal(trace["inp"].out, trace["inp:1"].out)
    assert [s.label for s in trace.modules] == [
        "", "inp", "block:1", "block.0:1", "block.1:1", "block:2", "block.0:2", "block.1:2", "out"]
    # every pass's input is what the plain forward passed in
    assert torch.equal(trace["block:2"].args[0], reads["block"][0])


def test_loop_passes_and_a_branch_that_did_not_run(control_flow):
    model, args, kwargs = control_flow.model, control_flow.args, control_flow.kwargs
    trace = tl.trace(model, *args, **kwargs)
    reads, _ = hook_reads(model, args, kwargs)
    assert len(reads["step"]) == 3
    for i in range(3):
        assert torch.equal(trace[f"step:{i + 1}"].out, reads["step"][i])
    assert [op.module_pass for op in trace.ops if op.func_name == "linear"][:3] == [1, 2, 3]
    assert "head_b" not in trace and "head_a" in trace
    trace_b = tl.trace(model, *args, mode="b")
    assert "head_b" in trace_b and "head_a" not in trace_b
    assert torch.equal(trace_b.output, model(*args, mode="b"))


def test_trace_getitem_by_label_address_and_index(tiny_gpt2):
    model, (ids,) = tiny_gpt2.model, tiny_gpt2.args
    trace = tl.trace(model, ids)
    reads, _ = hook_reads(model, (ids,))
    block = trace["transformer.h.0"]
    assert block.kind == "module" and torch.equal(block.out, reads["transformer.h.0"][0])
    attn = trace["transformer.h.0.attn"]
    assert isinstance(attn.out, tuple)
    assert_equal_tree(attn.out, reads["transformer.h.0.attn"][0])
    op = trace[trace.output_layers[0]]
    assert op.kind == "op" and torch.equal(op.out, reads["lm_head"][0])
    assert trace[0].label == "input_0" and trace[0].out is ids
    assert trace[op.label].record is op.record
    assert len(trace) == len(trace.layers)


def test_module_returning_tuple_and_dict(tuple_out, dict_out):
    trace = tl.trace(tuple_out.model, *tuple_out.args)
    reads, out = hook_reads(tuple_out.model, tuple_out.args)
    assert type(trace["pair"].out) is tuple
    assert_equal_tree(trace["pair"].out, reads["pair"][0])
    assert type(trace.output) is tuple and len(trace.output) == 2
    assert_equal_tree(trace.output, out)
    trace = tl.trace(dict_out.model, *dict_out.args)
    reads, out = hook_reads(dict_out.model, dict_out.args)
    assert type(trace["enc"].out) is dict and list(trace["enc"].out) == ["h", "gate"]
    assert_equal_tree(trace["enc"].out, reads["enc"][0])
    assert list(trace.output) == ["logits", "features", "gate"]
    assert_equal_tree(trace.output, out)
    assert set(trace.output_layers) == {"linear_2", "relu_1", "softmax_1"}


# -- find_sites ---------------------------------------------------------------------------------


def test_find_sites_selectors_and_combinations(shared_twice):
    trace = tl.trace(shared_twice.model, *shared_twice.args)
    assert trace.find_sites(tl.module("block")).labels == ["block:1", "block:2"]
    assert trace.find_sites(tl.module("block:2")).labels == ["block:2"]
    assert trace.find_sites(tl.in_module("block")).labels == ["linear_2", "tanh_1", "linear_3", "tanh_2"]
    assert trace.find_sites(tl.in_module("block:2")).labels == ["linear_3", "tanh_2"]
    assert trace.find_sites(tl.func("linear")).labels == ["linear_1", "linear_2", "linear_3", "linear_4"]
    assert trace.find_sites("tanh_2").labels == ["tanh_2"]
    assert trace.find_sites(tl.func("linear") & tl.in_module("block")).labels == ["linear_2", "linear_3"]
    assert trace.find_sites(tl.func("tanh") | "out").labels == ["tanh_1", "tanh_2", "out"]
    assert trace.find_sites(["inp", "linear_4"]).labels == ["inp", "linear_4"]
    found = trace.find_sites(tl.func("tanh"))
    assert len(found) == 2 and [s.label for s in found] == ["tanh_1", "tanh_2"]
    assert found.first().label == "tanh_1" and found[1].label == "tanh_2"
    reads, _ = hook_reads(shared_twice.model, shared_twice.args)
    assert torch.equal(found.first().out, reads["block.1"][0])
    assert torch.equal(found[1].out, reads["block.1"][1])
    assert torch.equal(trace.find_sites(tl.module("out")).first().out, reads["out"][0])


def test_max_fanout_bounds_the_matches(shared_twice):
    trace = tl.trace(shared_twice.model, *shared_twice.args)
    assert len(trace.find_sites(tl.func("linear"), max_fanout=4)) == 4
    with pytest.raises(TooManySitesError) as err:
        trace.find_sites(tl.func("linear"), max_fanout=3)
    assert err.value.count == 4 and "4" in str(err.value) and err.value.remedy


# -- save= -------------------------------------------------------------------------------------


def test_save_keeps_only_matching_ops_and_still_records_the_graph(tiny_gpt2):
    model, (ids,) = tiny_gpt2.model, tiny_gpt2.args
    full = tl.trace(model, ids)
    trace = tl.trace(model, ids, save=tl.func("scaled_dot_product_attention") | tl.module("transformer.h.1"))
    assert [op.label for op in trace.ops] == [op.label for op in full.ops]
    kept = {op.label for op in trace.ops if op.saved}
    block_out = full["transformer.h.1"].record.out_refs[0].index
    assert kept == {"input_0", "scaled_dot_product_attention_1", "scaled_dot_product_attention_2",
                    full.ops[block_out].label}
    for label in kept:
        assert torch.equal(trace[label].out, full[label].out)
    assert torch.equal(trace["transformer.h.1"].out, full["transformer.h.1"].out)
    with pytest.raises(ValueNotSavedError) as err:
        _ = trace["layer_norm_1"].out
    assert err.value.remedy and "save=" in err.value.remedy
    with pytest.raises(ValueNotSavedError):
        _ = trace["transformer.h.0"].out
    assert trace["linear_1"].parents == full["linear_1"].parents
    assert trace["layer_norm_1"].children == full["layer_norm_1"].children
    assert_equal_tree(trace.output, full.output)


def test_save_a_list_of_labels(small_mlp, mlp_input):
    trace = tl.trace(small_mlp, mlp_input, save=["relu_1", "fc2"])
    assert [op.label for op in trace.ops if op.saved] == ["input_0", "relu_1", "linear_2"]
    assert torch.equal(trace["act"].out, torch.relu(small_mlp.fc1(mlp_input)).detach())
    with pytest.raises(ValueNotSavedError):
        _ = trace["fc1"].out


def test_unsaved_op_keeps_its_shape_and_dtype(small_mlp, mlp_input):
    trace = tl.trace(small_mlp, mlp_input, save="fc2")
    assert trace["linear_1"].shape == (3, 6)
    assert trace["linear_1"].dtype == torch.float32


# -- the model is left as it was ----------------------------------------------------------------


def test_model_exception_propagates_unchanged_and_nothing_is_left_behind():
    torch.manual_seed(0)
    model, x = RaisingNet().eval(), torch.randn(3, 4)
    before, state = hook_state(model), global_state()
    with pytest.raises(KeyError) as plain:
        model(x)
    calls = [
        lambda: tl.trace(model, x),
        lambda: tl.extract(model, x, ["fc1"]),
        lambda: tl.extract(model, x, {"h": tl.func("linear")}),
        lambda: tl.trace(model, x, intervene=tl.when("fc1", 0.0)),
        lambda: tl.trace(model, x, intervene=tl.when("fc1", 0.0), save="fc1"),
        lambda: tl.trace(model, x, intervene=tl.when("linear_1", tl.scale(2.0))),
    ]
    for call in calls:
        with pytest.raises(KeyError) as err:
            call()
        assert type(err.value) is KeyError and err.value.args == plain.value.args
        assert_model_clean(model, before)
        assert global_state() == state
    ok = tl.trace(model, x[:2])  # and the model still works normally afterwards
    assert torch.equal(ok.output, model(x[:2]))


def test_an_edit_that_raises_propagates_unchanged(small_mlp, mlp_input):
    before = hook_state(small_mlp)

    def boom(activation):
        raise ValueError("boom from the edit")

    for call in (
        lambda: tl.trace(small_mlp, mlp_input, intervene=tl.when("fc1", boom)),
        lambda: tl.trace(small_mlp, mlp_input, intervene=tl.when("relu_1", boom)),
        lambda: tl.trace(small_mlp, mlp_input, intervene=tl.when("fc1", boom), save="fc2"),
    ):
        with pytest.raises(ValueError, match="boom from the edit"):
            call()
        assert_model_clean(small_mlp, before)


def test_capture_records_without_autograd_by_default(small_mlp, mlp_input):
    trace = tl.trace(small_mlp, mlp_input)
    assert not trace["linear_2"].out.requires_grad
    assert torch.is_grad_enabled()
    with_grad = tl.trace(small_mlp, mlp_input, grad=True)
    assert with_grad["linear_2"].out.requires_grad
    assert torch.equal(with_grad.output.detach(), trace.output)


def test_forward_slots_give_every_slot_back_exactly_as_it_was():
    from torchlens.capture.hooks import ForwardSlots

    plain, patched = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    custom = patched.forward  # a bound method stored on the instance, as some libraries do
    patched.__dict__["forward"] = custom
    x = torch.randn(1, 2)
    with pytest.raises(RuntimeError, match="boom"):
        with ForwardSlots() as slots:
            original = slots.install(plain, lambda *a: torch.zeros(1, 2))
            assert slots.install(patched, lambda *a: torch.ones(1, 2)) is custom
            assert torch.equal(plain(x), torch.zeros(1, 2)) and torch.equal(patched(x), torch.ones(1, 2))
            assert torch.equal(original(x), torch.nn.functional.linear(x, plain.weight, plain.bias))
            raise RuntimeError("boom")
    assert "forward" not in plain.__dict__
    assert patched.__dict__["forward"] is custom
    assert torch.equal(plain(x), torch.nn.functional.linear(x, plain.weight, plain.bias))


# -- a model in training mode (issue 28) ------------------------------------------------------------


@pytest.fixture
def training_gpt2():
    """The tiny GPT-2 in training mode (dropout on), its inputs, a corrupted prompt and the state to compare."""
    model = build_tiny_gpt2().train()
    ids = torch.tensor(TINY_GPT2_IDS)
    corrupted = ids.clone()
    corrupted[0, 2] = 9
    return model, ids, corrupted, hook_state(model), copy.deepcopy(model.state_dict())


def _unchanged(model, hooks, params):
    assert_model_clean(model, hooks)
    assert model.training
    after = model.state_dict()
    assert after.keys() == params.keys() and all(torch.equal(after[k], params[k]) for k in after)


@pytest.mark.parametrize("backend", [None, "hooks", "extract"])
def test_capture_in_training_mode_warns_naming_the_random_ops_and_eval(training_gpt2, backend):
    model, ids, _, hooks, params = training_gpt2
    with pytest.warns(RandomOpsWarning) as seen:
        if backend == "extract":  # module reads off hooks, no trace built
            tl.extract(model, ids, ["transformer.h.0"])
        else:
            trace = tl.trace(model, ids, backend=backend, save=["transformer.h.0"] if backend else None)
    message = str(seen[0].message)
    assert "model.eval()" in message and "training mode" in message
    if backend is None:  # every op recorded: the ops that drew random numbers, each with its module
        drew = [op for op in trace.ops if op.flags & RANDOM]
        assert [op.func_name for op in drew][:3] == ["dropout", "scaled_dot_product_attention", "dropout"]
        assert f"{drew[0].label} in transformer.drop" in message and f"{len(drew)} ops" in message
    else:  # module outputs only: the dropout modules that are on
        assert "transformer.drop, transformer.h.0.attn.attn_dropout" in message
    assert seen[0].filename == __file__  # shown at the caller's line, not inside TorchLens
    _unchanged(model, hooks, params)


def test_capture_in_eval_mode_does_not_warn(tiny_gpt2):
    with warnings.catch_warnings():
        warnings.simplefilter("error", RandomOpsWarning)
        tl.trace(tiny_gpt2.model, *tiny_gpt2.args)
        tl.extract(tiny_gpt2.model, tiny_gpt2.args[0], ["transformer.h.0"])


@pytest.mark.parametrize("workflow", ["activation", "attribution", "causal"])
def test_patching_in_training_mode_refuses_naming_eval_first(training_gpt2, workflow):
    model, ids, corrupted, hooks, params = training_gpt2
    metric = tl.patching.logit_diff(3, 4)
    run = {
        "activation": lambda: tl.patching.activation_patching(ids, corrupted, metric, model=model),
        "attribution": lambda: tl.patching.attribution_patching(ids, corrupted, metric, model=model),
        "causal": lambda: tl.patching.causal_trace(model, ids, [1], answer=3),
    }[workflow]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RandomOpsWarning)
        with pytest.raises(RandomForwardError) as info:
            run()
    assert info.value.remedy.startswith("Call model.eval()")
    assert "do(site, edit" not in info.value.remedy  # a fork's remedy does not apply to a workflow
    assert "training mode" in info.value.message and "dropout_1 in transformer.drop" in info.value.message
    _unchanged(model, hooks, params)


def test_attribution_patching_refuses_dropout_switched_on_after_capture(training_gpt2):
    """Traces captured in eval mode, the model put back in training mode: the gradient forward would be random."""
    model, ids, corrupted, hooks, params = training_gpt2
    model.eval()
    clean_trace, corrupted_trace = tl.trace(model, ids), tl.trace(model, corrupted)
    model.train()
    with pytest.raises(RandomForwardError) as info:
        tl.patching.attribution_patching(clean_trace, corrupted_trace, tl.patching.logit_diff(3, 4))
    assert info.value.remedy.startswith("Call model.eval()")
    assert info.value.modules[:2] == ["transformer.drop", "transformer.h.0.attn.attn_dropout"]
    _unchanged(model, hooks, params)
    model.eval()  # and in eval mode it runs: the estimate's baseline is the corrupted run's metric
    result = tl.patching.attribution_patching(clean_trace, corrupted_trace, tl.patching.logit_diff(3, 4))
    with torch.no_grad():
        logits = model(corrupted).logits
    assert result.corrupted == pytest.approx(float(logits[0, -1, 3] - logits[0, -1, 4]), abs=1e-5)


class _Histogram(torch.nn.Module):
    """``torch.histogramdd`` returns the histogram and a *list* of bin edges: tensors nested in containers."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(2, 2)

    def forward(self, x):
        hist, edges = torch.histogramdd(self.inp(x).reshape(-1, 2), bins=[3, 3])
        return hist.sum(0) * edges[0][-1] + edges[1][0]


def test_an_op_whose_output_nests_tensors_in_a_list_is_recorded_and_replayed(tmp_path):
    """Each tensor of histogramdd's nested output is one output of the op (the readers of the bin
    edges depend on it): a fork editing upstream equals a hooked forward (unrecorded, the edges
    were constants and the fork returned the unedited value), the op's value is its tensors flat,
    validate replays every op, and a saved trace replays it after loading."""
    model, x = _Histogram().eval(), torch.randn(1, 7, 2, generator=torch.Generator().manual_seed(1))
    trace = tl.trace(model, x)
    op = next(o for o in trace.ops if o.func_name == "histogramdd")
    hist, edges = torch.histogramdd(model.inp(x).reshape(-1, 2), bins=[3, 3])
    assert len(op.out) == 3 and all(torch.equal(a, b) for a, b in zip(op.out, (hist, *edges)))
    fork = trace.fork().do("inp", lambda out: out * 3.0)
    want = hooked_forward(model, {"inp": lambda out: out * 3.0}, (x,))
    assert torch.allclose(fork.output, want) and not torch.allclose(fork.output, trace.output)
    report = tl.validate(trace)
    assert report.ok and report.n_checked == report.n_ops - 1  # (the input is not an op to replay)
    loaded = tl.load_trace(trace.save(tmp_path / "hist"))
    assert torch.allclose(loaded.fork().do("inp", lambda out: out * 3.0).output, want)
