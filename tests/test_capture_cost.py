"""The short paths of an every-op capture record exactly what the general paths record.

An every-op capture takes shortcuts for its commonest cases: an op with one tensor out is
recorded inline, calls returning sizes or dtypes are passed through, every module shares two
hooks, and a module returning a flat tuple skips the pytree walk. Each shortcut is checked
here against the general path (a capture with ``grad=True`` records every op the general
way), against plain ``register_forward_hook`` reads, and for leaving the model as it was.
"""

from __future__ import annotations

import collections
import gc
import sys
import threading

import pytest
import torch
from conftest import BranchyNet, RaisingNet, ReshapeNet, assert_equal_tree, assert_model_clean, hook_reads, hook_state
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

import torchlens as tl
from torchlens.api import trace_until
from torchlens.capture.hooks import ModuleHooks


def _records(trace) -> list[tuple]:
    return [(op.label, op.func_name, op.module, op.module_pass, op.source, op.flags, op.shape) for op in trace.ops]


@pytest.mark.parametrize("name", ["tiny_gpt2", "tiny_llama"])
def test_inline_records_equal_the_general_path(name, request):
    case = request.getfixturevalue(name)
    lean = tl.trace(case.model, *case.args, **case.kwargs)
    general = tl.trace(case.model, *case.args, **case.kwargs, grad=True)  # every op through the general record
    assert _records(lean) == _records(general)
    assert [c.key for c in lean.calls] == [c.key for c in general.calls]
    for a, b in zip(lean.ops, general.ops):
        assert_equal_tree(a.out, b.out.detach() if isinstance(b.out, torch.Tensor) else b.out, what=a.label)
    # the sources name model lines, also for ops torch's own functions issued (embedding in F.embedding)
    emb = next(op for op in lean.ops if op.func_name == "embedding")
    assert "/torch/" not in emb.source and emb.source.split(":")[-1].isdigit()


def test_every_module_output_equals_a_plain_hook_read(tiny_gpt2):
    trace = tl.trace(tiny_gpt2.model, *tiny_gpt2.args)
    reads, out = hook_reads(tiny_gpt2.model, tiny_gpt2.args)
    assert sorted(c.address for c in trace.calls) == sorted(reads)
    for call in trace.calls:
        assert_equal_tree(trace.module_output(call), reads[call.address][call.pass_index - 1], what=call.key)
    assert_equal_tree(trace.output, out)


def test_a_module_returning_a_flat_tuple_keeps_the_pytree_spec(tiny_gpt2):
    trace = tl.trace(tiny_gpt2.model, *tiny_gpt2.args)
    reads, _ = hook_reads(tiny_gpt2.model, tiny_gpt2.args)
    attn = next(c for c in trace.calls if c.address == "transformer.h.0.attn")
    want = reads["transformer.h.0.attn"][0]
    assert type(want) is tuple and want[1] is None  # (output, None): the shortcut's case
    assert attn.out_spec == pytree.tree_flatten(want)[1]
    got = trace.module_output(attn)
    assert type(got) is tuple and got[1] is None
    assert torch.equal(got[0], want[0])


def test_data_reads_after_the_shortcuts_are_still_guards():
    torch.manual_seed(0)
    model, x = BranchyNet().eval(), torch.randn(2, 4)
    lean = tl.trace(model, x)
    general = tl.trace(model, x, grad=True)
    assert [r.name for r in lean.data_reads] == ["bool"]  # ``if h.sum() > 0``
    assert [(r.position, r.name, r.lineno, r.seen) for r in lean.data_reads] == \
        [(r.position, r.name, r.lineno, r.seen) for r in general.data_reads]
    with torch.no_grad():
        h = model.fc1(x)
    assert lean.data_reads[0].seen == bool(h.sum() > 0)


def test_sizes_read_in_python_pass_through_and_the_values_stay_exact():
    torch.manual_seed(0)
    model, x = ReshapeNet().eval(), torch.randn(3, 4)
    trace = tl.trace(model, x)
    with torch.no_grad():
        want = model(x)
    assert torch.equal(trace.output, want)
    assert not trace.data_reads  # a size is not tensor data
    assert _records(trace) == _records(tl.trace(model, x, grad=True))


def test_shared_hooks_keep_registration_order_with_per_module_callbacks(small_mlp, mlp_input):
    seen: list[tuple[str, str]] = []
    hooks = ModuleHooks(small_mlp)
    hooks.on_output("fc1", lambda info, a, k, o: seen.append(("first", info.address)))
    hooks.on_every_module(lambda info, a, k: None, lambda info, a, k, o: seen.append(("every", info.address)))
    hooks.on_output("fc2", lambda info, a, k, o: seen.append(("last", info.address)) or o * 2)
    before = hook_state(small_mlp)
    with torch.no_grad(), hooks:
        out = small_mlp(mlp_input)
    assert_model_clean(small_mlp, before)
    assert seen == [("first", "fc1"), ("every", "fc1"), ("every", "act"), ("every", "fc2"), ("last", "fc2"),
                    ("every", "")]
    with torch.no_grad():
        assert torch.equal(out, small_mlp(mlp_input) * 2)  # the replacement of the last callback is used
    assert [hooks.passes(a) for a in ("", "fc1", "act", "fc2")] == [1, 1, 1, 1]


def test_shared_hooks_give_each_pass_its_own_record(shared_twice):
    starts: list[tuple[str, int]] = []
    ends: list[tuple[str, int]] = []
    hooks = ModuleHooks(shared_twice.model)
    hooks.on_every_module(lambda info, a, k: starts.append((info.address, info.pass_index)),
                          lambda info, a, k, o: ends.append((info.address, info.pass_index)))
    with torch.no_grad(), hooks:
        shared_twice.model(*shared_twice.args)
    assert [s for s in starts if s[0] == "block"] == [("block", 1), ("block", 2)]
    assert sorted(starts) == sorted(ends)
    trace = tl.trace(shared_twice.model, *shared_twice.args)
    reads, _ = hook_reads(shared_twice.model, shared_twice.args)
    for i, want in enumerate(reads["block"]):
        assert torch.equal(trace[f"block:{i + 1}"].out, want)


def test_the_model_is_left_as_it_was_when_the_forward_raises_or_stops():
    model, x = RaisingNet().eval(), torch.randn(3, 4)
    before = hook_state(model)
    with pytest.raises(KeyError, match="batches of 3"):
        tl.trace(model, x)
    assert_model_clean(model, before)
    partial = trace_until(model, (torch.randn(2, 4),), {}, tl.module("fc1"))
    assert_model_clean(model, before)
    with torch.no_grad():
        want = model.fc1(partial.args[0])
    assert torch.equal(partial["fc1"].out, want)


ModuleCallStub = collections.namedtuple("ModuleCallStub", ["address", "pass_index"])  # what a row reads of its call


def test_a_recorded_op_record_equals_one_built_by_its_constructor():
    from torchlens.core.records import Op

    args, kwargs, out = (torch.ones(2),), {}, torch.zeros(2)
    code = test_a_recorded_op_record_equals_one_built_by_its_constructor.__code__
    made = Op(3, "add_1", torch.add, "add", out, "fc1", 2, code, None, args, kwargs, 0, None, 0)
    fast = Op.recorded(3, "add_1", torch.add, "add", out, "fc1", 2, code, None, 0, args, kwargs, None)
    for slot in Op.__slots__:  # every field set, to the same value (a new slot must be set by both)
        assert getattr(fast, slot) is getattr(made, slot) or getattr(fast, slot) == getattr(made, slot), slot
    # the recorder's rows, made records in one loop, set the same fields
    from torchlens.capture._classify import info_for
    from torchlens.core.builder import TraceBuilder

    build = TraceBuilder(None, (), {})
    call = ModuleCallStub("fc1", 2)
    build.graph.ops.extend([None, None, None])  # the row becomes op 3
    build.add_recorded_tensor_ops([(torch.add, info_for(torch.add), out, call, code, None, 0, args, kwargs)],
                                  {"add": 0}, None)
    rowed = build.graph.ops[3]
    for slot in Op.__slots__:
        assert getattr(rowed, slot) is getattr(made, slot) or getattr(rowed, slot) == getattr(made, slot), slot
    assert fast.source == made.source == f"{code.co_filename}:{code.co_firstlineno}"
    from torchlens.core.records import OPEN, ModuleCall

    made_call = ModuleCall("fc1", 2, "Linear", args, kwargs, 5)
    made_call.op_end = OPEN
    fast_call = ModuleCall.recorded("fc1", 2, "Linear", args, kwargs, 5, None)
    for slot in ModuleCall.__slots__:
        assert getattr(fast_call, slot) == getattr(made_call, slot), slot


class _CallsForwardDirectly(torch.nn.Module):
    """Calls a submodule's ``forward`` itself: no module call, as far as torch's hooks can tell."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.inner.forward(x))


def test_forward_slot_wrappers_see_what_hooks_see_and_are_removed(small_mlp, mlp_input):
    import inspect

    seen = {}

    def spy(info, args, kwargs):
        # during the capture a module's forward is our wrapper, yet reads as the model's own
        seen[info.address] = (inspect.signature(small_mlp.get_submodule(info.address).forward),
                              "forward" in small_mlp.get_submodule(info.address).__dict__)

    hooks = ModuleHooks(small_mlp)
    hooks.on_every_module(spy, lambda info, a, k, o: None)
    before = hook_state(small_mlp)
    with torch.no_grad(), hooks:
        small_mlp(mlp_input)
    assert_model_clean(small_mlp, before)
    assert seen["fc1"] == (inspect.signature(small_mlp.fc1.forward), True)  # wrapped, not hooked
    assert not small_mlp.fc1._forward_hooks and "forward" not in small_mlp.fc1.__dict__

    model = _CallsForwardDirectly().eval()
    x = torch.randn(2, 4)
    trace = tl.trace(model, x)
    assert [c.address for c in trace.calls] == ["", "head"]  # inner.forward(x) is no module call, as with hooks
    with torch.no_grad():
        assert torch.equal(trace.output, model(x))
        assert torch.equal(trace["head"].out, model(x))


def test_global_module_hooks_keep_every_module_hooked_in_order(small_mlp, mlp_input):
    from torch.nn.modules.module import register_module_forward_hook

    order: list[str] = []

    def doubles_fc1(module, inputs, output):  # global hooks run before a module's own: the capture sees this
        order.append(type(module).__name__)
        return output * 2 if module is small_mlp.fc1 else None

    handle = register_module_forward_hook(doubles_fc1)
    try:
        before = hook_state(small_mlp)
        trace = tl.trace(small_mlp, mlp_input)
        assert hook_state(small_mlp) == before  # (the global hook is the test's own)
    finally:
        handle.remove()
    assert order == ["Linear", "ReLU", "Linear", "SmallMLP"]
    handle = register_module_forward_hook(doubles_fc1)
    try:
        reads, out = hook_reads(small_mlp, (mlp_input,))
    finally:
        handle.remove()
    with torch.no_grad():
        assert torch.equal(reads["fc1"][0], small_mlp.fc1(mlp_input) * 2)
    for address in ("fc1", "act", "fc2"):
        assert torch.equal(trace[address].out, reads[address][0])
    assert torch.equal(trace.output, out)


def test_a_wrapped_module_that_raises_leaves_no_wrapper(tiny_gpt2):
    model = tiny_gpt2.model
    before = hook_state(model)
    with pytest.raises(IndexError):
        tl.trace(model, torch.tensor([[1, 2, 99]]))  # token 99 is outside the 64-token vocabulary
    assert_model_clean(model, before)
    trace = tl.trace(model, *tiny_gpt2.args)
    reads, _ = hook_reads(model, tiny_gpt2.args)
    assert torch.equal(trace["transformer.h.1"].out, reads["transformer.h.1"][0])


class _SpreadLines(torch.nn.Module):
    """Ops on lines of their own, one expression over two lines, one op issued inside torch (F.relu)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        y = x + 1
        z = (y *
             2)
        return torch.nn.functional.relu(self.fc(z))


class _LineReference(TorchFunctionMode):
    """The model line of every op returning a tensor, read from ``f_lineno`` of this file's frame."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[int] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):
            frame = sys._getframe(1)
            while frame.f_code.co_filename != __file__:
                frame = frame.f_back
            self.lines.append(frame.f_lineno)
        return out


def test_op_sources_are_the_lines_frames_report():
    model, x = _SpreadLines().eval(), torch.randn(2, 4)
    ref = _LineReference()
    with torch.no_grad(), ref:
        model(x)
    trace = tl.trace(model, x)
    ops = [op for op in trace.ops if not op.is_input]
    assert [int(op.source.rsplit(":", 1)[1]) for op in ops] == ref.lines
    assert all(op.source.startswith(__file__) for op in ops)
    assert len(set(ref.lines)) == 3  # add, mul (the two-line expression), linear and relu on the return line


def _detached(value):
    return value.detach() if isinstance(value, torch.Tensor) else value


def _calls(trace) -> list[tuple]:
    refs = [[None if r is None else (r.index, r.elem) for r in c.out_refs] for c in trace.calls]
    return [(c.key, c.module_type, c.op_start, c.op_end, c.n_passes, r) for c, r in zip(trace.calls, refs)]


@pytest.mark.parametrize("name", ["inplace_net", "control_flow", "shared_twice", "tuple_out", "tiny_gpt2"])
def test_ops_noted_in_batches_equal_the_general_path(name, request):
    # Inline ops are noted as rows and become records in batches (before an in-place op, a general
    # record, at the end); module returns look producers up among the rows not yet made records.
    case = request.getfixturevalue(name)
    tl.trace(case.model, *case.args, **case.kwargs)  # a frame seen for the first time takes the general record
    lean = tl.trace(case.model, *case.args, **case.kwargs)
    general = tl.trace(case.model, *case.args, **case.kwargs, grad=True)  # every op through the general record
    assert _records(lean) == _records(general)
    assert _calls(lean) == _calls(general)
    assert lean.output_layers == general.output_layers and lean.output_layers
    for a, b in zip(lean.ops, general.ops):
        assert_equal_tree(a.out, _detached(b.out) if not isinstance(b.out, tuple) else tuple(map(_detached, b.out)),
                          what=a.label)
    reads, out = hook_reads(case.model, case.args, case.kwargs)  # copied in the hook: the value at return
    for call in lean.calls:
        assert call.n_passes == len(reads[call.address])
        assert_equal_tree(lean.module_output(call), reads[call.address][call.pass_index - 1], what=call.key)
    assert_equal_tree(lean.output, out)


class _ReturnsDict(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        return {"h": h, "first": x + 1}  # ``x + 1`` is not the module's last op


class _RefillsADict(torch.nn.Module):
    """Changes the dict one submodule returned (a new value, a new key); leaves another's alone."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = _ReturnsDict()
        self.kept = _ReturnsDict()

    def forward(self, x):
        out = self.inner(x)
        out["h"] = out["h"] * 3
        out["extra"] = x.sum()
        kept = self.kept(x)
        return out["h"] + kept["h"] + kept["first"]


def test_a_container_refilled_after_its_module_returned_is_recorded_as_returned():
    torch.manual_seed(0)
    model, x = _RefillsADict().eval(), torch.randn(2, 4)
    tl.trace(model, x)  # a frame seen for the first time takes the general record
    trace = tl.trace(model, x)
    reads, out = hook_reads(model, (x,))
    for address in ("inner", "kept"):
        got = trace.module_output(trace.calls_of(address)[0])
        assert sorted(got) == ["first", "h"]  # not the key the parent added afterwards
        assert_equal_tree(got, reads[address][0], what=address)
    with torch.no_grad():
        assert torch.equal(trace["inner"].out["h"], model.inner.fc(x))  # before the parent tripled it
    assert torch.equal(trace.output, out)
    assert _calls(trace) == _calls(tl.trace(model, x, grad=True))


def test_a_call_record_outside_a_trace_has_one_pass():
    from torchlens.core.records import ModuleCall

    assert ModuleCall("fc1", 1, "Linear", (), {}, 0).n_passes == 1


class _NotesTheCollector(torch.nn.Module):
    """Notes, inside its forward, whether the cyclic garbage collector is enabled."""

    def __init__(self, raises: bool = False) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.raises = raises
        self.seen: list[bool] = []

    def forward(self, x):
        self.seen.append(gc.isenabled())
        if self.raises:
            raise ValueError("raised on purpose")
        return self.fc(x) + 1


def test_the_collector_is_held_off_only_while_an_in_memory_capture_runs(tmp_path):
    model, x = _NotesTheCollector().eval(), torch.randn(2, 4)
    assert gc.isenabled()
    trace = tl.trace(model, x)
    assert model.seen == [False] and gc.isenabled()  # held off in the forward, enabled again after
    with torch.no_grad():
        assert torch.equal(trace.output, model.fc(x) + 1)
    tl.trace(model, x, save=tl.module("fc"))  # a bounded capture: the model's cyclic garbage stays collectable
    tl.trace(model, x, store=str(tmp_path / "store"))
    assert model.seen[1:] == [True, True] and gc.isenabled()
    raising = _NotesTheCollector(raises=True).eval()
    with pytest.raises(ValueError, match="on purpose"):
        tl.trace(raising, x)
    assert raising.seen == [False] and gc.isenabled()
    gc.disable()  # the user's own choice is kept
    try:
        tl.trace(model, x)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_captures_in_two_threads_give_the_collector_back_once_both_ended():
    from torchlens._collector import GcPause

    first, second = GcPause(), GcPause()
    first.__enter__()
    second.__enter__()  # another capture starts while the first runs (another thread, or nested)
    first.__exit__(None, None, None)
    assert not gc.isenabled()  # the second capture still runs
    second.__exit__(None, None, None)
    assert gc.isenabled()
    done: list[bool] = []
    models = [_NotesTheCollector().eval() for _ in range(2)]
    threads = [threading.Thread(target=lambda m=m: done.append(len(tl.trace(m, torch.randn(2, 4)).ops) > 0))
               for m in models]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert done == [True, True] and gc.isenabled()
    assert all(m.seen == [False] for m in models)


class _OwnWalk(torch.nn.Sequential):
    def named_modules(self, *args, **kwargs):  # a type walking its modules its own way is asked (hides Tanh)
        yield from ((n, m) for n, m in super().named_modules(*args, **kwargs) if type(m) is not torch.nn.Tanh)


def test_the_module_walk_equals_named_modules():
    from torchlens.capture._interpose import named_modules

    shared = torch.nn.Linear(2, 2)
    model = torch.nn.Sequential(torch.nn.Sequential(shared, torch.nn.ReLU()), shared,
                                torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(shared)))
    model.add_module("nothing", None)
    assert [n for n in named_modules(model) if n.endswith(".0")] == ["0.0", "2.0"]  # ``shared`` once, first name
    walks_itself = torch.nn.Sequential(torch.nn.ReLU(), _OwnWalk(torch.nn.Tanh(), shared), shared)
    for m in (model, model[2], walks_itself, _OwnWalk(torch.nn.ReLU(), model[2])):
        got = named_modules(m)
        assert list(got.items()) == list(m.named_modules())  # same names, same order, shared modules once
    assert not any(type(m) is torch.nn.Tanh for m in named_modules(walks_itself).values())


class _Shadowing(torch.nn.Module):
    """A child a class attribute hides (``getattr`` finds the property, not ``_modules``)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Linear(2, 2)
        self.other = torch.nn.Linear(2, 2)

    @property
    def inner(self):  # noqa: F811 - the point: the class attribute wins over the child of that name
        return self.other

    @inner.setter
    def inner(self, value) -> None:
        self._modules["inner"] = value

    def forward(self, x):
        return self.other(x)


class _Redirecting(torch.nn.Module):
    """A type with its own ``__getattr__``: a name means what it says."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(2, 2)
        self.b = torch.nn.Linear(2, 2)

    def __getattr__(self, name):
        return super().__getattr__("b" if name == "a" else name)

    def forward(self, x):
        return self.b(x)


def test_the_module_lookup_equals_get_submodule():
    from torchlens.capture.hooks import resolve_module
    from torchlens.errors import SiteNotFoundError

    shadowed = torch.nn.Sequential(_Shadowing(), _Redirecting())
    hidden = torch.nn.Sequential(torch.nn.Linear(2, 2))
    object.__setattr__(hidden, "0", torch.nn.ReLU())  # an instance attribute over the child: getattr's pick
    model = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU()), shadowed, hidden)
    addresses = ["", "0", "0.0", "1.0.inner", "1.0.other", "1.1.a", "1.1.b", "2.0"]
    for address in addresses:
        assert resolve_module(model, address) is model.get_submodule(address), address
    assert resolve_module(model, "1.0.inner") is shadowed[0].other
    assert resolve_module(model, "1.1.a") is shadowed[1].b
    assert type(resolve_module(model, "2.0")) is torch.nn.ReLU
    for missing in ("3", "0.5", "0.0.weight.x", "1.0.nothing"):
        with pytest.raises(SiteNotFoundError):
            resolve_module(model, missing)
    x = torch.randn(1, 2)
    want, _ = hook_reads(model, (x,))
    before = hook_state(model)
    got = tl.extract(model, x, ["1.0.other", "0.0"])
    assert torch.equal(got["1.0.other"], want["1.0.other"][0]) and torch.equal(got["0.0"], want["0.0"][0])
    assert_model_clean(model, before)


class _WritesThroughData(torch.nn.Module):
    """Changes a child's output after its hook ran, through ``.data`` (no version bump) or in place."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.a = torch.nn.Linear(3, 3)
        self.b = torch.nn.Linear(3, 3)
        self.how = how

    def forward(self, x):
        h = self.a(x)
        if self.how == "data":
            h.data.add_(1)
        elif self.how == "inplace":
            h.add_(1)
        return self.b(h)


@pytest.mark.parametrize("how", ["data", "inplace", "none"])
def test_a_module_read_is_the_value_its_hook_saw(how):
    torch.manual_seed(0)
    model = _WritesThroughData(how).eval()
    x = torch.randn(2, 3)
    seen = []
    handle = model.a.register_forward_hook(lambda m, i, o: seen.append((o, o.clone())))
    with torch.no_grad():
        model(x)
    handle.remove()
    before = hook_state(model)
    got = tl.extract(model, x, ["a"])["a"]
    assert_model_clean(model, before)
    assert torch.equal(got, seen[0][1])  # the value when the module returned, not after the model changed it
    seen.clear()
    handle = model.a.register_forward_hook(lambda m, i, o: seen.append(o))
    try:
        got = tl.extract(model, x, ["a"])["a"]
    finally:
        handle.remove()
    assert (got is seen[0]) == (how == "none")  # the forward's own tensor when left as it was, else the copy


_Pair = collections.namedtuple("_Pair", ["first", "second"])


class _LeafBox:
    """A value pytree takes as a leaf until a test registers it as a node."""

    def __init__(self, value) -> None:
        self.value = value


def _same_flatten(got, want) -> None:
    assert got[1] == want[1] and repr(got[1]) == repr(want[1])  # (specs with keys 1 and True are ==)
    assert len(got[0]) == len(want[0]) and all(a is b for a, b in zip(got[0], want[0]))


def test_module_output_specs_kept_between_captures_equal_the_pytree_walk(tiny_gpt2):
    from torchlens.capture._calls import _flatten_output

    t, u = torch.ones(2), torch.zeros(3)
    box = _LeafBox(t)
    values = [
        (t, None), (None, t), (t, u, None), (t, (u, None)), (t, [u]), (),  # tuples, a nested one
        {"a": t, "b": None}, {"b": t, "a": u}, {"a": t, "b": box}, {"a": {"b": t}},  # dicts: keys in order
        {1: t}, {True: t}, {1.0: t}, {(1, 2): t}, {"a": [t]},  # 1, 1.0 and True: one dict key, three specs
        (t, _Pair(t, u)), {"a": _Pair(u, None)},  # a namedtuple is a container, though no registered type
    ]
    with torch.no_grad():
        out = tiny_gpt2.model(*tiny_gpt2.args)
        values += [out, type(out)(logits=t)]  # a ModelOutput, and one of its type with other keys
    for value in values * 2:  # the second time through the kept specs
        _same_flatten(_flatten_output(value), pytree.tree_flatten(value))
    # a type registered as a container after its values were leaves is walked into from then on
    pytree.register_pytree_node(_LeafBox, lambda b: ([b.value], None), lambda xs, _: _LeafBox(xs[0]))
    try:
        got, spec = _flatten_output({"a": t, "b": box})
        assert got == [t, t] and spec == pytree.tree_flatten({"a": t, "b": box})[1]
    finally:
        pytree._deregister_pytree_node(_LeafBox)
    _same_flatten(_flatten_output({"a": t, "b": box}), pytree.tree_flatten({"a": t, "b": box}))


def test_a_traced_model_output_keeps_its_spec_and_a_refilled_one_is_rebuilt(tiny_gpt2):
    model, args = tiny_gpt2.model, tiny_gpt2.args
    reads, out = hook_reads(model, args)
    for _ in range(2):  # the second capture meets the specs the first one kept
        trace = tl.trace(model, *args)
        for call in trace.calls:
            want = reads[call.address][call.pass_index - 1]
            assert call.out_spec == (None if isinstance(want, torch.Tensor) else pytree.tree_flatten(want)[1])
            assert_equal_tree(trace.module_output(call), want, what=call.key)
        assert_equal_tree(trace.output, out)
    # a hook refills the inner ModelOutput after it returned: the record keeps what it returned
    inner = model.transformer
    seen = {}

    def keep_inner(module, args, output):
        seen["inner"] = output

    def refill_after(module, args, output):
        seen["inner"]["past_key_values"] = None  # a key the inner call did not return
        seen["inner"]["attentions"] = (output.logits,)

    h1, h2 = inner.register_forward_hook(keep_inner), model.register_forward_hook(refill_after)
    try:
        before = hook_state(model)
        trace = tl.trace(model, *args)
        assert_model_clean(model, before)  # the user's hooks as they were, nothing of ours
    finally:
        h1.remove()
        h2.remove()
    got = trace.module_output(trace.calls_of("transformer")[0])
    assert list(got.keys()) == list(reads["transformer"][0].keys())
    assert_equal_tree(got, reads["transformer"][0])


def test_ops_called_without_keywords_each_keep_a_dict_of_their_own(tiny_gpt2):
    trace = tl.trace(tiny_gpt2.model, *tiny_gpt2.args)
    ops = [op for op in trace.ops if not op.is_input]
    assert ops and all(type(op.kwargs) is dict for op in ops)
    empty = [op.kwargs for op in ops if not op.kwargs]
    assert len(empty) > 10 and len({id(k) for k in empty}) == len(empty)  # no dict shared between records
    assert _records(trace) == _records(tl.trace(tiny_gpt2.model, *tiny_gpt2.args, grad=True))


def test_the_collector_is_held_off_while_a_replay_runs_and_given_back_after():
    """A replay's records stay reachable from its fork: the collector is off while the engine
    walks the graph (the edit runs inside it), on again after, also when the edit raises, and a
    collector the user turned off stays off."""
    model, x = _NotesTheCollector().eval(), torch.randn(2, 4)
    trace = tl.trace(model, x)
    seen: list[bool] = []

    def doubled(out):
        seen.append(gc.isenabled())
        return out * 2

    fork = trace.fork().do(tl.func("linear"), doubled)
    assert seen == [False] and gc.isenabled()
    with torch.no_grad():
        assert torch.equal(fork.output, model.fc(x) * 2 + 1)  # the fork's value: a re-computation by hand
    forks = trace.forks([(tl.func("linear"), doubled), (tl.func("add"), doubled)])
    assert seen[1:] == [False, False] and gc.isenabled() and len(forks) == 2

    def raising(out):
        raise ValueError("edit raised on purpose")

    with pytest.raises(ValueError, match="on purpose"):
        trace.fork().do(tl.func("linear"), raising)
    assert gc.isenabled()
    gc.disable()  # the user's own choice is kept
    try:
        trace.fork().do(tl.func("linear"), doubled)
        assert not gc.isenabled()
    finally:
        gc.enable()
