"""``op.source`` in the nnsight shim: drilling into the function an operation calls, and peeling wrappers.

Values are checked against the real functions computed by hand on the same weights (or a
plain ``register_forward_pre_hook`` read on GPT-2); operation names are checked against the
real nnsight 0.8 on a copy of the same model. Every refusal raises the shim's typed
``SourceNotAvailableError`` and leaves the model as it was (next trace still exact).
"""

from __future__ import annotations

import copy
import functools
import gc
import weakref

import nnsight as real_nnsight
import pytest
import torch
import torchlens_shims.nnsight as shim
from conftest import assert_model_clean, hook_state
from torch import nn
from torchlens_shims.nnsight import errors


# -- functions and modules to drill into (module level: their source must be readable) ------------
def relu_double(x):
    a = torch.relu(x)
    b = torch.add(a, a)
    return b


def inner_neg(x):
    return torch.relu(x)


def outer_neg(x):
    y = torch.neg(x)
    return inner_neg(y)


def _wraps(func):
    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        return func(*args, **kwargs)

    return wrapper


@_wraps
def tanh_wrapped(x):
    return torch.tanh(x) * 3


class Calls(nn.Module):
    """fc -> relu_double -> fc2: a plain module-level helper between two submodules."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.fc2 = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        d = relu_double(h)
        return self.fc2(d)


class Deep(nn.Module):
    """forward -> outer_neg -> inner_neg -> relu, and a wrapped helper after it."""

    def forward(self, x):
        return tanh_wrapped(outer_neg(x))


class Scaler:
    """A callable instance: no code of its own, its ``__call__`` has."""

    def __init__(self, factor):
        self.factor = factor

    def __call__(self, x):
        return torch.sigmoid(x) * self.factor


class Methods(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = Scaler(2.0)

    def compute(self, x):
        return torch.exp(-x)

    def forward(self, x):
        return self.scale(self.compute(x))


def _opaque(func):
    def wrapper(*args, **kwargs):  # no functools.wraps: the call names the decorated function
        return func(*args, **kwargs)

    return wrapper


def _apply(func, *args):
    return func(*args)


def _indirect(func):
    @functools.wraps(func)
    def wrapper(self, x):  # __wrapped__ is set, but the function runs through a helper
        return _apply(func, self, x)

    return wrapper


def _half(x):
    return x * 0.5


def _around(func, before=_half):
    def wrapper(self, x):  # two closed-over functions called: ambiguous
        return func(self, before(x))

    return wrapper


class Opaque(nn.Module):
    @_opaque
    def forward(self, x):
        return torch.relu(x) + 1


class Indirect(nn.Module):
    @_indirect
    def forward(self, x):
        return torch.relu(x) - 1


class Ambiguous(nn.Module):
    @_around
    def forward(self, x):
        return torch.relu(x)


class NoGrad(nn.Module):
    @torch.no_grad()
    def forward(self, x):
        return torch.relu(x) * 2


def _inputs():
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(5))


def _calls():
    torch.manual_seed(0)
    return Calls().eval()


# -- reads, edits, skips inside a called function ---------------------------------------------------
def test_nested_reads_match_the_function_computed_by_hand():
    model, x = _calls(), _inputs()
    before = hook_state(model)
    envoy = shim.NNsight(model)
    with envoy.trace(x):
        drilled = envoy.source.relu_double_0.source
        relu = drilled.torch_relu_0.output.save()
        add_in = drilled.torch_add_0.input.save()
        args, kwargs = drilled.torch_add_0.inputs
        second = shim.save(args[1])
        bound = drilled.b_0.output.save()
        outer = envoy.source.relu_double_0.output.save()
        out = envoy.output.save()
    with torch.no_grad():
        want_relu = torch.relu(model.fc(x))
        torch.testing.assert_close(relu, want_relu)
        torch.testing.assert_close(add_in, want_relu)
        torch.testing.assert_close(second, want_relu)
        torch.testing.assert_close(bound, want_relu + want_relu)
        torch.testing.assert_close(outer, want_relu + want_relu)
        torch.testing.assert_close(out, model.fc2(want_relu + want_relu))
    assert_model_clean(model, before)


def test_nested_edit_and_skip_propagate_downstream():
    model, x = _calls(), _inputs()
    envoy = shim.NNsight(model)
    with envoy.trace(x):
        envoy.source.relu_double_0.source.torch_relu_0.output = torch.full((3, 4), 0.25)
        edited = envoy.output.save()
    with envoy.trace(x):
        envoy.source.relu_double_0.source.torch_add_0.skip(torch.ones(3, 4) * 7)
        skipped = envoy.output.save()
    with envoy.trace(x):
        envoy.source.relu_double_0.source.torch_add_0.input = torch.ones(3, 4)
        new_input = envoy.source.relu_double_0.output.save()
    with envoy.trace(x):  # an edit lives for its own trace only
        clean = envoy.output.save()
    with torch.no_grad():
        torch.testing.assert_close(edited, model.fc2(torch.full((3, 4), 0.5)))
        torch.testing.assert_close(skipped, model.fc2(torch.ones(3, 4) * 7))
        torch.testing.assert_close(new_input, torch.ones(3, 4) + torch.relu(model.fc(x)))
        torch.testing.assert_close(clean, model(x))


def test_depth_three_and_wrapped_helper():
    model, x = Deep(), _inputs()
    envoy = shim.NNsight(model)
    with envoy.trace(x):
        deep = envoy.source.outer_neg_0.source.inner_neg_0.source.torch_relu_0.output.save()
        envoy.source.outer_neg_0.source.inner_neg_0.source.torch_relu_0.output = deep + 1
        tanh = envoy.source.tanh_wrapped_0.source.torch_tanh_0.output.save()
        out = envoy.output.save()
    torch.testing.assert_close(deep, torch.relu(-x))
    torch.testing.assert_close(tanh, torch.tanh(torch.relu(-x) + 1))
    torch.testing.assert_close(out, torch.tanh(torch.relu(-x) + 1) * 3)


def test_bound_method_and_callable_instance():
    model, x = Methods(), _inputs()
    envoy = shim.NNsight(model)
    with envoy.trace(x):
        exp = envoy.source.self_compute_0.source.torch_exp_0.output.save()
        sig = envoy.source.self_scale_0.source.torch_sigmoid_0.output.save()
        envoy.source.self_scale_0.source.torch_sigmoid_0.output = torch.zeros(3, 4)
        out = envoy.output.save()
    torch.testing.assert_close(exp, torch.exp(-x))
    torch.testing.assert_close(sig, torch.sigmoid(torch.exp(-x)))
    torch.testing.assert_close(out, torch.zeros(3, 4))
    # the instance and the method are untouched by the drill
    torch.testing.assert_close(model(x), torch.sigmoid(torch.exp(-x)) * 2.0)
    assert "__call__" not in vars(model.scale) and "compute" not in vars(model)


def test_two_invokes_drill_the_same_call():
    model, x = _calls(), _inputs()
    envoy = shim.NNsight(model)
    with envoy.trace() as tracer:
        with tracer.invoke(x):
            relu = envoy.source.relu_double_0.source.torch_relu_0.output.save()
        with tracer.invoke():
            add = envoy.source.relu_double_0.source.torch_add_0.output.save()
    with torch.no_grad():
        torch.testing.assert_close(relu, torch.relu(model.fc(x)))
        torch.testing.assert_close(add, 2 * torch.relu(model.fc(x)))


def test_nested_names_iteration_and_repr_match_real_nnsight():
    model, x = _calls(), _inputs()
    names = {}
    for lib in (real_nnsight, shim):
        envoy = lib.NNsight(copy.deepcopy(model))
        with envoy.trace(x):
            nested = envoy.source.relu_double_0.source
            names[lib.__name__] = ([op.name for op in nested], list(nested.compiled.names), repr(nested))
    want, got = names["nnsight"], names["torchlens_shims.nnsight"]
    assert got[0] == got[1] == want[0] == want[1] == ["torch_relu_0", "a_0", "torch_add_0", "b_0"]
    assert "def relu_double(x):" in got[2] and "torch_add_0 ->" in got[2]


def test_gpt2_attention_interface_drill_matches_a_plain_hook(tiny_gpt2):
    model = copy.deepcopy(tiny_gpt2.model)
    ids = tiny_gpt2.args[0]
    before = hook_state(model)
    seen, names = [], {}
    handle = model.transformer.h[1].attn.c_proj.register_forward_pre_hook(lambda m, a: seen.append(a[0].clone()))
    with torch.no_grad():
        plain = model(ids).logits
    handle.remove()
    envoy = shim.NNsight(model)
    with envoy.trace(ids):
        inner = envoy.transformer.h[1].attn.source.attention_interface_1.source
        names["shim"] = list(inner.compiled.names)
        transposed = inner.attn_output_transpose_0.output.save()
        logits = envoy.output.logits.save()
    torch.testing.assert_close(transposed.reshape(seen[0].shape), seen[0])
    torch.testing.assert_close(logits, plain)
    reference = real_nnsight.NNsight(copy.deepcopy(tiny_gpt2.model))
    with reference.trace(ids):
        names["nnsight"] = list(reference.transformer.h[1].attn.source.attention_interface_1.source.compiled.names)
    assert names["shim"] == names["nnsight"] and "attn_output_transpose_0" in names["shim"]
    assert_model_clean(model, before)


def test_gpt2_nested_edit_matches_a_plain_pre_hook_edit(tiny_gpt2):
    model = copy.deepcopy(tiny_gpt2.model)
    ids = tiny_gpt2.args[0]
    handle = model.transformer.h[0].attn.c_proj.register_forward_pre_hook(lambda m, a: (a[0] * 0,))
    with torch.no_grad():
        want = model(ids).logits
    handle.remove()
    envoy = shim.NNsight(model)
    with envoy.trace(ids):
        op = envoy.transformer.h[0].attn.source.attention_interface_1.source.attn_output_transpose_0
        op.output = op.output * 0
        got = envoy.output.logits.save()
    torch.testing.assert_close(got, want)


# -- which wrappers are peeled ----------------------------------------------------------------------
@pytest.mark.parametrize("make", [Opaque, Indirect, Ambiguous, NoGrad, Calls, Deep, Methods])
def test_top_level_names_match_real_nnsight(make):
    torch.manual_seed(0)
    model = make()
    want = list(real_nnsight.NNsight(copy.deepcopy(model)).source.compiled.names)
    assert shim.NNsight(model).source.names == want


def test_peeled_and_unpeeled_wrappers_run_their_real_behaviour():
    x = _inputs()
    opaque = shim.NNsight(Opaque())
    assert opaque.source.names == ["torch_relu_0"]  # peeled through its call of `func`
    with opaque.trace(x):
        relu = opaque.source.torch_relu_0.output.save()
    torch.testing.assert_close(relu, torch.relu(x))

    indirect = shim.NNsight(Indirect())
    assert indirect.source.names == ["_apply_0"]  # the helper call is what runs: not peeled
    with indirect.trace(x):
        op = indirect.source._apply_0.source.func_0.source.torch_relu_0
        inner = op.output.save()
        op.output = inner * 3
        out = indirect.output.save()
    torch.testing.assert_close(inner, torch.relu(x))
    torch.testing.assert_close(out, torch.relu(x) * 3 - 1)

    ambiguous = shim.NNsight(Ambiguous())
    assert ambiguous.source.names == ["before_0", "func_0"]
    with ambiguous.trace(x):
        inner = ambiguous.source.func_0.source.torch_relu_0.output.save()
    torch.testing.assert_close(inner, torch.relu(x * 0.5))

    no_grad = shim.NNsight(NoGrad())
    x = x.clone().requires_grad_(True)
    with no_grad.trace(x):
        relu = no_grad.source.torch_relu_0.output.save()
        out = no_grad.output.save()
    assert not relu.requires_grad and not out.requires_grad  # the rebuilt decorator still applies
    torch.testing.assert_close(out, torch.relu(x.detach()) * 2)


# -- refusals: typed, and nothing lost ----------------------------------------------------------------
@pytest.mark.parametrize(
    ("reach", "match"),
    [
        (lambda e: e.source.h_0.source, "assignment"),
        (lambda e: e.source.self_fc_0.source, "submodule"),
        (lambda e: e.source.relu_double_0.source.torch_relu_0.source, "no Python source"),
        (lambda e: e.source.relu_double_0.source.nope_0.output, "available: torch_relu_0, a_0, torch_add_0, b_0"),
    ],
    ids=["assignment", "submodule", "builtin", "unknown-op"],
)
def test_refusals_raise_typed_errors_and_lose_nothing(reach, match):
    model, x = _calls(), _inputs()
    before = hook_state(model)
    envoy = shim.NNsight(model)
    with pytest.raises(errors.SourceNotAvailableError, match=match) as caught:
        with envoy.trace(x):
            reach(envoy)
    assert caught.value.remedy
    assert_model_clean(model, before)
    with envoy.trace(x):
        relu = envoy.source.relu_double_0.source.torch_relu_0.output.save()
        out = envoy.output.save()
    with torch.no_grad():
        torch.testing.assert_close(relu, torch.relu(model.fc(x)))
        torch.testing.assert_close(out, model.fc2(2 * torch.relu(model.fc(x))))


def test_drilling_outside_a_trace_raises():
    envoy = shim.NNsight(_calls())
    with pytest.raises(errors.SourceNotAvailableError, match="inside a trace"):
        envoy.source.relu_double_0.source  # noqa: B018 - the access itself must raise
    assert relu_double(torch.ones(1)).item() == 2.0  # the function itself is untouched


def test_error_inside_a_drilled_function_keeps_the_model_clean():
    model, x = _calls(), _inputs()
    before = hook_state(model)
    envoy = shim.NNsight(model)
    with pytest.raises(ZeroDivisionError):
        with envoy.trace(x):
            envoy.source.relu_double_0.source.torch_relu_0.output = 1 // 0
    assert_model_clean(model, before)
    with torch.no_grad():
        torch.testing.assert_close(model(x), model.fc2(2 * torch.relu(model.fc(x))))


def _traced_once(drill: bool):
    model, x = _calls(), _inputs()
    envoy = shim.NNsight(model)
    with envoy.trace(x):
        if drill:
            value = envoy.source.relu_double_0.source.torch_relu_0.output.save()
        else:
            value = envoy.source.self_fc_0.output.save()
    return weakref.ref(model), value


def test_sourced_and_drilled_model_is_freed_by_refcounting():
    for drill in (False, True):
        gc.disable()  # a cycle through the sourced forward would keep the model until a GC pass
        try:
            alive, value = _traced_once(drill)
            assert alive() is None, f"model kept alive after its trace (drill={drill})"
        finally:
            gc.enable()
        assert value.shape == (3, 4)


def test_drilling_a_call_the_model_already_made_is_out_of_order():
    model, x = _calls(), _inputs()
    before = hook_state(model)
    envoy = shim.NNsight(model)
    with pytest.raises(errors.OutOfOrderError, match="relu_double_0"):
        with envoy.trace(x):
            envoy.output.save()
            envoy.source.relu_double_0.source.torch_relu_0.output.save()
    assert_model_clean(model, before)
    with envoy.trace(x):
        relu = envoy.source.relu_double_0.source.torch_relu_0.output.save()
    with torch.no_grad():
        torch.testing.assert_close(relu, torch.relu(model.fc(x)))
