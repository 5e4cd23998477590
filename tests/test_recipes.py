"""Saved interventions (``.tlspec/``): round trips pinned by value, portability, fingerprints.

Every applied recipe is compared with the fork it was saved from and with a plain
``register_forward_hook`` edit of the same model (``edited_forward``), never only with
TorchLens itself. Hostile-input and fuzz tests for the shared on-disk layer live in
``test_persist.py``.
"""

from __future__ import annotations

import json
import os
import pickle

import pytest
import torch
import transformers
from conftest import assert_equal_tree, edited_forward, manifest_of, rewrite

import torchlens as tl
from torchlens.edit.helpers import Helper
from torchlens.errors import (
    FingerprintMismatchError,
    InvalidArgumentError,
    NotPortableError,
    PickleNotAllowedError,
    RecipeExistsError,
    RecipeFormatError,
    RecipeHelperError,
    UnknownHelperError,
)
from torchlens.store import _ondisk as ondisk
from torchlens.store.recipes import Recipe, StoredSource, selector_from_dict, selector_to_dict

IDS = torch.tensor([[1, 2, 3, 4, 5]])
OTHER_IDS = torch.tensor([[9, 8, 7, 6, 5]])


def double(activation, *, ctx):  # module level, so level="pickle" can store it
    return activation * 2


# -- round trips ---------------------------------------------------------------------------------


def test_replay_round_trip_matches_fork_and_plain_hook(mlp, x, tmp_path):
    trace = tl.trace(mlp, x)
    fork = trace.fork("edited").do(tl.module("act"), tl.scale(2.0))
    path = fork.save_intervention(tmp_path / "r.tlspec")
    assert sorted(os.listdir(path)) == ["manifest.json", "tensors.safetensors"]
    recipe = tl.load_intervention(path)
    assert isinstance(recipe, Recipe) and len(recipe) == 1 and recipe.level == "portable"
    applied = recipe.apply(tl.trace(mlp, x))
    want = edited_forward(mlp, "act", lambda out: out * 2.0, (x,))
    assert torch.equal(applied.output, fork.output)
    assert torch.allclose(applied.output, want, atol=1e-6)
    assert isinstance(applied, tl.Fork) and applied.recipe[0].edit == tl.scale(2.0)


def test_capture_with_loaded_recipe_matches_fork(gpt2, tmp_path):
    vector = torch.linspace(-1, 1, 32)
    trace = tl.trace(gpt2, IDS)
    fork = trace.fork().do(tl.module("transformer.h.0"), tl.add(vector))
    fork.do(tl.module("transformer.h.1.mlp"), tl.scale(0.5))
    recipe = tl.load_intervention(fork.save_intervention(tmp_path / "steer.tlspec"))
    captured = tl.trace(gpt2, IDS, intervene=recipe)
    replayed = recipe.apply(tl.trace(gpt2, IDS))

    def steer(out):
        return (out[0] + vector, *out[1:]) if isinstance(out, tuple) else out + vector

    handles = [gpt2.transformer.h[0].register_forward_hook(lambda m, i, o: steer(o)),
               gpt2.transformer.h[1].mlp.register_forward_hook(lambda m, i, o: o * 0.5)]
    try:
        with torch.no_grad():
            want = gpt2(IDS).logits
    finally:
        for h in handles:
            h.remove()
    assert torch.allclose(captured.output.logits, want, atol=1e-5)
    assert torch.allclose(replayed.output.logits, fork.output.logits, atol=0, rtol=0)
    assert torch.allclose(captured.output.logits, fork.output.logits, atol=1e-5)
    # the steering vector went through safetensors untouched
    assert torch.equal(recipe.steps[0].edit.vector, vector)


def test_tensor_number_and_op_level_edits_round_trip(mlp, x, tmp_path):
    trace = tl.trace(mlp, x)
    relu_label = trace.find_sites(tl.func("relu")).first().label
    fork = trace.fork().do(tl.module("fc1"), torch.full((6,), 0.25)).do(relu_label, 3.0)
    fork.do(tl.in_module("fc2") & tl.func("linear"), tl.zero_ablate())
    recipe = tl.load_intervention(fork.save_intervention(tmp_path / "r"))
    assert [s.site.describe() for s in recipe] == [s.site.describe() for s in fork.recipe]
    applied = recipe.apply(tl.trace(mlp, x))
    assert torch.equal(applied.output, fork.output)
    assert torch.equal(applied.output, torch.zeros(3, 3))  # fc2's linear was zeroed last
    assert torch.equal(applied[relu_label].out, torch.full((3, 6), 3.0))


def test_capture_time_steps_are_saved_before_replay_steps(mlp, x, tmp_path):
    captured = tl.trace(mlp, x, intervene=tl.when(tl.module("fc1"), tl.scale(-1.0)))
    fork = captured.fork().do(tl.module("act"), tl.scale(3.0))
    recipe = tl.load_intervention(fork.save_intervention(tmp_path / "r"))
    assert [s.phase for s in recipe] == ["capture", "replay"]
    applied = recipe.apply(tl.trace(mlp, x))
    h = torch.relu(mlp.fc1(x) * -1.0) * 3.0
    assert torch.allclose(applied.output, mlp.fc2(h), atol=1e-6)
    assert torch.allclose(tl.trace(mlp, x, intervene=recipe).output, mlp.fc2(h), atol=1e-6)


def test_patch_from_stores_only_the_source_values_it_needs(gpt2, tmp_path):
    clean = tl.trace(gpt2, IDS)
    corrupt = tl.trace(gpt2, OTHER_IDS)
    fork = corrupt.fork().do(tl.module("transformer.h.1.attn"), tl.patch_from(clean))
    path = fork.save_intervention(tmp_path / "patch.tlspec")
    m = manifest_of(path)
    source = m["steps"][0]["edit"]["params"]["source"]["source"]  # param "source", stored as a source
    assert [k for k, _ in source["values"]] == ["transformer.h.1.attn"]
    del clean  # the recipe no longer needs the source trace
    recipe = tl.load_intervention(path)
    assert isinstance(recipe.steps[0].edit.source, StoredSource)
    applied = recipe.apply(tl.trace(gpt2, OTHER_IDS))
    assert torch.equal(applied.output.logits, fork.output.logits)
    donor = {}
    h = gpt2.transformer.h[1].attn.register_forward_hook(lambda m, i, o: donor.setdefault("v", o))
    with torch.no_grad():
        gpt2(IDS)
    h.remove()
    want = edited_forward(gpt2, "transformer.h.1.attn", lambda o: (donor["v"][0], *o[1:]) if isinstance(o, tuple)
                          else donor["v"], (OTHER_IDS,))
    assert torch.allclose(applied.output.logits, want.logits, atol=1e-5)
    # re-saving a loaded recipe keeps the stored source
    again = tl.load_intervention(recipe.save(tmp_path / "again"))
    assert again.steps[0].edit == recipe.steps[0].edit


def test_mean_ablate_with_reference_and_selector_param(gpt2, tmp_path):
    ref = tl.trace(gpt2, OTHER_IDS)
    trace = tl.trace(gpt2, IDS)
    fork = trace.fork().do(tl.module("transformer.h.0.mlp"), tl.mean_ablate(dims=(0, 1), reference=ref))
    fork.do(tl.module("transformer.ln_f"), tl.patch_from(ref, site=tl.module("transformer.ln_f")))
    recipe = tl.load_intervention(fork.save_intervention(tmp_path / "r"))
    applied = recipe.apply(tl.trace(gpt2, IDS))
    assert torch.equal(applied.output.logits, fork.output.logits)
    assert recipe.steps[1].edit.site.describe() == "module('transformer.ln_f')"


def test_empty_and_resaved_recipes(mlp, x, tmp_path):
    trace = tl.trace(mlp, x)
    empty = tl.load_intervention(trace.fork().save_intervention(tmp_path / "empty"))
    assert len(empty) == 0 and torch.equal(empty.apply(trace).output, trace.output)
    recipe = tl.load_intervention(trace.fork().do("fc2", tl.noise(0.1, seed=3)).save_intervention(tmp_path / "a"))
    again = tl.load_intervention(recipe.save(tmp_path / "b"))
    assert again.steps[0].edit == tl.noise(0.1, seed=3)
    assert "noise" in repr(again)


# -- portability ---------------------------------------------------------------------------------


def test_portable_level_refuses_plain_functions_and_writes_nothing(mlp, x, tmp_path):
    fork = tl.trace(mlp, x).fork().do(tl.module("act"), double)
    with pytest.raises(NotPortableError) as err:
        fork.save_intervention(tmp_path / "r.tlspec")
    assert "named helper" in err.value.remedy and "level='pickle'" in err.value.remedy
    assert os.listdir(tmp_path) == []  # not even a temporary directory is left


def test_pickle_level_says_so_and_needs_consent(mlp, x, tmp_path):
    fork = tl.trace(mlp, x).fork().do(tl.module("act"), double)
    path = fork.save_intervention(tmp_path / "r.tlspec", level="pickle")
    m = manifest_of(path)
    assert m["level"] == "pickle" and m["executes_code_on_load"] is True and "pickle" in m["files"]
    with pytest.raises(PickleNotAllowedError):
        tl.load_intervention(path)
    recipe = tl.load_intervention(path, allow_pickle=True)
    applied = recipe.apply(tl.trace(mlp, x))
    assert torch.allclose(applied.output, edited_forward(mlp, "act", lambda o: o * 2, (x,)), atol=1e-6)


def test_pickle_level_refuses_lambdas(mlp, x, tmp_path):
    fork = tl.trace(mlp, x).fork().do(tl.module("act"), lambda a: a + 1)
    with pytest.raises(NotPortableError, match="pickle"):
        fork.save_intervention(tmp_path / "r", level="pickle")
    assert os.listdir(tmp_path) == []


def test_loading_a_portable_recipe_never_unpickles(mlp, x, tmp_path, monkeypatch):
    path = tl.trace(mlp, x).fork().do("act", tl.scale(2.0)).save_intervention(tmp_path / "r")
    calls = []
    monkeypatch.setattr(pickle, "loads", lambda *a, **k: calls.append(a))
    monkeypatch.setattr(pickle, "load", lambda *a, **k: calls.append(a))
    tl.load_intervention(path)
    # a hostile manifest claiming portable while carrying pickled code is refused, unread
    (path / "code.pkl").write_bytes(b"cos\nsystem\n(S'echo pwned'\ntR.")
    m = manifest_of(path)
    m["files"]["pickle"] = {"name": "code.pkl", "sha256": "0" * 64, "bytes": 24}
    m["steps"][0]["edit"] = {"kind": "pickle", "index": 0}
    rewrite(path, m)
    with pytest.raises(RecipeFormatError, match="portable"):
        tl.load_intervention(path)
    assert calls == []


def test_unregistered_helper_subclass_is_not_portable(mlp, x, tmp_path):
    class Shift(Helper):
        name = "shift_test_unregistered"

        def __init__(self, by: float = 1.0) -> None:
            self.by = by

        def params(self):
            return {"by": self.by}

        def __call__(self, activation, *, ctx):
            return activation + self.by

    fork = tl.trace(mlp, x).fork().do("act", Shift(2.0))
    with pytest.raises(NotPortableError, match="not registered"):
        fork.save_intervention(tmp_path / "r")
    tl.register_helper(Shift)
    recipe = tl.load_intervention(fork.save_intervention(tmp_path / "r"))
    assert recipe.steps[0].edit == Shift(2.0)
    assert torch.equal(recipe.apply(tl.trace(mlp, x)).output, fork.output)


def test_unknown_helper_and_bad_params_are_format_errors(mlp, x, tmp_path):
    path = tl.trace(mlp, x).fork().do("act", tl.scale(2.0)).save_intervention(tmp_path / "r")
    m = manifest_of(path)
    m["steps"][0]["edit"]["helper"] = "os.system"
    rewrite(path, m)
    with pytest.raises(RecipeHelperError) as err:
        tl.load_intervention(path)
    assert isinstance(err.value, RecipeFormatError) and isinstance(err.value, UnknownHelperError)
    m["steps"][0]["edit"]["helper"] = "scale"
    m["steps"][0]["edit"]["params"] = {"k": 2.0, "exec": "import os"}
    rewrite(path, m)
    with pytest.raises(RecipeHelperError, match="rejected"):
        tl.load_intervention(path)


# -- fingerprints --------------------------------------------------------------------------------


def test_fingerprint_mismatch_lists_differences_and_can_be_overridden(gpt2, tmp_path):
    recipe = tl.load_intervention(
        tl.trace(gpt2, IDS).fork().do(tl.module("transformer.h.0.mlp"), tl.scale(0.0)).save_intervention(
            tmp_path / "r"))
    torch.manual_seed(1)
    bigger = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=3, n_embd=32, n_head=2, vocab_size=64,
                                                                  n_positions=16)).eval()
    other = tl.trace(bigger, IDS)
    with pytest.raises(FingerprintMismatchError) as err:
        recipe.apply(other)
    assert any("not in the recipe" in m and "transformer.h.2" in m for m in err.value.mismatches)
    with pytest.raises(FingerprintMismatchError):
        recipe.as_whens(bigger)
    applied = recipe.apply(other, check_fingerprint=False)
    want = edited_forward(bigger, "transformer.h.0.mlp", lambda o: o * 0.0, (IDS,))
    assert torch.allclose(applied.output.logits, want.logits, atol=1e-5)
    lenient = tl.load_intervention(recipe.path, check_fingerprint=False)
    assert len(lenient.as_whens(bigger)) == 1


def test_capture_with_a_recipe_checks_the_fingerprint(mlp, x, tmp_path):
    recipe = tl.load_intervention(tl.trace(mlp, x).fork().do("act", tl.scale(2.0)).save_intervention(tmp_path / "r"))
    other = torch.nn.Sequential()
    other.fc1, other.act, other.fc2 = torch.nn.Linear(4, 9), torch.nn.ReLU(), torch.nn.Linear(9, 3)
    with pytest.raises(FingerprintMismatchError):
        tl.trace(other, x, intervene=recipe)


def test_fingerprint_names_class_and_shape_differences(mlp, x, tmp_path):
    recipe = tl.load_intervention(tl.trace(mlp, x).fork().do("act", tl.scale(2.0)).save_intervention(tmp_path / "r"))
    wide = torch.nn.Sequential(torch.nn.Linear(4, 6))
    with pytest.raises(FingerprintMismatchError) as err:
        recipe.check(wide)
    text = str(err.value)
    assert "model class" in text and "SmallMLP" in text and "check_fingerprint=False" in text


def test_tampered_fingerprint_hash_is_a_format_error(mlp, x, tmp_path):
    path = tl.trace(mlp, x).fork().do("act", tl.scale(2.0)).save_intervention(tmp_path / "r")
    m = manifest_of(path)
    m["fingerprint"]["params"][0][1] = [99, 99]
    rewrite(path, m)
    with pytest.raises(RecipeFormatError, match="hash"):
        tl.load_intervention(path)


# -- selectors ---------------------------------------------------------------------------------


@pytest.mark.parametrize("sel", [
    tl.module("transformer.h.0:2"), tl.in_module("encoder"), tl.func("softmax"), "linear_3",
    (tl.in_module("a") & tl.func("add")) | tl.module("b"),
])
def test_selector_json_round_trip(sel):
    sel = sel if isinstance(sel, tl.Selector) else tl.core.selectors.as_selector(sel)
    back = selector_from_dict(json.loads(json.dumps(selector_to_dict(sel))))
    assert type(back) is type(sel) and back.describe() == sel.describe()


@pytest.mark.parametrize("bad", [{}, {"module": 3}, {"eval": "x"}, {"and": [{"func": "a"}]},
                                 {"module": "a", "func": "b"}, [1], {"or": "ab"}, {"label": "x" * 2000}])
def test_malformed_selectors_are_format_errors(bad):
    with pytest.raises(RecipeFormatError):
        selector_from_dict(bad)


def test_unknown_selector_class_is_not_portable():
    class Custom(tl.Selector):
        pass

    with pytest.raises(NotPortableError):
        selector_to_dict(Custom())


# -- writing safely -----------------------------------------------------------------------------


def test_overwrite_is_refused_unless_asked(mlp, x, tmp_path):
    trace = tl.trace(mlp, x)
    path = trace.fork().do("act", tl.scale(2.0)).save_intervention(tmp_path / "r")
    with pytest.raises(RecipeExistsError):
        trace.fork().do("act", tl.scale(3.0)).save_intervention(path)
    assert tl.load_intervention(path).steps[0].edit == tl.scale(2.0)
    trace.fork().do("act", tl.scale(3.0)).save_intervention(path, overwrite=True)
    assert tl.load_intervention(path).steps[0].edit == tl.scale(3.0)
    assert sorted(os.listdir(tmp_path)) == ["r"]  # no backup or temp directory left behind


def test_overwrite_never_replaces_something_that_is_not_a_save(mlp, x, tmp_path):
    precious = tmp_path / "notes"
    precious.mkdir()
    (precious / "keep.txt").write_text("mine")
    (tmp_path / "file.txt").write_text("mine too")
    fork = tl.trace(mlp, x).fork().do("act", tl.scale(2.0))
    for target in (precious, tmp_path / "file.txt"):
        with pytest.raises(RecipeExistsError, match="not a TorchLens save"):
            fork.save_intervention(target, overwrite=True)
    assert (precious / "keep.txt").read_text() == "mine" and (tmp_path / "file.txt").read_text() == "mine too"


def test_interrupted_save_leaves_nothing_that_loads(mlp, x, tmp_path, monkeypatch):
    fork = tl.trace(mlp, x).fork().do("act", tl.scale(2.0))

    def boom(directory, manifest):
        raise KeyboardInterrupt  # e.g. Ctrl-C between the tensors and the manifest

    monkeypatch.setattr(ondisk, "_write_manifest", boom)
    with pytest.raises(KeyboardInterrupt):
        fork.save_intervention(tmp_path / "r")
    assert os.listdir(tmp_path) == []
    # a hard kill cannot clean up: the temporary directory then has no manifest and never loads
    monkeypatch.setattr(ondisk.shutil, "rmtree", lambda *a, **k: None)
    with pytest.raises(KeyboardInterrupt):
        fork.save_intervention(tmp_path / "r")
    (leftover,) = os.listdir(tmp_path)
    assert leftover.startswith(".r.") and leftover.endswith(".partial")
    with pytest.raises(RecipeFormatError, match="missing"):
        tl.load_intervention(tmp_path / leftover)
    assert not (tmp_path / "r").exists()


def test_bad_arguments(mlp, x, tmp_path):
    fork = tl.trace(mlp, x).fork().do("act", tl.scale(2.0))
    with pytest.raises(InvalidArgumentError):
        fork.save_intervention(tmp_path / "r", level="yolo")
    with pytest.raises(InvalidArgumentError):
        fork.save_intervention(3)
    with pytest.raises(InvalidArgumentError):
        tl.load_intervention(None)
    recipe = tl.load_intervention(fork.save_intervention(tmp_path / "r"))
    with pytest.raises(InvalidArgumentError):
        recipe.apply("not a trace")


def test_missing_directory_is_a_format_error(tmp_path):
    for load in (tl.load_intervention, tl.load_trace):
        with pytest.raises(RecipeFormatError, match="does not exist") as err:
            load(tmp_path / "nope")
        assert "Check the path" in err.value.remedy and "Re-save" not in err.value.remedy


def test_loading_a_saved_trace_as_a_recipe_names_the_right_loader(mlp, x, tmp_path):
    path = tl.trace(mlp, x).save(tmp_path / "t")
    with pytest.raises(RecipeFormatError, match="load_trace"):
        tl.load_intervention(path)


def test_saved_values_round_trip_exactly(mlp, x, tmp_path):
    """Every dtype a steering vector may have comes back bit for bit."""
    for dtype in (torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.bool):
        vec = (torch.arange(6) % 3).to(dtype)
        fork = tl.trace(mlp, x).fork().do("act", tl.add(vec))
        recipe = tl.load_intervention(fork.save_intervention(tmp_path / f"r_{dtype}".replace(".", "_")))
        got = recipe.steps[0].edit.vector
        assert got.dtype == dtype and torch.equal(got, vec)
        assert_equal_tree(recipe.apply(tl.trace(mlp, x)).output, fork.output)
