"""Named edit helpers, each checked against a hand computation on Linear -> ReLU -> Linear.

Every helper is applied both after the fact (``fork().do``) and during capture
(``tl.when``); both must give the hand-computed value.
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch
from conftest import assert_equal_tree, edited_forward

import torchlens as tl
from torchlens.edit.helpers import helper_class
from torchlens.errors import EditShapeError, InvalidArgumentError, UnknownHelperError


def _relu(model, x):
    return torch.relu(model.fc1(x)).detach()


def _both_ways(model, x, site, edit):
    """The edited trace after the fact and during capture; they must agree exactly."""
    replayed = tl.trace(model, x).fork().do(site, edit)
    captured = tl.trace(model, x, intervene=tl.when(site, edit))
    assert torch.allclose(replayed.output, captured.output, atol=1e-6, rtol=0)
    assert torch.allclose(replayed[site].out, captured[site].out, atol=1e-6, rtol=0)
    return replayed


def test_zero_ablate_feeds_zeros_to_the_next_layer(small_mlp, mlp_input):
    fork = _both_ways(small_mlp, mlp_input, "act", tl.zero_ablate())
    assert torch.equal(fork["act"].out, torch.zeros(3, 6))
    # a zero-ablated ReLU feeding a Linear equals that Linear applied to zeros: its bias
    assert torch.allclose(fork.output, small_mlp.fc2(torch.zeros(3, 6)).detach(), atol=1e-6)
    assert torch.allclose(fork.output, small_mlp.fc2.bias.detach().expand(3, 3), atol=1e-6)


def test_mean_ablate_over_dims(small_mlp, mlp_input):
    h = _relu(small_mlp, mlp_input)
    fork = _both_ways(small_mlp, mlp_input, "act", tl.mean_ablate(dims=0))
    assert torch.allclose(fork["act"].out, h.mean(0, keepdim=True).expand(3, 6), atol=1e-6)
    assert torch.allclose(fork.output, small_mlp.fc2(h.mean(0, keepdim=True).expand(3, 6)).detach(), atol=1e-6)
    fork = _both_ways(small_mlp, mlp_input, "act", tl.mean_ablate(dims=None))
    assert torch.allclose(fork["act"].out, torch.full((3, 6), h.mean().item()), atol=1e-6)
    fork = _both_ways(small_mlp, mlp_input, "act", tl.mean_ablate(dims=(0, 1)))
    assert torch.allclose(fork["act"].out, torch.full((3, 6), h.mean().item()), atol=1e-6)
    fork = _both_ways(small_mlp, mlp_input, "act", tl.mean_ablate(dims=-1))
    assert torch.allclose(fork["act"].out, h.mean(-1, keepdim=True).expand(3, 6), atol=1e-6)


def test_mean_ablate_from_a_reference_trace(small_mlp, mlp_input):
    reference_x = torch.randn(10, 4, generator=torch.Generator().manual_seed(5))
    reference = tl.trace(small_mlp, reference_x)
    mean = _relu(small_mlp, reference_x).mean(0, keepdim=True)
    fork = _both_ways(small_mlp, mlp_input, "act", tl.mean_ablate(dims=0, reference=reference))
    assert torch.allclose(fork["act"].out, mean.expand(3, 6), atol=1e-6)
    assert torch.allclose(fork.output, small_mlp.fc2(mean.expand(3, 6)).detach(), atol=1e-6)


def test_mean_ablate_on_a_sequence_model(tiny_gpt2):
    model, (ids,) = tiny_gpt2.model, tiny_gpt2.args
    trace = tl.trace(model, ids)
    block = trace["transformer.h.0"].out
    fork = trace.fork().do("transformer.h.0", tl.mean_ablate(dims=1))  # mean over positions
    assert torch.allclose(fork["transformer.h.0"].out, block.mean(1, keepdim=True).expand_as(block), atol=1e-6)
    want = edited_forward(model, "transformer.h.0", lambda o: o.mean(1, keepdim=True).expand_as(o).clone(), (ids,))
    assert torch.allclose(fork.output.logits, want.logits, atol=1e-5)


def test_patch_from_same_site_and_named_site(small_mlp, mlp_input):
    donor_x = torch.randn(3, 4, generator=torch.Generator().manual_seed(9))
    donor = tl.trace(small_mlp, donor_x)
    fork = _both_ways(small_mlp, mlp_input, "act", tl.patch_from(donor))
    assert torch.equal(fork["act"].out, donor["act"].out)
    assert torch.allclose(fork.output, donor.output, atol=1e-6)
    fork = _both_ways(small_mlp, mlp_input, "fc1", tl.patch_from(donor, site="fc1"))
    assert torch.allclose(fork.output, donor.output, atol=1e-6)
    # a different site of the donor: its pre-activation lands in place of our ReLU output
    fork = _both_ways(small_mlp, mlp_input, "act", tl.patch_from(donor, site="fc1"))
    assert torch.equal(fork["act"].out, donor["fc1"].out)
    assert torch.allclose(fork.output, small_mlp.fc2(donor["fc1"].out).detach(), atol=1e-6)


def test_patch_from_across_prompts_on_gpt2(tiny_gpt2):
    model, (ids,) = tiny_gpt2.model, tiny_gpt2.args
    other = ids.flip(-1)
    donor = tl.trace(model, other)
    fork = tl.trace(model, ids).fork().do("transformer.h.1", tl.patch_from(donor))
    # patching the last block's output means the rest of the model sees the donor's state
    assert torch.allclose(fork.output.logits, donor.output.logits, atol=1e-5)


def test_patch_from_with_a_shape_mismatch_names_both_shapes(small_mlp, mlp_input):
    donor = tl.trace(small_mlp, torch.randn(5, 4))
    for call in (
        lambda: tl.trace(small_mlp, mlp_input).fork().do("act", tl.patch_from(donor)),
        lambda: tl.trace(small_mlp, mlp_input, intervene=tl.when("act", tl.patch_from(donor))),
    ):
        with pytest.raises(EditShapeError) as err:
            call()
        assert err.value.source_shape == (5, 6) and err.value.activation_shape == (3, 6)
        assert "(5, 6)" in str(err.value) and "(3, 6)" in str(err.value) and err.value.remedy


def test_scale(small_mlp, mlp_input):
    h = _relu(small_mlp, mlp_input)
    fork = _both_ways(small_mlp, mlp_input, "act", tl.scale(-1.5))
    assert torch.allclose(fork["act"].out, h * -1.5)
    assert torch.allclose(fork.output, small_mlp.fc2(h * -1.5).detach(), atol=1e-6)


def test_add_a_steering_vector_everywhere_or_at_positions(tiny_gpt2):
    model, (ids,) = tiny_gpt2.model, tiny_gpt2.args
    trace = tl.trace(model, ids)
    block = trace["transformer.h.0"].out
    vec = torch.linspace(-1, 1, 32)
    fork = trace.fork().do("transformer.h.0", tl.add(vec))
    assert torch.allclose(fork["transformer.h.0"].out, block + vec)
    want = edited_forward(model, "transformer.h.0", lambda o: o + vec, (ids,))
    assert torch.allclose(fork.output.logits, want.logits, atol=1e-5)
    fork = trace.fork().do("transformer.h.0", tl.add(vec, positions=[1, 3]))
    expected = block.clone()
    expected[:, [1, 3], :] += vec
    assert torch.allclose(fork["transformer.h.0"].out, expected)
    assert torch.equal(fork["transformer.h.0"].out[:, [0, 2, 4, 5]], block[:, [0, 2, 4, 5]])

    def at_positions(o):
        o = o.clone()
        o[:, [1, 3], :] += vec
        return o

    want = edited_forward(model, "transformer.h.0", at_positions, (ids,))
    assert torch.allclose(fork.output.logits, want.logits, atol=1e-5)
    single = trace.fork().do("transformer.h.0", tl.add(vec, positions=2))
    assert torch.allclose(single["transformer.h.0"].out[:, 2], block[:, 2] + vec)
    captured = tl.trace(model, ids, intervene=tl.when("transformer.h.0", tl.add(vec, positions=[1, 3])))
    assert torch.allclose(captured.output.logits, want.logits, atol=1e-5)


def test_add_positions_outside_the_activation_are_refused_never_wrapped(tiny_gpt2, small_mlp, mlp_input):
    """tl.add(positions=...) counts -n .. n-1 along dim -2 (-1: the last, as a hook's o[:, -1]);
    one outside is an InvalidArgumentError naming the length, the trace as it was; an activation
    without a position axis is an EditShapeError."""
    model, (ids,) = tiny_gpt2.model, tiny_gpt2.args
    trace = tl.trace(model, ids)
    n = ids.shape[-1]
    vec = torch.linspace(-1, 1, 32)
    last = trace.fork().do("transformer.h.0", tl.add(vec, positions=-1))

    def at_last(o):
        o = o.clone()
        o[:, -1, :] += vec
        return o

    want = edited_forward(model, "transformer.h.0", at_last, (ids,))
    assert torch.allclose(last.output.logits, want.logits, atol=1e-5)
    before = trace.output.logits.clone()
    for bad in (n, [0, n + 3], -n - 1):
        with pytest.raises(InvalidArgumentError) as err:
            trace.fork().do("transformer.h.0", tl.add(vec, positions=bad))
        assert f"{n} positions" in str(err.value) and err.value.remedy
        with pytest.raises(InvalidArgumentError):
            tl.trace(model, ids, intervene=tl.when("transformer.h.0", tl.add(vec, positions=bad)))
    assert torch.equal(trace.output.logits, before) and not trace.edits
    with pytest.raises(EditShapeError) as err:
        tl.trace(small_mlp, mlp_input[0]).fork().do("act", tl.add(torch.ones(6), positions=0))
    assert "dim -2" in str(err.value)


def test_add_refuses_bad_vectors(small_mlp, mlp_input):
    with pytest.raises(InvalidArgumentError):
        tl.add([1.0, 2.0])
    with pytest.raises(EditShapeError) as err:
        tl.trace(small_mlp, mlp_input).fork().do("act", tl.add(torch.ones(4)))
    assert "(4,)" in str(err.value) and "(3, 6)" in str(err.value)


def test_noise_is_seeded_and_deterministic(small_mlp, mlp_input):
    h = _relu(small_mlp, mlp_input)
    fork = _both_ways(small_mlp, mlp_input, "act", tl.noise(0.3, seed=7))
    expected = h + torch.randn(3, 6, generator=torch.Generator().manual_seed(7)) * 0.3
    assert torch.allclose(fork["act"].out, expected, atol=1e-6)
    again = tl.trace(small_mlp, mlp_input).fork().do("act", tl.noise(0.3, seed=7))
    assert torch.equal(again.output, fork.output)
    other = tl.trace(small_mlp, mlp_input).fork().do("act", tl.noise(0.3, seed=8))
    assert not torch.allclose(other.output, fork.output)
    torch.manual_seed(123)
    state = torch.get_rng_state()
    tl.trace(small_mlp, mlp_input).fork().do("act", tl.noise(0.3, seed=7))
    assert torch.equal(torch.get_rng_state(), state)  # the global RNG is left alone


def test_helpers_on_a_tuple_output_edit_the_first_tensor(tiny_gpt2):
    model, (ids,) = tiny_gpt2.model, tiny_gpt2.args
    trace = tl.trace(model, ids)
    fork = trace.fork().do("transformer.h.0.attn", tl.zero_ablate())
    attn = fork["transformer.h.0.attn"].out
    assert isinstance(attn, tuple) and torch.equal(attn[0], torch.zeros_like(attn[0]))
    assert all(a is b for a, b in zip(attn[1:], trace["transformer.h.0.attn"].out[1:]))
    want = edited_forward(model, "transformer.h.0.attn", lambda o: (torch.zeros_like(o[0]), *o[1:]), (ids,))
    assert torch.allclose(fork.output.logits, want.logits, atol=1e-5)


def test_helpers_are_named_serialisable_values():
    vec = torch.ones(3)
    assert tl.scale(2) == tl.scale(2.0) and tl.scale(2) != tl.scale(3)
    assert tl.add(vec, positions=1) == tl.add(vec.clone(), positions=[1])
    assert tl.zero_ablate() == tl.zero_ablate() and tl.zero_ablate() != tl.scale(0)
    assert tl.noise(0.1, seed=2).to_dict() == {"helper": "noise", "params": {"std": 0.1, "seed": 2}}
    assert tl.mean_ablate(dims=(0, 1)).params() == {"dims": [0, 1], "reference": None}
    assert repr(tl.scale(0.5)) == "tl.scale(k=0.5)"
    for name in ("zero_ablate", "mean_ablate", "patch_from", "scale", "add", "noise"):
        assert helper_class(name).name == name


class ClampAbove(tl.Helper):
    """A user helper: clip the activation at ``limit``."""

    name: ClassVar[str] = "test_clamp_above"

    def __init__(self, limit: float) -> None:
        self.limit = float(limit)

    def params(self) -> dict[str, Any]:
        return {"limit": self.limit}

    def __call__(self, activation, *, ctx):
        return activation.clamp(max=self.limit)


def test_register_a_user_helper(small_mlp, mlp_input):
    assert tl.register_helper(ClampAbove) is ClampAbove
    assert helper_class("test_clamp_above") is ClampAbove
    h = _relu(small_mlp, mlp_input)
    fork = _both_ways(small_mlp, mlp_input, "act", ClampAbove(0.3))
    assert torch.allclose(fork["act"].out, h.clamp(max=0.3))
    assert torch.allclose(fork.output, small_mlp.fc2(h.clamp(max=0.3)).detach(), atol=1e-6)
    assert ClampAbove(0.3).to_dict() == {"helper": "test_clamp_above", "params": {"limit": 0.3}}
    assert_equal_tree(fork.output, edited_forward(small_mlp, "act", lambda o: o.clamp(max=0.3), (mlp_input,)))


def test_register_helper_and_lookup_errors():
    class Nameless(tl.Helper):
        pass

    with pytest.raises(InvalidArgumentError) as err:
        tl.register_helper(Nameless)
    assert err.value.remedy
    with pytest.raises(InvalidArgumentError):
        tl.register_helper(tl.scale(1.0))
    with pytest.raises(UnknownHelperError) as err:
        helper_class("no_such_helper")
    assert "scale" in str(err.value) and err.value.remedy
