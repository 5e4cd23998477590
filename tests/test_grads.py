"""Per-op gradients: ``tl.trace(..., grad=True)`` then a backward leaves ``trace[label].grad`` on
every recorded op, equal to ``retain_grad()`` on a plain forward; ``save=`` bounds them too."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torchlens as tl
from torchlens.errors import ValueNotSavedError


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x, keep=None):
        a = self.lin(x)
        b = torch.relu(a)
        c = b * 3
        d = c.tanh()
        e = d.sum(-1)
        if keep is not None:
            keep.extend([a, b, c, d, e])
            for t in keep:
                t.retain_grad()
        return e


@pytest.fixture()
def small():
    torch.manual_seed(0)
    return Small()


def test_every_op_gradient_equals_retain_grad(small):
    x = torch.randn(5, 4)
    trace = tl.trace(small, x, grad=True)
    trace.output.pow(2).sum().backward()
    kept: list[torch.Tensor] = []
    small.zero_grad()
    small(x, keep=kept).pow(2).sum().backward()
    labels = ["linear_1", "relu_1", "mul_1", "tanh_1", "sum_1"]
    assert [op.label for op in trace.ops[1:]] == labels
    for label, plain in zip(labels, kept):
        torch.testing.assert_close(trace[label].grad, plain.grad, rtol=0, atol=0)


def test_module_output_gradients_equal_hooks(tiny_gpt2):
    model, (ids,) = tiny_gpt2.model, tiny_gpt2.args
    trace = tl.trace(model, ids, grad=True)
    trace.output.logits[0, -1].logsumexp(-1).backward()
    grads = {}

    def hook(mod, inputs, output, name):
        out = output[0] if isinstance(output, tuple) else output
        out.register_hook(lambda g: grads.__setitem__(name, g))

    names = ["transformer.h.0", "transformer.h.1", "transformer.ln_f"]
    handles = [model.get_submodule(n).register_forward_hook(lambda m, i, o, n=n: hook(m, i, o, n)) for n in names]
    try:
        model.zero_grad()
        model(ids).logits[0, -1].logsumexp(-1).backward()
    finally:
        for h in handles:
            h.remove()
    model.zero_grad()
    for name in names:
        ref = trace[name].out_refs[0]
        torch.testing.assert_close(trace.ops[ref.index].grad, grads[name], rtol=0, atol=0)


def test_save_bounds_gradients_and_errors_say_why(small):
    x = torch.randn(5, 4)
    bounded = tl.trace(small, x, grad=True, save=tl.func("relu"))
    bounded.output.sum().backward()
    kept: list[torch.Tensor] = []
    small(x, keep=kept).sum().backward()
    small.zero_grad()
    torch.testing.assert_close(bounded["relu_1"].grad, kept[1].grad, rtol=0, atol=0)
    with pytest.raises(ValueNotSavedError, match="save= excluded it"):
        _ = bounded["mul_1"].grad
    plain = tl.trace(small, x)
    with pytest.raises(ValueNotSavedError, match="without grad=True"):
        _ = plain["relu_1"].grad
    fresh = tl.trace(small, x, grad=True)
    with pytest.raises(ValueNotSavedError, match="no backward"):
        _ = fresh["relu_1"].grad


def test_multi_output_op_gradients():
    class Splits(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 6)

        def forward(self, x):
            a, b = self.lin(x).split(3, dim=-1)
            return (a * 2 + b.exp()).sum()

    torch.manual_seed(0)
    model = Splits()
    x = torch.randn(2, 4)
    trace = tl.trace(model, x, grad=True)
    trace.output.backward()
    ga, gb = trace["split_1"].grad
    h = model.lin(x)
    h.retain_grad()
    a, b = h.split(3, dim=-1)
    (a * 2 + b.exp()).sum().backward()
    torch.testing.assert_close(torch.cat([ga, gb], -1), h.grad, rtol=0, atol=0)
