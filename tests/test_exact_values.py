"""Every recorded value is the value the model computed at that moment (issue 13).

The reference is independent of TorchLens: a ``TorchFunctionMode`` that clones each output
the moment it is produced, and plain ``register_forward_hook`` hooks that clone module
outputs at hook time. Models change values after they are produced (in-place ops on tuple
elements, on views of them, on module and dict outputs, on their own input, ``out=``); the
recorded values must not follow.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_equal_tree, clone_tree, hook_reads
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.overrides import TorchFunctionMode, handle_torch_function, has_torch_function_unary

import torchlens as tl

__all__: list[str] = []


class CloneAtBirth(TorchFunctionMode):
    """The reference: every torch call's output, cloned the moment the call returns.

    Only calls that give a tensor or a tuple/list of tensors are kept: the calls that are
    ops of a trace. The copy is made with torch functions disabled, so that neither this
    mode nor a recorder below it sees it.
    """

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[Any, Any]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if out is None and getattr(func, "__name__", "") == "__setitem__":
            out = args[0]  # an assignment's op is the tensor it wrote into
        if isinstance(out, torch.Tensor) or (
            isinstance(out, (tuple, list)) and out and all(isinstance(t, torch.Tensor) or t is None for t in out)
        ):
            with torch._C.DisableTorchFunction():
                self.seen.append((func, clone_tree(out)))
        return out


# -- the grammar of random models --------------------------------------------------------------


class Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor(0.75))

    def forward(self, x):
        return x * self.w


class PairOut(nn.Module):
    def forward(self, x):
        return x * 2, x - 1


class DictOutput(nn.Module):
    def forward(self, x):
        return {"a": x + 1, "b": torch.tanh(x)}


class BumpInPlace(nn.Module):
    """Changes its own input in place and returns it."""

    def forward(self, x):
        return x.add_(0.25)


PRODUCERS = ("tanh", "add", "scale", "topk", "max", "sort", "sort_out", "split", "chunk", "unbind", "pair", "dict",
             "t", "slice", "relu_module", "bump_module")
MUTATORS = ("add_", "mul_", "div_", "clamp_", "relu_inplace", "setitem", "out", "masked_fill_", "foreach",
            "index_add_")
VIEWS = ("self", "slice", "transpose", "row")


class GrammarNet(nn.Module):
    """Runs a program of producer and in-place instructions over a list of live tensors.

    Register 0 is the model's own input, so in-place instructions can change it too. Operand
    numbers are taken modulo the number of live tensors, and an instruction a tensor's shape
    does not allow falls back to ``tanh``: every program runs.
    """

    def __init__(self, program: list[tuple[str, int, int]]) -> None:
        super().__init__()
        self.program = program
        self.scale = Scale()
        self.pair = PairOut()
        self.dict_out = DictOutput()
        self.relu = nn.ReLU(inplace=True)
        self.bump = BumpInPlace()
        self.reference: CloneAtBirth | None = None

    def forward(self, x):
        with self.reference if self.reference is not None else nullcontext():
            regs = [x]
            indices: list[torch.Tensor] = []
            for name, a, b in self.program:
                r = regs[a % len(regs)]
                if name in PRODUCERS:
                    self._produce(name, r, regs[b % len(regs)], regs, indices)
                elif name == "index_add_" and indices:
                    indices[a % len(indices)].add_(1)
                else:
                    self._mutate(name, _view(r, VIEWS[b % len(VIEWS)]), regs[b % len(regs)])
            return tuple(regs) + tuple(indices)

    def _produce(self, name, r, other, regs, indices):
        wide = r.dim() >= 1 and r.shape[-1] >= 2
        if name == "add":
            regs.append(r + other.sum())
        elif name == "scale":
            regs.append(self.scale(r))
        elif name in ("topk", "max", "sort") and wide:
            values, idx = {"topk": lambda: r.topk(2, dim=-1), "max": lambda: r.max(-1),
                           "sort": lambda: torch.sort(r, -1)}[name]()
            regs.append(values)
            indices.append(idx)
        elif name == "sort_out" and wide:
            values, idx = torch.empty(0), torch.empty(0, dtype=torch.long)
            torch.sort(r, -1, out=(values, idx))
            regs.append(values)
            indices.append(idx)
        elif name == "split" and wide:
            regs.extend(r.split(1, dim=-1))
        elif name == "chunk" and r.dim() >= 1 and r.shape[0] >= 2:
            regs.extend(r.chunk(2, dim=0))
        elif name == "unbind" and r.dim() >= 1 and 2 <= r.shape[0] <= 4:
            regs.extend(r.unbind(0))
        elif name == "pair":
            regs.extend(self.pair(r))
        elif name == "dict":
            d = self.dict_out(r)
            regs.extend([d["a"], d["b"]])
        elif name == "t" and r.dim() <= 2:
            regs.append(r.t())
        elif name == "slice" and r.dim() >= 1:
            regs.append(r[..., :1])
        elif name == "relu_module":
            regs.append(self.relu(r))
        elif name == "bump_module":
            regs.append(self.bump(r))
        else:
            regs.append(torch.tanh(r))

    @staticmethod
    def _mutate(name, target, other):
        if name == "add_":
            target.add_(0.5)
        elif name == "mul_":
            target.mul_(1.5)
        elif name == "div_":
            target.div_(2.0)
        elif name == "clamp_":
            target.clamp_(-0.5, 0.5)
        elif name == "relu_inplace":
            F.relu(target, inplace=True)
        elif name == "setitem" and target.dim() >= 1:
            target[..., 0] = 3.0
        elif name == "out":
            torch.mul(target, 2.0, out=target)
        elif name == "masked_fill_":
            target.masked_fill_(target > 0, 0.25)
        elif name == "foreach":
            torch._foreach_add_([target, other], 1.0)
        else:
            target.fill_(3.0)


def _view(r: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "slice" and r.dim() >= 1:
        return r[..., :1]
    if kind == "transpose" and r.dim() >= 2:
        return r.transpose(0, 1)
    if kind == "row" and r.dim() >= 1:
        return r[0]
    return r


PROGRAMS = st.lists(
    st.tuples(st.sampled_from(PRODUCERS + MUTATORS), st.integers(0, 15), st.integers(0, 15)),
    min_size=1, max_size=14,
)


def _input() -> torch.Tensor:
    return torch.tensor([[0.5, -1.0, 2.0, 0.25], [-0.75, 1.5, -2.0, 1.0], [0.1, 0.2, -0.3, 3.0]])


def assert_records_exact(model: GrammarNet) -> None:
    """Every op's, module call's and module read's recorded value equals the reference."""
    x = _input()
    hooked, plain_out = hook_reads(model, (x.clone(),))

    reference = CloneAtBirth()
    model.reference = reference
    try:
        traced_x = x.clone()
        trace = tl.trace(model, traced_x)
    finally:
        model.reference = None
    assert_equal_tree(trace.output, plain_out, what="model output")
    assert torch.equal(trace["input_0"].out, x), "the input as it was passed, before the model changed it"

    ops = [site for site in trace.layers if not site.is_input]
    assert len(ops) == len(reference.seen), [s.func_name for s in ops]
    for site, (func, want) in zip(ops, reference.seen):
        assert site.func is func, (site.label, func)
        assert_equal_tree(site.out, want, what=site.label)

    calls = [(site.address, site.pass_index) for site in trace.modules]
    for site in trace.modules:
        assert_equal_tree(site.out, hooked[site.address][site.pass_index - 1], what=f"module {site.label}")

    # The hooks engine (module outputs only), on every module call of the forward.
    keys = [f"{address}:{n}" for address, n in calls if address]
    if keys:
        got = tl.extract(model, x.clone(), keys)
        for key in keys:
            address, n = key.rsplit(":", 1)
            assert_equal_tree(got[key], hooked[address][int(n) - 1], what=f"extract {key}")


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(PROGRAMS)
def test_every_recorded_value_is_the_value_at_birth(program):
    with torch.no_grad():
        assert_records_exact(GrammarNet(program))


def test_grammar_covers_every_instruction():
    # One program using every instruction on fresh tensors and on views of tuple elements.
    program = [(p, 0, 1) for p in PRODUCERS]
    program += [(m, k, v) for m in MUTATORS for k in (3, 5, 8, 12) for v in range(len(VIEWS))]
    with torch.no_grad():
        assert_records_exact(GrammarNet(program))


# -- the issue's examples, one path each -------------------------------------------------------


class IssueExample(nn.Module):
    def forward(self, x):
        v, i = torch.topk(x, 2)
        v /= 2
        a, b = x.max(-1)
        a += 100
        return v.sum() + a.sum()


def test_issue_example_topk_and_max_keep_the_values_the_model_computed():
    x = torch.tensor([[4.0, 3.0, 1.0, 0.0]])
    trace = tl.trace(IssueExample(), x)
    assert torch.equal(trace["topk_1"].out.values, torch.tensor([[4.0, 3.0]]))
    assert torch.equal(trace["topk_1"].out.indices, torch.tensor([[0, 1]]))
    assert torch.equal(trace["max_1"].out.values, torch.tensor([4.0]))
    # The in-place ops themselves show the changed values, and the output is the model's.
    assert torch.equal(trace["div_1"].out, torch.tensor([[2.0, 1.5]]))
    assert torch.equal(trace["add_1"].out, torch.tensor([104.0]))
    assert torch.equal(trace.output, IssueExample()(x))
    # Changing the element itself aliases nothing: readers of ``v`` read the div_ op.
    assert trace.stale_positions() == {}


class ViewOfTupleElement(nn.Module):
    def forward(self, x):
        v, i = x.topk(2)
        v[:, 0] += 1  # through a view of the tuple element
        s = v.sum()
        a, b = x.split(2, dim=-1)
        a.mul_(10)  # writes into x's memory, not into b's
        return s + b.sum() + x.sum()


def test_inplace_through_a_view_of_a_tuple_element():
    x = torch.tensor([[4.0, 3.0, 1.0, 0.0]])
    trace = tl.trace(ViewOfTupleElement(), x.clone())
    assert torch.equal(trace["topk_1"].out.values, torch.tensor([[4.0, 3.0]]))
    assert torch.equal(trace["split_1"].out[0], torch.tensor([[4.0, 3.0]]))
    assert torch.equal(trace["split_1"].out[1], torch.tensor([[1.0, 0.0]]))
    assert torch.equal(trace["input_0"].out, x)
    assert torch.equal(trace.output, ViewOfTupleElement()(x.clone()))
    stale = trace.stale_positions()
    # ``v`` is read after the write through its view; ``x`` after the write through ``a``.
    assert trace.op_index("topk_1") in stale and trace.op_index("input_0") in stale
    assert trace.op_index("split_1") not in stale  # the written element was the target itself


class OutTuple(nn.Module):
    def forward(self, x):
        values, idx = torch.empty(0), torch.empty(0, dtype=torch.long)
        torch.sort(x, -1, out=(values, idx))
        values.add_(1)
        idx.mul_(2)
        return values, idx


def test_out_tuple_arguments_are_snapshotted():
    x = torch.tensor([[3.0, 1.0, 2.0]])
    trace = tl.trace(OutTuple(), x)
    want = torch.sort(x, -1)
    assert torch.equal(trace["sort_1"].out[0], want.values)
    assert torch.equal(trace["sort_1"].out[1], want.indices)
    assert_equal_tree(trace.output, OutTuple()(x))


def pieces(x):
    """A function that takes part in torch's function overrides and returns a list of tensors."""
    if has_torch_function_unary(x):
        return handle_torch_function(pieces, (x,), x)
    return [x * 2, x + 1]


class ListOut(nn.Module):
    def forward(self, x):
        ys = pieces(x)
        ys[0] = torch.zeros(1)  # the list object the op returned, refilled by the model
        ys[1].sub_(5)
        y, z = torch._foreach_mul([x, x + 1], 2.0)
        torch._foreach_add_([y, z], 1.0)
        return ys[0] + ys[1] + y + z


def test_list_outputs_and_foreach_ops_are_kept_as_returned():
    x = torch.tensor([1.0, 2.0])
    trace = tl.trace(ListOut(), x)
    assert_equal_tree(trace["pieces_1"].out, [x * 2, x + 1])
    assert type(trace["pieces_1"].out) is list
    assert_equal_tree(trace["_foreach_mul_1"].out, (x * 2, (x + 1) * 2))
    assert torch.equal(trace.output, ListOut()(x))


class ParentChangesChildren(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.pair = PairOut()
        self.dict_out = DictOutput()

    def forward(self, x):
        h = self.lin(x)
        h.mul_(0)
        p, q = self.pair(x)
        q[:, 1:] = 7.0
        d = self.dict_out(x)
        d["a"].div_(4)
        d["b"] = d["b"] * 0  # refills the dict the module returned
        return h + p + q + d["a"] + d["b"]


@pytest.mark.parametrize("backend", ["function_mode", "hooks"])
def test_module_outputs_changed_by_the_parent(backend):
    torch.manual_seed(0)
    model = ParentChangesChildren().eval()
    x = torch.randn(2, 4)
    hooked, plain_out = hook_reads(model, (x,))
    sites = ["lin", "pair", "dict_out"]
    with torch.no_grad():
        trace = tl.trace(model, x, save=tl.module("lin") | tl.module("pair") | tl.module("dict_out"),
                         backend=backend)
    assert trace.engine == backend
    for address in sites:
        assert_equal_tree(trace[address].out, hooked[address][0], what=address)
    assert torch.equal(trace.output, plain_out)
    got = tl.extract(model, x, sites)
    for address in sites:
        assert_equal_tree(got[address], hooked[address][0], what=f"extract {address}")
    assert set(trace["dict_out"].out) == {"a", "b"}


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 3)

    def forward(self, x):
        h = self.a(x)
        h += 1  # changes a's output after its hook ran
        return self.b(h)


def test_hooks_engine_edit_and_grad_keep_exact_values():
    torch.manual_seed(0)
    model = Inner().eval()
    x = torch.randn(2, 3)
    want_a = model.a(x).detach() * 3  # what the edit hands on, before the parent's += 1
    trace = tl.trace(model, x, intervene=tl.when(tl.module("a"), lambda out: out * 3),
                     save=tl.module("a") | tl.module("b"), grad=True)
    assert trace.engine == "hooks"
    assert torch.equal(trace["a"].out.detach(), want_a)
    # b's output was left alone: it is the forward's own tensor, so autograd reaches it.
    (grad,) = torch.autograd.grad(trace.output.sum(), trace["b"].out)
    assert torch.equal(grad, torch.ones(2, 3))
    assert torch.allclose(trace.output, model.b(want_a + 1))


class MutatesItsInput(nn.Module):
    def forward(self, x, extra):
        x.add_(1)
        extra[:1].mul_(-1)  # through a view: the model then returns the changed ``extra`` itself
        return x * extra, extra


def test_inputs_the_model_mutates_keep_their_values():
    x, extra = torch.tensor([1.0, 2.0]), torch.tensor([5.0, 6.0])
    model = MutatesItsInput()
    hooked, plain_out = hook_reads(model, (x.clone(), extra.clone()))
    trace = tl.trace(model, x.clone(), extra.clone())
    assert torch.equal(trace["input_0"].out, x)
    assert torch.equal(trace["input_1"].out, extra)
    assert_equal_tree(trace.output, plain_out)
    root = next(site for site in trace.modules if site.address == "")
    assert_equal_tree(root.out, hooked[""][0], what="the model's own call")
    assert torch.equal(root.out[1], torch.tensor([-5.0, 6.0]))


def test_mixtral_router_topk_is_recorded_before_renormalisation(tiny_mixtral):
    model, (ids,) = tiny_mixtral.model, tiny_mixtral.args
    reference = CloneAtBirth()
    with torch.no_grad(), reference:
        plain = model(ids)
    topks = [out for func, out in reference.seen if func is torch.topk]
    hooked, _ = hook_reads(model, (ids,))

    trace = tl.trace(model, ids)
    ops = [s for s in trace.layers if s.func_name == "topk"]
    assert len(ops) == len(topks) >= 1
    for site, want in zip(ops, topks):
        assert_equal_tree(site.out, want, what=site.label)
        probs = trace[site.parents[0]].out
        assert torch.equal(site.out.values, torch.topk(probs, 2, dim=-1).values)
        assert not torch.allclose(site.out.values.sum(-1), torch.ones(ids.shape[1]))  # not renormalised
    gate = "model.layers.0.mlp.gate"
    assert_equal_tree(trace[gate].out, hooked[gate][0], what=gate)
    assert torch.allclose(trace[gate].out[1].sum(-1), torch.ones(ids.shape[1]))  # the router's own output is
    assert torch.equal(trace.output.logits, plain.logits)


class OverwrittenBeforeReturn(nn.Module):
    def forward(self, x):
        y = x * 2
        z = x + 1
        y[:1].add_(1)  # writes y's memory through a view: the mul op's record predates it
        return y, z


def test_fork_output_is_the_value_returned_after_a_write_through_a_view():
    x = torch.ones(2, 3)
    trace = tl.trace(OverwrittenBeforeReturn(), x)
    fork = trace.fork().do("add_1", tl.scale(2.0))  # an unrelated edit: the fork rebuilds its output
    want = OverwrittenBeforeReturn()(x)
    torch.testing.assert_close(fork.output[0], want[0], rtol=0, atol=0)
    torch.testing.assert_close(fork.output[1], want[1] * 2, rtol=0, atol=0)
    torch.testing.assert_close(trace.output[0], want[0], rtol=0, atol=0)
