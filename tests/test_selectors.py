"""Selectors: what each matches on a recorded trace and during capture, and how they compose."""

from __future__ import annotations

import pytest
import torch
from conftest import hook_reads

import torchlens as tl
from torchlens.core.selectors import as_selector, split_pass
from torchlens.errors import InvalidArgumentError, SiteNotFoundError


@pytest.fixture(scope="module")
def shared_trace(shared_twice):
    return tl.trace(shared_twice.model, *shared_twice.args)


def test_split_pass():
    assert split_pass("transformer.h.0") == ("transformer.h.0", None)
    assert split_pass("block:2") == ("block", 2)
    assert split_pass("") == ("", None)
    assert split_pass("a.b:x") == ("a.b:x", None)


def test_as_selector_coerces_strings_and_lists(shared_trace):
    assert as_selector("tanh_1").match(shared_trace)[0].label == "tanh_1"
    assert [r.label for r in as_selector(["inp", "tanh_2"]).match(shared_trace)] == ["inp", "tanh_2"]
    sel = tl.func("linear")
    assert as_selector(sel) is sel
    for bad in (3, [], None, {"a": 1}):
        with pytest.raises(InvalidArgumentError):
            as_selector(bad)


def test_module_selector_matches_calls_and_reads_their_output(shared_twice, shared_trace):
    reads, _ = hook_reads(shared_twice.model, shared_twice.args)
    calls = tl.module("block").match(shared_trace)
    assert [c.key for c in calls] == ["block:1", "block:2"]
    assert tl.module("block").module_paths() == ["block"]
    (root,) = tl.module("").match(shared_trace)
    assert root.address == "" and torch.equal(shared_trace.find_sites(tl.module("")).first().out, reads[""][0])
    with pytest.raises(SiteNotFoundError):
        tl.module("block:0").match(shared_trace)


def test_in_module_matches_every_op_inside_including_submodules(shared_trace):
    assert [op.label for op in tl.in_module("block:1").match(shared_trace)] == ["linear_2", "tanh_1"]
    everything = tl.in_module("").match(shared_trace)
    assert [op.label for op in everything] == [op.label for op in shared_trace.ops if not op.is_input]
    assert tl.in_module("block").module_paths() is None


def test_func_matches_by_name_and_dunder_names(shared_trace):
    assert tl.func("add").match(shared_trace)[0].label == "add_1"
    assert tl.func("__add__").name == "add"
    assert [op.label for op in tl.func("tanh").match(shared_trace)] == ["tanh_1", "tanh_2"]


def test_composition_keeps_execution_order_and_drops_duplicates(shared_trace):
    both = tl.func("tanh") | tl.func("tanh")
    assert [r.label for r in both.match(shared_trace)] == ["tanh_1", "tanh_2"]
    left = "inp" | tl.func("tanh")  # a plain string on the left composes too
    assert [r.label for r in left.match(shared_trace)] == ["inp", "tanh_1", "tanh_2"]
    narrowed = tl.in_module("block") & "tanh_2"
    assert [r.label for r in narrowed.match(shared_trace)] == ["tanh_2"]
    nested = (tl.func("linear") & tl.in_module("block")) | (tl.func("tanh") & tl.in_module("block:2"))
    assert [r.label for r in nested.match(shared_trace)] == ["linear_2", "linear_3", "tanh_2"]
    assert (tl.module("inp") | tl.module("out")).module_paths() == ["inp", "out"]
    assert (tl.module("inp") | tl.func("tanh")).module_paths() is None


def test_matches_op_is_what_capture_time_edits_use(shared_trace):
    ops = {op.label: op for op in shared_trace.ops}
    assert tl.func("tanh").matches_op(ops["tanh_1"]) and not tl.func("tanh").matches_op(ops["linear_2"])
    assert tl.in_module("block:2").matches_op(ops["tanh_2"])
    assert (tl.func("tanh") & tl.in_module("block:1")).matches_op(ops["tanh_1"])
    assert (tl.func("add") | "tanh_2").matches_op(ops["tanh_2"])
    assert not tl.module("block").matches_op(ops["tanh_1"])  # module outputs are served by hooks


def test_describe_is_readable():
    assert tl.module("a.b").describe() == "module('a.b')"
    assert tl.in_module("a").describe() == "in_module('a')"
    assert str(tl.func("softmax")) == "func('softmax')"
    assert (tl.func("x") & "lbl").describe() == "(func('x') & 'lbl')"
    assert (tl.module("m") | tl.func("f")).describe() == "(module('m') | func('f'))"


def test_in_module_with_a_pass_matches_only_that_pass_during_capture(shared_trace):
    ops = {op.label: op for op in shared_trace.ops}
    assert not tl.in_module("block:2").matches_op(ops["tanh_1"])


def test_capture_time_edit_inside_one_pass_agrees_with_find_sites(shared_twice, shared_trace):
    site = tl.in_module("block:2") & tl.func("tanh")
    assert shared_trace.find_sites(site).labels == ["tanh_2"]
    edited = tl.trace(shared_twice.model, *shared_twice.args, intervene=tl.when(site, tl.scale(0.0)))
    assert [e.label for e in edited.edits] == ["tanh_2"]


def test_asking_for_softmax_on_a_fused_attention_model_names_the_fused_kernel():
    import transformers

    from torchlens.errors import FusedKernelError

    cfg = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=8)
    cfg._attn_implementation = "sdpa"
    model = transformers.GPT2LMHeadModel(cfg).eval()
    trace = tl.trace(model, torch.tensor([[1, 2, 3]]))
    with pytest.raises(FusedKernelError) as info:
        trace.find_sites(tl.func("softmax"))
    assert "eager" in info.value.remedy
    assert trace.find_sites(tl.func("scaled_dot_product_attention")).first().out.shape == (1, 2, 3, 8)


def test_a_union_fails_only_when_both_sides_match_nothing(shared_trace):
    labels = shared_trace.find_sites(tl.func("tanh") | tl.func("no_such_function")).labels
    assert labels == [s.label for s in shared_trace.find_sites(tl.func("tanh"))]
    with pytest.raises(tl.SiteNotFoundError):
        shared_trace.find_sites(tl.func("nope") | tl.func("no_such_function"))


class _Names:
    """A hand-written model namespace (``core.selectors.Names``): ``a.b`` is a module, ``blocks.0.mlp`` is a
    canonical name for it, ``blocks.0.resid_mid`` one for an op, ``blocks.0.features`` a sub-site."""

    def canonical(self, path: str):
        return {"blocks.0.mlp": tl.module("a.b"), "blocks.0.resid_mid": tl.func("add")}.get(path)

    def sub_site(self, label: str):
        return "a.b.features" if label == "blocks.0.features" else None

    def is_module(self, path: str) -> bool:
        return split_pass(path)[0] in ("a", "a.b")

    def not_found(self, label: str) -> SiteNotFoundError:
        return SiteNotFoundError(f"{label!r} names nothing here", site=label)


def test_each_selector_binds_itself_and_combinators_bind_their_parts():
    """``Selector.bind(names)``: canonical module names keep their name and match what they stand for,
    sub-sites become the capture's label, plain module strings become module selectors only with
    ``strings_as_modules``, op labels stay labels, and ``&`` / ``|`` bind both sides."""
    names = _Names()
    mlp = tl.module("blocks.0.mlp").bind(names, strings_as_modules=False)
    assert mlp.describe() == tl.module("blocks.0.mlp").describe() and mlp.module_paths() == ["a.b"]
    inside = tl.in_module("blocks.0.mlp").bind(names, strings_as_modules=False)
    assert inside.module_paths() is None and (inside._address, inside._pass) == ("a.b", None)
    assert as_selector("blocks.0.features").bind(names, strings_as_modules=True).label == "a.b.features"
    assert as_selector("a.b:2").bind(names, strings_as_modules=True).module_paths() == ["a.b:2"]
    label = as_selector("a.b")
    assert label.bind(names, strings_as_modules=False) is label
    assert as_selector("linear_3").bind(names, strings_as_modules=True).label == "linear_3"
    func = tl.func("relu")
    assert func.bind(names, strings_as_modules=True) is func
    both = (tl.module("blocks.0.mlp") | tl.module("a")).bind(names, strings_as_modules=False)
    assert both.module_paths() == ["a.b", "a"]
    narrowed = (tl.module("blocks.0.resid_mid") & tl.in_module("blocks.0.mlp")).bind(names, strings_as_modules=False)
    assert narrowed.a.module_paths() is None and narrowed.b._address == "a.b"


def test_binding_a_string_that_names_nothing_raises_the_names_error():
    with pytest.raises(SiteNotFoundError, match="names nothing here"):
        as_selector("nowhere").bind(_Names(), strings_as_modules=True)
    assert as_selector("nowhere").bind(_Names(), strings_as_modules=False).label == "nowhere"
    with pytest.raises(SiteNotFoundError, match="needs a module") as err:
        tl.in_module("blocks.0.resid_mid").bind(_Names(), strings_as_modules=False)
    assert "tl.module" in err.value.remedy


def test_binding_on_a_real_model_matches_the_module_it_names(shared_twice):
    """Through arch's names of a real model, a bound module selector reads what a forward hook reads."""
    trace = tl.trace(shared_twice.model, *shared_twice.args)
    address = next(n for n, _ in shared_twice.model.named_modules() if n)
    bound = trace.bind(address, strings_as_modules=True)
    assert bound.module_paths() == [address]
    got = [trace.read(r) for r in bound.match(trace)]
    want = hook_reads(shared_twice.model, shared_twice.args)[0][address]
    assert len(got) == len(want) and all(torch.equal(g, w) for g, w in zip(got, want))
