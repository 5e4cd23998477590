"""Calls that used to do nothing silently or disagree with each other (issue 13).

One input convention for every entry point; a module address in ``trace.table``; edits that
change nothing are reported; ambiguity remedies name the model's real addresses; reads of an
edited site show the edit on every path; ``trace.modules[address]``; keywords of the older
TorchLens package; suggestions ranked by intent. Values are checked against plain forward
hooks, plain forwards or hand-computed results, never against TorchLens itself.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import SmallMLP, assert_model_clean, hook_reads, hook_state
from torch import nn

import torchlens as tl
from torchlens.core.names import nearest
from torchlens.errors import (
    AmbiguousSiteError,
    EditHadNoEffectError,
    EmptySelectionError,
    InvalidArgumentError,
    LegacyArgumentError,
    SiteNotFoundError,
)


class TwoInputs(nn.Module):
    """Two positional inputs and a keyword that changes the result."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, a, b, scale=1.0):
        return self.fc(a - b) * scale


class TakesADict(nn.Module):
    """Its one positional argument is itself a dict (a batch)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, batch):
        return self.fc(batch["x"]) + batch["bias"]


class SeededNet(nn.Module):
    """A forward that names ``random_seed`` itself: that keyword must reach it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)
        self.calls = 0

    def forward(self, x, random_seed=None):
        self.calls += 1
        return self.fc(x) + (0.0 if random_seed is None else float(random_seed))


class Counting(nn.Module):
    """Counts forward calls, so a test can tell nothing ran."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.fc(x)


def _mlp() -> SmallMLP:
    torch.manual_seed(0)
    return SmallMLP().eval()


def _table_labels(text: str) -> list[str]:
    return [line.split()[0] for line in text.splitlines()[2:]]


def _consumed_by(module: nn.Module, model: nn.Module, x, edit_module: nn.Module | None = None, edit=None):
    """What ``module`` received as input in a plain forward (``edit_module``'s output edited by a hook)."""
    seen = []
    handles = [module.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach().clone()))]
    if edit_module is not None:
        handles.append(edit_module.register_forward_hook(lambda m, i, out: edit(out)))
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in handles:
            h.remove()
    return seen[0]


# -- 1. one input convention ------------------------------------------------------------------


def test_trace_takes_a_dict_of_keyword_inputs_like_extract(tiny_gpt2):
    model, (ids,) = tiny_gpt2.model, tiny_gpt2.args
    reads, out = hook_reads(model, (), {"input_ids": ids})
    trace = tl.trace(model, {"input_ids": ids})
    assert torch.equal(trace.output.logits, out.logits)
    assert torch.equal(trace["transformer.h.0"].out[0], reads["transformer.h.0"][0][0])
    extracted = tl.extract(model, {"input_ids": ids}, ["transformer.h.0"])["transformer.h.0"]
    assert torch.equal(extracted[0], trace["transformer.h.0"].out[0])
    assert trace.kwargs.keys() == {"input_ids"} and trace.args == ()
    # model kwargs passed directly still work, and land where the dict's would
    direct = tl.trace(model, input_ids=ids)
    assert torch.equal(direct.output.logits, out.logits)


def test_a_tuple_is_positional_inputs_and_kwargs_join_a_dict():
    torch.manual_seed(0)
    model = TwoInputs().eval()
    a, b = torch.randn(2, 4), torch.randn(2, 4)
    want = model(a, b, scale=3.0).detach()
    assert torch.equal(tl.trace(model, (a, b), scale=3.0).output, want)
    assert torch.equal(tl.trace(model, a, b, scale=3.0).output, want)
    assert torch.equal(tl.trace(model, {"a": a, "b": b, "scale": 3.0}).output, want)
    assert torch.equal(tl.trace(model, {"a": a, "b": b}, scale=3.0).output, want)
    # the same convention re-runs a trace on new inputs
    trace = tl.trace(model, (a, b))
    assert torch.equal(trace.run(model, {"a": b, "b": a}).output, model(b, a).detach())
    with pytest.raises(InvalidArgumentError) as err:
        tl.trace(model, {"a": a, "b": b, "scale": 2.0}, scale=3.0)
    assert "scale" in str(err.value) and err.value.remedy


def test_a_dict_the_forward_cannot_take_says_how_to_pass_it_whole():
    torch.manual_seed(0)
    model = TakesADict().eval()
    batch = {"x": torch.randn(2, 4), "bias": torch.ones(2)}
    before = hook_state(model)
    with pytest.raises(InvalidArgumentError) as err:
        tl.trace(model, batch)
    assert "(d,)" in err.value.remedy and "bias" in str(err.value)
    assert_model_clean(model, before)
    trace = tl.trace(model, (batch,))  # the remedy works
    assert torch.equal(trace.output, model(batch).detach())


# -- 2. trace.table of a module ---------------------------------------------------------------


def test_table_of_a_module_address_lists_its_ops(tiny_gpt2):
    model, (ids,) = tiny_gpt2.model, tiny_gpt2.args
    trace = tl.trace(model, ids)
    call = trace.calls_of("transformer.h.0")[0]
    want = [op.label for op in trace.ops[call.op_start:call.op_end]]
    assert len(want) > 10
    assert _table_labels(trace.table("transformer.h.0")) == want
    assert _table_labels(trace.table(tl.module("transformer.h.0"))) == want
    assert _table_labels(trace.table(tl.func("addmm") & tl.in_module("transformer.h.0"))) == [
        label for label in want if label.startswith("addmm_")]


def test_table_of_nothing_raises_empty_selection_with_nearest_names(tiny_gpt2):
    trace = tl.trace(tiny_gpt2.model, *tiny_gpt2.args)
    with pytest.raises(EmptySelectionError) as err:
        trace.table("transformer.h.9")
    assert err.value.candidates[0] in ("transformer.h.0", "transformer.h.1") and err.value.remedy
    with pytest.raises(EmptySelectionError):
        trace.table(tl.module("transformer.h.9"))

    class WithIdentity(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.skip = nn.Identity()
            self.fc = nn.Linear(2, 2)

        def forward(self, x):
            return self.fc(self.skip(x))

    ident = tl.trace(WithIdentity(), torch.ones(1, 2))
    with pytest.raises(EmptySelectionError) as err:
        ident.table("skip")  # ran, but no op ran inside it
    assert "no op ran" in str(err.value)


# -- 3. edits that change nothing -----------------------------------------------------------------


def test_mean_ablate_on_a_batch_of_one_warns_and_strict_raises(small_mlp):
    x = torch.randn(1, 4, generator=torch.Generator().manual_seed(3))
    with pytest.warns(tl.EditHadNoEffect, match="size 1"):
        trace = tl.trace(small_mlp, x, intervene=tl.when(tl.module("act"), tl.mean_ablate()))
    assert trace.edits[0].n_changed == 0
    assert issubclass(tl.EditHadNoEffect, UserWarning)
    before = hook_state(small_mlp)
    with pytest.raises(EditHadNoEffectError) as err:
        tl.trace(small_mlp, x, intervene=tl.when(tl.module("act"), tl.mean_ablate()), strict=True)
    assert err.value.remedy and "act" in str(err.value)
    assert_model_clean(small_mlp, before)
    # the module-hooks engine (edit + module read) reports it the same way
    with pytest.warns(tl.EditHadNoEffect):
        hooked = tl.trace(small_mlp, x, intervene=tl.when(tl.module("act"), tl.mean_ablate()), save=tl.module("act"))
    assert hooked.engine == "hooks"
    with pytest.raises(EditHadNoEffectError):
        tl.trace(small_mlp, x, intervene=tl.when(tl.module("act"), tl.mean_ablate()), save=tl.module("act"),
                 strict=True)


def test_an_edit_that_changes_something_is_silent_and_exact(small_mlp, mlp_input):
    with warnings.catch_warnings():
        warnings.simplefilter("error", tl.EditHadNoEffect)
        trace = tl.trace(small_mlp, mlp_input, intervene=tl.when(tl.module("act"), tl.mean_ablate()), strict=True)
    act = hook_reads(small_mlp, (mlp_input,))[0]["act"][0]
    mean = act.mean(0, keepdim=True).expand_as(act)
    assert torch.allclose(trace["act"].out, mean)
    assert trace.edits[0].n_changed == int((act != mean).sum())


def test_a_strict_fork_refuses_a_no_op_edit_and_loses_nothing(small_mlp, mlp_input):
    trace = tl.trace(small_mlp, mlp_input, strict=True)
    fork = trace.fork("f").do("fc1", tl.scale(2.0))
    state = (list(fork.recipe), list(fork.edits), fork.output.clone(), fork["act"].out.clone())
    with pytest.raises(EditHadNoEffectError):
        fork.do("act", tl.scale(1.0))
    assert fork.recipe == state[0] and fork.edits == state[1]
    assert torch.equal(fork.output, state[2]) and torch.equal(fork["act"].out, state[3])
    with pytest.raises(EditHadNoEffectError):  # re-executing the real forward stays strict too
        fork.do("act", tl.scale(1.0), model=small_mlp, inputs=mlp_input)
    assert fork.recipe == state[0] and torch.equal(fork.output, state[2])
    loose = tl.trace(small_mlp, mlp_input).fork("g")
    with pytest.warns(tl.EditHadNoEffect):
        loose.do("act", tl.scale(1.0))
    assert loose.edits[-1].n_changed == 0


def test_patching_an_identical_value_is_legitimate_and_silent(small_mlp, mlp_input):
    clean = tl.trace(small_mlp, mlp_input)
    assert tl.patch_from(clean).may_change_nothing and not tl.zero_ablate().may_change_nothing
    with warnings.catch_warnings():
        warnings.simplefilter("error", tl.EditHadNoEffect)
        patched = tl.trace(small_mlp, mlp_input, intervene=tl.when(tl.module("act"), tl.patch_from(clean)),
                           strict=True)
        forked = clean.fork().do("act", tl.patch_from(clean))
    assert patched.edits[0].n_changed == 0 and forked.edits[-1].n_changed == 0
    assert torch.equal(patched.output, clean.output)


# -- 4. AmbiguousSiteError names the real passes -------------------------------------------------


def test_ambiguous_site_remedy_uses_the_models_own_address(shared_twice, cnn):
    model, (x,) = shared_twice.model, shared_twice.args
    trace = tl.trace(model, x)
    with pytest.raises(AmbiguousSiteError) as err:
        trace["block"]
    assert "'block:1'" in err.value.remedy and "'block:2'" in err.value.remedy
    assert "transformer" not in err.value.remedy
    with pytest.raises(AmbiguousSiteError) as err:
        tl.extract(model, x, ["block"])
    assert "'block:1'" in err.value.remedy and err.value.passes == ["block:1", "block:2"]
    assert "transformer" not in tl.errors.AmbiguousSiteError.remedy  # not a GPT-2 example on a CNN


# -- 5. a read of an edited site shows the edit, on every path ----------------------------------


def test_capture_time_op_edit_reads_as_what_downstream_consumed():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)).eval()
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    consumed = _consumed_by(model[2], model, x, model[1], torch.zeros_like)
    trace = tl.trace(model, x, intervene=tl.when(tl.func("relu"), tl.zero_ablate()), save=tl.func("relu"))
    site = trace.find_sites(tl.func("relu")).first()
    assert torch.equal(site.out, consumed) and bool((consumed == 0).all())
    assert torch.equal(trace.edits[0].before, torch.relu(model[0](x)).detach())  # the value before the edit
    assert trace.edits[0].n_changed == int((torch.relu(model[0](x)) != 0).sum())
    full = tl.trace(model, x, intervene=tl.when(tl.func("relu"), tl.scale(3.0)))
    assert torch.allclose(full["relu_1"].out, 3 * torch.relu(model[0](x)).detach())
    assert torch.allclose(full.output, model[2](3 * torch.relu(model[0](x))).detach())
    # a fork replaying upstream of the capture-time edit re-applies it, and still reads edited
    fork = full.fork().do("linear_1", tl.scale(2.0))
    want = 3 * torch.relu(2 * model[0](x)).detach()
    assert torch.allclose(fork["relu_1"].out, want)
    assert torch.allclose(fork.output, model[2](want).detach(), atol=1e-6)


def test_module_edits_read_edited_on_both_engines_and_on_forks(small_mlp, mlp_input):
    def double(out):
        return out * 2

    consumed = _consumed_by(small_mlp.fc2, small_mlp, mlp_input, small_mlp.act, double)
    plain = hook_reads(small_mlp, (mlp_input,))[0]["act"][0]
    function_mode = tl.trace(small_mlp, mlp_input, intervene=tl.when(tl.module("act"), tl.scale(2.0)))
    hooks = tl.trace(small_mlp, mlp_input, intervene=tl.when(tl.module("act"), tl.scale(2.0)), save=tl.module("act"))
    fork = tl.trace(small_mlp, mlp_input).fork().do(tl.module("act"), tl.scale(2.0))
    assert (function_mode.engine, hooks.engine) == ("function_mode", "hooks")
    for trace in (function_mode, hooks, fork):
        assert torch.allclose(trace["act"].out, consumed), trace.engine
        assert torch.equal(trace.edits[-1].before, plain), trace.engine
    op_fork = tl.trace(small_mlp, mlp_input).fork().do("relu_1", tl.zero_ablate())
    assert bool((op_fork["relu_1"].out == 0).all())
    assert torch.equal(op_fork.edits[-1].before, plain)


# -- 6. trace.modules by address ----------------------------------------------------------------


def test_modules_are_indexed_by_address_and_pass(tiny_gpt2, shared_twice):
    model, (ids,) = tiny_gpt2.model, tiny_gpt2.args
    reads = hook_reads(model, (ids,))[0]
    trace = tl.trace(model, ids)
    site = trace.modules["transformer.h.0"]
    assert site.kind == "module" and torch.equal(site.out[0], reads["transformer.h.0"][0][0])
    assert len(trace.modules) == len(trace.calls) and trace.modules[0].label == ""
    assert [s.label for s in trace.modules][:2] == ["", "transformer"]
    assert "transformer.h.0" in trace.modules and "transformer.h.7" not in trace.modules
    with pytest.raises(SiteNotFoundError) as err:
        trace.modules["transformer.h.O"]
    assert err.value.candidates[0] == "transformer.h.0"
    with pytest.raises(SiteNotFoundError):
        trace.modules["linear_1"]  # an op label is not a module
    twice = tl.trace(shared_twice.model, *shared_twice.args)
    block = hook_reads(shared_twice.model, shared_twice.args)[0]["block"]
    assert torch.equal(twice.modules["block:2"].out, block[1])
    with pytest.raises(AmbiguousSiteError):
        twice.modules["block"]


# -- 7. keywords of the older TorchLens package ---------------------------------------------------


@pytest.mark.parametrize("keyword,ours", [
    ("layers_to_save", "save="), ("save_grads", "grad="), ("save_gradients", "grad="),
    ("random_seed", "manual_seed"), ("vis_opt", "draw"), ("keep_unsaved_layers", "save="),
    ("output_device", ".to("), ("save_function_args", "args_spec"), ("mark_distances", "parents"),
])
def test_old_torchlens_keywords_raise_with_our_spelling(keyword, ours):
    torch.manual_seed(0)
    model = Counting().eval()
    before = hook_state(model)
    with pytest.raises(LegacyArgumentError) as err:
        tl.trace(model, torch.ones(1, 4), **{keyword: "all"})
    assert ours in str(err.value) and err.value.keywords == [keyword] and err.value.remedy
    assert isinstance(err.value, InvalidArgumentError)
    assert model.calls == 0  # refused before the model ran
    assert_model_clean(model, before)


def test_an_old_keyword_the_forward_names_reaches_the_model(tiny_gpt2):
    torch.manual_seed(0)
    model = SeededNet().eval()
    x = torch.ones(1, 4)
    assert torch.equal(tl.trace(model, x, random_seed=3).output, model(x, random_seed=3).detach())
    with pytest.raises(LegacyArgumentError):  # a **kwargs forward (transformers) does not name it
        tl.trace(tiny_gpt2.model, *tiny_gpt2.args, layers_to_save="all")


# -- 8. suggestions ranked by intent --------------------------------------------------------------


def test_a_look_alike_typo_suggests_the_name_it_looks_like_first(tiny_gpt2):
    trace = tl.trace(tiny_gpt2.model, *tiny_gpt2.args)
    with pytest.raises(SiteNotFoundError) as err:
        trace["transformer.h.O"]  # the letter O
    assert err.value.candidates[0] == "transformer.h.0"
    assert isinstance(err.value, EmptySelectionError)  # a name that matches nothing is an empty selection


def test_nearest_breaks_ties_by_look_alikes_then_numbers():
    blocks = ["transformer", *(f"transformer.h.{i}" for i in range(12))]
    assert nearest("transformer.h.O", blocks) == [f"transformer.h.{i}" for i in range(5)]
    assert nearest("transformer.h.1O", blocks)[0] == "transformer.h.10"
    assert nearest("transformer.h.l", blocks)[:3] == ["transformer.h.1", "transformer.h.0", "transformer.h.2"]
    assert nearest("fcl", ["fc2", "fc1", "fc3"])[0] == "fc1"
    assert nearest("layer.I", ["layer.7", "layer.1", "layer.2"])[:2] == ["layer.1", "layer.2"]
    assert nearest("transformer.h.13", blocks)[:2] == ["transformer.h.3", "transformer.h.1"]  # 13 is nearer 3
