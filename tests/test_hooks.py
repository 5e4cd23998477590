"""``ModuleHooks``: the hooks every capture attaches are torch's own entries, in torch's order,
and nothing of them is left on the model afterwards (also when the forward raises).

Reference values come from plain ``register_forward_hook`` reads of the same forward.
"""

from __future__ import annotations

import pytest
import torch
from conftest import assert_model_clean, hook_state
from torch import nn

import torchlens as tl
from torchlens.capture.hooks import ModuleHooks


class _CountingLinear(nn.Linear):
    """A module type that registers hooks its own way: captures must go through its API."""

    registered: list[str] = []

    def register_forward_pre_hook(self, hook, **kwargs):
        type(self).registered.append("pre")
        return super().register_forward_pre_hook(hook, **kwargs)

    def register_forward_hook(self, hook, **kwargs):
        type(self).registered.append("post")
        return super().register_forward_hook(hook, **kwargs)


def test_user_hooks_run_first_and_the_capture_sees_what_they_returned(small_mlp, mlp_input):
    # The user's hook (attached before the capture) doubles fc1's output: the capture must
    # record the doubled value, as a plain hook attached after the user's sees it.
    user = small_mlp.fc1.register_forward_hook(lambda m, i, o: o * 2)
    try:
        seen = {}
        reader = small_mlp.fc1.register_forward_hook(lambda m, i, o: seen.setdefault("fc1", o.clone()))
        with torch.no_grad():
            want_out = small_mlp(mlp_input)
        reader.remove()
        before = hook_state(small_mlp)
        trace = tl.trace(small_mlp, mlp_input)
        assert_model_clean(small_mlp, before)
    finally:
        user.remove()
    assert torch.equal(trace["fc1"].out, seen["fc1"])
    assert torch.equal(trace.output, want_out)


def test_a_module_type_with_its_own_registration_is_hooked_through_it(small_mlp, mlp_input):
    small_mlp.fc2 = _CountingLinear(6, 3)
    _CountingLinear.registered.clear()
    seen = {}
    reader = small_mlp.fc2.register_forward_hook(lambda m, i, o: seen.setdefault("fc2", o.clone()))
    with torch.no_grad():
        small_mlp(mlp_input)
    reader.remove()
    _CountingLinear.registered.clear()
    before = hook_state(small_mlp)
    trace = tl.trace(small_mlp, mlp_input)
    assert _CountingLinear.registered == ["pre", "post"]
    assert torch.equal(trace["fc2"].out, seen["fc2"])
    assert [c.address for c in trace.calls] == ["", "fc1", "act", "fc2"]
    assert_model_clean(small_mlp, before)


def test_hooks_are_gone_after_a_forward_that_raised(small_mlp, mlp_input):
    before = hook_state(small_mlp)
    with pytest.raises(RuntimeError, match="mat1 and mat2"):
        tl.trace(small_mlp, mlp_input[:, :3])  # fc1 expects 4 features
    assert_model_clean(small_mlp, before)
    # and the model still runs hook-free, with the same values as before the failed capture
    with torch.no_grad():
        assert torch.equal(tl.trace(small_mlp, mlp_input).output, small_mlp(mlp_input))


def test_on_every_module_sees_each_call_once_with_its_pass(small_mlp, mlp_input):
    hooks = ModuleHooks(small_mlp)
    starts: list[tuple[str, int]] = []
    ends: list[tuple[str, int, torch.Tensor]] = []
    hooks.on_every_module(lambda info, a, k: starts.append((info.address, info.pass_index)),
                          lambda info, a, k, o: ends.append((info.address, info.pass_index, o)))
    before = hook_state(small_mlp)
    with torch.no_grad(), hooks:
        small_mlp(mlp_input)
        small_mlp(mlp_input)
    assert_model_clean(small_mlp, before)
    assert starts == [(a, p) for p in (1, 2) for a in ("", "fc1", "act", "fc2")]
    assert [(a, p) for a, p, _ in ends] == [(a, p) for p in (1, 2) for a in ("fc1", "act", "fc2", "")]
    with torch.no_grad():
        want = small_mlp.fc1(mlp_input)
    assert torch.equal(ends[0][2], want)
    with pytest.raises(RuntimeError, match="before entering"):
        with hooks:
            hooks.on_every_module(lambda *a: None, lambda *a: None)
    assert_model_clean(small_mlp, before)
