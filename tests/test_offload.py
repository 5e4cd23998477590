"""Models dispatched and offloaded by accelerate: the trace holds the model's ops, replay and
validate see the real weights, and nothing disagrees with the same model undispatched."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import edited_forward

import torchlens as tl
from torchlens.capture._offload import OffloadedWeight
from torchlens.core.records import DISPATCH, INPUT, Deferred

accelerate = pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")

IDS = torch.tensor([[1, 2, 3, 4, 5, 6]])
DEVICE_MAP = {"transformer.wte": "cpu", "transformer.wpe": "cpu", "transformer.drop": "cpu",
              "transformer.h.0": "cpu", "transformer.h.1": "disk", "transformer.ln_f": "cpu", "lm_head": "cpu"}


@pytest.fixture(scope="module")
def plain(tiny_gpt2):
    return tiny_gpt2.model


@pytest.fixture(scope="module")
def saved_dir(plain, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_gpt2")
    plain.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def disk_mapped(saved_dir):
    """The same weights loaded back with block 1 on "disk" (meta parameters between calls)."""
    model = transformers.GPT2LMHeadModel.from_pretrained(saved_dir, device_map=DEVICE_MAP,
                                                         offload_folder=os.path.join(saved_dir, "offload"))
    return model.eval()


def _cpu_offloaded(plain):
    import copy

    model = copy.deepcopy(plain)
    return accelerate.cpu_offload(model, execution_device=torch.device("cpu"))


def _disk_offloaded(plain, folder):
    import copy

    model = copy.deepcopy(plain)
    return accelerate.disk_offload(model, str(folder), execution_device=torch.device("cpu"))


@pytest.fixture(scope="module", params=["device_map", "cpu_offload", "disk_offload"])
def dispatched(request, plain, disk_mapped, tmp_path_factory):
    if request.param == "device_map":
        return disk_mapped
    if request.param == "cpu_offload":
        return _cpu_offloaded(plain)
    return _disk_offloaded(plain, tmp_path_factory.mktemp("disk_offload"))


def _model_ops(trace):
    return [op for op in trace.ops if not op.flags & DISPATCH]


def test_parameters_are_meta_between_calls(disk_mapped):
    assert disk_mapped.transformer.h[1].attn.c_attn.weight.is_meta


def test_op_labels_match_the_undispatched_model(dispatched, plain):
    got = tl.trace(dispatched, IDS)
    want = tl.trace(plain, IDS)
    assert [op.label for op in _model_ops(got)] == [op.label for op in want.ops]
    for a, b in zip(_model_ops(got), want.ops):
        assert a.func_name == b.func_name and a.module == b.module
        if not a.flags & INPUT:
            torch.testing.assert_close(a.out, b.out, rtol=0, atol=0)
    dispatch = [op for op in got.ops if op.flags & DISPATCH]
    assert dispatch and all(op.label.startswith("dispatch_") for op in dispatch)
    assert not any(op.out.is_meta for op in got.ops if isinstance(op._out, torch.Tensor))
    torch.testing.assert_close(got.output.logits, want.output.logits, rtol=0, atol=0)


def test_func_selector_skips_dispatcher_moves(disk_mapped, plain):
    got = tl.trace(disk_mapped, IDS)
    # The model itself calls .to once (the attention mask's dtype); accelerate moves tensors many times.
    want = [s.label for s in tl.trace(plain, IDS).find_sites(tl.func("to"))]
    assert [s.label for s in got.find_sites(tl.func("to"))] == want
    assert any(op.func_name == "to" for op in got.ops if op.flags & DISPATCH)


def test_module_listings_hold_the_model_ops_only(dispatched, plain):
    got = tl.trace(dispatched, IDS)
    want = tl.trace(plain, IDS)
    for address in ("transformer.h.1", "transformer.h.1.attn", "transformer", ""):
        sel = tl.in_module(address)
        labels = [s.label for s in got.find_sites(sel)]
        assert labels == [s.label for s in want.find_sites(sel)], address
        assert all(sel.matches_op(got[label].record) for label in labels)
    dispatch = [op for op in got.ops if op.flags & DISPATCH]
    assert not any(tl.in_module("").matches_op(op) or tl.in_module(op.module or "").matches_op(op)
                   for op in dispatch)
    for call in got.calls:
        assert call.op_labels == want.module_call(call.key).op_labels, call.key
    # Where the dispatcher moved something inside a block, the listing above really dropped it.
    inside = [op for op in dispatch if op.module.startswith("transformer.h.")]
    assert inside and all(op.label not in got.module_call(op.module + ":1").op_labels for op in inside)


def test_validate_and_replay_through_offloaded_weights(dispatched, plain):
    trace = tl.trace(dispatched, IDS)
    report = tl.validate(trace)
    assert report.ok, report.summary()
    assert report.output_max_abs_error == 0.0
    fork = trace.fork().do("transformer.h.0.mlp", tl.scale(0.5))
    want = edited_forward(plain, "transformer.h.0.mlp", lambda o: o * 0.5, (IDS,))
    torch.testing.assert_close(fork.output.logits, want.logits)
    fork2 = trace.fork().do("transformer.h.1.attn.c_attn", tl.zero_ablate())
    want2 = edited_forward(plain, "transformer.h.1.attn.c_attn", torch.zeros_like, (IDS,))
    torch.testing.assert_close(fork2.output.logits, want2.logits)


def test_offloaded_weights_are_references_not_copies(dispatched):
    trace = tl.trace(dispatched, IDS)
    trace.ensure_graph()
    deferred = [leaf for op in trace.ops if op.args_spec for leaf in op.args_spec[0] if isinstance(leaf, Deferred)]
    # every weight of the offloaded block(s) is read back through the offload, none is held
    offloaded = {name for name, p in dispatched.named_parameters() if p.is_meta}
    assert offloaded
    assert all(isinstance(w, OffloadedWeight) for w in deferred)
    assert len({(id(w.weights_map), w.key) for w in deferred}) >= len(offloaded)
    held = [leaf for op in trace.ops if op.args_spec for leaf in op.args_spec[0]
            if isinstance(leaf, torch.Tensor) and isinstance(leaf, torch.nn.Parameter)
            and not any(leaf is p for p in dispatched.parameters())]
    assert held == []


def test_extract_when_and_rerun_agree(dispatched, plain):
    got = tl.extract(dispatched, IDS, ["transformer.h.1", "transformer.h.1.mlp"])
    want = tl.extract(plain, IDS, ["transformer.h.1", "transformer.h.1.mlp"])
    torch.testing.assert_close(got["transformer.h.1.mlp"], want["transformer.h.1.mlp"], rtol=0, atol=0)
    torch.testing.assert_close(got["transformer.h.1"][0], want["transformer.h.1"][0], rtol=0, atol=0)
    edited = tl.trace(dispatched, IDS, intervene=tl.when("transformer.h.1.mlp", tl.scale(2.0)))
    want_logits = edited_forward(plain, "transformer.h.1.mlp", lambda o: o * 2.0, (IDS,)).logits
    torch.testing.assert_close(edited.output.logits, want_logits)
    fork = tl.trace(dispatched, IDS).fork().do("transformer.h.1.mlp", tl.scale(2.0), model=dispatched,
                                               inputs=IDS)
    torch.testing.assert_close(fork.output.logits, want_logits)


def test_compare_with_the_undispatched_trace(disk_mapped, plain):
    result = tl.debug.compare(tl.trace(plain, IDS), tl.trace(disk_mapped, IDS))
    assert result.first_divergence is None
    assert all(label.startswith("dispatch_") for label in result.only_in_b)


def test_shims_on_a_dispatched_model(disk_mapped, plain):
    from torchlens_shims.baukit import TraceDict
    from torchlens_shims.nnsight import NNsight

    def baukit_read(model):
        with TraceDict(model, ["transformer.h.1.mlp"]) as td:
            model(IDS)
        return td["transformer.h.1.mlp"].output

    torch.testing.assert_close(baukit_read(disk_mapped), baukit_read(plain), rtol=0, atol=0)

    def nnsight_edit(model):
        wrapped = NNsight(model)
        with wrapped.trace(IDS):
            wrapped.transformer.h[1].mlp.output[:, -1, :] = 0.0
            logits = wrapped.output.logits.save()
        return logits

    torch.testing.assert_close(nnsight_edit(disk_mapped), nnsight_edit(plain))


def test_dispatched_model_left_as_it_was(disk_mapped):
    hooks_before = {name: getattr(m, "_hf_hook", None) for name, m in disk_mapped.named_modules()}
    tl.trace(disk_mapped, IDS, save=tl.module("transformer.h.1"))
    assert {name: getattr(m, "_hf_hook", None) for name, m in disk_mapped.named_modules()} == hooks_before
    assert disk_mapped.transformer.h[1].attn.c_attn.weight.is_meta
    with torch.no_grad():
        assert torch.isfinite(disk_mapped(IDS).logits).all()


def test_validate_reports_meta_values_instead_of_crashing():
    class MetaOut(torch.nn.Module):
        def forward(self, x):
            return x * 2, x.to("meta")

    report = tl.validate(tl.trace(MetaOut(), torch.ones(2)))
    assert not report.ok
    assert any("meta tensor" in e for e in report.errors)


def test_saved_offloaded_trace_holds_the_weights(disk_mapped, plain, tmp_path):
    trace = tl.trace(disk_mapped, IDS)
    trace.save(tmp_path / "saved")
    loaded = tl.load_trace(tmp_path / "saved")
    assert tl.validate(loaded).ok
    fork = loaded.fork().do("transformer.h.1.mlp", tl.scale(0.5))
    want = edited_forward(plain, "transformer.h.1.mlp", lambda o: o * 0.5, (IDS,))
    torch.testing.assert_close(fork.output.logits, want.logits)
