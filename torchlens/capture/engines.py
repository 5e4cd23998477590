"""The two built-in capture engines, registered as plugins like any third party's.

``hooks``: module forward hooks only — reads and edits module outputs at almost no cost.
``function_mode``: a TorchFunctionMode recorder plus module hooks for context — every op.
"""

from __future__ import annotations

import torch

from ..core.records import INPUT, OPEN, Op
from ..core.trace import Trace
from ..core.tree import flatten
from ..edits import AppliedEdit, EditContext, When, apply_edit, count_changed
from ..errors import StopCapture
from ..hookspecs import hookimpl
from .hooks import ModuleHooks
from .recorder import Recorder, clone_value
from .request import CaptureRequest, real_address


def _module_steps(request: CaptureRequest) -> tuple[dict[str, list[tuple[int | None, When]]], list[When]]:
    """Split capture-time edits into per-module (hook) edits and per-op (recorder) edits."""
    by_address: dict[str, list[tuple[int | None, When]]] = {}
    op_steps: list[When] = []
    for when in request.intervene:
        paths = when.site.module_paths()
        if paths is None:
            op_steps.append(when)
            continue
        for path in paths:
            address, pass_index = real_address(request.model, path)
            by_address.setdefault(address, []).append((pass_index, when))
    return by_address, op_steps


def _until_addresses(request: CaptureRequest) -> dict[str, int | None]:
    if request.until is None or request.until.module_paths() is None:
        return {}
    return dict(real_address(request.model, p) for p in request.until.module_paths())


class HooksEngine:
    """Module outputs only: one forward hook per requested module, nothing per op."""

    name = "hooks"

    def cost(self, request: CaptureRequest) -> float | None:
        if request.record_ops or not request.module_only():
            return None
        return 1.0

    def capture(self, request: CaptureRequest) -> Trace:
        from ..core.records import ModuleCall

        trace = Trace(request.model, request.args, request.kwargs)
        trace.engine = self.name
        edits, _ = _module_steps(request)
        stops = _until_addresses(request)
        wanted: dict[str, None] = {}
        for sel in [request.sites] if request.sites is not None else []:
            for path in sel.module_paths() or ():
                wanted[real_address(request.model, path)[0]] = None
        hooks = ModuleHooks(request.model)
        for address in dict.fromkeys([*wanted, *edits, *stops]):
            steps = edits.get(address)
            stop_pass = stops.get(address, -1)

            def on_output(info, args, kwargs, output, steps=steps, stop_pass=stop_pass):
                call = ModuleCall(info.address, info.pass_index, type(info.module).__name__, args, kwargs, 0)
                replaced = None
                for pass_index, when in steps or ():
                    if pass_index is None or pass_index == info.pass_index:
                        ctx = EditContext(when.site.describe(), info.address, info.address, info.pass_index, call,
                                          trace)
                        edited = apply_edit(clone_value(output), when.edit, ctx)
                        trace.edits.append(
                            AppliedEdit(when.site.describe(), info.address, info.pass_index,
                                        count_changed(output, edited))
                        )
                        when.fired.append(info.address)
                        output = replaced = edited
                call._out = output
                trace._add_call(call)
                if stop_pass != -1 and (stop_pass is None or stop_pass == info.pass_index):
                    raise StopCapture(info.address)
                return replaced

            hooks.on_output(address, on_output)
        output = None
        with torch.set_grad_enabled(request.grad), hooks:
            try:
                output = request.model(*request.args, **request.kwargs)
            except StopCapture:
                trace.complete = False
        trace._output_raw = output
        trace.steps = list(request.intervene)
        return trace


def _record_inputs(trace: Trace, args: tuple, kwargs: dict) -> None:
    named = [(str(i), a) for i, a in enumerate(args)] + list(kwargs.items())
    for key, value in named:
        leaves, _ = flatten(value)
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        for j, t in enumerate(tensors):
            label = f"input_{key}" if len(tensors) == 1 else f"input_{key}_{j}"
            index = len(trace.ops)
            op = Op(index, label, None, "input", t, "", 1, None, 0, (), {}, INPUT)
            trace._add_op(op)
            trace._register(t, index, None)
            trace.input_layers.append(label)


class FunctionModeEngine:
    """Every executed op, through a thread-local TorchFunctionMode; module context from hooks."""

    name = "function_mode"

    def cost(self, request: CaptureRequest) -> float | None:
        return 10.0

    def capture(self, request: CaptureRequest) -> Trace:
        model = request.model
        trace = Trace(model, request.args, request.kwargs)
        trace.engine = self.name
        module_steps, op_steps = _module_steps(request)
        stops = _until_addresses(request)
        op_until = request.until if request.until is not None and not stops else None
        recorder = Recorder(trace, op_steps, op_until)
        _record_inputs(trace, request.args, request.kwargs)
        hooks = ModuleHooks(model)
        enter = recorder.enter_module
        for name in hooks.names():
            steps = module_steps.get(name)
            stop_pass = stops.get(name, -1)
            hooks.on_input(name, enter)

            def exit_(info, args, kwargs, output, steps=steps, stop_pass=stop_pass):
                stop = stop_pass != -1 and (stop_pass is None or stop_pass == info.pass_index)
                return recorder.exit_module(info, args, kwargs, output, steps, stop)

            hooks.on_output(name, exit_)
        output = None
        with torch.set_grad_enabled(request.grad), hooks, recorder:
            try:
                output = model(*request.args, **request.kwargs)
            except StopCapture:
                trace.complete = False
        for call in trace.calls:  # calls a stopped (until=) forward never finished
            if call.op_end == OPEN:
                call.op_end = len(trace.ops)
        trace._stale = recorder.stale
        trace.grad = request.grad
        trace.steps = list(request.intervene)
        trace._finish(output, request.save)
        return trace


class HooksEnginePlugin:
    @staticmethod
    @hookimpl
    def torchlens_engines():
        return [HooksEngine()]


class FunctionModeEnginePlugin:
    @staticmethod
    @hookimpl
    def torchlens_engines():
        return [FunctionModeEngine()]
