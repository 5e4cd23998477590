"""Editing after capture: forks, ``do`` replay, re-execution, transactions and refusals.

The reference for every replayed value is independent of replay: the real forward with
a plain forward hook doing the same edit, and ``do(..., model=, inputs=)`` (re-execution).
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest
import torch
from conftest import (
    BranchyNet,
    DropoutNet,
    EarlyExitNet,
    ReshapeNet,
    ReturnsState,
    SelectPoolNet,
    assert_equal_tree,
    edited_forward,
    hook_reads,
    leaves,
)
from torch import nn

import torchlens as tl
from torchlens.errors import InvalidArgumentError, ReplayNotExactError, SiteNotFoundError, ValueNotSavedError

SHARED = pathlib.Path(__file__).resolve().parents[2] / "shared"  # beside the repository root
SEED_DIR = str(SHARED / "acceptance" / "seed_fences")
ATOL = 1e-5


def _block_edit(output):
    """A block-level edit of the first tensor of a tensor, tuple or dict output."""
    if isinstance(output, tuple):
        return (output[0] * 0.5 + 0.25, *output[1:])
    if isinstance(output, dict):
        first = next(iter(output))
        return {k: v * 0.5 + 0.25 if k == first else v for k, v in output.items()}
    return output * 0.5 + 0.25


def _edit_fn(activation, *, ctx):
    return _block_edit(activation)


# -- replay equals re-execution ------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gpt2_small", "tiny_llama", "minilm", "tiny_gpt2", "cnn", "tuple_out", "dict_out"])
def test_replay_equals_re_execution_for_block_edits(name, request, zoo_traces):
    case, trace = zoo_traces(name)
    address = case.block
    replayed = trace.fork("replayed").do(tl.module(address), _edit_fn)
    reexecuted = trace.fork("real").do(tl.module(address), _edit_fn, model=case.model, inputs=case.inputs_for_do)
    hooked = edited_forward(case.model, address, _block_edit, case.args, case.kwargs)
    assert_equal_tree(replayed.output, hooked, atol=ATOL, what=f"{name}: replay vs plain hook")
    assert_equal_tree(reexecuted.output, hooked, atol=ATOL, what=f"{name}: re-execution vs plain hook")
    assert not all(torch.equal(a, b) for a, b in zip(leaves(replayed.output), leaves(trace.output)))
    # every module read of the replayed fork matches a plain hook read of the edited forward
    handle = case.model.get_submodule(address).register_forward_hook(lambda m, i, o: _block_edit(o))
    try:
        reads, _ = hook_reads(case.model, case.args, case.kwargs)
    finally:
        handle.remove()
    for addr, outs in reads.items():
        if len(outs) == 1 and addr:
            assert_equal_tree(replayed[addr].out, outs[0], atol=ATOL, what=f"{name}:{addr}")
    assert [e.label for e in replayed.edits] == [address]


@pytest.mark.parametrize("name", ["tiny_gpt2", "tiny_llama"])
def test_a_forks_kv_cache_holds_the_edited_keys_and_values(name, request):
    """``fork.output.past_key_values`` after an MLP ablation at layer 0: every key and value equals the
    cache of a forward with the same edit done by a plain hook, and growing it leaves the trace's alone."""
    case = request.getfixturevalue(name)
    model, (ids,) = case.model, case.args
    mlp = f"{case.block}.mlp"
    trace = tl.trace(model, ids, use_cache=True)
    fork = trace.fork().do(mlp, tl.zero_ablate())
    handle = model.get_submodule(mlp).register_forward_hook(lambda m, i, o: torch.zeros_like(o))
    try:
        with torch.no_grad():
            want = model(ids, use_cache=True)
    finally:
        handle.remove()
    with torch.no_grad():
        plain = model(ids, use_cache=True).past_key_values
    got, parent = fork.output.past_key_values, trace.output.past_key_values
    base = fork[case.block.rsplit(".", 2)[0]].out.past_key_values  # transformer / model: returns the cache too
    assert torch.allclose(fork.output.logits, want.logits, atol=ATOL)
    assert len(got.layers) == len(want.past_key_values.layers) == 2
    for i, layer in enumerate(want.past_key_values.layers):
        for kind in ("keys", "values"):
            for cache in (got, base):
                assert torch.allclose(getattr(cache.layers[i], kind), getattr(layer, kind), atol=ATOL), (i, kind)
            assert torch.equal(getattr(parent.layers[i], kind), getattr(plain.layers[i], kind))  # parent's as it was
    assert not torch.allclose(got.layers[1].keys, parent.layers[1].keys, atol=ATOL)  # the edit reached the cache
    length = parent.get_seq_length()
    got.update(got.layers[0].keys[..., :1, :], got.layers[0].values[..., :1, :], 0)
    assert got.get_seq_length() == length + 1 and parent.get_seq_length() == length


def test_a_held_state_replay_cannot_rebuild_is_withheld_not_stale():
    """An object the model returns beside its output (as a cache): a fork holds its replayed tensor, also
    when an in-place write through a view changed it after its op (replay applies the write again); when
    the write reinterprets its bytes (a view as integers), which replay cannot lay out again, reading it
    raises, naming why."""
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(0))
    for overwrite in (False, True):
        torch.manual_seed(0)
        model = ReturnsState(overwrite=overwrite).eval()
        fork = tl.trace(model, x).fork().do("fc1", tl.scale(2.0))
        want = edited_forward(model, "fc1", lambda o: o * 2, (x,))
        assert torch.allclose(fork.output[1].t, want[1].t, atol=1e-6)
        assert (want[1].t[:, 0] == 0).all() == overwrite
    torch.manual_seed(0)
    model = ReturnsState(overwrite=True, reinterpret=True).eval()
    trace = tl.trace(model, x)
    fork = trace.fork().do("fc1", tl.scale(2.0))
    want = edited_forward(model, "fc1", lambda o: o * 2, (x,))
    assert torch.allclose(fork.output[0], want[0], atol=1e-6)  # the rest of the output is there
    with pytest.raises(ReplayNotExactError, match="cannot give its HeldState: its t comes from op linear_2") as err:
        _ = fork.output[1].t
    assert "model=model, inputs=x" in err.value.remedy
    real = trace.fork().do("fc1", tl.scale(2.0), model=model, inputs=x)  # the remedy
    assert torch.allclose(real.output[1].t, want[1].t, atol=1e-6)


def test_forking_a_save_trace_names_every_missing_op_at_once_and_re_execution(tiny_gpt2):
    """A trace that kept only the blocks' outputs: one error lists every op the replay needs (keeping
    exactly those makes it work, equal to a plain hook), and names model=, inputs= as the remedy."""
    model, (ids,) = tiny_gpt2.model, tiny_gpt2.args
    blocks = [tl.module("transformer.h.0"), tl.module("transformer.h.1")]
    mlp = "transformer.h.0.mlp"
    trace = tl.trace(model, ids, save=blocks)
    fork = trace.fork()
    for attempt in (lambda: fork.do(mlp, tl.zero_ablate()), lambda: trace.forks([(mlp, tl.zero_ablate())])):
        with pytest.raises(ValueNotSavedError) as err:
            attempt()
        missing = err.value.missing
        assert len(missing) > 1 and all(not trace[label].record.saved for label in missing)
        assert all(repr(label) in str(err.value) for label in missing)
        assert "model=model, inputs=x" in err.value.remedy
        assert fork.recipe == [] and fork.edits == []
    want = edited_forward(model, mlp, torch.zeros_like, (ids,))
    kept = tl.trace(model, ids, save=[*blocks, *missing]).fork().do(mlp, tl.zero_ablate())  # one more try suffices
    assert torch.allclose(kept.output.logits, want.logits, atol=ATOL)
    real = fork.do(mlp, tl.zero_ablate(), model=model, inputs=ids)  # the remedy named first
    assert torch.allclose(real.output.logits, want.logits, atol=ATOL)


def test_replay_only_reexecutes_downstream_ops(gpt2_small, zoo_traces):
    case, trace = zoo_traces("gpt2_small")
    fork = trace.fork().do(tl.module(case.block), tl.scale(2.0))
    start = trace[case.block].record.op_start
    for op in trace.ops[:start]:
        assert fork[op.label].out is trace[op.label].out  # shared, not copied, not recomputed
    block_9 = trace.find_sites(tl.in_module("transformer.h.9")).labels
    assert all(not torch.equal(fork[label].out, trace[label].out) for label in block_9[-3:])
    for i in range(8):  # and upstream module reads are the parent's own objects
        assert fork[f"transformer.h.{i}"].out is trace[f"transformer.h.{i}"].out


def test_replay_on_a_multi_pass_module(shared_twice):
    model, (x,) = shared_twice.model, shared_twice.args
    trace = tl.trace(model, x)
    fork = trace.fork().do("block:1", tl.scale(-1.0))
    want = edited_forward(model, "block", lambda o: -o, (x,), pass_index=1)
    assert torch.allclose(fork.output, want, atol=1e-6)
    assert torch.equal(fork["block:1"].out, -trace["block:1"].out)
    every = trace.fork().do(tl.module("block"), tl.scale(-1.0))
    assert torch.allclose(every.output, edited_forward(model, "block", lambda o: -o, (x,)), atol=1e-6)
    assert [e.pass_index for e in every.edits] == [1, 2]


@pytest.mark.parametrize("site", ["block.1:2", "block:1", "block.0:2", "inp", "out", ""])
def test_every_module_read_of_a_fork_matches_hooks_on_the_edited_forward(shared_twice, site):
    """Modules sharing an output op with the edited one: enclosing ones see the edit, inner ones not."""
    model, (x,) = shared_twice.model, shared_twice.args
    fork = tl.trace(model, x).fork().do(tl.module(site), tl.scale(-2.0))
    address, _, pass_text = site.partition(":")
    pass_index = int(pass_text) if pass_text else None
    module = model.get_submodule(address) if address else model
    count = [0]

    def edit(m, inputs, output):
        count[0] += 1
        return output * -2.0 if pass_index in (None, count[0]) else None

    handle = module.register_forward_hook(edit)
    try:
        reads, out = hook_reads(model, (x,))
    finally:
        handle.remove()
    for addr, outs in reads.items():
        for i, want in enumerate(outs):
            key = addr if len(outs) == 1 else f"{addr}:{i + 1}"
            assert torch.allclose(fork[key].out, want, atol=1e-6), key
    assert torch.allclose(fork.output, out, atol=1e-6)


def test_replay_at_op_level_sites(shared_twice):
    model, (x,) = shared_twice.model, shared_twice.args
    trace = tl.trace(model, x)
    fork = trace.fork().do("tanh_1", tl.zero_ablate())
    want = edited_forward(model, "block.1", torch.zeros_like, (x,), pass_index=1)
    assert torch.allclose(fork.output, want, atol=1e-6)
    fork = trace.fork().do(tl.func("tanh"), tl.scale(2.0))
    assert torch.allclose(fork.output, edited_forward(model, "block.1", lambda o: o * 2, (x,)), atol=1e-6)
    captured = tl.trace(model, x, intervene=tl.when(tl.func("tanh"), tl.scale(2.0)))
    assert torch.allclose(fork.output, captured.output, atol=1e-6)


def test_a_multi_pass_module_keeps_its_pass_labels_on_every_fork_path(shared_twice):
    """Trace, replayed fork, re-executed fork and a guard fallback name each pass alike (``block:2``)."""
    model, (x,) = shared_twice.model, shared_twice.args
    trace = tl.trace(model, x)
    replayed = trace.fork().do("inp", tl.scale(2.0))
    reexecuted = trace.fork().do("inp", tl.scale(2.0), model=model, inputs=x)
    want = [c.label for c in trace.modules]
    assert want[:3] == ["", "inp", "block:1"]
    for fork in (replayed, reexecuted):
        assert fork.find_sites(tl.module("block")).labels == ["block:1", "block:2"]
        assert [c.label for c in fork.modules] == want
        assert fork.ops[-1].parents == trace.ops[-1].parents  # its records still know their trace
    reads, _ = hook_reads(model, (x,))
    assert torch.allclose(trace["block:2"].out, reads["block"][1])
    with_edit = edited_forward(model, "inp", lambda o: o * 2, (x,))
    assert torch.allclose(reexecuted.output, with_edit, atol=1e-6)
    assert torch.allclose(reexecuted["block:2"].out, replayed["block:2"].out, atol=1e-6)
    # a changed guard that falls back to re-execution: labelled as a capture of the edited run is
    torch.manual_seed(1)
    early, x = EarlyExitNet().eval(), torch.randn(1, 8)
    with pytest.warns(tl.errors.ReplayFellBack):
        fallback = tl.trace(early, x).fork().do("layers.0", tl.scale(3.0), replay="fallback")
    captured = tl.trace(early, x, intervene=tl.when("layers.0", tl.scale(3.0)))
    assert len(captured.calls_of("exit")) > 1
    assert [c.label for c in fallback.modules] == [c.label for c in captured.modules]
    assert fallback.find_sites(tl.module("exit")).labels == captured.find_sites(tl.module("exit")).labels


def test_edit_of_the_last_module_reaches_the_output(small_mlp, mlp_input):
    trace = tl.trace(small_mlp, mlp_input)
    fork = trace.fork().do("fc2", tl.add(torch.ones(3)))
    assert torch.allclose(fork.output, trace.output + 1)
    assert torch.allclose(fork[fork.output_layers[0]].out, trace.output + 1)
    assert torch.allclose(fork["fc2"].out, trace.output + 1)
    assert torch.allclose(fork[""].out, trace.output + 1)
    root = trace.fork().do(tl.module(""), tl.scale(0.0))
    assert torch.equal(root.output, torch.zeros(3, 3))
    captured = tl.trace(small_mlp, mlp_input, intervene=tl.when("fc2", tl.add(torch.ones(3))))
    assert torch.allclose(captured.output, fork.output)


# -- forks ---------------------------------------------------------------------------------------


def test_forks_are_isolated_from_parent_and_siblings(small_mlp, mlp_input):
    trace = tl.trace(small_mlp, mlp_input)
    original = {op.label: op.out.clone() for op in trace.ops}
    original_out = trace.output.clone()
    a = trace.fork("a").do("act", tl.scale(2.0))
    b = trace.fork("b").do("fc1", tl.scale(-1.0))
    h = small_mlp.fc1(mlp_input).detach()
    assert torch.allclose(a.output, small_mlp.fc2(2 * torch.relu(h)).detach(), atol=1e-6)
    assert torch.allclose(b.output, small_mlp.fc2(torch.relu(-h)).detach(), atol=1e-6)
    assert torch.equal(trace.output, original_out) and trace.edits == []
    for op in trace.ops:
        assert torch.equal(op.out, original[op.label])
    assert torch.equal(a["fc1"].out, original["linear_1"])  # a's upstream untouched by b
    aa = a.fork("aa").do("fc2", tl.add(torch.ones(3)))
    assert torch.allclose(aa.output, small_mlp.fc2(2 * torch.relu(h)).detach() + 1, atol=1e-6)
    assert torch.allclose(a.output, small_mlp.fc2(2 * torch.relu(h)).detach(), atol=1e-6)  # parent fork unchanged
    assert [e.label for e in a.edits] == ["act"] and [e.label for e in aa.edits] == ["act", "fc2"]
    assert aa.name == "aa" and aa.parent is a and a.parent is trace
    with pytest.raises(InvalidArgumentError) as err:
        trace.do("act", 0.0)
    assert "fork" in err.value.remedy


def test_do_chains_and_composes_in_order(small_mlp, mlp_input):
    trace = tl.trace(small_mlp, mlp_input)
    fork = trace.fork()
    assert fork.do("act", tl.add(torch.ones(6))) is fork
    fork.do("act", tl.scale(2.0))
    h = torch.relu(small_mlp.fc1(mlp_input)).detach()
    assert torch.allclose(fork["act"].out, (h + 1) * 2)
    both = tl.trace(small_mlp, mlp_input, intervene=[tl.when("act", tl.add(torch.ones(6))),
                                                     tl.when("act", tl.scale(2.0))])
    assert torch.allclose(fork.output, both.output, atol=1e-6)


def test_a_second_do_upstream_of_the_first_equals_capturing_with_both(tiny_gpt2):
    model, (ids,) = tiny_gpt2.model, tiny_gpt2.args
    trace = tl.trace(model, ids)
    vec = torch.linspace(-0.5, 0.5, 32)
    fork = trace.fork().do("transformer.h.1", tl.scale(0.5)).do("transformer.h.0", tl.add(vec))
    both = tl.trace(model, ids, intervene=[tl.when("transformer.h.1", tl.scale(0.5)),
                                           tl.when("transformer.h.0", tl.add(vec))])
    assert_equal_tree(fork.output, both.output, atol=ATOL)
    assert torch.allclose(fork["transformer.h.1"].out, both["transformer.h.1"].out, atol=ATOL)
    only_h1 = trace.fork().do("transformer.h.1", tl.scale(0.5))
    assert not torch.allclose(fork.output.logits, only_h1.output.logits, atol=1e-4)
    real = trace.fork().do("transformer.h.1", tl.scale(0.5)).do("transformer.h.0", tl.add(vec), model=model,
                                                                 inputs=ids)
    assert_equal_tree(real.output, both.output, atol=ATOL)


def test_fork_run_reruns_the_model_with_the_recipe(tiny_gpt2):
    model, (ids,) = tiny_gpt2.model, tiny_gpt2.args
    fork = tl.trace(model, ids).fork().do("transformer.h.0", tl.zero_ablate()).do("transformer.h.1", tl.scale(2.0))
    rerun = fork.run(model, ids)
    both = [tl.when("transformer.h.0", tl.zero_ablate()), tl.when("transformer.h.1", tl.scale(2.0))]
    assert_equal_tree(rerun.output, tl.trace(model, ids, intervene=both).output)
    assert_equal_tree(rerun.output, fork.output, atol=ATOL)
    assert [e.label for e in rerun.edits] == ["transformer.h.0", "transformer.h.1"]
    other = torch.tensor([[7, 7, 1, 2]])
    on_other = fork.run(model, other)
    assert_equal_tree(on_other.output, tl.trace(model, other, intervene=both).output)
    # a trace captured with edits re-runs them too
    captured = tl.trace(model, ids, intervene=both)
    assert_equal_tree(captured.run(model, other).output, on_other.output)


def test_do_with_model_needs_both_model_and_inputs(small_mlp, mlp_input):
    fork = tl.trace(small_mlp, mlp_input).fork()
    with pytest.raises(InvalidArgumentError):
        fork.do("act", 0.0, model=small_mlp)
    with pytest.raises(SiteNotFoundError):
        fork.do("fc9", 0.0)


# -- transactions ----------------------------------------------------------------------------------


def test_run_transaction_stops_right_after_the_site(tiny_gpt2):
    model, (ids,) = tiny_gpt2.model, tiny_gpt2.args
    full = tl.trace(model, ids)
    for until in ("transformer.h.0", tl.module("transformer.h.0.attn"), "addmm_3"):
        partial = full.run_transaction(inputs=ids, until=until)
        assert not partial.complete
        site = full[until] if isinstance(until, str) else full.find_sites(until).first()
        end = site.record.op_end if site.kind == "module" else site.record.index + 1
        assert [op.label for op in partial.ops] == [op.label for op in full.ops[:end]]
        for op in partial.ops:
            assert_equal_tree(op.out, full[op.label].out, what=op.label)
    partial = full.run_transaction(inputs=ids, until="transformer.h.0")
    assert torch.equal(partial["transformer.h.0"].out, full["transformer.h.0"].out)
    assert "transformer.h.1" not in partial
    other = torch.tensor([[5, 4, 3]])
    partial = full.run_transaction(inputs=other, until="transformer.h.0")
    assert torch.equal(partial["transformer.h.0"].out, hook_reads(model, (other,))[0]["transformer.h.0"][0])


def test_run_transaction_keeps_capture_time_edits(small_mlp, mlp_input):
    edited = tl.trace(small_mlp, mlp_input, intervene=tl.when("fc1", tl.scale(-1.0)))
    partial = edited.run_transaction(until="act")
    assert torch.allclose(partial["act"].out, torch.relu(-small_mlp.fc1(mlp_input)).detach())
    assert "fc2" not in partial


# -- refusals --------------------------------------------------------------------------------------


def _assert_refused(call, fragment: str) -> ReplayNotExactError:
    with pytest.raises(ReplayNotExactError) as err:
        call()
    assert fragment in str(err.value)
    assert "model=" in err.value.remedy and "inputs=" in err.value.remedy
    return err.value


def test_dropout_in_train_mode_downstream_is_refused():
    torch.manual_seed(0)
    model, x = DropoutNet().train(), torch.randn(2, 4)
    trace = tl.trace(model, x)
    err = _assert_refused(lambda: trace.fork().do("fc1", tl.scale(2.0)), "random")
    assert err.op_label == "dropout_1" and "conftest.py" in err.source
    fork = trace.fork().do("fc2", tl.scale(2.0))  # nothing random downstream of fc2: exact
    assert torch.allclose(fork.output, trace.output * 2)
    evaluated = tl.trace(model.eval(), x)
    fork = evaluated.fork().do("fc1", tl.scale(2.0))  # eval-mode dropout is the identity
    assert torch.allclose(fork.output, edited_forward(model, "fc1", lambda o: o * 2, (x,)), atol=1e-6)
    model.train()


def test_random_op_downstream_of_the_edit_is_refused():
    class NoisyNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(4, 4)
            self.fc2 = nn.Linear(4, 2)

        def forward(self, x):
            h = self.fc1(x)
            return self.fc2(h + 0.1 * torch.randn_like(h))

    torch.manual_seed(0)
    model, x = NoisyNet().eval(), torch.randn(2, 4)
    trace = tl.trace(model, x)
    err = _assert_refused(lambda: trace.fork().do("fc1", tl.scale(2.0)), "random")
    assert err.op_label == "randn_like_1"


def test_noise_drawn_independently_of_the_edit_is_reused_and_check_catches_it():
    class ShapeNoiseNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(4, 4)
            self.fc2 = nn.Linear(4, 2)

        def forward(self, x):
            h = self.fc1(x)
            return self.fc2(h + torch.randn(h.shape))

    torch.manual_seed(0)
    model, x = ShapeNoiseNet().eval(), torch.randn(2, 4)
    torch.manual_seed(42)
    trace = tl.trace(model, x)
    fork = trace.fork().do("fc1", tl.scale(2.0))  # the noise does not depend on fc1: it is reused
    torch.manual_seed(42)
    assert torch.allclose(fork.output, edited_forward(model, "fc1", lambda o: o * 2, (x,)), atol=1e-6)
    # re-execution draws fresh noise, so check=True reports the difference instead of hiding it
    _assert_refused(lambda: trace.fork().do("fc1", tl.scale(2.0), check=True), "differs from re-execution")


def test_edit_that_changes_a_baked_in_shape_is_refused():
    torch.manual_seed(0)
    model, x = ReshapeNet().eval(), torch.randn(2, 4)
    trace = tl.trace(model, x)
    err = _assert_refused(lambda: trace.fork().do("fc1", lambda a: a[:1], replay="strict"), "reshape_1")
    assert err.op_label == "reshape_1"
    fork = trace.fork().do("fc1", tl.scale(3.0))  # same shape: fine
    assert torch.allclose(fork.output, edited_forward(model, "fc1", lambda o: o * 3, (x,)), atol=1e-6)
    plain = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)).eval()
    trace = tl.trace(plain, x)
    _assert_refused(lambda: trace.fork().do("0", lambda a: a[:1], replay="strict"), "shape")


def test_data_dependent_branch_downstream_is_refused_in_strict_mode():
    torch.manual_seed(0)
    model, x = BranchyNet().eval(), torch.randn(2, 4)
    trace = tl.trace(model, x)
    fork = trace.fork()
    err = _assert_refused(lambda: fork.do("fc1", tl.scale(-5.0), replay="strict"), "branched on")
    assert isinstance(err, tl.errors.GuardChangedError) and (err.recorded, err.new) == (True, False)
    line = BranchyNet.forward.__code__.co_firstlineno + 2
    assert err.source.endswith(f"conftest.py:{line}")
    assert fork.recipe == [] and fork.edits == [] and torch.equal(fork.output, trace.output)  # nothing lost
    fork = trace.fork().do("fc2", tl.scale(-5.0))  # downstream of the branch: exact
    assert torch.allclose(fork.output, trace.output * -5)
    real = trace.fork().do("fc1", tl.scale(-5.0), model=model, inputs=x)  # the remedy works
    assert torch.allclose(real.output, edited_forward(model, "fc1", lambda o: o * -5, (x,)), atol=1e-6)


def test_check_true_passes_when_replay_is_exact(tiny_gpt2):
    model, (ids,) = tiny_gpt2.model, tiny_gpt2.args
    fork = tl.trace(model, ids).fork().do("transformer.h.0", tl.scale(0.5), check=True)
    assert torch.allclose(fork.output.logits,
                          edited_forward(model, "transformer.h.0", lambda o: o * 0.5, (ids,)).logits, atol=ATOL)


def test_replay_through_a_chain_of_in_place_ops(inplace_net):
    model, (x,) = inplace_net.model, inplace_net.args
    trace = tl.trace(model, x)
    fork = trace.fork().do("fc1", tl.scale(2.0))
    assert torch.allclose(fork.output, edited_forward(model, "fc1", lambda o: o * 2, (x,)), atol=1e-6)


# -- acceptance ------------------------------------------------------------------------------------


def test_seed_fences_pass_verbatim():
    proc = subprocess.run([sys.executable, str(SHARED / "acceptance" / "run_fences.py"), SEED_DIR],
                          capture_output=True, text=True, timeout=600)
    lines = proc.stdout.splitlines()
    torchlens_lines = [line for line in lines if "_torchlens" in line]
    assert len(torchlens_lines) == 3, proc.stdout
    assert all(line.startswith("PASS") for line in torchlens_lines), proc.stdout + proc.stderr


def test_a_hooks_only_trace_refuses_replay_instead_of_a_silent_no_op():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2)).eval()
    x = torch.randn(2, 4)
    trace = tl.trace(net, x, intervene=tl.when(tl.module("0"), tl.scale(2.0)), save=tl.module("0"))
    assert trace.engine == "hooks" and trace.ops == []
    with pytest.raises(tl.ReplayNotExactError) as info:
        trace.fork().do(tl.module("1"), tl.zero_ablate())
    assert "model=model" in info.value.remedy
    redone = trace.fork().do(tl.module("1"), tl.zero_ablate(), model=net, inputs=x)
    assert torch.allclose(redone.output, net[2](torch.zeros(2, 4)), atol=1e-6)


def _first_block_input_case():
    """``SelectPoolNet("mask")``: block 0's input is the model's own input (no module produces it),
    and each block selects ``h[h > 0]`` (a guard an edit of the input changes)."""
    torch.manual_seed(0)
    model = SelectPoolNet("mask").eval()
    x = torch.randn(1, 5, 8, generator=torch.Generator().manual_seed(1))

    def edit(act):
        act = act.clone()
        act[:, 2] += 3.0
        return act

    handle = model.blocks[0].register_forward_pre_hook(lambda m, args: (edit(args[0]),))
    try:
        with torch.no_grad():
            want = model(x)
    finally:
        handle.remove()
    return model, x, edit, want


def test_an_edit_of_the_model_input_that_changes_a_guard_re_executes_with_the_input_edited():
    """``blocks.0.resid_pre`` is the model's input: replay changes the mask's guard, so the fork
    re-executes, the edit applied to the input the forward is given (every reader sees it, as on the
    fork); equal to a forward pre-hook on block 0, also with model=/inputs= given. (The re-executed
    capture used to refuse the site: it never fired.)"""
    model, x, edit, want = _first_block_input_case()
    trace = tl.trace(model, x)
    with pytest.warns(tl.errors.ReplayFellBack):
        fork = trace.fork().do("blocks.0.resid_pre", edit)
    assert torch.allclose(fork.output, want, atol=1e-6)
    assert fork.edits[-1].how.startswith("re-executed") and fork.edits[-1].label == "input_0"
    assert fork.edits[-1].n_changed == 8
    given = trace.fork().do("blocks.0.resid_pre", edit, model=model, inputs=x)
    assert torch.allclose(given.output, want, atol=1e-6)
    assert torch.equal(x, _first_block_input_case()[1])  # the caller's input is not written


def test_a_capture_time_edit_of_the_model_input_is_refused_before_the_forward():
    """During a capture nothing produces block 0's input: refused up front, saying why, the model left without hooks."""
    model, x, edit, _ = _first_block_input_case()
    with pytest.raises(tl.errors.EditNotAppliedError, match="is the model's own input here") as got:
        tl.trace(model, x, intervene=tl.when("blocks.0.resid_pre", edit))
    assert "Edit the input you pass" in got.value.remedy
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
