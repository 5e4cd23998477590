"""Big models, what is left of issue 14: a disk-backed trace keeps the model output on disk too,
its shards are written straight from the model's memory, the graph shares argument specs, and
an in-memory capture estimated not to fit is refused before the forward runs."""

from __future__ import annotations

import errno
import json
import weakref

import pytest
import torch
from conftest import assert_model_clean, hook_reads, hook_state
from safetensors.torch import load_file
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

import torchlens as tl
from torchlens.capture import _trace_store
from torchlens.capture._estimate import estimate_capture, kept_bytes
from torchlens.capture._trace_store import TraceStore
from torchlens.core.graph import _flatten_args
from torchlens.core.tree import flatten
from torchlens.errors import CaptureMemoryError, InvalidArgumentError, TraceStoreWriteError
from torchlens.store import _ondisk
from torchlens.store._value_codec import LazyTensor

# -- the model output of a disk-backed trace -------------------------------------------------------


class Head(nn.Module):
    """Remembers (weakly) the tensor its forward returned, to see who still holds it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 16)
        self.returned = None

    def forward(self, x):
        out = torch.relu(self.lin(x)) * 3
        self.returned = weakref.ref(out)
        return {"logits": out, "hidden": x + 1}


@pytest.fixture()
def head():
    torch.manual_seed(0)
    return Head().eval()


def test_store_keeps_the_model_output_on_disk(head, tmp_path):
    x = torch.randn(4, 8)
    full = tl.trace(head, x)
    want = head(x)
    disk = tl.trace(head, x, store=tmp_path / "t")
    assert head.returned() is None  # the trace does not hold what the forward returned
    got = disk.output
    assert torch.equal(got["logits"], want["logits"]) and torch.equal(got["hidden"], want["hidden"])
    assert torch.equal(got["logits"], full.output["logits"])
    assert torch.equal(disk.raw_output["logits"], want["logits"])
    assert torch.equal(disk[disk.output_layers[0]].out, full[full.output_layers[0]].out)
    in_memory = tl.trace(head, x)
    assert head.returned() is not None  # an in-memory trace keeps it (the contrast)
    del in_memory


def test_store_output_of_gpt2_is_bit_equal_saved_and_forked(tiny_gpt2, tmp_path):
    model, (ids,) = tiny_gpt2.model, tiny_gpt2.args
    full = tl.trace(model, ids)
    _, out = hook_reads(model, (ids,))
    disk = tl.trace(model, ids, store=tmp_path / "t")
    assert torch.equal(disk.output.logits, out.logits)
    assert torch.equal(disk["lm_head"].out, full["lm_head"].out)
    disk.save(tmp_path / "saved")
    assert torch.equal(tl.load_trace(tmp_path / "saved").output.logits, out.logits)
    fork = disk.fork().do("transformer.ln_f", tl.zero_ablate())
    bias = model.lm_head.bias
    want = torch.zeros_like(out.logits) + (0 if bias is None else bias)
    assert torch.equal(fork.output.logits, want)
    assert torch.equal(disk.output.logits, out.logits)  # the base trace is unchanged by the fork


def test_saving_a_stored_trace_reads_each_value_back_as_it_writes_it(tiny_gpt2, tmp_path, monkeypatch):
    """``trace.save`` of a trace on disk holds no value: each is listed, then read back (from its shard
    or its recompute recipe) when its bytes are written, one at a time. The saved trace loads back
    with every value bit for bit the in-memory trace's, and replays as it does."""
    model, (ids,) = tiny_gpt2.model, tiny_gpt2.args
    full = tl.trace(model, ids)
    disk = tl.trace(model, ids, store=tmp_path / "t")
    index = json.loads((tmp_path / "t" / _trace_store.INDEX).read_text())
    assert index["recomputed"]  # some values come back by recompute, not from a shard
    listed, live = {}, []
    real_get, real_write = TraceStore.get, _ondisk.write_safetensors

    def get(store, name):
        t = real_get(store, name)
        live.append(weakref.ref(t))
        return t

    def write(f, tensors):
        listed.update(tensors)
        # when the file is written, no value read back while listing is still alive
        assert sum(r() is not None for r in live) == 0
        return real_write(f, tensors)

    monkeypatch.setattr(TraceStore, "get", get)
    monkeypatch.setattr(_ondisk, "write_safetensors", write)
    disk.save(tmp_path / "saved")
    lazy = [name for name, t in listed.items() if isinstance(t, LazyTensor)]
    views = json.loads((tmp_path / "saved" / "manifest.json").read_text()).get("views", {})
    assert views  # what the store keeps as views of stored values is saved as views of them
    assert len(lazy) + len(views) >= len([op for op in full.ops if op.saved]) - len(full.input_layers)
    kept = {name for name, t in listed.items() if isinstance(t, torch.Tensor) and name.startswith("op/")}
    assert kept == {f"op/{label}" for label in full.input_layers}  # the inputs are held in memory anyway
    monkeypatch.undo()
    loaded = tl.load_trace(tmp_path / "saved")
    for op in full.ops:
        assert torch.equal(loaded[op.label].out, op.out) if isinstance(op.out, torch.Tensor) else True, op.label
    assert torch.equal(loaded.output.logits, full.output.logits)
    edit = tl.zero_ablate()
    assert torch.equal(loaded.fork().do("transformer.h.0.mlp", edit).output.logits,
                       full.fork().do("transformer.h.0.mlp", edit).output.logits)


# -- the shard writer -------------------------------------------------------------------------------


def test_store_shards_are_safetensors_written_from_the_tensor_itself(tmp_path):
    store = TraceStore(tmp_path / "s", budget=1000)
    values = {f"v{i}": torch.arange(i * 10, i * 10 + 7 + i, dtype=torch.float32) for i in range(20)}
    values["mask"] = torch.tensor([True, False, True])  # 3 bytes: the next value must still be aligned
    values["half"] = torch.arange(5, dtype=torch.bfloat16)
    handles = {name: store.put(name, t) for name, t in values.items()}
    # Read back while the shard is still open (an edit or a hook reads during the forward).
    assert torch.equal(handles["v19"].load(), values["v19"])
    store.close()
    shards = sorted((tmp_path / "s").glob("*.safetensors"))
    assert len(shards) == store.n_shards >= 2
    on_disk = {}
    for shard in shards:  # the safetensors library itself reads every shard
        on_disk.update({k: v for k, v in load_file(shard).items() if not k.startswith("__pad__")})
    assert on_disk.keys() == values.keys()
    for name, t in values.items():
        assert torch.equal(on_disk[name], t) and torch.equal(handles[name].load(), t), name
        assert handles[name].load().dtype == t.dtype


def test_store_keeps_a_dtype_safetensors_cannot_hold_in_memory(tmp_path):
    store = TraceStore(tmp_path / "s")
    wide = torch.arange(4.0, dtype=torch.float64) * (1 + 2j)  # complex128: safetensors has no such dtype
    handle = store.put("pair", (wide, torch.ones(2)))
    wide.mul_(0)  # the model changes it later: the store kept its own copy
    store.close()
    got_wide, got_ones = handle.load()
    assert got_wide.dtype == torch.complex128
    assert torch.equal(got_wide, torch.arange(4.0, dtype=torch.float64) * (1 + 2j))
    assert torch.equal(got_ones, torch.ones(2))


class _FullDisk:
    """A file whose writes fail the way a full disk does."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def seek(self, pos: int) -> int:
        return pos

    def write(self, data) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    def close(self) -> None:
        pass


def test_store_on_a_full_disk_raises_a_typed_error_and_leaves_the_model(tiny_gpt2, tmp_path, monkeypatch):
    model, (ids,) = tiny_gpt2.model, tiny_gpt2.args
    before = hook_state(model)
    params = {k: v.clone() for k, v in model.state_dict().items()}
    monkeypatch.setattr(_trace_store, "open", _FullDisk, raising=False)
    with pytest.raises(TraceStoreWriteError) as err:
        tl.trace(model, ids, store=tmp_path / "t")
    assert "store=" in err.value.remedy and "No space left" in str(err.value)
    assert_model_clean(model, before)
    assert all(torch.equal(v, params[k]) for k, v in model.state_dict().items())
    monkeypatch.undo()
    _, out = hook_reads(model, (ids,))
    assert torch.equal(tl.trace(model, ids, store=tmp_path / "again").output.logits, out.logits)


# -- the graph's bytes ------------------------------------------------------------------------------


def test_flat_argument_specs_are_shared_and_equal_to_pytree():
    t = torch.ones(2)
    cases = [((t, 1), {}), ((t, (1, 2)), {"dim": [0, 1]}), ((t, torch.Size([2, 3]), slice(1, 2), ...), {}),
             ((t, ()), {"a": None}), ((t, [t, t]), {}), ((t, [(1, 2)]), {}), ((t, {"k": t}), {}),
             ((torch.float32, torch.device("cpu"), torch.contiguous_format, torch.strided, 1.5, "x", True), {})]
    for args, kwargs in cases:
        got, spec = _flatten_args(args, kwargs)
        want, want_spec = flatten((args, kwargs))
        assert spec == want_spec and len(got) == len(want) and all(a is b for a, b in zip(got, want)), args
    assert _flatten_args((t, 2), {"dim": 0})[1] is _flatten_args((t * 2, 5), {"dim": 1})[1]


def test_bounded_trace_ops_share_specs_and_replay(tiny_gpt2):
    model, (ids,) = tiny_gpt2.model, tiny_gpt2.args
    trace = tl.trace(model, ids, save=tl.module("transformer.h.1"))
    specs = [op.args_spec[1] for op in trace.ops if op.args_spec is not None]
    assert len({id(s) for s in specs}) < len(specs) / 3  # one spec per signature, not per op
    full = tl.trace(model, ids)
    assert tl.validate(full).ok
    assert [op.parents for op in trace.ops] == [op.parents for op in full.ops]


# -- the estimate before the forward ----------------------------------------------------------------


class Grows(nn.Module):
    """300 ops of 1 MiB each; notes whether each forward ran on real or fake tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1024))
        self.runs: list[bool] = []

    def forward(self, x):
        self.runs.append(isinstance(x, FakeTensor))
        if not hasattr(self, "cache"):
            self.cache = torch.ones(1024) * 2  # a tensor built on first use (on fake tensors in the estimate)
        x = x * self.scale
        for _ in range(299):
            x = x + 1
        return x


class DataDependent(nn.Module):
    """Reads tensor data in Python each step: it cannot run on fake tensors."""

    def forward(self, x):
        for _ in range(300):
            x = x + 1
            if x.sum() > 1e12:
                break
        return x


def test_estimate_equals_the_bytes_the_trace_holds(tiny_gpt2):
    model, (ids,) = tiny_gpt2.model, tiny_gpt2.args
    for save in (None, tl.module("transformer.h.1")):
        estimate = estimate_capture(model, (ids,), {},
                                    lambda a, k, save=save: tl.trace(model, *a, save=save, max_bytes=None))
        real = tl.trace(model, ids, save=save, max_bytes=None)
        assert estimate.failure is None and estimate.n_ops == len(real.ops)
        assert estimate.nbytes == kept_bytes(real) > 0


def test_too_big_capture_is_refused_before_the_forward():
    model = Grows()
    x = torch.zeros(256, 1024)
    before = hook_state(model)
    params = {k: (v, v.clone()) for k, v in model.state_dict(keep_vars=True).items()}
    with pytest.raises(CaptureMemoryError) as err:
        tl.trace(model, x, max_bytes=32 * 2**20)  # an every-op trace would hold 300 MiB
    assert model.runs == [True]  # only the pass over shapes ran: no real compute
    # 300 ops of 256 x 1024 floats, and the cache built on the way (ones, then * 2: 1024 floats each)
    assert err.value.estimated == 300 * 2**20 + 2 * 4096 and err.value.max_bytes == 32 * 2**20
    assert "save=" in err.value.remedy and "store=" in err.value.remedy
    assert_model_clean(model, before)
    assert not hasattr(model, "cache")  # what the fake pass built is gone, no fake tensor stays
    for k, v in model.state_dict(keep_vars=True).items():
        assert v is params[k][0] and not isinstance(v, FakeTensor) and torch.equal(v, params[k][1])
    small = tl.trace(model, x, max_bytes=32 * 2**20, save="add_299")  # fits: estimated, then run
    assert model.runs[-2:] == [True, False]
    torch.testing.assert_close(small["add_299"].out, x + 299, rtol=0, atol=0)


def test_estimate_against_available_memory_is_opt_in(monkeypatch):
    from torchlens import api

    monkeypatch.setattr(api, "_available_memory", lambda: 64 * 2**20)
    model = Grows()
    x = torch.zeros(256, 1024)
    with pytest.raises(CaptureMemoryError, match="estimated on fake tensors"):
        tl.trace(model, x, max_bytes="estimate")
    assert model.runs == [True]
    with pytest.raises(CaptureMemoryError, match="after .* ops"):  # "auto": checked during the forward only
        tl.trace(model, x)
    assert model.runs[1:] == [False]


def test_model_that_cannot_run_on_fake_tensors_is_stopped_during_the_forward():
    model = DataDependent()
    with pytest.raises(CaptureMemoryError, match="does not run on fake tensors") as err:
        tl.trace(model, torch.zeros(256, 1024), max_bytes=32 * 2**20)
    assert err.value.grown > 32 * 2**20 and "store=" in err.value.remedy
    estimate = estimate_capture(model, (torch.zeros(2, 2),), {}, lambda a, k: tl.trace(model, *a, max_bytes=None))
    assert estimate.nbytes is None and "DataDependent" in estimate.failure


@pytest.mark.parametrize("bad", [0, -5, True, "estimat", 1.5])
def test_bad_max_bytes_is_refused_and_the_model_left(bad):
    model = Grows()
    before = hook_state(model)
    with pytest.raises(InvalidArgumentError, match="max_bytes="):
        tl.trace(model, torch.zeros(2, 1024), max_bytes=bad)
    assert model.runs == [] and not hasattr(model, "cache")
    assert_model_clean(model, before)
