"""Layout inference: canonical sites on families with no adapter of their own (the generic adapter).

Every family here is built from its transformers config class with random weights. Each
canonical site must equal a plain ``register_forward_hook`` read of the module it names, and
the structure it claims must hold on the recorded forward (``resid_post[L] == resid_pre[L+1]``,
``resid_mid == resid_pre + attn`` for pre-norm blocks); where it does not (parallel blocks,
post-norm BERT-style blocks, tied candidates) reading the site raises ``LayoutInferenceError``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import pytest
import torch
from conftest import _seeded, assert_model_clean, hook_state
from torch import nn

import torchlens as tl
from torchlens.arch import check_layout
from torchlens.errors import LayoutInferenceError

IDS = torch.tensor([[3, 17, 42, 9, 100, 5]])


@dataclass(frozen=True)
class Family:
    config: str
    model: str
    kwargs: dict
    blocks: str
    attn: str  # relative to a block
    mlp: str
    mid: str  # "checked": resid_mid offered and equal to resid_pre + attn; else the refusal's words
    addend: str = ""  # the module whose output resid_mid adds to resid_pre, when not attn (a sandwich norm)


LLAMA_LIKE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, vocab_size=128, max_position_embeddings=64, pad_token_id=0)
FAMILIES = {
    # fc1/fc2 MLPs directly in the block
    "opt": Family("OPTConfig", "OPTForCausalLM", dict(hidden_size=32, ffn_dim=64, word_embed_proj_dim=32,
                  num_hidden_layers=2, num_attention_heads=2, vocab_size=128, max_position_embeddings=64),
                  "model.decoder.layers", "self_attn", "fc2", "checked"),
    # fc1/fc2 and an encoder_attn (cross-attention) that must not tie with self_attn; post-norm blocks,
    # whose first add is resid_pre + attn but whose stream is the normalised sum: resid_mid refused
    "bart": Family("BartConfig", "BartForCausalLM", dict(d_model=32, decoder_layers=2, decoder_attention_heads=2,
                   decoder_ffn_dim=64, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64,
                   vocab_size=128, max_position_embeddings=64), "model.decoder.layers", "self_attn", "fc2",
                   "a post-norm block"),
    "biogpt": Family("BioGptConfig", "BioGptForCausalLM", dict(LLAMA_LIKE), "biogpt.layers", "self_attn", "fc2",
                     "checked"),
    "xglm": Family("XGLMConfig", "XGLMForCausalLM", dict(d_model=32, num_layers=2, attention_heads=2, ffn_dim=64,
                   vocab_size=128, max_position_embeddings=64), "model.layers", "self_attn", "fc2", "checked"),
    # Llama-style: post_attention_layernorm matches 'attention' and must be excluded as a norm
    "phi3": Family("Phi3Config", "Phi3ForCausalLM", dict(LLAMA_LIKE), "model.layers", "self_attn", "mlp", "checked"),
    "qwen3": Family("Qwen3Config", "Qwen3ForCausalLM", dict(LLAMA_LIKE, head_dim=16), "model.layers", "self_attn",
                    "mlp", "checked"),
    "olmo": Family("OlmoConfig", "OlmoForCausalLM", dict(LLAMA_LIKE), "model.layers", "self_attn", "mlp", "checked"),
    "gpt_bigcode": Family("GPTBigCodeConfig", "GPTBigCodeForCausalLM", dict(n_embd=32, n_layer=2, n_head=2,
                          vocab_size=128, n_positions=64), "transformer.h", "attn", "mlp", "checked"),
    # sandwich norms: resid_mid = resid_pre + post_attention_layernorm(attn); Gemma-2's pre_/post_feedforward
    # norms match the MLP pattern and must be set aside
    "olmo2": Family("Olmo2Config", "Olmo2ForCausalLM", dict(LLAMA_LIKE), "model.layers", "self_attn", "mlp",
                    "checked", "post_attention_layernorm"),
    "gemma2": Family("Gemma2Config", "Gemma2ForCausalLM", dict(LLAMA_LIKE, head_dim=16), "model.layers",
                     "self_attn", "mlp", "checked", "post_attention_layernorm"),
    # per-layer sizes (a heterogeneous config: reading head_dim raises in transformers); the block adds its
    # per-layer input and scales after the MLP, so resid_post is not resid_mid + mlp: resid_mid refused
    "gemma4_text": Family("Gemma4TextConfig", "Gemma4ForCausalLM", dict(LLAMA_LIKE, head_dim=16), "model.layers",
                          "self_attn", "mlp", r"resid_post != add_\d+ \+ mlp_out"),
    # parallel blocks (the MLP reads the block input, not resid_mid): the check fails, the site is refused
    "codegen": Family("CodeGenConfig", "CodeGenForCausalLM", dict(n_embd=32, n_layer=2, n_head=2, vocab_size=128,
                      rotary_dim=8, n_positions=64), "transformer.h", "attn", "mlp", "a parallel block"),
    "cohere": Family("CohereConfig", "CohereForCausalLM", dict(LLAMA_LIKE), "model.layers", "self_attn", "mlp",
                     "a parallel block"),
    # BERT-style encoder with no adapter of its own
    "roberta": Family("RobertaConfig", "RobertaModel", dict(hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=2, vocab_size=128, max_position_embeddings=64),
                      "encoder.layer", "attention.self", "output.dense", "post-norm BERT-style"),
}


@cache
def family(key: str):
    """(family, model, hook reads {address: output}, block inputs {address: tensor}, trace), built once."""
    import transformers

    fam = FAMILIES[key]
    config = getattr(transformers, fam.config)(**fam.kwargs)
    config._attn_implementation = "eager"
    model = _seeded(lambda: getattr(transformers, fam.model)(config))
    outs: dict[str, torch.Tensor] = {}
    ins: dict[str, torch.Tensor] = {}
    handles = []
    def keep_out(name):
        def hook(module, args, out):
            out = out[0] if isinstance(out, tuple) else out
            if isinstance(out, torch.Tensor):
                outs.setdefault(name, out.clone())
        return hook

    def keep_in(name):
        def hook(module, args, kwargs):
            ins.setdefault(name, (args[0] if args else kwargs["hidden_states"]).clone())
        return hook

    for name, module in model.named_modules():
        handles.append(module.register_forward_hook(keep_out(name)))
    for i, block in enumerate(model.get_submodule(fam.blocks)):
        handles.append(block.register_forward_pre_hook(keep_in(f"{fam.blocks}.{i}"), with_kwargs=True))
    try:
        with torch.no_grad():
            model(IDS)
    finally:
        for h in handles:
            h.remove()
    return fam, model, outs, ins, tl.trace(model, IDS)


def _read(trace, name: str) -> torch.Tensor:
    out = trace.find_sites(tl.module(name)).first().out
    return out[0] if isinstance(out, tuple) else out


@pytest.mark.parametrize("key", list(FAMILIES))
def test_inferred_sites_equal_hook_reads(key):
    fam, model, outs, ins, trace = family(key)
    view = tl.arch(model)
    assert view.adapter == "generic" and view.n_layers == 2
    for i in range(2):
        block = f"{fam.blocks}.{i}"
        assert view.resolve(f"blocks.{i}.attn") == f"{block}.{fam.attn}"
        assert view.resolve(f"blocks.{i}.mlp") == f"{block}.{fam.mlp}"
        assert torch.equal(_read(trace, f"blocks.{i}.attn"), outs[f"{block}.{fam.attn}"])
        assert torch.equal(_read(trace, f"blocks.{i}.mlp"), outs[f"{block}.{fam.mlp}"])
        assert torch.equal(_read(trace, f"blocks.{i}.resid_pre"), ins[block])
        assert torch.equal(_read(trace, f"blocks.{i}.resid_post"), outs[block])


@pytest.mark.parametrize("key", list(FAMILIES))
def test_structure_is_checked_not_assumed(key):
    fam, model, outs, ins, trace = family(key)
    view = tl.arch(model)
    rows = {what: (holds, detail) for what, holds, detail in check_layout(trace, view)}
    assert rows["blocks.0.resid_post == blocks.1.resid_pre"] == (True, "")
    for i in range(2):
        block = f"{fam.blocks}.{i}"
        row = f"blocks.{i}.resid_mid == blocks.{i}.resid_pre + blocks.{i}.attn (checked on read)"
        if fam.mid == "checked":  # hand-computed from hook reads: the block input plus what attention adds
            addend = outs[f"{block}.{fam.addend or fam.attn}"]
            assert torch.equal(_read(trace, f"blocks.{i}.resid_mid"), ins[block] + addend)
            assert rows[row] == (True, "")
        else:
            with pytest.raises(LayoutInferenceError, match=fam.mid) as info:
                _read(trace, f"blocks.{i}.resid_mid")
            assert "Layout(" in info.value.remedy
            assert not rows.get(row, (False,))[0]


def test_checked_resid_mid_edits_after_and_during_capture():
    """Zeroing the checked resid_mid (OPT) makes the block's output its MLP branch on a zero input, as a
    plain hook that cancels the block input with the attention output computes it."""
    fam, model, _, _, trace = family("opt")
    block = model.model.decoder.layers[1]
    seen: list[torch.Tensor] = []
    handles = [block.register_forward_pre_hook(lambda m, a, kw: seen.append(a[0]), with_kwargs=True),
               block.self_attn.register_forward_hook(lambda m, a, o: (-seen[-1], *o[1:]))]
    try:
        with torch.no_grad():
            want = model(IDS).logits
    finally:
        for h in handles:
            h.remove()
    forked = trace.fork("mid").do(tl.module("blocks.1.resid_mid"), tl.zero_ablate())
    assert torch.equal(forked.output.logits, want)
    assert torch.count_nonzero(forked.find_sites(tl.module("blocks.1.resid_mid")).first().out) == 0
    during = tl.trace(model, IDS, intervene=tl.when(tl.module("blocks.1.resid_mid"), tl.zero_ablate()))
    assert torch.equal(during.output.logits, want)


def test_parallel_block_refuses_resid_mid_edit_during_capture_and_leaves_model_clean():
    _, model, _, _, _ = family("codegen")
    before = hook_state(model)
    with pytest.raises(LayoutInferenceError, match="structural check failed"):
        tl.trace(model, IDS, intervene=tl.when(tl.module("blocks.1.resid_mid"), tl.zero_ablate()))
    assert_model_clean(model, before)


class _Mixer(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        return self.proj(x)


class _TwoAttn(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.attn_local, self.attn_global, self.proj = _Mixer(d), _Mixer(d), nn.Linear(d, d)

    def forward(self, x):
        x = x + self.attn_local(x) + self.attn_global(x)
        return x + self.proj(x)


class _TwoAttnModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_TwoAttn(), _TwoAttn()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_tied_candidates_refuse_by_name_and_lose_nothing():
    torch.manual_seed(0)
    model = _TwoAttnModel().eval()
    x = torch.randn(1, 3, 8)
    before = hook_state(model)
    with torch.no_grad():
        want = model(x)
    view = tl.arch(model)
    with pytest.raises(LayoutInferenceError, match=r"\['attn_local', 'attn_global'\] tie") as info:
        view.selector("blocks.0.attn")
    assert "Layout(blocks=" in info.value.remedy and info.value.fields["candidates"] == ["attn_local", "attn_global"]
    with pytest.raises(LayoutInferenceError, match="no candidate was found"):
        view.selector("blocks.1.mlp")
    assert "blocks.0.attn" not in view.names() and view.names("mlp") == []
    trace = tl.trace(model, x)
    with pytest.raises(LayoutInferenceError):
        trace.find_sites(tl.module("blocks.1.attn"))
    assert torch.equal(trace.output, want)
    assert torch.equal(_read(trace, "blocks.1.resid_pre"), trace["layers.0"].out)  # the rest still serves
    assert_model_clean(model, before)


def test_describe_says_what_was_inferred_and_what_was_declared(tiny_llama):
    _, model, _, _, _ = family("opt")
    table = tl.arch(model).describe()
    assert "model.decoder.layers.0.fc2" in table and "fc1/fc2" in table
    assert "self_attn_layer_norm, final_layer_norm" in table and "generic adapter" in table
    declared = tl.arch(tiny_llama.model).describe()
    assert "declared by adapter 'llama'" in declared and "inferred" not in declared
    refused = tl.arch(_TwoAttnModel()).describe()
    assert "refused: LayoutInferenceError" in refused
