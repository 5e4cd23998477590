"""A disk-backed trace (``store=``) recomputes exactly reproducible values on read instead of
writing them: every value still reads back bit-equal to the in-memory trace, fewer bytes reach the
disk, ``store_recompute=False`` writes every value, and a recompute that is not bit-equal is written."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import assert_model_clean, hook_reads, hook_state
from safetensors import safe_open
from torch import nn

import torchlens as tl
from torchlens.capture import _trace_store
from torchlens.capture._recompute import MAX_RECOMPUTE_OPS, RECOMPUTABLE
from torchlens.core.tree import tensor_leaves
from torchlens.errors import InvalidArgumentError
from torchlens.store._fn_allowlist import function_table

INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bits: torch.equal on the integer views (NaNs and -0.0 count)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype.is_floating_point:
        return torch.equal(a.contiguous().view(INTS[a.element_size()]), b.contiguous().view(INTS[b.element_size()]))
    return torch.equal(a, b)


def refuse(constant: str) -> None:
    raise AssertionError(f"{constant} is not strict JSON")


def index_of(path) -> dict:
    return json.loads((path / "trace-store.json").read_text())


def written_bytes(path) -> int:
    """Bytes of tensor data in the store's shards (padding left out), read from the shard headers."""
    total = 0
    for shard in index_of(path)["shards"]:
        with safe_open(str(path / shard), framework="pt") as f:
            for name in f.keys():
                if not name.startswith("__pad__"):
                    t = f.get_tensor(name)
                    total += t.numel() * t.element_size()
    return total


def assert_all_values_bit_equal(disk, full) -> int:
    """Every op value of ``disk`` equals ``full``'s bit for bit; returns how many tensors were compared."""
    assert [op.label for op in disk.ops] == [op.label for op in full.ops]
    n = 0
    for a, b in zip(disk.ops, full.ops):
        got, want = tensor_leaves(a.out), tensor_leaves(b.out)
        assert len(got) == len(want), a.label
        for x, y in zip(got, want):
            assert torch.equal(x, y) and same_bits(x, y), a.label
            n += 1
    return n


@pytest.mark.parametrize("fixture", ["tiny_gpt2", "tiny_llama"])
def test_every_value_of_a_stored_trace_is_bit_equal_and_some_were_recomputed(fixture, request, tmp_path):
    case = request.getfixturevalue(fixture)
    model, args = case.model, case.args
    full = tl.trace(model, *args)
    disk = tl.trace(model, *args, store=tmp_path / "on")
    assert_all_values_bit_equal(disk, full)
    _, out = hook_reads(model, args)
    assert torch.equal(disk.output.logits, out.logits)  # and the model's own output, read by a plain forward
    recomputed = index_of(tmp_path / "on")["recomputed"]
    labels = {op.label for op in disk.ops}
    assert len(recomputed) >= 10 and set(recomputed) <= labels
    funcs = {r["fn"].rsplit(".", 1)[-1] for r in recomputed.values()}
    assert funcs <= {"add", "__add__", "__radd__", "mul", "__mul__", "__rmul__", "__rsub__", "__truediv__", "div",
                     "neg", "__neg__", "contiguous", "clone", "where", "masked_fill", "to", "sub", "__sub__"}
    # The same capture with the off switch writes every value; the difference is what was recomputed.
    off = tl.trace(model, *args, store=tmp_path / "off", store_recompute=False)
    assert_all_values_bit_equal(off, full)
    assert index_of(tmp_path / "off")["recomputed"] == {}
    saved = index_of(tmp_path / "on")["recomputed_bytes"]
    assert saved > 0
    assert written_bytes(tmp_path / "off") - written_bytes(tmp_path / "on") == saved


def test_gpt2_gelu_chain_and_residual_adds_are_recomputed_tanh_and_pow_written(tiny_gpt2, tmp_path):
    model, (ids,) = tiny_gpt2.model, tiny_gpt2.args
    disk = tl.trace(model, ids, store=tmp_path / "t")
    index = index_of(tmp_path / "t")
    by_func = {}
    for op in disk.ops:
        by_func.setdefault(op.func_name, []).append(op.label)
    assert not set(by_func["tanh"] + by_func["pow"]) & set(index["recomputed"])
    assert set(by_func["tanh"] + by_func["pow"]) <= set(index["tensors"])  # their bytes are on disk
    assert set(by_func["mul"]) <= set(index["recomputed"])  # NewGELU's four muls per block
    assert len(set(by_func["add"]) & set(index["recomputed"])) >= len(by_func["add"]) - 1
    # Conv1D's view of the GELU output is stored as a view of a recomputed value: no bytes either.
    views_of_recomputed = {name for name, (base, *_) in index["views"].items() if base in index["recomputed"]}
    assert set(by_func["view"]) & views_of_recomputed
    full = tl.trace(model, ids)
    for name in views_of_recomputed:
        assert torch.equal(disk[name].out, full[name].out)


def test_replay_and_validate_on_a_recomputing_store_agree_with_the_in_memory_trace(tiny_gpt2, tmp_path):
    model, (ids,) = tiny_gpt2.model, tiny_gpt2.args
    full = tl.trace(model, ids)
    disk = tl.trace(model, ids, store=tmp_path / "t")
    recomputed = index_of(tmp_path / "t")["recomputed"]
    report, want = tl.validate(disk), tl.validate(full)
    assert report.ok and want.ok
    assert report.n_checked == want.n_checked and report.output_max_abs_error == want.output_max_abs_error
    # An edit at a recomputed value, and one upstream of many: replay reads recomputed values.
    site = next(op.label for op in disk.ops if op.label in recomputed and op.module.startswith("transformer.h.0"))
    for where in (site, "transformer.h.0.ln_1"):
        got = disk.fork().do(where, tl.scale(0.5)).output.logits
        assert torch.equal(got, full.fork().do(where, tl.scale(0.5)).output.logits)
    # The fork replays the same graph as re-executing the edited model (a plain forward hook).
    handle = model.transformer.h[0].ln_1.register_forward_hook(lambda m, i, o: o * 0.5)
    try:
        with torch.no_grad():
            real = model(ids).logits
    finally:
        handle.remove()
    torch.testing.assert_close(disk.fork().do("transformer.h.0.ln_1", tl.scale(0.5)).output.logits, real)


class Chain(nn.Module):
    """A residual stream of adds (every value recomputable from the one before), in-place changes,
    a parameter, and signed zeros."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.w = nn.Parameter(torch.randn(6))

    def forward(self, x):
        h = self.lin(x)
        for i in range(3 * MAX_RECOMPUTE_OPS):
            h = h + (i + 1) * 0.25
        a = self.lin(x) * 2.0
        b = a + 1.0
        a.mul_(3.0)  # in place: ``a`` on disk is the value before this
        c = b * a  # reads the changed ``a``: its recipe must not name the stored one
        d = c * self.w  # a parameter: not a value of the store
        z = (x * 0.0).neg()  # -0.0 where x > 0
        masked = b.masked_fill(b > 1.0, float("-inf"))  # a scalar strict JSON has no spelling for
        return d + z.sum(), z * 1.0, masked


def recipe_cost(recipes: dict, views: dict, name: str) -> int:
    name = views[name][0] if name in views else name
    if name not in recipes:
        return 0
    tensors = [a["tensor"] for a in recipes[name]["args"] if isinstance(a, dict) and "tensor" in a]
    return 1 + sum(recipe_cost(recipes, views, t) for t in tensors)


def test_a_chain_of_adds_is_recomputed_in_bounded_links_and_in_place_changes_are_seen(tmp_path):
    torch.manual_seed(0)
    model = Chain().eval()
    x = torch.randn(4, 6)
    full = tl.trace(model, x)
    disk = tl.trace(model, x, store=tmp_path / "t")
    assert_all_values_bit_equal(disk, full)
    index = index_of(tmp_path / "t")
    recipes, views = index["recomputed"], index["views"]
    adds = [op.label for op in disk.ops if op.func_name == "add"][:3 * MAX_RECOMPUTE_OPS]
    costs = [recipe_cost(recipes, views, name) for name in adds]
    assert max(costs) == MAX_RECOMPUTE_OPS and costs.count(0) >= 2  # every so often a link is written
    assert all(recipe_cost(recipes, views, name) <= MAX_RECOMPUTE_OPS for name in recipes)
    mul_in_place = next(op for op in disk.ops if op.func_name == "mul_")
    c, d = (op.label for op in disk.ops[mul_in_place.index + 1:mul_in_place.index + 3])
    assert c in recipes and {"tensor": mul_in_place.label} in recipes[c]["args"]  # the changed a, not the old
    assert d not in recipes  # multiplies by a parameter
    masked = next(op.label for op in disk.ops if op.func_name == "masked_fill")
    assert recipes[masked]["args"][2] == {"float": "-inf"}
    json.loads((tmp_path / "t" / "trace-store.json").read_text(), parse_constant=refuse)  # strict JSON


def test_a_recompute_that_is_not_bit_equal_is_written(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = Chain().eval()
    x = torch.randn(4, 6)
    full = tl.trace(model, x)
    real = _trace_store.run_recipe
    # A recompute that loses the sign of zero (-0.0 + 0.0 is +0.0): equal by ==, not bit for bit.
    monkeypatch.setattr(_trace_store, "run_recipe", lambda f, a, k: real(f, a, k) + 0.0)
    disk = tl.trace(model, x, store=tmp_path / "t")
    monkeypatch.undo()
    index = index_of(tmp_path / "t")
    zero_ops = [op for op in full.ops if isinstance(op.out, torch.Tensor) and op.out.dtype.is_floating_point
                and bool((op.out == 0).any() and torch.signbit(op.out[op.out == 0]).any())]
    assert zero_ops, "the model makes -0.0"
    for op in zero_ops:
        assert op.label not in index["recomputed"]
    assert index["recomputed"]  # values without -0.0 still pass the check
    assert_all_values_bit_equal(disk, full)


def test_bad_store_recompute_raises_before_the_forward_and_writes_nothing(tiny_gpt2, tmp_path):
    model, (ids,) = tiny_gpt2.model, tiny_gpt2.args
    before = hook_state(model)
    for bad in ("no", 0, None):
        with pytest.raises(InvalidArgumentError) as err:
            tl.trace(model, ids, store=tmp_path / "t", store_recompute=bad)
        assert "store_recompute=False" in err.value.remedy
        assert not (tmp_path / "t").exists()
    with pytest.raises(InvalidArgumentError):
        tl.trace(model, ids, store_recompute="off")
    assert_model_clean(model, before)
    disk = tl.trace(model, ids, store=tmp_path / "t", store_recompute=True)  # the path is still free
    assert torch.equal(disk.output.logits, tl.trace(model, ids).output.logits)


def test_every_recipe_names_its_function_by_the_portable_table(tiny_llama, tmp_path):
    model, args = tiny_llama.model, tiny_llama.args
    disk = tl.trace(model, *args, store=tmp_path / "t")
    by_name = function_table()[0]
    assert RECOMPUTABLE <= set(by_name)  # a loader resolves every name a recipe can carry, without pickle
    recipes = index_of(tmp_path / "t")["recomputed"]
    assert recipes
    for label, recipe in recipes.items():
        assert by_name[recipe["fn"]] is disk[label].func  # the very function the forward called
        json.dumps(recipe, allow_nan=False)  # strict JSON
