"""Bad input: each raises a named ``TorchLensError`` subclass carrying a non-empty remedy."""

from __future__ import annotations

import pickle

import pytest
import torch
from conftest import SmallMLP, assert_model_clean, hook_state
from torch import nn

import torchlens as tl
from torchlens import errors
from torchlens.errors import (
    AmbiguousSiteError,
    EmptySelectionError,
    InvalidArgumentError,
    SiteNotFoundError,
    TooManySitesError,
    TorchLensError,
    UnsupportedModelError,
)


def _raises(cls: type[TorchLensError], call) -> TorchLensError:
    with pytest.raises(cls) as err:
        call()
    assert isinstance(err.value, TorchLensError)
    assert err.value.remedy and err.value.remedy in str(err.value)
    return err.value


class CountingNet(nn.Module):
    """Counts forward calls, so a test can tell that nothing ran."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.fc(x)


@pytest.fixture(scope="module")
def compiled():
    model = CountingNet()
    return model, torch.compile(model)  # only wraps: nothing is compiled until it is called


def test_not_a_module_is_refused():
    err = _raises(UnsupportedModelError, lambda: tl.trace(lambda x: x * 2, torch.ones(2)))
    assert "function" in str(err)
    _raises(UnsupportedModelError, lambda: tl.extract("model", torch.ones(2), ["fc"]))

    class Wrapper:  # an nnsight-style wrapper: the remedy says which attribute to pass
        def __init__(self, model):
            self._model = model

    err = _raises(UnsupportedModelError, lambda: tl.trace(Wrapper(SmallMLP()), torch.ones(2, 4)))
    assert "_model" in err.remedy


def test_a_torch_compiled_model_is_refused_without_compiling(compiled):
    model, wrapper = compiled
    err = _raises(UnsupportedModelError, lambda: tl.trace(wrapper, torch.randn(2, 4)))
    assert "torch.compile" in str(err) and "_orig_mod" in err.remedy
    _raises(UnsupportedModelError, lambda: tl.extract(wrapper, torch.randn(2, 4), ["fc"]))
    assert model.calls == 0  # refused before anything ran (nothing was compiled either)
    assert wrapper._orig_mod is model
    trace = tl.trace(wrapper._orig_mod, torch.ones(1, 4))  # the remedy works
    assert torch.equal(trace.output, model.fc(torch.ones(1, 4)).detach())


def test_a_torchscript_model_is_refused():
    torch.manual_seed(0)
    eager = SmallMLP().eval()
    for scripted in (torch.jit.script(eager), torch.jit.trace(eager, torch.randn(2, 4))):
        err = _raises(UnsupportedModelError, lambda s=scripted: tl.trace(s, torch.randn(2, 4)))
        assert "TorchScript" in str(err) and "eager" in err.remedy
        _raises(UnsupportedModelError, lambda s=scripted: tl.extract(s, torch.randn(2, 4), ["fc1"]))


def test_unknown_site_names_the_nearest_valid_addresses(tiny_gpt2):
    model, (ids,) = tiny_gpt2.model, tiny_gpt2.args
    trace = tl.trace(model, ids)
    before = hook_state(model)
    cases = [
        lambda: trace["transformer.h.0.atn"],
        lambda: trace.find_sites(tl.module("transformer.h.0.atn")),
        lambda: trace.find_sites(tl.in_module("transformer.h.0.atn")),
        lambda: tl.extract(model, ids, ["transformer.h.0.atn"]),
        lambda: trace.fork().do(tl.module("transformer.h.0.atn"), 0.0),
        lambda: tl.trace(model, ids, intervene=tl.when(tl.module("transformer.h.0.atn"), 0.0)),
        lambda: tl.trace(model, ids, save=tl.module("transformer.h.0.atn")),
    ]
    for call in cases:
        err = _raises(SiteNotFoundError, call)
        assert "transformer.h.0.attn" in str(err), str(err)
        assert_model_clean(model, before)
    err = _raises(SiteNotFoundError, lambda: trace.find_sites(tl.func("sofmax")))
    assert "softmax" not in err.candidates  # sdpa model: only ops that exist are suggested
    assert "scaled_dot_product_attention" in {op.func_name for op in trace.ops}
    err = _raises(SiteNotFoundError, lambda: trace["layer_nrm_1"])
    assert "layer_norm_1" in err.candidates


def test_unknown_pass_is_refused(shared_twice):
    trace = tl.trace(shared_twice.model, *shared_twice.args)
    err = _raises(SiteNotFoundError, lambda: trace.find_sites(tl.module("block:3")))
    assert "1 and 2" in err.remedy
    _raises(SiteNotFoundError, lambda: trace["block:3"])
    _raises(AmbiguousSiteError, lambda: trace["block"])


def test_empty_selector_result(shared_twice):
    trace = tl.trace(shared_twice.model, *shared_twice.args)
    err = _raises(EmptySelectionError, lambda: trace.find_sites(tl.func("tanh") & tl.in_module("inp")))
    assert "tanh" in str(err) and "inp" in str(err)
    _raises(EmptySelectionError, lambda: trace.fork().do(tl.func("linear") & tl.module("out"), 0.0))
    err = _raises(TooManySitesError, lambda: trace.find_sites(tl.in_module(""), max_fanout=1))
    assert err.count == len(trace.ops) - 1


def test_wrong_save_type(small_mlp, mlp_input):
    for bad in (3, {"fc1": True}, [], 1.5, object()):
        err = _raises(InvalidArgumentError, lambda b=bad: tl.trace(small_mlp, mlp_input, save=b))
        assert "save=" in str(err)
    assert isinstance(InvalidArgumentError("x"), TypeError)


def test_wrong_argument_types(small_mlp, mlp_input):
    trace = tl.trace(small_mlp, mlp_input)
    calls = [
        lambda: tl.trace(small_mlp, mlp_input, intervene=5),
        lambda: tl.trace(small_mlp, mlp_input, intervene=[tl.when("fc1", 0.0), "fc2"]),
        lambda: tl.when("fc1", "zero"),
        lambda: tl.module(3),
        lambda: tl.in_module(None),
        lambda: tl.func(len),
        lambda: trace[1.5],
        lambda: trace.find_sites(5),
        lambda: trace.find_sites([]),
        lambda: tl.extract(small_mlp, mlp_input, 5),
        lambda: tl.extract(small_mlp, mlp_input, []),
        lambda: tl.trace(small_mlp, mlp_input, backend="no_such_engine"),
        lambda: tl.validate("trace"),
        lambda: tl.validate(tl.trace(small_mlp, mlp_input, intervene=tl.when("fc1", 0.0), save="fc2")),
        lambda: trace.do("fc1", 0.0),
    ]
    for call in calls:
        _raises(InvalidArgumentError, call)


def test_every_error_class_has_a_remedy_and_survives_pickling():
    classes = errors.all_error_classes()
    assert TorchLensError in classes and UnsupportedModelError in classes and len(classes) >= 15
    for cls in classes:
        if cls is TorchLensError or cls.__name__ == "TorchLensError":
            continue
        assert cls.__doc__, cls
        err = cls("something went wrong", site="x")
        assert err.remedy or cls in (errors.SiteError, errors.CaptureError, errors.EditError, errors.ReplayError,
                                     errors.RecipeError), cls
        clone = pickle.loads(pickle.dumps(err))
        assert type(clone) is cls and str(clone) == str(err) and clone.site == "x"
