"""Guarded replay: forks replay exactly through routing and control flow while the values the
forward branched on stay the same, and refuse (strict) or re-execute (fallback) when they change.

Every replayed result is compared with a re-executed forward whose edit is a plain forward
hook (``edited_forward``), never with another TorchLens path.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import BranchyNet, DropoutNet, EarlyExitNet, GreedyDecoder, IfCNN, edited_forward

import torchlens as tl
from torchlens.errors import GuardChangedError, ReplayFellBack, ReplayNotExactError


def _scale_first(k: float):
    """A hook edit scaling a module's output (or the first element of a tuple output)."""

    def edit(out):
        if isinstance(out, tuple):
            return (out[0] * k, *out[1:])
        return out * k

    return edit


def _router_choices(model, ids, site: str, edit) -> list[torch.Tensor]:
    """The expert indices every router picked in a plain forward with ``edit`` hooked on ``site``."""
    seen: list[torch.Tensor] = []
    handles = [layer.mlp.gate.register_forward_hook(lambda m, i, o: seen.append(o[2].clone()))
               for layer in model.model.layers]
    try:
        edited_forward(model, site, edit, (ids,))
    finally:
        for h in handles:
            h.remove()
    return seen


def _quiet_fork(trace, *args, **kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fork = trace.fork().do(*args, **kwargs)
    return fork, [w for w in caught if issubclass(w.category, ReplayFellBack)]


@pytest.fixture(scope="module", params=["grouped", "eager"])
def mixtral(request, tiny_mixtral):
    """The tiny Mixtral with the default (sorted, grouped) experts and with the eager loop over
    experts (``nonzero``, one-argument ``where`` and ``bool`` reads of expert indices)."""
    model = tiny_mixtral.model
    before = model.config._experts_implementation  # the default: sorted, grouped experts
    if request.param == "eager":
        model.config._experts_implementation = "eager"  # read by the experts module on every forward
    try:
        yield model, tiny_mixtral.args[0], request.param
    finally:
        model.config._experts_implementation = before


SITE = "model.layers.0.self_attn"
KEEP, FLIP = 1.001, 0.5  # scales of block 0's attention output that keep / change layer 1's routing


def test_moe_edit_that_keeps_routing_replays_exactly(mixtral):
    model, ids, _ = mixtral
    base = _router_choices(model, ids, SITE, _scale_first(1.0))
    assert all(torch.equal(a, b) for a, b in zip(base, _router_choices(model, ids, SITE, _scale_first(KEEP))))
    trace = tl.trace(model, ids)
    assert any(op.func_name == "topk" for op in trace.ops)
    fork = trace.fork().do(SITE, tl.scale(KEEP), replay="strict")
    want = edited_forward(model, SITE, _scale_first(KEEP), (ids,)).logits
    assert torch.allclose(fork.output.logits, want, atol=1e-5)
    assert [e.how for e in fork.edits] == ["replayed"]


def test_moe_edit_that_flips_routing_is_refused_in_strict_mode(mixtral):
    model, ids, _ = mixtral
    base = _router_choices(model, ids, SITE, _scale_first(1.0))
    flipped = _router_choices(model, ids, SITE, _scale_first(FLIP))
    assert not all(torch.equal(a, b) for a, b in zip(base, flipped))  # the premise: routing changes
    trace = tl.trace(model, ids)
    fork = trace.fork()
    with pytest.raises(GuardChangedError) as err:
        fork.do(SITE, tl.scale(FLIP), replay="strict")
    assert "topk" in str(err.value) and "modeling_mixtral.py" in err.value.source
    assert "which experts the router at model.layers.0.mlp.gate picks" in err.value.message  # the thing at hand
    assert "token" not in err.value.message
    assert "fallback" in err.value.remedy
    assert fork.recipe == [] and fork.edits == [] and torch.equal(fork.output.logits, trace.output.logits)


def test_moe_edit_that_flips_routing_falls_back_to_the_real_forward(mixtral):
    model, ids, _ = mixtral
    trace = tl.trace(model, ids)
    fork, fell_back = _quiet_fork(trace, SITE, tl.scale(FLIP))  # replay="auto": the trace holds its model
    want = edited_forward(model, SITE, _scale_first(FLIP), (ids,)).logits
    assert torch.allclose(fork.output.logits, want, atol=1e-5)
    assert len(fell_back) == 1 and fork.edits[0].how.startswith("re-executed: ")
    # the fork is a real capture of the new path: further edits replay on it
    more = fork.do("model.layers.1.mlp", tl.scale(1.0), replay="strict")
    assert torch.allclose(more.output.logits, want, atol=1e-5)


def test_a_changed_greedy_token_is_named_as_the_generated_token(tiny_gpt2):
    """An edit that changes which token a decoding loop's argmax picks: the refusal names the generated
    token (not a router), with the recorded and new token ids; the fallback generates for real."""
    decoder, ids = GreedyDecoder(tiny_gpt2.model), torch.tensor([[1, 2, 3, 4]])
    trace = tl.trace(decoder, ids)
    site = "lm.transformer.h.1.mlp:1"
    want = edited_forward(decoder, "lm.transformer.h.1.mlp", lambda o: o * 20, (ids,), pass_index=1)
    assert not torch.equal(want, trace.output)  # the premise: the edit changes a generated token
    with pytest.raises(GuardChangedError) as err:
        trace.fork().do(site, tl.scale(20.0), replay="strict")
    first = int(trace.output[0, 4])
    assert err.value.message.startswith("the edit changes the generated token (argmax at ")
    assert f"recorded tensor(1, 1) [{first}], now tensor(1, 1) [{int(want[0, 4])}]" in err.value.message
    assert "expert" not in err.value.message
    with pytest.warns(ReplayFellBack):
        fork = trace.fork().do(site, tl.scale(20.0), replay="fallback")
    assert torch.equal(fork.output, want)


def test_validate_is_ok_on_moe_with_guards_as_notes(mixtral):
    model, ids, impl = mixtral
    report = tl.validate(tl.trace(model, ids))
    assert report.ok, report.summary()
    assert report.guards and any("topk" in g for g in report.guards)
    if impl == "eager":  # the loop over experts reads expert indices into Python
        assert any("bool()" in g for g in report.guards)


def _if_cnn():
    torch.manual_seed(3)
    model = IfCNN().eval()
    x = torch.randn(2, 1, 6, 6)
    with torch.no_grad():
        assert torch.relu(model.conv1(x)).mean() > 0  # the premise: the first branch runs
    return model, x


def test_cnn_with_python_if_replays_while_the_branch_holds():
    model, x = _if_cnn()
    trace = tl.trace(model, x)
    fork = trace.fork().do("conv1", tl.scale(1.05), replay="strict")
    assert torch.allclose(fork.output, edited_forward(model, "conv1", lambda o: o * 1.05, (x,)), atol=1e-6)


def test_cnn_with_python_if_refuses_or_reexecutes_when_the_branch_flips():
    model, x = _if_cnn()
    trace = tl.trace(model, x)
    with pytest.raises(GuardChangedError) as err:
        trace.fork().do("conv1", tl.zero_ablate(), replay="strict")
    line = IfCNN.forward.__code__.co_firstlineno + 2
    assert err.value.source.endswith(f"conftest.py:{line}") and (err.value.recorded, err.value.new) == (True, False)
    fork = trace.fork().do("conv1", tl.zero_ablate(), replay="fallback")
    assert torch.allclose(fork.output, edited_forward(model, "conv1", torch.zeros_like, (x,)), atol=1e-6)
    assert "conv2" not in fork.module_addresses  # the real forward took the other branch


def test_early_exit_model():
    torch.manual_seed(1)
    model, x = EarlyExitNet().eval(), torch.randn(1, 8)
    trace = tl.trace(model, x)
    n_run = len(trace.calls_of("exit"))
    assert len(trace.data_reads) == n_run - 1  # one confidence read per layer that ran
    # an edit after the last read (the final head) replays exactly
    last = f"exit:{n_run}"
    fork = trace.fork().do(last, tl.scale(2.0), replay="strict")
    assert torch.allclose(fork.output, edited_forward(model, "exit", lambda o: o * 2, (x,), pass_index=n_run),
                          atol=1e-6)
    # an edit before a confidence read changes the value read (.item()): refuse, or re-execute
    with pytest.raises(GuardChangedError, match="item"):
        trace.fork().do("layers.0", tl.scale(3.0), replay="strict")
    fork = trace.fork().do("layers.0", tl.scale(3.0), replay="fallback")
    want = edited_forward(model, "layers.0", lambda o: o * 3, (x,))
    assert torch.allclose(fork.output, want, atol=1e-6)


def test_a_loaded_trace_without_its_model_refuses_a_changed_guard(tmp_path):
    torch.manual_seed(0)
    model, x = BranchyNet().eval(), torch.randn(2, 4)
    tl.trace(model, x).save(tmp_path / "t")
    loaded = tl.load_trace(tmp_path / "t")
    with pytest.raises(GuardChangedError) as err:
        loaded.fork().do("fc1", tl.scale(-5.0))  # auto, but no model to fall back on
    assert "branched" in str(err.value) or "did not record" in str(err.value)
    with pytest.raises(GuardChangedError, match="needs the model"):
        loaded.fork().do("fc1", tl.scale(-5.0), replay="fallback")
    fork = loaded.fork().do("fc2", tl.scale(2.0))  # after the branch: replays
    assert torch.allclose(fork.output, edited_forward(model, "fc2", lambda o: o * 2, (x,)), atol=1e-6)


def test_unknown_replay_mode_is_refused_and_changes_nothing():
    torch.manual_seed(0)
    model, x = BranchyNet().eval(), torch.randn(2, 4)
    fork = tl.trace(model, x).fork()
    with pytest.raises(tl.errors.InvalidArgumentError, match="replay="):
        fork.do("fc2", tl.scale(2.0), replay="sometimes")
    assert fork.recipe == [] and fork.edits == []


def test_dropout_refusal_names_model_eval_first():
    torch.manual_seed(0)
    model, x = DropoutNet().train(), torch.randn(2, 4)
    trace = tl.trace(model, x)
    with pytest.raises(ReplayNotExactError) as err:
        trace.fork().do("fc1", tl.scale(2.0))
    assert err.value.remedy.startswith("Call model.eval()")
