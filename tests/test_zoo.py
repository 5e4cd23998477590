"""The model zoo of the core issue, each model checked by value against plain PyTorch.

For every model: each module's output in the trace equals what a plain forward hook on
that module saw at that moment (every module, every pass), each recorded op equals an
independent TorchFunctionMode reference that clones outputs as they are produced, the
final output equals the plain forward's, and the model is left exactly as it was.
"""

from __future__ import annotations

import torch
from conftest import ZOO, assert_equal_tree, assert_model_clean, clone_tree, hook_reads, hook_state, leaves
from torch.overrides import TorchFunctionMode

import torchlens as tl


class ReferenceRecorder(TorchFunctionMode):
    """Independent reference: every torch call returning tensors, output cloned at once."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[str, object]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        result = out
        if out is None and args and isinstance(args[0], torch.Tensor):  # in-place returning None
            out = args[0]
        if isinstance(out, torch.Tensor) or (
            isinstance(out, (tuple, list)) and out and all(isinstance(x, torch.Tensor) or x is None for x in out)
        ):
            self.records.append((getattr(func, "__name__", repr(func)), clone_tree(out)))
        return result


def _module_key(trace, address: str, n_passes: int, i: int) -> str:
    return address if n_passes == 1 else f"{address}:{i + 1}"


def test_every_module_output_equals_a_plain_hook_read(zoo_case, zoo_traces):
    case, trace = zoo_traces(zoo_case.name)
    reads, out = hook_reads(case.model, case.args, case.kwargs)
    checked = 0
    for address, outs in reads.items():
        for i, want in enumerate(outs):
            key = _module_key(trace, address, len(outs), i)
            assert_equal_tree(trace[key].out, want, what=f"{case.name}:{key}")
            checked += 1
    assert checked == len(trace.modules)
    assert_equal_tree(trace.output, out, what=f"{case.name}: final output")


def test_final_output_equals_plain_forward_and_has_the_same_type(zoo_case, zoo_traces):
    case, trace = zoo_traces(zoo_case.name)
    plain = case.forward()
    assert type(trace.output) is type(plain)
    assert_equal_tree(trace.output, plain)
    if isinstance(plain, dict):
        assert list(trace.output) == list(plain)


def test_every_op_equals_an_independent_reference_taken_at_that_moment(zoo_case, zoo_traces):
    case, trace = zoo_traces(zoo_case.name)
    ref = ReferenceRecorder()
    with torch.no_grad(), ref:
        case.model(*case.args, **case.kwargs)
    ops = [op for op in trace.ops if not op.is_input]
    names = [name.strip("_") if name.startswith("__") else name for name, _ in ref.records]
    assert names == [op.func_name for op in ops]
    for (_, want), op in zip(ref.records, ops):
        assert_equal_tree(op.out, want, what=f"{case.name}:{op.label}")


def test_capture_leaves_the_model_exactly_as_it_was(zoo_case):
    before = hook_state(zoo_case.model)
    tl.trace(zoo_case.model, *zoo_case.args, **zoo_case.kwargs)
    assert_model_clean(zoo_case.model, before)
    tl.extract(zoo_case.model, zoo_case.inputs_for_do, [zoo_case.block])
    assert_model_clean(zoo_case.model, before)


def test_op_fields_are_consistent(zoo_case, zoo_traces):
    case, trace = zoo_traces(zoo_case.name)
    labels = [op.label for op in trace.ops]
    assert len(labels) == len(set(labels))
    addresses = {name for name, _ in case.model.named_modules()}
    by_label = {op.label: op for op in trace.ops}
    for i, op in enumerate(trace.ops):
        assert op.index == i and trace[op.label].record is op
        for t in leaves(op.out):
            assert isinstance(t, torch.Tensor)
        if isinstance(op.out, torch.Tensor):
            assert op.shape == tuple(op.out.shape) and op.dtype == op.out.dtype
        assert op.module in addresses
        assert op.module_pass >= 1
        for parent in op.parents:
            assert op.label in by_label[parent].children
            assert by_label[parent].index < op.index
        for child in op.children:
            assert op.label in by_label[child].parents
    # the module recorded for an op is a module whose call was open when it ran
    for call in trace.calls:
        for op in trace.ops[call.op_start:call.op_end]:
            assert op.module == call.address or op.module.startswith(call.address + ".") or call.address == ""


def test_layers_modules_inputs_and_outputs(zoo_case, zoo_traces):
    case, trace = zoo_traces(zoo_case.name)
    assert [s.label for s in trace.layers] == [op.label for op in trace.ops]
    n_inputs = len(leaves((case.args, case.kwargs)))
    assert len(trace.input_layers) == n_inputs
    assert trace.layers[0].label == trace.input_layers[0]
    inputs = leaves((case.args, case.kwargs))
    for label, x in zip(trace.input_layers, inputs):
        assert trace[label].out is x and trace[label].is_input
    out_leaves = leaves(trace.output)
    produced = {id(leaf) for label in trace.output_layers for leaf in leaves(trace[label].out)}
    assert trace.output_layers and all(id(t) in produced for t in out_leaves if t.is_floating_point())
    starts = [m.record.op_start for m in trace.modules]
    assert starts == sorted(starts)
    assert trace.modules[0].label == ""  # the root module's call comes first


def test_zoo_list_is_complete():
    assert len(ZOO) == 10
