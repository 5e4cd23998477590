"""``tl.TraceBuilder``: the one writer of a trace's graph, as a third-party capture engine uses it."""

from __future__ import annotations

import pytest
import torch
from conftest import hook_reads, refused

import torchlens as tl
from torchlens.core.records import ModuleCall
from torchlens.errors import ReplayNotExactError
from torchlens.hookspecs import hookimpl
from torchlens.plugins import register, unregister


class ChildOutputsEngine:
    """Keeps the output of every direct child of the model (forward hooks), no op graph: built
    with ``tl.TraceBuilder`` as docs/plugins.md tells an engine author."""

    name = "child_outputs"
    records_ops = False

    def cost(self, request):
        return 100.0 if not request.record_ops else None  # dearer than the built-ins: only when asked for by name

    def capture(self, request):
        build = tl.TraceBuilder(request.model, request.args, request.kwargs, engine=self.name, op_graph=False)
        handles = []
        for address, module in request.model.named_children():
            def keep(mod, args, out, address=address):
                build.add_call(ModuleCall(address, 1, type(mod).__name__, args, {}, 0), output=out.detach().clone())
            handles.append(module.register_forward_hook(keep))
        try:
            output = request.model(*request.args, **request.kwargs)
        finally:
            for handle in handles:
                handle.remove()
        trace = build.finish(output, steps=request.intervene)
        assert trace is build.trace  # handed back, built
        return trace


@pytest.fixture
def child_engine():
    class Plugin:
        @hookimpl
        def torchlens_engines(self):
            return [ChildOutputsEngine()]

    register(Plugin(), name="child-outputs-plugin")
    yield
    unregister(name="child-outputs-plugin")


def test_an_engine_builds_its_trace_with_the_builder(child_engine, small_mlp, mlp_input):
    seen, want = hook_reads(small_mlp, (mlp_input,))  # plain register_forward_hook reads
    seen = {name: outs[0] for name, outs in seen.items()}
    trace = tl.trace(small_mlp, mlp_input, backend="child_outputs")
    assert trace.engine == "child_outputs" and not trace.has_op_graph and trace.ops == []
    assert [c.address for c in trace.calls] == ["fc1", "act", "fc2"]
    for name in ("fc1", "act", "fc2"):
        assert torch.equal(trace[name].out, seen[name])
    assert torch.equal(trace.output, want)
    assert torch.equal(trace["act"].out, torch.relu(seen["fc1"]))  # by hand: ReLU of fc1's output


def test_a_trace_without_an_op_graph_refuses_replay_and_leaves_the_model(child_engine, small_mlp, mlp_input):
    trace = tl.trace(small_mlp, mlp_input, backend="child_outputs")
    err = refused(small_mlp, lambda: trace.fork().do("fc1", tl.zero_ablate()), ReplayNotExactError)
    assert "without an op graph" in str(err) and "child_outputs" in str(err)


def test_the_builder_records_what_the_trace_reads(small_mlp, mlp_input):
    build = tl.TraceBuilder(small_mlp, (mlp_input,), {}, engine="by_hand", op_graph=False, strict=True)
    out = small_mlp(mlp_input)
    build.add_call(ModuleCall("", 1, "SmallMLP", (mlp_input,), {}, 0), output=out)
    trace = build.finish(out, steps=[])
    assert trace.strict and trace.engine == "by_hand" and trace.args == (mlp_input,)
    assert torch.equal(trace[""].out, out) and torch.equal(trace.output, out)
    fork = trace.fork()
    assert fork.strict and fork.engine == "by_hand" and fork.calls is trace.calls  # the records, shared
