"""``tl.extract``: module reads through forward hooks alone; op reads through function mode.

Values are compared with what a plain forward hook sees (the same object when the site
is a module); the engine used is observed from inside the forward (is a function mode
active?) and by wrapping the engines' ``capture``.
"""

from __future__ import annotations

import pytest
import torch
from conftest import assert_equal_tree, assert_model_clean, hook_reads, hook_state
from torch.overrides import _get_current_function_mode_stack

import torchlens as tl
from torchlens.errors import AmbiguousSiteError, InvalidArgumentError, SiteNotFoundError
from torchlens.plugins import engines


@pytest.fixture
def engine_spy(monkeypatch):
    """``(engine name, what it returned)`` for every capture, and every module read served without a
    trace (the hooks engine's ``read``: a dict of outputs, or the trace when a module did not run once)."""
    captured: list = []
    for engine in engines().values():
        for method in ("capture", "read"):
            original = getattr(engine, method, None)
            if original is None:
                continue

            def spied(*args, original=original, name=engine.name, **kwargs):
                got = original(*args, **kwargs)
                captured.append((name, got))
                return got

            monkeypatch.setattr(engine, method, spied)
    return captured


def _modes_seen_in(model: torch.nn.Module, address: str) -> tuple[list[int], object]:
    """A plain hook recording how many torch function modes are active when ``address`` runs."""
    seen: list[int] = []
    handle = model.get_submodule(address).register_forward_hook(
        lambda *_: seen.append(len(_get_current_function_mode_stack())))
    return seen, handle


def test_a_list_of_modules_is_keyed_by_address_and_is_what_hooks_see(tiny_gpt2, engine_spy):
    model, (ids,) = tiny_gpt2.model, tiny_gpt2.args
    sites = ["transformer.h.0", "transformer.h.1.mlp", "transformer.h.0.attn", "lm_head"]
    seen_objects: dict[str, object] = {}
    handles = [model.get_submodule(s).register_forward_hook(
        lambda m, i, o, s=s: seen_objects.__setitem__(s, o)) for s in sites]
    modes, mode_handle = _modes_seen_in(model, "transformer.h.1")
    try:
        got = tl.extract(model, ids, sites)
    finally:
        for h in [*handles, mode_handle]:
            h.remove()
    assert list(got) == sites
    for s in sites:
        assert got[s] is seen_objects[s]  # the very object a forward hook sees
    reads, _ = hook_reads(model, (ids,))
    for s in sites:
        assert_equal_tree(got[s], reads[s][0], what=s)
    assert isinstance(got["transformer.h.0.attn"], tuple)
    assert modes == [0], "a module-only extract must not run a function mode"
    ((engine, values),) = engine_spy  # one forward, on module hooks, no trace built
    assert engine == "hooks" and set(values) == set(sites)
    assert all(values[s] is got[s] for s in sites)


@pytest.mark.parametrize("grad", [False, True])
def test_module_reads_without_a_trace_are_the_traced_reads(tiny_gpt2, engine_spy, grad):
    """Plain module addresses are read off hooks with no trace built (the hooks engine's ``read``); the
    values, keys, grad graph and what is left on the model are those of the traced read (``backend=``)."""
    model, (ids,) = tiny_gpt2.model, tiny_gpt2.args
    sites = ["transformer.h.1", "transformer.h.0.attn", "transformer.h.1", "transformer.ln_f"]
    before = hook_state(model)
    got = tl.extract(model, ids, sites, grad=grad)
    assert [name for name, _ in engine_spy] == ["hooks"] and type(engine_spy[0][1]) is dict
    traced = tl.extract(model, ids, sites, grad=grad, backend="hooks")
    assert engine_spy[1][0] == "hooks" and type(engine_spy[1][1]) is not dict  # a trace
    assert list(got) == list(traced) == list(dict.fromkeys(sites))
    for s in got:
        assert_equal_tree(got[s], traced[s], what=s)
    h1 = got["transformer.h.1"]
    assert (h1.grad_fn is not None) == grad and h1.requires_grad == grad
    assert tl.extract(model, ids, "transformer.h.1")["transformer.h.1"].equal(h1)  # one string: one site
    assert_model_clean(model, before)


def test_module_reads_fall_back_to_the_trace_for_what_it_decides(shared_twice, control_flow, engine_spy):
    """A module that ran twice (no pass named) or not at all: the read builds the trace, which refuses
    as it does for a captured trace; a module read beside it is not lost to the error."""
    model, (x,) = shared_twice.model, shared_twice.args
    with pytest.raises(AmbiguousSiteError) as err:
        tl.extract(model, x, ["out", "block"])
    assert err.value.passes == ["block:1", "block:2"]
    assert engine_spy[-1][0] == "hooks" and type(engine_spy[-1][1]) is not dict
    assert set(tl.extract(model, x, ["out", "block:2"])) == {"out", "block:2"}  # a pass: the traced path
    model, (x,) = control_flow.model, control_flow.args
    with pytest.raises(SiteNotFoundError, match="did not run"):
        tl.extract(model, {"x": x, "mode": "a"}, ["head_a", "head_b"])
    with pytest.raises(InvalidArgumentError):
        tl.extract(model, {"x": x, "mode": "a"}, "")  # a bare '' names no site (in a list: the model)


def test_a_dict_is_keyed_by_name(shared_twice):
    model, (x,) = shared_twice.model, shared_twice.args
    got = tl.extract(model, x, {"first": "block:1", "second": tl.module("block:2"), "head": "out"})
    reads, _ = hook_reads(model, (x,))
    assert list(got) == ["first", "second", "head"]
    assert torch.equal(got["first"], reads["block"][0])
    assert torch.equal(got["second"], reads["block"][1])
    assert torch.equal(got["head"], reads["out"][0])


def test_keyword_inputs_and_padding_on_minilm(minilm):
    model = minilm.model
    sites = ["encoder.layer.0", "encoder.layer.5.output", "pooler"]
    got = tl.extract(model, minilm.inputs_for_do, sites)
    reads, out = hook_reads(model, (), minilm.kwargs)
    for s in sites:
        assert torch.equal(got[s], reads[s][0]), s
    assert torch.equal(got["pooler"], out.pooler_output)
    unmasked = tl.extract(model, {"input_ids": minilm.kwargs["input_ids"]}, ["pooler"])
    assert not torch.allclose(unmasked["pooler"], got["pooler"])  # the mask reached the model


def test_op_level_sites_use_function_mode(shared_twice, engine_spy):
    model, (x,) = shared_twice.model, shared_twice.args
    modes, handle = _modes_seen_in(model, "out")
    try:
        got = tl.extract(model, x, {"tanh": tl.func("tanh"), "sum": "add_1", "inner": tl.in_module("block:2"),
                                    "block": "block:1"})
    finally:
        handle.remove()
    assert modes == [1]
    ((engine, trace),) = engine_spy
    assert engine == "function_mode" and trace.engine == "function_mode"
    reads, _ = hook_reads(model, (x,))
    assert len(got["tanh"]) == 2
    assert torch.equal(got["tanh"][0], reads["block.1"][0]) and torch.equal(got["tanh"][1], reads["block.1"][1])
    assert torch.equal(got["sum"], reads["block"][1] + reads["block"][0])
    assert [t.shape for t in got["inner"]] == [(3, 8), (3, 8)]
    assert torch.equal(got["inner"][1], reads["block"][1])
    assert torch.equal(got["block"], reads["block"][0])


def test_single_site_and_tuple_inputs(small_mlp, mlp_input):
    reads, _ = hook_reads(small_mlp, (mlp_input,))
    assert torch.equal(tl.extract(small_mlp, mlp_input, "act")["act"], reads["act"][0])
    assert torch.equal(tl.extract(small_mlp, (mlp_input,), ["fc2"])["fc2"], reads["fc2"][0])
    selector = tl.module("fc1")
    got = tl.extract(small_mlp, mlp_input, [selector])
    assert list(got) == [str(selector)] and torch.equal(got[str(selector)], reads["fc1"][0])


def test_extract_leaves_the_model_clean(cnn):
    before = hook_state(cnn.model)
    tl.extract(cnn.model, cnn.args[0], ["bn1", "fc"])
    tl.extract(cnn.model, cnn.args[0], {"add": tl.func("add")})
    assert_model_clean(cnn.model, before)


def test_extract_errors_name_what_to_do(shared_twice):
    model, (x,) = shared_twice.model, shared_twice.args
    with pytest.raises(AmbiguousSiteError) as err:
        tl.extract(model, x, ["block"])
    assert err.value.passes == ["block:1", "block:2"]
    with pytest.raises(SiteNotFoundError) as err:
        tl.extract(model, x, ["blocks"])
    assert "block" in err.value.candidates and err.value.remedy
    with pytest.raises(SiteNotFoundError) as err:
        tl.extract(model, x, ["block:3"])
    assert "there is no pass 3" in str(err.value) and err.value.remedy


def test_extract_of_a_module_that_did_not_run(control_flow):
    model, (x,) = control_flow.model, control_flow.args
    with pytest.raises(SiteNotFoundError) as err:
        tl.extract(model, {"x": x, "mode": "a"}, ["head_b"])
    assert "did not run" in str(err.value) and err.value.remedy



def test_stop_reads_the_same_values_and_never_runs_the_rest(tiny_gpt2):
    model, (ids,) = tiny_gpt2.model, tiny_gpt2.args
    before = hook_state(model)
    ran = []
    handles = [model.get_submodule(a).register_forward_hook(lambda *_, a=a: ran.append(a))
               for a in ("transformer.h.1", "transformer.ln_f", "lm_head")]
    try:
        got = tl.extract(model, ids, ["transformer.h.0.mlp", "transformer.h.1.attn"], stop=True)
    finally:
        for h in handles:
            h.remove()
    assert ran == []  # stopped inside h.1, right after its attention returned
    reads, _ = hook_reads(model, (ids,))
    assert_equal_tree(got["transformer.h.0.mlp"], reads["transformer.h.0.mlp"][0], what="mlp")
    assert_equal_tree(got["transformer.h.1.attn"], reads["transformer.h.1.attn"][0], what="attn")
    assert_model_clean(model, before)


def test_stop_refuses_op_sites_and_passes(tiny_gpt2, shared_twice):
    from torchlens.errors import InvalidArgumentError

    model, (ids,) = tiny_gpt2.model, tiny_gpt2.args
    before = hook_state(model)
    with pytest.raises(InvalidArgumentError) as err:
        tl.extract(model, ids, ["transformer.h.0", tl.func("layer_norm")], stop=True)
    assert "op site" in str(err.value) and err.value.remedy
    assert_model_clean(model, before)
    with pytest.raises(InvalidArgumentError) as err:
        tl.extract(shared_twice.model, shared_twice.args[0], ["block:2"], stop=True)
    assert "pass index" in str(err.value)


def test_sites_is_read_one_way_by_extract_and_the_dataset_runs(tiny_gpt2, tmp_path):
    """``as_sites`` is the one reading of ``sites=``: names from a dict's keys, else each site's own
    text; a bad ``sites=`` raises ``InvalidArgumentError`` with a remedy before anything runs."""
    from torchlens.core.selectors import as_sites
    from torchlens.errors import InvalidArgumentError

    model, (ids,) = tiny_gpt2.model, tiny_gpt2.args
    mlp = tl.module("transformer.h.0.mlp")
    assert as_sites(["transformer.h.0", mlp]) == [("transformer.h.0", "transformer.h.0"), (str(mlp), mlp)]
    assert as_sites({"resid": "transformer.h.0"}) == [("resid", "transformer.h.0")]
    assert as_sites(mlp) == [(str(mlp), mlp)]
    reads, _ = hook_reads(model, (ids,))
    got = tl.extract(model, ids, {"resid": "transformer.h.0"})
    assert_equal_tree(got["resid"], reads["transformer.h.0"][0])
    assert_equal_tree(tl.extract(model, ids, mlp)[str(mlp)], reads["transformer.h.0.mlp"][0])
    before = hook_state(model)
    for bad in ([], {}, "", {3: "transformer.h.0"}, {"": "transformer.h.0"}, 3, None):
        with pytest.raises(InvalidArgumentError) as err:
            tl.extract(model, ids, bad)
        assert err.value.remedy and "sites" in str(err.value)
        with pytest.raises(InvalidArgumentError):
            tl.cache_activations(model, [[1, 2, 3]], bad, out=tmp_path / "job", progress=False)
        assert not (tmp_path / "job").exists()
    assert_model_clean(model, before)
