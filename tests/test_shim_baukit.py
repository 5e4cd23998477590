"""torchlens_shims.baukit: baukit's nethook semantics, pinned by value.

Every activation read or edited through the shim is compared with the same thing done
with plain ``register_forward_hook`` calls on the same model. Tests marked "cross-check"
also run the real baukit (its ``nethook.py``, from the wheel in ``../shared/oracles``) when it
is installed, and skip otherwise.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import importlib.util
import itertools
import pathlib
from collections import OrderedDict, defaultdict, namedtuple

import pytest
import torch
import torchlens_shims.baukit as shim
import transformers
from torch import nn
from torchlens_shims.baukit import (
    StopForward,
    Trace,
    TraceDict,
    get_module,
    get_parameter,
    invoke_with_optional_args,
    recursive_copy,
    replace_module,
    set_requires_grad,
    subsequence,
)

from torchlens.errors import (
    InvalidArgumentError,
    ShimUnsupportedError,
    SiteNotFoundError,
    TorchLensError,
)

# shared/ sits beside the repository root (CI lays a copy there); nowhere else.
FENCE = pathlib.Path(__file__).resolve().parents[2] / "shared" / "acceptance/seed_fences/baukit_guide_baukit.py"
IDS = torch.tensor([[3, 14, 15, 9, 26, 5, 35, 8]])
# Loads the installed real baukit's nethook.py alone (its package __init__ needs torchvision).
ORACLE = pathlib.Path(__file__).resolve().parent / "fixtures" / "oracles" / "baukit" / "__init__.py"


def real_nethook():
    """The real baukit's nethook module, or a skip saying how to get it."""
    spec = importlib.util.spec_from_file_location("_real_baukit", ORACLE)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(
            "real baukit is not installed (not on PyPI; scripts/test.sh unpacks its wheel from "
            "../shared/oracles into .venv/oracles when that directory exists)"
        )
    return module.nethook


# -- conftest_baukit: models and plain-hook references ---------------------------------


def tiny_gpt2(seed: int = 0, n_layer: int = 2, attn: str | None = None, init: float = 0.02) -> nn.Module:
    """A random-weight GPT-2 small enough for unit tests (no network)."""
    extra = {} if attn is None else {"attn_implementation": attn}
    config = transformers.GPT2Config(
        n_layer=n_layer,
        n_embd=32,
        n_head=2,
        vocab_size=64,
        n_positions=16,
        bos_token_id=0,
        eos_token_id=0,
        initializer_range=init,
        **extra,
    )
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(config).eval()


class InPlaceAfter(nn.Module):
    """``fc``'s output is doubled in place after fc ran: shows what clone/detach keep."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.post = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        h.mul_(2)
        return self.post(h)


class CalledTwice(nn.Module):
    """One Linear applied twice: Trace keeps the last call and edits both."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.tanh(self.fc(x)))


class Scale(nn.Module):
    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return x * scale


class KwargCalls(nn.Module):
    """Submodules called with keyword-only, mixed and all-positional arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.by_kw = Scale()
        self.mixed = Scale()
        self.by_pos = Scale()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.by_pos(self.mixed(self.by_kw(x=x, scale=2.0), scale=3.0), 5.0)


class TupleOut(nn.Module):
    """Returns a (tensor, None, namedtuple) output, like attention modules do."""

    Pair = namedtuple("Pair", ["a", "b"])

    def forward(self, x: torch.Tensor):
        return x + 1, None, self.Pair(x * 2, 7)


def seeded(fn):
    torch.manual_seed(0)
    return fn()


def small_net() -> nn.Module:
    return seeded(lambda: nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).eval())


@contextlib.contextmanager
def plain_hooks(model: nn.Module, hooks: dict):
    """Attach ``{name: hook(module, args, output)}`` with plain register_forward_hook."""
    handles = [model.get_submodule(name).register_forward_hook(fn) for name, fn in hooks.items()]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def plain_record(model: nn.Module, names, inputs, edits=None, stop_after=None):
    """Outputs of ``names`` and the model's result, via plain hooks; ``edits`` map name -> fn."""
    edits = edits or {}
    seen: dict = {}

    def make(name):
        def hook(module, args, output):
            if name in edits:
                output = edits[name](output)
            seen[name] = output
            seen[name + ":args"] = args
            return output

        return hook

    with plain_hooks(model, {n: make(n) for n in dict.fromkeys([*names, *edits])}):
        result = model(inputs)
    return seen, result


def keep(store: dict, key: str):
    """A plain forward hook that stores (args, output) under ``key`` and changes nothing."""

    def hook(module, args, output):
        store[key] = (args, output)

    return hook


def no_hooks_left(model: nn.Module) -> bool:
    return all(
        not m._forward_hooks
        and not m._forward_pre_hooks
        and not m._forward_hooks_with_kwargs
        and not m._forward_pre_hooks_with_kwargs
        for m in model.modules()
    )


def logits(model, ids=IDS):
    out = model(ids)
    return out.logits if hasattr(out, "logits") else out


# -- import forms ------------------------------------------------------------------------


def test_three_import_forms_give_the_same_objects():
    from torchlens_shims.baukit import Trace as T1
    from torchlens_shims.baukit import nethook
    from torchlens_shims.baukit.nethook import Trace as T3
    from torchlens_shims.baukit.nethook import TraceDict as TD3

    assert T1 is nethook.Trace is T3
    assert TraceDict is nethook.TraceDict is TD3
    for name in [
        "get_module",
        "get_parameter",
        "replace_module",
        "set_requires_grad",
        "subsequence",
        "recursive_copy",
        "invoke_with_optional_args",
        "StopForward",
        "module_names",
        "parameter_names",
        "hierarchical_subsequence",
    ]:
        assert getattr(shim, name) is getattr(nethook, name)
    assert issubclass(StopForward, Exception) and not issubclass(StopForward, TorchLensError)


def test_non_nethook_baukit_names_raise_shim_unsupported():
    with pytest.raises(ShimUnsupportedError, match="nethook only"):
        from torchlens_shims.baukit import show  # noqa: F401
    with pytest.raises(AttributeError):
        shim.no_such_name  # noqa: B018


# -- Trace: reading ----------------------------------------------------------------------


def test_trace_output_is_the_very_object_the_layer_produced():
    model = tiny_gpt2()
    ref, ref_result = plain_record(model, ["transformer.h.0"], IDS)
    with Trace(model, "transformer.h.0") as tr:
        result = model(IDS)
    assert torch.equal(tr.output, ref["transformer.h.0"])
    assert torch.equal(result.logits, ref_result.logits)
    assert tr.output.grad_fn is not None  # not detached by default
    assert tr.layer == "transformer.h.0"
    assert no_hooks_left(model)

    seen = {}
    handle = model.transformer.h[0].register_forward_hook(keep(seen, "o"))
    with Trace(model, "transformer.h.0") as tr:
        model(IDS)
    handle.remove()
    assert tr.output is seen["o"][1]


def test_trace_of_module_itself_when_layer_is_none():
    model = small_net()
    x = seeded(lambda: torch.randn(3, 4))
    with Trace(model[1]) as tr:
        model(x)
    assert tr.layer is None
    assert torch.equal(tr.output, torch.relu(model[0](x)))
    with Trace(model, "") as whole:  # '' names the model itself, as in named_modules()
        out = model(x)
    assert whole.output is out


def test_trace_is_live_from_construction_until_close():
    model = small_net()
    x = seeded(lambda: torch.randn(3, 4))
    tr = Trace(model, "0")
    assert not no_hooks_left(model)
    model(x)
    first = tr.output
    assert torch.equal(first, nn.functional.linear(x, model[0].weight, model[0].bias))
    model[0](x * 0)  # calling the layer alone fires the hook too
    assert torch.equal(tr.output, model[0].bias.expand(3, -1))
    tr.close()
    assert no_hooks_left(model)
    model(x + 1)
    assert torch.equal(tr.output, model[0].bias.expand(3, -1))  # nothing recorded after close
    tr.close()  # closing twice is harmless
    tr2 = Trace(model, "0")
    tr2.registered_hook.remove()  # baukit code sometimes removes the handle directly
    assert no_hooks_left(model)


def test_closed_trace_does_not_keep_the_model_alive():
    import gc
    import weakref

    model = small_net()
    x = torch.randn(1, 4)
    with Trace(model, "0") as tr:
        model(x)
    alive = weakref.ref(model)
    del model
    gc.collect()
    assert alive() is None
    assert tr.output.shape == (1, 8)


def test_input_is_single_positional_or_tuple_and_excludes_kwargs():
    model = KwargCalls()
    x = torch.arange(4.0)
    with TraceDict(model, ["by_kw", "mixed", "by_pos"], retain_input=True) as td:
        out = model(x)
    assert td["by_kw"].input == ()  # called with keywords only: no positional inputs
    assert torch.equal(td["mixed"].input, x * 2)  # one positional: the value itself
    pos = td["by_pos"].input
    assert isinstance(pos, tuple) and len(pos) == 2 and pos[1] == 5.0
    assert torch.equal(pos[0], x * 6)
    assert torch.equal(out, x * 30)


def test_gpt2_block_input_is_the_positional_tuple():
    model = tiny_gpt2()
    ref, _ = plain_record(model, ["transformer.h.1", "transformer.ln_f"], IDS)
    with TraceDict(model, ["transformer.h.1", "transformer.ln_f"], retain_input=True) as td:
        model(IDS)
    args = ref["transformer.h.1:args"]
    block_input = td["transformer.h.1"].input
    assert isinstance(block_input, tuple) and len(block_input) == len(args)
    assert torch.equal(block_input[0], args[0])
    assert torch.equal(td["transformer.ln_f"].input, ref["transformer.ln_f:args"][0])


def test_input_is_taken_after_the_module_ran():
    # ReLU(inplace=True) overwrites its input; baukit reads inputs in the forward hook,
    # so the retained input already shows the ReLU.
    model = seeded(lambda: nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True)))
    x = seeded(lambda: torch.randn(5, 4))
    with torch.no_grad(), Trace(model, "1", retain_input=True) as tr:
        model(x)
    assert torch.equal(tr.input, torch.relu(model[0](x)).detach())


def test_output_before_any_forward_is_an_attribute_error():
    model = small_net()
    with Trace(model, "0", retain_input=True) as tr:
        with pytest.raises(AttributeError, match="no output yet"):
            tr.output  # noqa: B018
        with pytest.raises(AttributeError, match="no input yet"):
            tr.input  # noqa: B018
    with Trace(model, "0", retain_output=False) as tr:
        model(torch.randn(1, 4))
    assert not hasattr(tr, "output")


def test_module_called_several_times_keeps_last_and_edits_every_call():
    model = seeded(CalledTwice)
    x = seeded(lambda: torch.randn(2, 4))
    with torch.no_grad():
        with Trace(model, "fc") as tr:
            out = model(x)
        assert torch.equal(tr.output, out)  # the last call's output
        with Trace(model, "fc", edit_output=lambda output: output * 2) as tr:
            edited = model(x)
        expected = 2 * model.fc(torch.tanh(2 * model.fc(x)))
    assert torch.allclose(edited, expected)
    assert torch.equal(tr.output, edited)


# -- clone / detach / retain_grad ----------------------------------------------------------


@pytest.mark.parametrize(
    "clone, detach, sees_later_inplace, on_graph",
    [
        (False, False, True, True),
        (False, True, True, False),
        (True, False, False, True),
        (True, True, False, False),
    ],
)
def test_clone_detach_decide_what_a_later_inplace_change_does(clone, detach, sees_later_inplace, on_graph):
    model = seeded(InPlaceAfter)
    x = seeded(lambda: torch.randn(3, 4))
    seen = {}
    handle = model.fc.register_forward_hook(keep(seen, "fc"))
    with Trace(model, "fc", clone=clone, detach=detach) as tr:
        model(x)
    handle.remove()
    before = model.fc(x).detach()
    expected = 2 * before if sees_later_inplace else before
    assert torch.allclose(tr.output.detach(), expected)
    assert (tr.output is seen["fc"][1]) == (not clone and not detach)
    assert tr.output.requires_grad == on_graph
    if detach and not clone:
        assert tr.output.data_ptr() == seen["fc"][1].data_ptr()  # a view, not a copy


def test_clone_and_detach_apply_to_inputs_too():
    model = seeded(lambda: nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 2)))
    x = seeded(lambda: torch.randn(3, 4))
    with Trace(model, "2", retain_input=True, clone=True, detach=True) as tr:
        model(x)
    assert torch.equal(tr.input, torch.relu(model[0](x)).detach())
    assert not tr.input.requires_grad


def test_retain_grad_gives_output_grad_and_passes_a_clone_downstream():
    model = seeded(InPlaceAfter)
    x = seeded(lambda: torch.randn(3, 4))
    seen = {}

    def plain(module, args, output):  # what baukit's retain_grad does, with a plain hook
        output.retain_grad()
        seen["fc"] = output
        return output.clone()

    handle = model.fc.register_forward_hook(plain)
    model(x).pow(2).sum().backward()
    handle.remove()
    expected_grad = seen["fc"].grad.clone()
    model.zero_grad()

    downstream = {}
    handle = model.post.register_forward_hook(keep(downstream, "post"))
    with Trace(model, "fc", retain_grad=True) as tr:
        model(x).pow(2).sum().backward()
    handle.remove()
    assert torch.allclose(tr.output.grad, expected_grad)
    # The model continued on a clone (which it then doubled in place); the retained
    # tensor was left alone.
    assert downstream["post"][0][0] is not tr.output
    assert torch.allclose(downstream["post"][0][0], 2 * tr.output)
    assert torch.allclose(tr.output, model.fc(x))


def test_retain_grad_on_gpt2_block_matches_plain_hooks():
    model = tiny_gpt2()
    answer = 7
    seen = {}

    def plain(module, args, output):
        output.retain_grad()
        seen["h0"] = output
        return output.clone()

    with plain_hooks(model, {"transformer.h.0": plain}):
        model(IDS).logits[0, -1, answer].backward()
    expected = seen["h0"].grad.clone()
    model.zero_grad()
    with TraceDict(
        model, ["transformer.h.0", "transformer.h.1"], retain_grad={"transformer.h.0": True}
    ) as td:
        model(IDS).logits[0, -1, answer].backward()
    assert torch.allclose(td["transformer.h.0"].output.grad, expected)
    assert not td["transformer.h.1"].output.retains_grad


# -- edit_output ---------------------------------------------------------------------------


class Editor:
    def __init__(self, k: float) -> None:
        self.k = k

    def edit(self, output, layer):
        assert layer == "transformer.h.0"
        return output * self.k

    def __call__(self, output):
        return output + self.k


def _scale(output, k):
    return output * k


def _scale_first(k, output):
    return output * k


def _with_inputs(output, layer_name, inputs):
    assert layer_name == "transformer.h.0"
    return output - inputs[0]


EDITS = {
    "f(out)": (lambda out: out * 2, lambda o, a: o * 2),
    "f(out, layer)": (
        lambda out, layer: out + (1.0 if layer == "transformer.h.0" else 99.0),
        lambda o, a: o + 1,
    ),
    "f(layer, output)": (
        lambda layer, output: output * 3 if layer == "transformer.h.0" else None,
        lambda o, a: o * 3,
    ),
    "f(output, layer_name, inputs)": (_with_inputs, lambda o, a: o - a[0]),
    "partial": (functools.partial(_scale, k=0.5), lambda o, a: o * 0.5),
    "partial-positional": (functools.partial(_scale_first, -1.0), lambda o, a: -o),
    "bound method": (Editor(4.0).edit, lambda o, a: o * 4.0),
    "callable object": (Editor(0.25), lambda o, a: o + 0.25),
}


@pytest.mark.parametrize("form", list(EDITS))
def test_edit_output_forms_match_plain_hook_edits(form):
    edit, same_with_plain_hook = EDITS[form]
    model = tiny_gpt2()
    with torch.no_grad():
        seen = {}

        def plain(module, args, output):
            seen["h0"] = same_with_plain_hook(output, args)
            return seen["h0"]

        with plain_hooks(model, {"transformer.h.0": plain}):
            expected = model(IDS).logits
        with Trace(model, "transformer.h.0", edit_output=edit) as tr:
            got = model(IDS).logits
        clean = model(IDS).logits
    assert torch.allclose(got, expected)
    assert not torch.allclose(got, clean)
    assert torch.allclose(tr.output, seen["h0"])  # .output is the value after the edit


def test_inplace_edit_returning_none_edits_downstream_and_leaves_output_none():
    # baukit keeps what the edit returned as .output, so an in-place edit that returns
    # None edits the model and leaves .output None.
    model = tiny_gpt2()

    def double_last(output):
        output[:, -1, :] *= 2

    def plain(module, args, output):
        output[:, -1, :] *= 2

    with torch.no_grad():
        with plain_hooks(model, {"transformer.h.1": plain}):
            expected = model(IDS).logits
        with Trace(model, "transformer.h.1", edit_output=double_last) as tr:
            got = model(IDS).logits
        with Trace(model, "transformer.h.1", edit_output=lambda output: double_last(output) or output) as tr2:
            got2 = model(IDS).logits
    assert torch.equal(got, expected) and torch.equal(got2, expected)
    assert tr.output is None
    assert tr2.output is not None


def test_edit_sees_the_layer_name_in_tracedict_and_inputs_tuple():
    model = tiny_gpt2()
    calls = []

    def edit(output, layer, inputs):
        calls.append((layer, type(inputs), len(inputs)))
        return output

    with torch.no_grad(), TraceDict(model, ["transformer.h.0", "transformer.ln_f"], edit_output=edit):
        model(IDS)
    assert calls == [("transformer.h.0", tuple, 4), ("transformer.ln_f", tuple, 1)]


# -- stop ----------------------------------------------------------------------------------


def _counter(model, name):
    count = {"n": 0}
    handle = model.get_submodule(name).register_forward_hook(
        lambda m, a, o: count.update(n=count["n"] + 1) and None
    )
    return count, handle


def test_stop_ends_the_forward_right_after_the_layer():
    model = tiny_gpt2()
    ref, _ = plain_record(model, ["transformer.h.0"], IDS)
    count, handle = _counter(model, "transformer.h.1")
    finished = False
    with Trace(model, "transformer.h.0", stop=True) as tr:
        model(IDS)
        finished = True  # pragma: no cover - never reached
    handle.remove()
    assert count["n"] == 0 and not finished
    assert torch.equal(tr.output, ref["transformer.h.0"])
    assert no_hooks_left(model)


def test_stop_outside_with_reaches_the_caller():
    model = small_net()
    tr = Trace(model, "0", stop=True)
    with pytest.raises(StopForward):
        model(torch.randn(1, 4))
    tr.close()
    assert no_hooks_left(model)


def test_stop_without_a_forward_exits_cleanly():
    model = small_net()
    with Trace(model, "0", stop=True):
        pass
    with TraceDict(model, ["0", "2"], stop=True):
        pass
    assert no_hooks_left(model)


def test_stop_swallows_only_stopforward():
    model = small_net()
    with pytest.raises(ValueError, match="boom"):
        with Trace(model, "0", stop=True):
            raise ValueError("boom")
    stopper = Trace(model, "0", stop=True)
    with pytest.raises(StopForward):  # stop=False does not swallow another trace's stop
        with Trace(model, "2"):
            model(torch.randn(1, 4))
    stopper.close()
    assert no_hooks_left(model)


# -- TraceDict -----------------------------------------------------------------------------


def test_tracedict_reads_match_plain_hooks_and_behave_as_ordered_dict():
    model = tiny_gpt2()
    names = ["transformer.h.1", "transformer.wte", "transformer.h.0", "transformer.h.1"]
    ref, ref_result = plain_record(model, names, IDS)
    with TraceDict(model, names) as td:
        result = model(IDS)
    assert isinstance(td, OrderedDict)
    assert list(td) == ["transformer.h.1", "transformer.wte", "transformer.h.0"]  # duplicates collapsed
    assert "transformer.h.0" in td and "transformer.h.5" not in td
    for name, trace in td.items():
        assert isinstance(trace, Trace) and trace.layer == name
        assert torch.equal(td[name].output, ref[name])
    assert torch.equal(result.logits, ref_result.logits)
    assert no_hooks_left(model)


def test_tracedict_options_as_per_layer_dicts():
    model = tiny_gpt2()
    names = ["transformer.h.0", "transformer.h.1"]
    seen = {}
    handles = [model.get_submodule(n).register_forward_hook(keep(seen, n)) for n in names]
    with TraceDict(
        model,
        names,
        retain_input={"transformer.h.1": True},
        clone={"transformer.h.0": True},
        retain_output={"transformer.h.0": True, "transformer.h.1": True},
        edit_output={"transformer.h.1": lambda output: output * 2},
    ) as td:
        model(IDS)
    for h in handles:
        h.remove()
    h0, h1 = td["transformer.h.0"], td["transformer.h.1"]
    assert not hasattr(h0, "input")
    assert torch.equal(h1.input[0], seen["transformer.h.1"][0][0])
    assert h0.output is not seen["transformer.h.0"][1] and torch.equal(h0.output, seen["transformer.h.0"][1])
    assert torch.equal(h1.output, seen["transformer.h.1"][1] * 2)  # later plain hook sees pre-edit value


def test_tracedict_shared_edit_matches_plain_hooks():
    model = tiny_gpt2(n_layer=3)
    names = ["transformer.h.0", "transformer.h.2"]
    factors = {"transformer.h.0": 0.5, "transformer.h.2": 3.0}

    def edit(output, layer_name):  # not named "layer": filled by position
        return output * factors[layer_name]

    with torch.no_grad():
        ref, expected = plain_record(
            model, names, IDS, edits={n: (lambda o, n=n: o * factors[n]) for n in names}
        )
        with TraceDict(model, names, edit_output=edit) as td:
            got = model(IDS)
    assert torch.allclose(got.logits, expected.logits)
    for n in names:
        assert torch.allclose(td[n].output, ref[n])


def test_tracedict_stop_applies_after_the_last_listed_layer():
    model = tiny_gpt2()
    ref, _ = plain_record(model, ["transformer.h.0"], IDS)
    count, handle = _counter(model, "transformer.ln_f")
    # Listed last, run first: the forward stops after h.0, so h.1 never runs.
    with TraceDict(model, ["transformer.h.1", "transformer.h.0"], stop=True) as td:
        model(IDS)
    assert count["n"] == 0
    assert not hasattr(td["transformer.h.1"], "output")
    assert torch.equal(td["transformer.h.0"].output, ref["transformer.h.0"])
    assert td["transformer.h.0"].stop is True and td["transformer.h.1"].stop is False
    # A repeated name does not count as last-listed: stop after h.1 here.
    with TraceDict(model, ["transformer.h.0", "transformer.h.1", "transformer.h.0"], stop=True) as td:
        model(IDS)
    handle.remove()
    assert count["n"] == 0 and hasattr(td["transformer.h.1"], "output")


# -- nested contexts -----------------------------------------------------------------------


def test_nested_contexts_compose_in_construction_order():
    model = tiny_gpt2()
    h0, h1 = "transformer.h.0", "transformer.h.1"
    with torch.no_grad():
        ref, expected = plain_record(model, [h0, h1], IDS, edits={h0: lambda o: o * 2})
        with Trace(model, h0, edit_output=lambda output: output * 2) as outer:
            with TraceDict(model, [h0, h1]) as inner:
                got = model(IDS)
    assert inner[h0].output is outer.output  # the inner hook ran second, on the edited value
    assert torch.allclose(inner[h1].output, ref[h1])
    assert torch.allclose(got.logits, expected.logits)
    assert no_hooks_left(model)

    # An edit attached later is invisible to a reader attached earlier.
    with torch.no_grad(), Trace(model, h0) as reader:
        with Trace(model, h0, edit_output=lambda output: output + 1) as editor:
            model(IDS)
    assert torch.allclose(editor.output, reader.output + 1)


def test_nested_stop_is_swallowed_by_the_trace_that_asked():
    model = tiny_gpt2()
    ref, _ = plain_record(model, ["transformer.h.0"], IDS)
    with Trace(model, "transformer.h.1", stop=True) as outer:
        with Trace(model, "transformer.h.0") as inner:
            model(IDS)
    assert torch.equal(inner.output, ref["transformer.h.0"])
    assert hasattr(outer, "output")
    assert no_hooks_left(model)


# -- tuple outputs (attention) ---------------------------------------------------------------


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("opts", [{}, {"clone": True}, {"detach": True}, {"clone": True, "detach": True}])
def test_attention_tuple_output_with_none_entries(attn, opts):
    model = tiny_gpt2(attn=attn)
    name = "transformer.h.0.attn"
    seen: dict = {}
    with plain_hooks(model, {name: keep(seen, name)}), Trace(model, name, retain_input=True, **opts) as tr:
        model(IDS)
    args, ref = seen[name]
    assert isinstance(tr.output, tuple) and len(tr.output) == len(ref) == 2
    assert torch.equal(tr.output[0], ref[0])
    assert (ref[1] is None) == (attn == "sdpa")
    if ref[1] is None:
        assert tr.output[1] is None
    else:
        assert torch.equal(tr.output[1], ref[1])
    assert (tr.output is ref) == (not opts)
    assert torch.equal(tr.input, args[0])


def test_retain_grad_on_attention_tuple_and_cache_in_block_input():
    model = tiny_gpt2()
    name = "transformer.h.0.attn"
    with TraceDict(
        model,
        [name, "transformer.h.1"],
        retain_grad={name: True},
        retain_input=True,
        clone={"transformer.h.1": True},
    ) as td:
        model(IDS, use_cache=True).logits.sum().backward()
    assert td[name].output[1] is None and td[name].output[0].grad is not None
    cache = td["transformer.h.1"].input[1]
    assert type(cache).__name__ == "DynamicCache"  # passed through, not copied or rejected


def test_recursive_copy_passes_non_tensors_and_rebuilds_containers():
    t = torch.ones(2, requires_grad=True) * 1
    value = {"a": [t, None, 3], "b": (t, TupleOut.Pair(t, "x"))}
    copied = recursive_copy(value, clone=True, detach=True)
    assert copied["a"][1] is None and copied["a"][2] == 3
    assert isinstance(copied["b"][1], TupleOut.Pair) and copied["b"][1].b == "x"
    assert copied["a"][0] is not t and torch.equal(copied["a"][0], t) and not copied["a"][0].requires_grad
    assert recursive_copy(value) is value
    ints = torch.arange(3)
    assert recursive_copy(ints, retain_grad=True) is ints and not ints.requires_grad


def test_namedtuple_output_with_clone():
    model = TupleOut()
    x = torch.arange(3.0)
    with Trace(model, clone=True) as tr:
        out = model(x)
    assert tr.output[1] is None and tr.output[2].b == 7
    assert torch.equal(tr.output[0], out[0]) and tr.output[0] is not out[0]
    assert torch.equal(tr.output[2].a, x * 2)


# -- ROME-style causal tracing -------------------------------------------------------------


def _corrupt_and_restore(model, run, n_layer, subject, answer, noise):
    """Causal-tracing table [token, layer] -> prob of ``answer`` after restoring that state."""
    table = torch.zeros(IDS.shape[1], n_layer)
    for token in range(IDS.shape[1]):
        for layer in range(n_layer):
            table[token, layer] = run(model, [(token, f"transformer.h.{layer}")], subject, answer, noise)
    return table


def baukit_style_trace_with_patch(model, states_to_patch, subject, answer, noise, lib=shim):
    """The ROME recipe, written against baukit's API (the shim, or real baukit)."""
    batch = IDS.repeat(1 + noise.shape[0], 1)
    patch_spec = defaultdict(list)
    for token, layer in states_to_patch:
        patch_spec[layer].append(token)
    embed = "transformer.wte"

    def patch_rep(x, layer):
        if layer == embed:
            begin, end = subject
            x[1:, begin:end] += noise
            return x
        h = x[0] if isinstance(x, tuple) else x
        for token in patch_spec[layer]:
            h[1:, token] = h[0, token]
        return x

    with torch.no_grad(), lib.TraceDict(model, [embed, *patch_spec], edit_output=patch_rep):
        out = model(batch)
    return torch.softmax(out.logits[1:, -1, :], dim=-1).mean(dim=0)[answer].item()


def plain_hook_trace_with_patch(model, states_to_patch, subject, answer, noise):
    """The same recipe with plain forward hooks."""
    batch = IDS.repeat(1 + noise.shape[0], 1)
    begin, end = subject

    def corrupt(module, args, output):
        output[1:, begin:end] += noise
        return output

    def restore(tokens):
        def hook(module, args, output):
            for token in tokens:
                output[1:, token] = output[0, token]
            return output

        return hook

    hooks = {"transformer.wte": corrupt}
    for token, layer in states_to_patch:
        hooks[layer] = restore([token])
    with torch.no_grad(), plain_hooks(model, hooks):
        out = model(batch)
    return torch.softmax(out.logits[1:, -1, :], dim=-1).mean(dim=0)[answer].item()


def _rome_setup(n_layer: int):
    model = tiny_gpt2(seed=1, n_layer=n_layer, init=0.2)  # larger weights: visible effects
    subject = (1, 4)
    with torch.no_grad():
        clean = torch.softmax(model(IDS).logits[0, -1], -1)
    gen = torch.Generator().manual_seed(0)
    std = model.transformer.wte.weight.std().item()
    noise = 3 * std * torch.randn(3, subject[1] - subject[0], 32, generator=gen)
    return model, subject, clean, int(clean.argmax()), noise


def test_rome_causal_tracing_matches_plain_hooks():
    n_layer = 4
    model, subject, clean, answer, noise = _rome_setup(n_layer)
    shim_table = _corrupt_and_restore(model, baukit_style_trace_with_patch, n_layer, subject, answer, noise)
    plain_table = _corrupt_and_restore(model, plain_hook_trace_with_patch, n_layer, subject, answer, noise)
    assert torch.allclose(shim_table, plain_table, atol=0, rtol=1e-6)
    corrupted = plain_hook_trace_with_patch(model, [], subject, answer, noise)
    assert abs(corrupted - clean[answer].item()) > 1e-4  # corruption changed the answer's prob
    effect = shim_table - corrupted
    assert effect.abs().max() > 1e-4  # restoring states matters somewhere
    # Token 0 comes before the subject, so its state is the same in both runs and
    # restoring it changes nothing; at the last layer only the last token matters, and
    # restoring it there brings back the clean probability.
    assert torch.allclose(shim_table[0], torch.full((n_layer,), corrupted), rtol=1e-5)
    assert torch.allclose(shim_table[:-1, -1], torch.full((IDS.shape[1] - 1,), corrupted), rtol=1e-5)
    assert abs(shim_table[-1, -1].item() - clean[answer].item()) < 1e-6
    assert no_hooks_left(model)


# -- acceptance fence --------------------------------------------------------------------


def _run_fence(source: str) -> dict:
    namespace: dict = {"__name__": "fence"}
    exec(compile(source, str(FENCE), "exec"), namespace)
    return namespace


@pytest.mark.skipif(not FENCE.exists(), reason="acceptance fences not laid out here")
def test_acceptance_fence_through_the_shim():
    source = FENCE.read_text()
    assert "from baukit import" in source
    namespace = _run_fence(source.replace("from baukit import", "from torchlens_shims.baukit import"))
    assert namespace["RESULT"] == [2, 4]
    model, x = namespace["model"], namespace["x"]
    assert torch.equal(namespace["ret"].output, model.fc1(x))
    assert no_hooks_left(model)


@pytest.mark.skipif(not FENCE.exists(), reason="acceptance fences not laid out here")
def test_acceptance_fence_with_real_baukit():
    real_nethook()  # registers the real nethook as `baukit.nethook`
    source = FENCE.read_text().replace("from baukit import", "from baukit.nethook import")
    assert _run_fence(source)["RESULT"] == [2, 4]


# -- helpers ---------------------------------------------------------------------------------


def test_get_module_and_get_parameter():
    model = tiny_gpt2()
    assert get_module(model, "transformer.h.1.mlp") is model.transformer.h[1].mlp
    assert get_module(model, "") is model
    assert get_parameter(model, "transformer.h.0.ln_1.weight") is model.transformer.h[0].ln_1.weight
    assert shim.module_names(model)[:2] == ["", "transformer"]
    assert shim.parameter_names(model) == [n for n, _ in model.named_parameters()]
    assert "transformer.wte.weight" in shim.parameter_names(model)


def test_get_module_follows_named_modules_for_shared_modules():
    shared = nn.Linear(2, 2)
    model = nn.Module()
    model.a = shared
    model.b = shared  # reachable twice; named_modules lists it once, as 'a'
    assert get_module(model, "a") is shared
    with pytest.raises(SiteNotFoundError):
        get_module(model, "b")


def test_tracedict_resolves_names_like_get_module():
    shared = nn.Linear(2, 2)
    model = nn.Sequential(shared, shared)  # '1' is the same module as '0'
    with pytest.raises(SiteNotFoundError):
        TraceDict(model, ["0", "1"])
    assert no_hooks_left(model)
    x = torch.ones(1, 2)
    with TraceDict(model, ["0", None]) as td:  # None hooks the model itself, as Trace does
        out = model(x)
    assert td[None].output is out
    assert torch.equal(td["0"].output, out)  # the shared module's last call


def test_replace_module_dotted_and_undotted():
    model = small_net()
    new = nn.Tanh()
    replace_module(model, "1", new)  # undotted: baukit raises UnboundLocalError here
    assert model[1] is new
    gpt = tiny_gpt2()
    mlp = nn.Identity()
    replace_module(gpt, "transformer.h.0.mlp", mlp)
    assert gpt.transformer.h[0].mlp is mlp


def test_set_requires_grad_on_modules_and_tensors():
    model = small_net()
    t = torch.zeros(2)
    set_requires_grad(False, model)
    assert not any(p.requires_grad for p in model.parameters())
    set_requires_grad(True, model[0], t)
    assert all(p.requires_grad for p in model[0].parameters()) and t.requires_grad
    assert not any(p.requires_grad for p in model[2].parameters())


def nested_sequential() -> nn.Sequential:
    def build():
        inner = nn.Sequential(OrderedDict(x=nn.Linear(4, 4), y=nn.ReLU(), z=nn.Linear(4, 4)))
        return nn.Sequential(OrderedDict(a=nn.Linear(4, 4), b=inner, c=nn.Tanh(), d=nn.Linear(4, 4)))

    return seeded(build)


def _layout(seq: nn.Sequential) -> list:
    """Child names, with nested Sequentials as (name, [their children])."""
    return [
        (name, _layout(child)) if isinstance(child, nn.Sequential) else name
        for name, child in seq.named_children()
    ]


SUBSEQUENCES = [
    ({"first_layer": "b", "last_layer": "c"}, [("b", ["x", "y", "z"]), "c"], ["b.x", "b.y", "b.z", "c"]),
    ({"after_layer": "a", "upto_layer": "d"}, [("b", ["x", "y", "z"]), "c"], ["b.x", "b.y", "b.z", "c"]),
    ({"first_layer": "b.y"}, [("b", ["y", "z"]), "c", "d"], ["b.y", "b.z", "c", "d"]),
    ({"last_layer": "b.x"}, ["a", ("b", ["x"])], ["a", "b.x"]),
    ({"after_layer": "b.x", "upto_layer": "b.z"}, [("b", ["y"])], ["b.y"]),
    ({"single_layer": "b.y"}, [("b", ["y"])], ["b.y"]),
    ({"upto_layer": "b.x"}, ["a"], ["a"]),
    ({"after_layer": "d"}, [], []),
    ({}, ["a", ("b", ["x", "y", "z"]), "c", "d"], ["a", "b.x", "b.y", "b.z", "c", "d"]),
]


@pytest.mark.parametrize("kwargs, layout, path", SUBSEQUENCES)
def test_subsequence_boundaries(kwargs, layout, path):
    seq = nested_sequential()
    sub = subsequence(seq, **kwargs)
    assert _layout(sub) == layout
    x = seeded(lambda: torch.randn(2, 4))
    want = x
    for name in path:
        want = seq.get_submodule(name)(want)
    assert torch.allclose(sub(x), want)


def test_subsequence_copies_unless_share_weights():
    seq = nested_sequential().train(False)
    copied = subsequence(seq, first_layer="b", last_layer="b")
    shared = subsequence(seq, first_layer="b", last_layer="b", share_weights=True)
    assert shared.b is seq.b and copied.b is not seq.b
    assert copied.training is False
    with torch.no_grad():
        copied.b.x.weight.zero_()
    assert seq.b.x.weight.abs().sum() > 0
    assert subsequence(seq, share_weights=True) is seq


# -- invoke_with_optional_args -----------------------------------------------------------------


def test_invoke_with_optional_args_rules():
    offer = {"output": "O", "layer": "L", "inputs": "I"}
    assert invoke_with_optional_args(lambda out: out, **offer) == "O"
    assert invoke_with_optional_args(lambda a, b: (a, b), **offer) == ("O", "L")
    assert invoke_with_optional_args(lambda layer, output: (layer, output), **offer) == ("L", "O")
    assert invoke_with_optional_args(lambda x, inputs, y: (x, inputs, y), **offer) == ("O", "I", "L")
    assert invoke_with_optional_args(lambda a, b, c, d=5: (a, b, c, d), **offer) == ("O", "L", "I", 5)
    assert invoke_with_optional_args(lambda output, *, layer: (output, layer), **offer) == ("O", "L")
    assert invoke_with_optional_args(lambda *args, **kw: (args, kw), **offer) == ((), offer)
    assert invoke_with_optional_args(lambda output, **kw: (output, kw), **offer) == ("O", {})
    assert invoke_with_optional_args(lambda a, *rest: (a, rest), 1, 2, 3) == (1, (2, 3))
    assert invoke_with_optional_args(lambda a, b=2: (a, b), 1) == (1, 2)


def test_invoke_with_optional_args_bad_callables():
    offer = {"output": "O", "layer": "L", "inputs": "I"}
    with pytest.raises(InvalidArgumentError, match="cannot be passed d"):
        invoke_with_optional_args(lambda a, b, c, d: None, **offer)
    with pytest.raises(TypeError, match="cannot be passed"):
        invoke_with_optional_args(functools.partial(lambda a, b, c, d, e: None, 1), **offer)
    with pytest.raises(InvalidArgumentError, match="cannot read the parameters"):
        invoke_with_optional_args(torch.relu, **offer)


# -- bad inputs raise the named errors ---------------------------------------------------------


def test_missing_layer_is_site_not_found_naming_nearest():
    model = tiny_gpt2()
    with pytest.raises(SiteNotFoundError) as info:
        Trace(model, "transformer.h.9")
    err = info.value
    assert isinstance(err, LookupError)
    assert "transformer.h.0" in str(err) and err.remedy and err.candidates
    assert no_hooks_left(model)
    with pytest.raises(LookupError, match="nearest"):
        get_parameter(model, "transformer.h.0.ln_1.wieght")
    with pytest.raises(LookupError):
        get_module(model, "transformer.hh")
    with pytest.raises(SiteNotFoundError):
        replace_module(model, "transformer.nope.mlp", nn.Identity())


def test_tracedict_with_a_missing_layer_detaches_the_others():
    model = tiny_gpt2()
    with pytest.raises(SiteNotFoundError):
        TraceDict(model, ["transformer.h.0", "transformer.h.1", "transformer.h.7"])
    assert no_hooks_left(model)


@pytest.mark.parametrize("layers", [None, "transformer.h.0"])
def test_tracedict_needs_a_list(layers):
    with pytest.raises(InvalidArgumentError, match="list of layer names"):
        TraceDict(small_net(), layers)


def test_non_module_arguments():
    with pytest.raises(InvalidArgumentError):
        Trace(torch.zeros(2))
    with pytest.raises(InvalidArgumentError):
        Trace("model", "fc")
    with pytest.raises(InvalidArgumentError):
        set_requires_grad(True, small_net(), "weights")


def test_subsequence_errors():
    seq = nested_sequential()
    with pytest.raises(shim.LayerNotFoundError) as info:
        subsequence(seq, first_layer="b.q")
    assert isinstance(info.value, ValueError) and isinstance(info.value, SiteNotFoundError)
    assert "b.q" in str(info.value)
    with pytest.raises(ValueError, match="Layer e not found"):
        subsequence(seq, upto_layer="e")
    with pytest.raises(InvalidArgumentError, match="not an nn.Sequential"):
        subsequence(seq, first_layer="a.weight")
    with pytest.raises(InvalidArgumentError):
        subsequence(seq, single_layer="a", last_layer="b")
    with pytest.raises(InvalidArgumentError):
        subsequence(seq, last_layer="a", upto_layer="b")
    with pytest.raises(InvalidArgumentError):
        subsequence(seq, first_layer="a", after_layer="b")


def test_hooks_ignore_forwards_on_other_threads():
    # ModuleHooks only answers the thread that attached it (documented deviation).
    import threading

    model = small_net()
    with Trace(model, "0") as tr:
        worker = threading.Thread(target=model, args=(torch.randn(1, 4),))
        worker.start()
        worker.join()
        assert not hasattr(tr, "output")
        model(torch.randn(1, 4))
    assert hasattr(tr, "output")


def test_edit_that_cannot_be_called_raises_from_the_forward():
    model = small_net()
    with pytest.raises(InvalidArgumentError, match="cannot be passed"):
        with Trace(model, "0", edit_output=lambda a, b, c, d: a):
            model(torch.randn(1, 4))
    assert no_hooks_left(model)


# -- no hooks remain -------------------------------------------------------------------------


def _failing_edit(output):
    raise RuntimeError("edit failed")


@pytest.mark.parametrize(
    "make",
    [
        lambda m: Trace(m, "transformer.h.0"),
        lambda m: Trace(m, "transformer.h.0", edit_output=_failing_edit),
        lambda m: Trace(m, "transformer.h.0", stop=True),
        lambda m: TraceDict(m, ["transformer.h.0", "transformer.h.1.attn", "lm_head"], retain_input=True),
        lambda m: TraceDict(m, ["transformer.h.1", "transformer.h.0"], edit_output=_failing_edit),
        lambda m: TraceDict(m, ["transformer.h.0", "transformer.h.1"], stop=True, retain_grad=True),
    ],
)
@pytest.mark.parametrize("inputs", ["good", "bad"])
def test_no_hooks_remain_after_exit_even_when_the_forward_raises(make, inputs):
    model = tiny_gpt2()
    ids = IDS if inputs == "good" else torch.full((1, 4), 999)  # out of vocabulary: embedding fails
    with contextlib.suppress(RuntimeError, IndexError):
        with make(model):
            model(ids)
    assert no_hooks_left(model)
    tracer = make(model)
    with contextlib.suppress(RuntimeError, IndexError, StopForward):
        model(ids)
    tracer.close()
    assert no_hooks_left(model)


# -- cross-checks against real baukit -----------------------------------------------------------


@pytest.fixture
def real():
    return real_nethook()


def _scenario_outputs(lib, scenario):
    """Run one baukit-API scenario with ``lib`` (the shim or baukit's nethook)."""
    torch.manual_seed(0)
    if scenario == "read":
        model = tiny_gpt2()
        with lib.TraceDict(model, ["transformer.h.0", "transformer.ln_f"], retain_input=True) as td:
            model(IDS)
        return [td["transformer.h.0"].output, td["transformer.ln_f"].input, td["transformer.h.0"].input[0]]
    if scenario == "edit":
        model = tiny_gpt2()
        with (
            torch.no_grad(),
            lib.Trace(model, "transformer.h.0", edit_output=lambda output, layer: output * 2) as tr,
        ):
            out = model(IDS).logits
        return [tr.output, out]
    if scenario == "inplace-none":
        model = tiny_gpt2()

        def edit(output):
            output[:, -1] *= 2

        with torch.no_grad(), lib.Trace(model, "transformer.h.1", edit_output=edit) as tr:
            out = model(IDS).logits
        return [tr.output, out]
    if scenario == "stop":
        model = tiny_gpt2()
        with lib.TraceDict(model, ["transformer.h.1", "transformer.h.0"], stop=True) as td:
            model(IDS)
        return [td["transformer.h.0"].output, hasattr(td["transformer.h.1"], "output")]
    if scenario == "clone-detach":
        model = seeded(InPlaceAfter)
        x = seeded(lambda: torch.randn(3, 4))
        results = []
        for clone, detach in itertools.product([False, True], repeat=2):
            with lib.Trace(model, "fc", clone=clone, detach=detach) as tr:
                model(x)
            results += [tr.output.detach(), tr.output.requires_grad]
        return results
    if scenario == "retain-grad":
        model = seeded(InPlaceAfter)
        x = seeded(lambda: torch.randn(3, 4))
        with lib.Trace(model, "fc", retain_grad=True) as tr:
            model(x).pow(2).sum().backward()
        return [tr.output.grad, tr.output.detach()]
    if scenario == "twice":
        model = seeded(CalledTwice)
        with torch.no_grad(), lib.Trace(model, "fc", edit_output=lambda out: out + 1) as tr:
            out = model(torch.ones(1, 4))
        return [tr.output, out]
    if scenario == "nested":
        model = tiny_gpt2()
        with (
            torch.no_grad(),
            lib.Trace(model, "transformer.h.0", edit_output=lambda output: output * 2) as outer,
        ):
            with lib.TraceDict(model, ["transformer.h.0", "transformer.h.1"]) as inner:
                out = model(IDS).logits
        return [outer.output, inner["transformer.h.1"].output, out]
    raise AssertionError(scenario)


def _assert_same(a, b):
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    else:
        assert a == b


@pytest.mark.parametrize(
    "scenario", ["read", "edit", "inplace-none", "stop", "clone-detach", "retain-grad", "twice", "nested"]
)
def test_cross_check_scenarios_against_real_baukit(real, scenario):
    _assert_same(_scenario_outputs(shim, scenario), _scenario_outputs(real, scenario))


_SIGNATURES = [
    "a",
    "output",
    "a, b",
    "layer, output",
    "output, layer",
    "a, inputs",
    "a, b, c",
    "inputs, a, b",
    "a, b, c, d",
    "a, b, c, d=4",
    "a=1, b=2",
    "output, *, layer",
    "output, *, nope=0",
    "*args",
    "*args, **kw",
    "a, *args",
    "a, **kw",
    "**kw",
]


@pytest.mark.parametrize("params", _SIGNATURES)
@pytest.mark.parametrize("positional", [(), (10,), (10, 20)])
def test_cross_check_invoke_with_optional_args(real, params, positional):
    namespace: dict = {}
    exec(f"def fn({params}):\n    return dict(locals())", namespace)
    fn = namespace["fn"]
    offer = {"output": "O", "layer": "L", "inputs": "I"}

    def outcome(invoke):
        try:
            return invoke(fn, *positional, **offer)
        except (TypeError, AttributeError):
            return "error"

    assert outcome(shim.invoke_with_optional_args) == outcome(real.invoke_with_optional_args)


@pytest.mark.parametrize("kwargs, layout, path", SUBSEQUENCES)
def test_cross_check_subsequence(real, kwargs, layout, path):
    seq = nested_sequential()
    assert _layout(subsequence(seq, **kwargs)) == _layout(real.subsequence(seq, **kwargs))


def test_cross_check_recursive_copy_and_helpers(real):
    t = torch.ones(2, requires_grad=True) * 3
    value = {"a": [t, (t, t)]}
    for flags in itertools.product([False, True], repeat=2):
        _assert_same(
            shim.recursive_copy(value, clone=flags[0], detach=flags[1])["a"],
            real.recursive_copy(value, clone=flags[0], detach=flags[1])["a"],
        )
    model = tiny_gpt2()
    assert shim.module_names(model) == real.module_names(model)
    assert shim.parameter_names(model) == real.parameter_names(model)
    assert shim.get_module(model, "transformer.h.1") is real.get_module(model, "transformer.h.1")
    with pytest.raises(LookupError):
        real.get_module(model, "transformer.h.9")


def test_cross_check_rome_causal_tracing(real):
    model, subject, _, answer, noise = _rome_setup(3)
    shim_table = _corrupt_and_restore(model, baukit_style_trace_with_patch, 3, subject, answer, noise)
    real_table = _corrupt_and_restore(
        model, functools.partial(baukit_style_trace_with_patch, lib=real), 3, subject, answer, noise
    )
    assert torch.equal(shim_table, real_table)


def test_cross_check_documented_deviations_fail_in_real_baukit(real):
    """Each deviation listed in nethook's docstring is a place where baukit itself fails."""
    model = tiny_gpt2()
    attn = "transformer.h.0.attn"
    with pytest.raises(AssertionError):  # None inside the attention tuple
        with real.Trace(model, attn, clone=True):
            model(IDS)
    with shim.Trace(model, attn, clone=True) as tr:
        model(IDS)
    assert tr.output[1] is None
    with pytest.raises(TypeError):  # a bound method counts its self
        with torch.no_grad(), real.Trace(model, "transformer.h.0", edit_output=Editor(2.0).edit):
            model(IDS)
    with pytest.raises(UnboundLocalError):
        real.replace_module(small_net(), "1", nn.Tanh())
    with pytest.raises(TypeError):  # issubclass(None, StopForward)
        with real.Trace(model, "transformer.h.0", stop=True):
            pass
    with pytest.raises(LookupError):
        real.TraceDict(model, ["transformer.h.0", "transformer.h.7"])
    assert not no_hooks_left(model)  # baukit left h.0 hooked
