"""The two built-in capture engines, registered as plugins like any third party's.

``hooks``: module forward hooks only — reads and edits module outputs at almost no cost.
``function_mode``: a TorchFunctionMode recorder plus module hooks for context — every op.
"""

from __future__ import annotations

import operator
from itertools import repeat
from typing import Any

import torch

from .._collector import GcPause
from .._interrupts import Attached
from ..core.builder import TraceBuilder
from ..core.inputs import input_tensors
from ..core.records import INPUT, OPEN, ModuleCall, Op
from ..core.selectors import split_pass
from ..core.steps import Step
from ..core.trace import Trace
from ..core.tree import clone_value, flatten
from ..edit.edits import AppliedEdit, EditContext, apply_edit, count_changed, land_edit
from ..errors import StopCapture
from ..hookspecs import hookimpl
from ._offload import defer_offloaded_weights
from ._random import active_dropout, warn_random
from ._recorder import Recorder
from .hooks import ModuleHooks
from .request import CaptureRequest, module_address

__all__ = ["FunctionModeEngine", "FunctionModeEnginePlugin", "HooksEngine", "HooksEnginePlugin"]


def _module_steps(request: CaptureRequest, *, check: bool = True
                  ) -> tuple[dict[str, list[tuple[int | None, Step]]], list[Step]]:
    """Split capture-time edits into per-module (hook) edits and per-op (recorder) edits.

    ``check``: refuse an address the model lacks here (``False``: the caller hooks each one, which refuses it).
    """
    by_address: dict[str, list[tuple[int | None, Step]]] = {}
    op_steps: list[Step] = []
    for when in request.intervene:
        paths = when.site.module_paths()
        if paths is None:
            op_steps.append(when)
            continue
        for path in paths:
            address, pass_index = module_address(request.model, path) if check else split_pass(path)
            by_address.setdefault(address, []).append((pass_index, when))
    return by_address, op_steps


def _until_addresses(request: CaptureRequest) -> dict[str, int | None]:
    if request.until is None or request.until.module_paths() is None:
        return {}
    return dict(module_address(request.model, p) for p in request.until.module_paths())


class HooksEngine:
    """Module outputs only: one forward hook per requested module, nothing per op."""

    name = "hooks"
    records_ops = False  # module outputs only: tl.trace(..., backend=name) asks it for those

    def cost(self, request: CaptureRequest) -> float | None:
        if request.record_ops or not request.module_only():
            return None
        return 1.0

    def capture(self, request: CaptureRequest) -> Trace:
        build = TraceBuilder(request.model, request.args, request.kwargs, engine=self.name, op_graph=False,
                             strict=request.strict)
        edits = _module_steps(request, check=False)[0] if request.intervene else {}
        stops = _until_addresses(request) if request.until is not None else {}
        paths = request.sites.module_paths() if request.sites is not None else None
        run = _HookedForward(request.model, [split_pass(path)[0] for path in paths or ()], edits, stops,
                             request.stop_after_sites, build)
        output, complete = run.forward(request.args, request.kwargs, request.grad)
        return build.finish(output, steps=request.intervene, grad=request.grad, complete=complete)

    def read(self, model: torch.nn.Module, args: tuple, kwargs: dict, addresses: list[str], *,
             grad: bool = False) -> dict[str, Any] | Trace:
        """The outputs of the modules at ``addresses`` (no pass index), read in one forward with no
        trace built: ``tl.extract``'s commonest call, whose fixed cost is most of what it costs.

        Returns:
            ``{address: output}`` (what ``capture`` would hold for each) when every one of them ran
            exactly once; else the trace ``capture`` makes of the same forward, which says what
            such a read means (the module did not run; which pass).
        """
        run = _HookedForward(model, addresses, {}, {}, False, None)
        output, complete = run.forward(args, kwargs, grad)
        calls = run.calls
        if len(calls) == len(addresses):
            found = {call.address: call._out for call in calls}
            if len(found) == len(addresses):  # each address once
                return found
        build = TraceBuilder(model, args, kwargs, engine=self.name, op_graph=False)
        for call in calls:
            build.add_call(call)
        return build.finish(output, steps=[], grad=grad, complete=complete)


class _HookedForward:
    """One forward of ``model`` with a hook on each module that is read, edited or stopped after.

    Each call of a hooked module is kept (``calls``, in the order they returned) with the output a
    forward hook there sees: the object itself when the model left it as it was, a copy taken in the
    hook otherwise. ``build`` receives the calls as they return (and the edits), when there is one.
    """

    def __init__(self, model: torch.nn.Module, reads: list[str], edits: dict[str, list[tuple[int | None, Step]]],
                 stops: dict[str, int | None], stop_after_reads: bool, build: TraceBuilder | None) -> None:
        self.model = model
        self.calls: list[ModuleCall] = []
        self._handed: list[tuple[ModuleCall, object, list[int | None]]] = []
        self.hooks = hooks = ModuleHooks(model)
        unread = dict.fromkeys(reads) if stop_after_reads else {}
        # the module of each site is looked up (or refused) as it is hooked
        for address in dict.fromkeys([*reads, *edits, *stops]):
            hooks.on_output(address, self._hook(edits.get(address), stops.get(address, -1), unread, build))

    def _hook(self, steps: list[tuple[int | None, Step]] | None, stop_pass: int | None, unread: dict[str, None],
              build: TraceBuilder | None) -> Any:
        calls, handed = self.calls, self._handed

        def on_output(info, args, kwargs, output):
            call = ModuleCall(info.address, info.pass_index, type(info.module).__name__, args, kwargs, 0)
            replaced = None
            for pass_index, when in steps if steps is not None else ():
                if pass_index is None or pass_index == info.pass_index:
                    ctx = EditContext(when.site.describe(), info.address, info.address, info.pass_index, call,
                                      build.trace)
                    edited = apply_edit(clone_value(output), when.edit, ctx)
                    land_edit(build, when.edit, AppliedEdit(when.site.describe(), info.address, info.pass_index,
                                                            count_changed(output, edited), "captured",
                                                            before=output))
                    when.fired.append(info.address)
                    output = replaced = edited
            # No op graph here, so no copy on write: the model may still change the tensor
            # (or the container) it got back, so a copy made now is kept next to it.
            with torch._C.DisableTorchFunction():  # our copy, not an op of the model
                call._out = output.clone() if type(output) is torch.Tensor else clone_value(output)
            handed.append((call, output, _versions(output)))
            calls.append(call)
            if build is not None:
                build.add_call(call)
            if stop_pass != -1 and (stop_pass is None or stop_pass == info.pass_index):
                raise StopCapture(info.address)
            if unread and unread.pop(info.address, 0) is None and not unread:
                raise StopCapture(info.address)  # every site has given its output
            return replaced

        return on_output

    def forward(self, args: tuple, kwargs: dict, grad: bool) -> tuple[Any, bool]:
        """Run the model with the hooks on (taken off whatever happens); returns its output (None when
        stopped early) and whether it ran to the end."""
        output = None
        complete = True
        with Attached(_GradMode(grad), self.hooks):
            try:
                output = self.model(*args, **kwargs)
            except StopCapture:
                complete = False
        # no ops recorded: the dropout modules say (model.eval() turns every one off: not looked for then)
        dropout = active_dropout(self.hooks.named().items()) if self.model.training else None
        if dropout:
            warn_random(self.model, [], dropout)
        for call, handed_out, versions in self._handed:
            # The object the forward really used (what a forward hook sees, with its autograd
            # graph) is kept when the model left it as it was; the copy otherwise.
            if _unchanged(handed_out, call._out, versions):
                call._out = handed_out
        return output, complete


class _GradMode:
    """The grad mode of a capture, set on entry and restored on exit (``torch.set_grad_enabled``
    sets it when made, before ``Attached`` holds Ctrl-C off)."""

    __slots__ = ("grad", "before")

    def __init__(self, grad: bool) -> None:
        self.grad = grad
        self.before = True

    def __enter__(self) -> None:
        self.before = torch.is_grad_enabled()
        torch._C._set_grad_enabled(self.grad)

    def __exit__(self, *exc: object) -> None:
        torch._C._set_grad_enabled(self.before)


def _versions(value: object) -> list[int | None]:
    """The version counter of each tensor leaf (bumped by every in-place change, views included)."""
    if type(value) is torch.Tensor:  # the commonest module output: no tree walk
        try:
            return [value._version]
        except RuntimeError:
            return [None]
    found: list[int | None] = []
    for leaf in flatten(value)[0]:
        try:
            found.append(leaf._version if isinstance(leaf, torch.Tensor) else None)
        except RuntimeError:  # an inference-mode tensor keeps no version counter
            found.append(None)
    return found


def _unchanged(value: object, copy: object, versions: list[int | None]) -> bool:
    """Whether ``value`` still holds what ``copy`` was taken from: same structure and elements."""
    if type(value) is torch.Tensor and type(copy) is torch.Tensor:  # a bare tensor: no tree walk
        # Writes through ``.data`` bypass the version counter: compare the elements too.
        return _versions(value) == versions and value.shape == copy.shape and value.dtype == copy.dtype \
            and torch.equal(value, copy)
    leaves, spec = flatten(value)
    copies, copy_spec = flatten(copy)
    if spec != copy_spec or len(leaves) != len(copies) or _versions(value) != versions:
        return False
    for a, b in zip(leaves, copies):
        if isinstance(a, torch.Tensor):
            # Writes through ``.data`` bypass the version counter: compare the elements too.
            if a.shape != b.shape or a.dtype != b.dtype or not torch.equal(a, b):
                return False
        elif a is not b:
            return False
    return True


def _any_offload(modules: list[torch.nn.Module]) -> bool:
    """Whether some module carries an accelerate hook (``_hf_hook``), which may offload its weights."""
    # (looked for in each module's __dict__ by C-level iteration: this runs on every capture, for every module)
    if any(map(operator.contains, map(vars, modules), repeat("_hf_hook"))):
        return True
    kinds = set(map(type, modules))
    # a failed class attribute lookup is slow (an exception): once per module type, not per capture
    for kind in kinds - _CLASS_HOOK.keys():
        _CLASS_HOOK[kind] = hasattr(kind, "_hf_hook")
    return any(map(_CLASS_HOOK.__getitem__, kinds))


_CLASS_HOOK: dict[type, bool] = {}  # module type -> whether the class itself carries ``_hf_hook``


def _record_inputs(build: TraceBuilder, args: tuple, kwargs: dict) -> None:
    for label, t in input_tensors(args, kwargs):
        index = len(build.ops)
        op = Op(index, label, None, "input", t, "", 1, None, 0, (), {}, INPUT)
        build.add_op(op)
        build.register_tensor(t, index, None)
        build.add_input(label)


class FunctionModeEngine:
    """Every executed op, through a thread-local TorchFunctionMode; module context from hooks."""

    name = "function_mode"
    records_ops = True

    def cost(self, request: CaptureRequest) -> float | None:
        return 10.0

    def capture(self, request: CaptureRequest) -> Trace:
        if request.save is None and request.sink is None:  # in memory: every record stays reachable
            with GcPause():
                return self._capture(request)
        return self._capture(request)  # bounded (save=, store=, offload): the model's cycles stay collectable

    def _capture(self, request: CaptureRequest) -> Trace:
        model = request.model
        build = TraceBuilder(model, request.args, request.kwargs, engine=self.name, strict=request.strict)
        trace = build.trace
        module_steps, op_steps = _module_steps(request)
        stops = _until_addresses(request)
        op_until = request.until if request.until is not None and not stops else None
        recorder = Recorder(build, op_steps, op_until, save=request.save, grad=request.grad, sink=request.sink,
                            max_bytes=request.max_bytes, module_steps=module_steps, stops=stops)
        _record_inputs(build, request.args, request.kwargs)
        hooks = ModuleHooks(model)
        hooks.on_every_module(recorder.enter_module, recorder.exit_module)
        output = None
        complete = True
        try:
            with Attached(_GradMode(request.grad), hooks, recorder):
                try:
                    output = model(*request.args, **request.kwargs)
                except StopCapture:
                    complete = False
            recorder.flush()
            recorder.settle()
            for call in trace.calls:  # calls a stopped (until=) forward never finished
                if call.op_end == OPEN:
                    call.op_end = len(trace.ops)
            if _any_offload(hooks.modules()):  # the full search reads every module's attributes
                defer_offloaded_weights(trace, model)  # offloaded weights: references, not a second copy
            if request.sink is not None:
                request.sink.close()
        except BaseException:
            # the forward raised or was interrupted (Ctrl-C): a disk store takes back what it wrote,
            # so no half-written trace is left to be taken for a whole one
            abort = getattr(request.sink, "abort", None)
            if abort is not None:
                abort()
            raise
        build.finish(output, steps=request.intervene, save=request.save, grad=request.grad, complete=complete,
                     stale=recorder.stale, alias_writes=recorder.alias_writes,
                     output_refs=recorder.output_refs(output))
        if recorder.random:
            warn_random(model, recorder.random, [])
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
