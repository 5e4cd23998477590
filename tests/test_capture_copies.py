"""A copy of the model made while a capture is attached (inside an edit or a hook) is the model
without the capture: it runs its own weights, holds none of our wrappers or hooks, pickles, and
keeps only the hooks its owner put there. Compared against copies made with no capture."""

from __future__ import annotations

import copy
import copyreg
import io
import pickle

import torch
from torch import nn

import torchlens as tl
from torchlens.capture.hooks import ForwardSlots


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 8), nn.Tanh()), nn.Linear(8, 2)).eval()


def _zeroed(model: nn.Module) -> nn.Module:
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    return model


def _clean(module: nn.Module) -> bool:
    """No forward slot entry and no hook in any table, for the module and every submodule."""
    return all("forward" not in m.__dict__ and not m._forward_hooks and not m._forward_pre_hooks
               and not m._forward_hooks_with_kwargs and not m._forward_pre_hooks_with_kwargs
               for m in module.modules())


def _copy_inside(model: nn.Module, x: torch.Tensor, make, site: str = "0", **trace_kwargs):
    """What ``make(model)`` returns when called from an edit during ``tl.trace``."""
    made = []

    def edit(out):
        made.append(make(model))
        return out

    dispatch = dict(copyreg.dispatch_table)
    trace = tl.trace(model, x, intervene=tl.when(tl.module(site), edit), **trace_kwargs)
    assert copyreg.dispatch_table == dispatch  # the capture took its entries back
    return trace, made[0]


def test_deepcopy_inside_an_edit_runs_its_own_weights():
    model, x = _model(), torch.randn(3, 4)
    want_copy = _zeroed(copy.deepcopy(model))(x)  # made with no capture attached
    trace, made = _copy_inside(model, x, copy.deepcopy)
    assert _clean(made) and _clean(model)
    assert torch.equal(_zeroed(made)(x), want_copy)
    assert not torch.equal(want_copy, model(x))  # the copy's own (zeroed) weights, not the model's
    assert torch.equal(trace.output, model(x))


def test_a_module_hooked_by_its_owner_copies_with_its_owner_hooks_only():
    model, x = _model(), torch.randn(3, 4)
    seen = []

    def owner_hook(mod, args, out):
        seen.append(out.clone())

    model[2][0].register_forward_hook(owner_hook)  # this module is hooked by the capture, not wrapped
    try:
        _, made = _copy_inside(model, x, copy.deepcopy)
        inner = made[2][0]
        assert list(inner._forward_hooks.values()) == [owner_hook]
        assert not inner._forward_hooks_with_kwargs and not inner._forward_pre_hooks
        assert _clean(made[0]) and _clean(made[3])
        seen.clear()
        got = made(x)
        assert len(seen) == 1 and torch.equal(got, model(x))
        assert len(model[2][0]._forward_hooks) == 1  # the original keeps its owner's hook, ours are gone
    finally:
        model[2][0]._forward_hooks.clear()


def test_pickle_and_torch_save_inside_an_edit_give_the_plain_model():
    model, x = _model(), torch.randn(3, 4)
    _, blob = _copy_inside(model, x, pickle.dumps)
    loaded = pickle.loads(blob)
    assert _clean(loaded) and torch.equal(loaded(x), model(x))

    def save(m):
        buf = io.BytesIO()
        torch.save(m, buf)
        return buf.getvalue()

    _, saved = _copy_inside(model, x, save)
    loaded = torch.load(io.BytesIO(saved), weights_only=False)
    assert _clean(loaded) and torch.equal(loaded(x), model(x))


def test_shallow_copy_of_a_submodule_inside_a_hook_read():
    model, x = _model(), torch.randn(3, 4)
    _, made = _copy_inside(model, x, lambda m: copy.copy(m[3]), site="2")
    assert "forward" not in made.__dict__ and not made._forward_hooks and not made._forward_pre_hooks
    h = torch.randn(5, 8)
    assert torch.equal(made(h), torch.nn.functional.linear(h, model[3].weight, model[3].bias))


def test_a_copy_inside_a_forward_slot_and_a_capture_drops_both_wrappers():
    model, x = _model(), torch.randn(3, 4)

    def make(m):
        slots = ForwardSlots()
        inner = slots.install(m[3], lambda h: inner(h) * 2)  # a slot wrapper on top of the capture's
        try:
            return copy.deepcopy(m)
        finally:
            slots.restore()

    _, made = _copy_inside(model, x, make)
    assert _clean(made) and _clean(model)
    assert torch.equal(made(x), model(x))


def test_a_type_that_deep_copies_itself_is_left_to_it():
    class Own(nn.Linear):
        copies = 0

        def __deepcopy__(self, memo):
            Own.copies += 1
            fresh = Own(self.in_features, self.out_features)
            fresh.load_state_dict(self.state_dict())
            return fresh

    torch.manual_seed(0)
    model = nn.Sequential(Own(4, 4), nn.ReLU()).eval()
    x = torch.randn(2, 4)
    seen = []

    def edit(out):
        seen.append(copyreg.dispatch_table.get(Own))
        made = copy.deepcopy(model)
        seen.append(made)
        return out

    tl.trace(model, x, intervene=tl.when(tl.module("1"), edit))
    assert seen[0] is None and Own.copies == 1
    assert torch.equal(seen[1](x), model(x))
