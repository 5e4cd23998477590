"""Edits during capture (``tl.when``): what an edit is, where it lands, and proof that it did.

References are independent of TorchLens: a plain forward hook that replaces a module's
output, or a tiny TorchFunctionMode that edits the output of one function.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import assert_equal_tree, assert_model_clean, edited_forward, hook_reads, hook_state
from torch.overrides import TorchFunctionMode

import torchlens as tl
from torchlens.core.records import ModuleCall, Op
from torchlens.errors import EditDtypeError, EditNotAppliedError, EditShapeError, InvalidArgumentError


class FuncEditMode(TorchFunctionMode):
    """Reference for op-level edits: replace the output of every call of ``name`` by ``fn(out)``."""

    def __init__(self, name: str, fn) -> None:
        super().__init__()
        self.name, self.fn, self.calls = name, fn, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if getattr(func, "__name__", "") == self.name:
            self.calls += 1
            return self.fn(out)
        return out


@pytest.fixture(scope="module")
def eager_gpt2():
    """The seed tiny GPT-2 with eager attention: softmax is an ordinary op there."""
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).eval(), torch.tensor([[1, 2, 3, 4, 5, 6]])


# -- what an edit is ------------------------------------------------------------------------------


def test_tensor_edit_replaces_the_value_broadcasting(small_mlp, mlp_input):
    vec = torch.arange(6.0)
    trace = tl.trace(small_mlp, mlp_input, intervene=tl.when("act", vec))
    assert torch.equal(trace["act"].out, vec.expand(3, 6))
    assert torch.allclose(trace.output, small_mlp.fc2(vec.expand(3, 6)).detach())
    assert_equal_tree(trace.output, edited_forward(small_mlp, "act", lambda o: vec.expand_as(o).clone(), (mlp_input,)))


def test_scalar_edit_fills_the_value(small_mlp, mlp_input):
    trace = tl.trace(small_mlp, mlp_input, intervene=tl.when("act", 0.25))
    assert torch.equal(trace["act"].out, torch.full((3, 6), 0.25))
    assert_equal_tree(trace.output, edited_forward(small_mlp, "act", lambda o: torch.full_like(o, 0.25),
                                                   (mlp_input,)))


def test_tensor_edit_that_does_not_broadcast_names_both_shapes(small_mlp, mlp_input):
    before = hook_state(small_mlp)
    for call in (
        lambda: tl.trace(small_mlp, mlp_input, intervene=tl.when("act", torch.ones(5))),
        lambda: tl.trace(small_mlp, mlp_input, intervene=tl.when("relu_1", torch.ones(2, 6))),
        lambda: tl.trace(small_mlp, mlp_input).fork().do("act", torch.ones(3, 6, 2)),
    ):
        with pytest.raises(EditShapeError) as err:
            call()
        assert err.value.activation_shape == (3, 6)
        assert str(err.value.edit_shape) in str(err.value) and "(3, 6)" in str(err.value)
        assert err.value.remedy
        assert_model_clean(small_mlp, before)


def test_function_edit_returning_a_wrong_shape_is_refused(small_mlp, mlp_input):
    with pytest.raises(EditShapeError) as err:
        tl.trace(small_mlp, mlp_input, intervene=tl.when("act", lambda a: a[:, :4]))
    assert "(3, 4)" in str(err.value) and "(3, 6)" in str(err.value)


@pytest.mark.parametrize("site", ["act", "relu_1"])
def test_function_edit_returning_another_dtype_is_refused_on_every_path(small_mlp, mlp_input, tiny_gpt2, site):
    """float64 from a float32 model: a typed error naming the site and both dtypes, before any work is
    lost (model clean, fork unchanged), on capture, replay, stacked forks and re-execution."""
    before = hook_state(small_mlp)
    trace = tl.trace(small_mlp, mlp_input)
    fork = trace.fork()
    calls = {
        "capture": lambda: tl.trace(small_mlp, mlp_input, intervene=tl.when(site, lambda a: a.double())),
        "replay": lambda: fork.do(site, lambda a: a.double()),
        "forks": lambda: trace.forks([(site, lambda a: a.double())]),
        "re-execution": lambda: fork.do(site, lambda a: a.double(), model=small_mlp, inputs=mlp_input),
    }
    for path, call in calls.items():
        with pytest.raises(EditDtypeError) as err:
            call()
        assert (err.value.expected_dtype, err.value.given_dtype) == (torch.float32, torch.float64), path
        assert "torch.float64" in str(err.value) and "torch.float32" in str(err.value) and site in str(err.value)
        assert ".to(activation.dtype)" in err.value.remedy
        assert_model_clean(small_mlp, before)
        assert fork.recipe == [] and fork.edits == [] and torch.equal(fork.output, trace.output), path
    # the remedy works: computed in float64, returned as the activation's dtype
    fixed = fork.do("act", lambda a: (a.double() * 3).to(a.dtype))
    assert torch.allclose(fixed.output, edited_forward(small_mlp, "act", lambda o: o * 3, (mlp_input,)), atol=1e-6)
    # a structured output: the tensor of the tuple that changed dtype is named
    model, (ids,) = tiny_gpt2.model, tiny_gpt2.args
    with pytest.raises(EditDtypeError, match="tensor 0 of the output"):
        tl.trace(model, ids).fork().do("transformer.h.0", lambda out: (out[0].double(), *out[1:]))


def test_an_edit_that_is_not_an_edit_is_refused():
    for bad in ("zero", None, [1.0, 2.0]):
        with pytest.raises(InvalidArgumentError) as err:
            tl.when("act", bad)
        assert err.value.remedy


def test_function_edit_gets_ctx_at_a_module_site(shared_twice):
    model, (x,) = shared_twice.model, shared_twice.args
    seen = []

    def edit(activation, *, ctx):
        seen.append(ctx)
        return activation * 2

    for kwargs in ({}, {"save": "out"}):
        seen.clear()
        trace = tl.trace(model, x, intervene=tl.when(tl.module("block:2"), edit), **kwargs)
        (ctx,) = seen
        assert ctx.label == "block" and ctx.module == "block" and ctx.pass_index == 2
        assert isinstance(ctx.op, ModuleCall) and ctx.op.pass_index == 2 and ctx.op.address == "block"
        assert ctx.site == "module('block:2')"
        assert ctx.trace is not None and len(ctx.trace.calls) >= 1
        want = edited_forward(model, "block", lambda o: o * 2, (x,), pass_index=2)
        assert_equal_tree(trace.output, want)


def test_function_edit_gets_ctx_at_an_op_site(shared_twice):
    model, (x,) = shared_twice.model, shared_twice.args
    seen = []

    def edit(activation, ctx):  # ctx as a plain parameter works too
        seen.append((ctx.label, ctx.module, ctx.pass_index, ctx.op, len(ctx.trace.ops)))
        return -activation

    trace = tl.trace(model, x, intervene=tl.when(tl.func("tanh"), edit))
    assert [s[:3] for s in seen] == [("tanh_1", "block.1", 1), ("tanh_2", "block.1", 2)]
    assert all(isinstance(s[3], Op) and s[3].func_name == "tanh" for s in seen)
    assert seen[0][4] < seen[1][4]  # the trace as far as it got when the edit ran
    ref = FuncEditMode("tanh", lambda o: -o)
    with torch.no_grad(), ref:
        want = model(x)
    assert ref.calls == 2
    assert torch.equal(trace.output, want)


def test_function_edit_without_ctx_and_in_place_function_edit(small_mlp, mlp_input):
    def in_place(activation):
        activation.mul_(3.0)  # returns None: the value itself was changed

    trace = tl.trace(small_mlp, mlp_input, intervene=tl.when("act", in_place))
    want = edited_forward(small_mlp, "act", lambda o: o * 3.0, (mlp_input,))
    assert torch.equal(trace.output, want)
    assert trace.edits[0].n_changed == int((hook_reads(small_mlp, (mlp_input,))[0]["act"][0] != 0).sum())


# -- during capture ------------------------------------------------------------------------------


def test_module_when_with_module_save_uses_hooks_only(tiny_gpt2):
    model, (ids,) = tiny_gpt2.model, tiny_gpt2.args
    edit = tl.when(tl.module("transformer.h.0"), tl.zero_ablate())
    trace = tl.trace(model, ids, intervene=edit, save=tl.module("transformer.h.1"))
    assert trace.engine == "hooks" and len(trace.ops) == 0
    want_reads: dict = {}

    def zero_and_read(o):
        return torch.zeros_like(o)

    want = edited_forward(model, "transformer.h.0", zero_and_read, (ids,))
    assert_equal_tree(trace.output, want)
    handle = model.transformer.h[0].register_forward_hook(lambda m, i, o: torch.zeros_like(o))
    try:
        want_reads, _ = hook_reads(model, (ids,))
    finally:
        handle.remove()
    assert torch.equal(trace["transformer.h.1"].out, want_reads["transformer.h.1"][0])
    explicit = tl.trace(model, ids, intervene=edit, backend="hooks")
    assert explicit.engine == "hooks" and len(explicit.ops) == 0
    assert_equal_tree(explicit.output, want)


def test_module_when_during_a_full_trace_records_the_edit_in_the_graph(tiny_gpt2):
    model, (ids,) = tiny_gpt2.model, tiny_gpt2.args
    trace = tl.trace(model, ids, intervene=tl.when(tl.module("transformer.h.0"), tl.scale(0.5)))
    assert trace.engine == "function_mode"
    want = edited_forward(model, "transformer.h.0", lambda o: o * 0.5, (ids,))
    assert_equal_tree(trace.output, want)
    unedited = tl.trace(model, ids)
    assert torch.equal(trace["transformer.h.0"].out, unedited["transformer.h.0"].out * 0.5)
    (edit_op,) = [op for op in trace.ops if op.func_name == "edit"]
    assert edit_op.module == "transformer.h.0" and edit_op.children
    ln = trace.find_sites(tl.func("layer_norm") & tl.in_module("transformer.h.1.ln_1")).first()
    assert edit_op.label in ln.parents


def test_op_level_when_by_function_name(eager_gpt2):
    model, ids = eager_gpt2
    trace = tl.trace(model, ids, intervene=tl.when(tl.func("softmax"), tl.scale(0.5)))
    ref = FuncEditMode("softmax", lambda o: o * 0.5)
    with torch.no_grad(), ref:
        want = model(ids)
    assert ref.calls == 2
    assert_equal_tree(trace.output, want)
    assert [e.label for e in trace.edits] == ["softmax_1", "softmax_2"]
    causal_nonzero = 2 * sum(range(1, 7))  # heads x lower-triangle entries of a 6-token pattern
    assert [e.n_changed for e in trace.edits] == [causal_nonzero, causal_nonzero]


def test_op_level_when_by_label(shared_twice):
    model, (x,) = shared_twice.model, shared_twice.args
    trace = tl.trace(model, x, intervene=tl.when("tanh_2", tl.zero_ablate()))
    want = edited_forward(model, "block.1", torch.zeros_like, (x,), pass_index=2)
    assert_equal_tree(trace.output, want)
    assert [(e.label, e.pass_index) for e in trace.edits] == [("tanh_2", 2)]


def test_a_list_of_whens_applies_in_order(small_mlp, mlp_input):
    first, second = tl.when("act", tl.add(torch.ones(6))), tl.when("act", tl.scale(2.0))
    trace = tl.trace(small_mlp, mlp_input, intervene=[first, second])
    h = torch.relu(small_mlp.fc1(mlp_input)).detach()
    assert torch.allclose(trace["act"].out, (h + 1) * 2)
    assert torch.allclose(trace.output, small_mlp.fc2((h + 1) * 2).detach())
    swapped = tl.trace(small_mlp, mlp_input, intervene=[second, first])
    assert torch.allclose(swapped["act"].out, h * 2 + 1)
    mixed = tl.trace(small_mlp, mlp_input, intervene=[tl.when("linear_1", tl.scale(-1.0)), tl.when("fc2", 0.0)])
    assert torch.equal(mixed.output, torch.zeros(3, 3))
    assert torch.allclose(mixed["act"].out, torch.relu(-small_mlp.fc1(mlp_input)).detach())
    # the When objects are reusable: 'fired' is per capture
    again = tl.trace(small_mlp, mlp_input, intervene=[first, second])
    assert torch.equal(again.output, trace.output)


def test_when_on_every_pass_or_one_pass(shared_twice):
    model, (x,) = shared_twice.model, shared_twice.args
    every = tl.trace(model, x, intervene=tl.when(tl.module("block"), tl.scale(0.5)))
    assert [e.pass_index for e in every.edits] == [1, 2]
    assert_equal_tree(every.output, edited_forward(model, "block", lambda o: o * 0.5, (x,)))
    one = tl.trace(model, x, intervene=tl.when("block:1", tl.scale(0.5)))
    assert [e.pass_index for e in one.edits] == [1]
    assert_equal_tree(one.output, edited_forward(model, "block", lambda o: o * 0.5, (x,), pass_index=1))


# -- no silent no-ops ----------------------------------------------------------------------------


def test_trace_edits_lists_site_pass_label_and_changed_count(small_mlp, mlp_input):
    reads, _ = hook_reads(small_mlp, (mlp_input,))
    nonzero = int((reads["act"][0] != 0).sum())
    assert 0 < nonzero < 18
    trace = tl.trace(small_mlp, mlp_input, intervene=[tl.when("act", tl.zero_ablate()), tl.when("fc2", 0.0)])
    assert [(e.site, e.label, e.pass_index, e.n_changed) for e in trace.edits] == [
        ("module('act')", "act", 1, nonzero),
        ("module('fc2')", "fc2", 1, int((reads["fc2"][0] != 0).sum())),
    ]
    assert tl.trace(small_mlp, mlp_input).edits == []


def test_edit_whose_module_did_not_run_raises(control_flow):
    model, (x,) = control_flow.model, control_flow.args
    before = hook_state(model)
    for kwargs in ({}, {"save": "head_a"}):
        with pytest.raises(EditNotAppliedError) as err:
            tl.trace(model, x, intervene=tl.when("head_b", 0.0), **kwargs)
        assert "head_a" in err.value.fired and "head_b" not in err.value.fired
        assert "head_b" in str(err.value) and err.value.remedy
        assert_model_clean(model, before)
    with pytest.raises(EditNotAppliedError) as err:  # hooks alone only see the edited module
        tl.trace(model, x, intervene=tl.when("head_b", 0.0), backend="hooks")
    assert err.value.fired == [] and "none of the hooked modules ran" in str(err.value)
    assert_model_clean(model, before)


def test_edit_on_a_pass_that_does_not_exist_raises(control_flow):
    model, (x,) = control_flow.model, control_flow.args
    for kwargs in ({}, {"save": "head_a"}):
        with pytest.raises(EditNotAppliedError) as err:
            tl.trace(model, x, intervene=tl.when("step:4", tl.scale(2.0)), **kwargs)
        assert "step" in err.value.fired and "step:4" in str(err.value)
    trace = tl.trace(model, x)
    with pytest.raises(EditNotAppliedError):
        trace.fork().do("step:4", tl.scale(2.0), model=model, inputs=x)


def test_op_edit_that_never_fires_raises(small_mlp, mlp_input):
    with pytest.raises(EditNotAppliedError) as err:
        tl.trace(small_mlp, mlp_input, intervene=tl.when(tl.func("softmax"), 0.0))
    assert "fc1" in err.value.fired and "softmax" in str(err.value)
    with pytest.raises(EditNotAppliedError):
        tl.trace(small_mlp, mlp_input, intervene=[tl.when("act", 0.0), tl.when("linear_7", 0.0)])
