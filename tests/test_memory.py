"""Bounded memory: ``save=`` bounds the peak (values it does not keep are freed when the forward
frees them), the graph stays whole, ``trace.nbytes`` counts what is held."""

from __future__ import annotations

import weakref

import pytest
import torch
from conftest import assert_model_clean, edited_forward, hook_reads, hook_state
from torch import nn

import torchlens as tl
from torchlens.capture._trace_store import TraceStore
from torchlens.core.records import Deferred
from torchlens.core.tree import tensor_leaves
from torchlens.errors import CaptureMemoryError, InvalidArgumentError, ValueNotSavedError


class Chain(nn.Module):
    """Each step's input is dropped by the forward; it notes which earlier values are still alive."""

    def __init__(self, n: int = 6) -> None:
        super().__init__()
        self.steps = nn.ModuleList(nn.Linear(8, 8) for _ in range(n))
        self.alive_during: list[bool] = []

    def forward(self, x):
        refs = []
        for step in self.steps:
            x = torch.relu(step(x) * 2)
            refs.append(weakref.ref(x))
        self.alive_during = [r() is not None for r in refs[:-1]]
        return x.sum(-1)


@pytest.fixture()
def chain():
    torch.manual_seed(0)
    return Chain().eval()


def test_unsaved_values_are_freed_during_the_forward(chain):
    x = torch.randn(2, 8)
    tl.trace(chain, x)
    assert all(chain.alive_during)  # an every-op trace holds every value until it is dropped
    bounded = tl.trace(chain, x, save=tl.module("steps.5"))
    assert not any(chain.alive_during)  # with save=, the forward frees them as it would unhooked
    hooked, out = hook_reads(chain, (x,))
    torch.testing.assert_close(bounded["steps.5"].out, hooked["steps.5"][0], rtol=0, atol=0)
    torch.testing.assert_close(bounded.output, out, rtol=0, atol=0)


def test_bounded_graph_equals_the_full_graph(chain):
    # Freed tensors' ids are reused by later tensors: links must still name the real producers.
    x = torch.randn(2, 8)
    full = tl.trace(chain, x)
    bounded = tl.trace(chain, x, save=tl.func("relu"))
    assert [op.label for op in bounded.ops] == [op.label for op in full.ops]
    for a, b in zip(bounded.ops, full.ops):
        assert a.parents == b.parents, a.label
        assert a.shape == b.shape and a.dtype == b.dtype
    for site in bounded.find_sites(tl.func("relu")):
        torch.testing.assert_close(site.out, full[site.label].out, rtol=0, atol=0)
    with pytest.raises(ValueNotSavedError):
        _ = bounded["linear_1"].out


def test_bounded_gpt2_module_values_and_labels(tiny_gpt2):
    model, (ids,) = tiny_gpt2.model, tiny_gpt2.args
    full = tl.trace(model, ids)
    bounded = tl.trace(model, ids, save=tl.module("transformer.h.1") | tl.func("scaled_dot_product_attention"))
    hooked, out = hook_reads(model, (ids,))
    torch.testing.assert_close(bounded["transformer.h.1"].out[0], hooked["transformer.h.1"][0][0], rtol=0, atol=0)
    torch.testing.assert_close(bounded.output.logits, out.logits, rtol=0, atol=0)
    assert [op.label for op in bounded.ops] == [op.label for op in full.ops]
    assert all(a.parents == b.parents for a, b in zip(bounded.ops, full.ops))
    kept = [op.label for op in bounded.ops if op.saved and not op.is_input]
    assert kept and len(kept) < len(full.ops) // 5
    assert bounded.nbytes < full.nbytes / 5


def test_bounded_fork_replays_from_a_kept_value(tiny_gpt2):
    # Replay downstream of a kept value needs every value below it: refused with a typed error.
    model, (ids,) = tiny_gpt2.model, tiny_gpt2.args
    bounded = tl.trace(model, ids, save=tl.module("transformer.h.0"))
    with pytest.raises(ValueNotSavedError):
        bounded.fork().do("transformer.h.0", tl.scale(2.0))


def test_nbytes_counts_each_storage_once(mlp, x):
    trace = tl.trace(mlp, x)
    values = [op.out for op in trace.ops if op.saved and isinstance(op._out, torch.Tensor)]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in values}
    calls = [c._out for c in trace.calls if isinstance(c._out, torch.Tensor)]
    storages.update({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in calls})
    assert trace.nbytes == sum(storages.values())
    assert tl.trace(mlp, x, save=tl.func("relu")).nbytes < trace.nbytes


# -- traces on disk (store=) ----------------------------------------------------------------------


class InPlaceViews(nn.Module):
    """Views of stored values, and a write through one of them after they were recorded."""

    def forward(self, x):
        h = x * 2
        v = h.view(-1)
        t = h.transpose(0, 1)
        u = t + 1
        v[:2].mul_(10)  # writes h's memory after h, v and t were recorded
        return u, h


def _assert_values_equal(got, want):
    assert [op.label for op in got.ops] == [op.label for op in want.ops]
    for a, b in zip(got.ops, want.ops):
        if b.saved:
            for x, y in zip(tensor_leaves(a.out), tensor_leaves(b.out)):
                assert x.shape == y.shape and torch.equal(x, y), a.label


def test_store_values_are_bit_equal_and_read_lazily(tiny_gpt2, tmp_path):
    model, (ids,) = tiny_gpt2.model, tiny_gpt2.args
    full = tl.trace(model, ids)
    disk = tl.trace(model, ids, store=tmp_path / "trace")
    assert any(p.suffix == ".safetensors" for p in (tmp_path / "trace").iterdir())
    assert all(isinstance(op._out, Deferred) for op in disk.ops if op.saved and not op.is_input
               and isinstance(full.ops[op.index]._out, torch.Tensor))
    assert disk.nbytes < full.nbytes / 50  # the graph, not the values
    _assert_values_equal(disk, full)
    torch.testing.assert_close(disk["transformer.h.1"].out[0], full["transformer.h.1"].out[0], rtol=0, atol=0)


def test_store_replay_validate_compare_save_and_facets(tiny_gpt2, tmp_path):
    model, (ids,) = tiny_gpt2.model, tiny_gpt2.args
    disk = tl.trace(model, ids, store=tmp_path / "trace")
    report = tl.validate(disk)
    assert report.ok and report.output_max_abs_error == 0.0, report.summary()
    fork = disk.fork().do("transformer.h.0.mlp", tl.scale(0.5))
    want = edited_forward(model, "transformer.h.0.mlp", lambda o: o * 0.5, (ids,))
    torch.testing.assert_close(fork.output.logits, want.logits)
    full = tl.trace(model, ids)
    assert tl.debug.compare(disk, full).first_divergence is None
    disk.save(tmp_path / "saved")
    _assert_values_equal(tl.load_trace(tmp_path / "saved"), full)
    sdpa = tl.func("scaled_dot_product_attention")
    torch.testing.assert_close(disk.find_sites(sdpa).first().facets.pattern.as_subclass(torch.Tensor),
                               full.find_sites(sdpa).first().facets.pattern.as_subclass(torch.Tensor), rtol=0, atol=0)


def test_store_keeps_values_from_before_a_write_through_a_view(tmp_path):
    x = torch.arange(6.0).reshape(2, 3)
    full = tl.trace(InPlaceViews(), x)
    disk = tl.trace(InPlaceViews(), x, store=tmp_path / "t")
    _assert_values_equal(disk, full)
    torch.testing.assert_close(disk["mul_1"].out, x * 2, rtol=0, atol=0)  # as it was when the op ran
    torch.testing.assert_close(disk["transpose_1"].out, (x * 2).T, rtol=0, atol=0)
    assert disk.stale_positions() == full.stale_positions()
    torch.testing.assert_close(disk.output[1], InPlaceViews()(x)[1], rtol=0, atol=0)


def test_trace_store_big_values_views_and_structures(tmp_path):
    store = TraceStore(tmp_path / "s", budget=256)
    big = torch.arange(100.0)  # 400 bytes: over the budget, written at once from its own memory
    h_big = store.put("big", big)
    h_view = store.put("view", big.view(10, 10).t())  # stored as a view of "big", not as bytes
    h_tuple = store.put("small", (torch.ones(3), None, 2))
    h_scalar = store.put("scalar", torch.tensor(5.0))
    big.mul_(2)  # after both were recorded: the store keeps what they were
    h_after = store.put("after", big.view(10, 10))  # a view made after the write: its own bytes
    store.close()
    want = torch.arange(100.0)
    assert torch.equal(h_big.load(), want)
    assert torch.equal(h_view.load(), want.view(10, 10).t())
    ones, none, two = h_tuple.load()
    assert torch.equal(ones, torch.ones(3)) and none is None and two == 2
    assert h_scalar.load().shape == () and h_scalar.load().item() == 5.0
    assert torch.equal(h_after.load(), (want * 2).view(10, 10))
    assert store.n_shards >= 2


def test_store_refuses_a_non_empty_directory(tiny_gpt2, tmp_path):
    (tmp_path / "other.txt").write_text("x")
    with pytest.raises(InvalidArgumentError, match="not an empty directory"):
        tl.trace(tiny_gpt2.model, tiny_gpt2.args[0], store=tmp_path)
    assert (tmp_path / "other.txt").read_text() == "x"
    with pytest.raises(InvalidArgumentError):
        tl.trace(tiny_gpt2.model, tiny_gpt2.args[0], store=tmp_path / "a", offload_values="cpu")


def test_store_with_save_keeps_only_the_selection(tiny_gpt2, tmp_path):
    model, (ids,) = tiny_gpt2.model, tiny_gpt2.args
    disk = tl.trace(model, ids, store=tmp_path / "t", save=tl.module("transformer.h.1"))
    hooked, _ = hook_reads(model, (ids,))
    torch.testing.assert_close(disk["transformer.h.1"].out[0], hooked["transformer.h.1"][0][0], rtol=0, atol=0)
    with pytest.raises(ValueNotSavedError):
        _ = disk["linear_1"].out


# -- offload_values= and max_bytes= ------------------------------------------------------------------


def test_offload_values_keeps_copies_read_back_on_the_op_device(tiny_gpt2):
    model, (ids,) = tiny_gpt2.model, tiny_gpt2.args
    full = tl.trace(model, ids)
    moved = tl.trace(model, ids, offload_values="cpu")
    _assert_values_equal(moved, full)
    assert tl.validate(moved).ok
    with pytest.raises(InvalidArgumentError):
        tl.trace(model, ids, offload_values="no-such-device")


class Grows(nn.Module):
    """Each op makes a new 1 MiB tensor, and the forward keeps none of them."""

    def forward(self, x):
        for _ in range(300):
            x = x + 1
        return x


def test_max_bytes_stops_the_capture_and_leaves_the_model_clean():
    model = Grows()
    x = torch.zeros(256, 1024)
    before = hook_state(model)
    with pytest.raises(CaptureMemoryError) as err:
        tl.trace(model, x, max_bytes=32 * 2**20)  # an every-op trace would hold 300 MiB
    assert "save=" in err.value.remedy and "store=" in err.value.remedy
    assert_model_clean(model, before)
    small = tl.trace(model, x, max_bytes=32 * 2**20, save="add_300")  # values freed as the forward runs
    assert len(small.ops) == 301
    torch.testing.assert_close(small["add_300"].out, x + 300, rtol=0, atol=0)
    with pytest.raises(InvalidArgumentError):
        tl.trace(model, x, max_bytes=-1)
