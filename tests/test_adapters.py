"""Architecture adapters: canonical sites against plain forward hooks, per model family.

Every family runs on a small random-weight model. References come from plain
``register_forward_hook`` / ``register_forward_pre_hook`` reads on the real module paths,
written out below per family independently of the adapters, never from TorchLens.
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import transformers as tf
from conftest import assert_equal_tree, clone_tree
from torch import nn

import torchlens as tl
from torchlens.arch import ArchView
from torchlens.errors import SiteNotFoundError, UnsupportedModelError

IDS = torch.tensor([[3, 17, 42, 9, 60, 5, 33]])


@dataclass
class Family:
    """A family's real paths (what the adapter should map to), written out by hand."""

    name: str
    build: Callable[[], nn.Module]
    block: str  # "{i}" is the block index
    attn: str
    mlp: str
    embed: str
    unembed: str | None
    mid_reader: str | None  # the module whose input is resid_mid (the pre-MLP norm), if any
    mid_addend: str | None  # the module whose output is added to resid_pre to make resid_mid
    heads: Callable[[nn.Module, ArchView], None]  # checks head counts against the weights


def _seeded(fn: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        torch.manual_seed(0)
        return fn().eval()

    return build


def _gpt2_heads(model: nn.Module, view: ArchView) -> None:
    attn = model.transformer.h[0].attn
    assert (view.n_heads, view.head_dim) == (attn.num_heads, attn.head_dim)
    assert attn.c_attn.weight.shape[1] == 3 * view.n_heads * view.head_dim


def _neox_heads(model: nn.Module, view: ArchView) -> None:
    attn = model.gpt_neox.layers[0].attention
    assert view.head_dim == attn.head_size
    assert attn.query_key_value.out_features == 3 * view.n_heads * view.head_dim


def _qkv_heads(layers: Callable[[nn.Module], nn.Module]) -> Callable[[nn.Module, ArchView], None]:
    def check(model: nn.Module, view: ArchView) -> None:
        attn = layers(model)[0].self_attn
        assert attn.q_proj.out_features == view.n_heads * view.head_dim
        assert attn.k_proj.out_features == view.n_kv_heads * view.head_dim
        assert attn.head_dim == view.head_dim

    return check


def _bert_heads(model: nn.Module, view: ArchView) -> None:
    attn = model.encoder.layer[0].attention.self
    assert (view.n_heads, view.head_dim) == (attn.num_attention_heads, attn.attention_head_size)
    assert attn.query.out_features == view.n_heads * view.head_dim


SMALL = {"hidden_size": 32, "num_attention_heads": 4, "intermediate_size": 64, "vocab_size": 64,
         "max_position_embeddings": 16, "num_hidden_layers": 3}
LLAMA_HEADS = _qkv_heads(lambda m: m.model.layers)

FAMILIES = {
    "gpt2": Family(
        "gpt2", _seeded(lambda: tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=3, n_embd=32, n_head=4, vocab_size=64,
                                                                 n_positions=16))),
        "transformer.h.{i}", "attn", "mlp", "transformer.wte", "lm_head", "ln_2", "attn", _gpt2_heads),
    "gpt_neox": Family(
        "gpt_neox", _seeded(lambda: tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(**SMALL))),
        "gpt_neox.layers.{i}", "attention", "mlp", "gpt_neox.embed_in", "lm_head", None, None, _neox_heads),
    "gpt_neox_serial": Family(
        "gpt_neox", _seeded(lambda: tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(**SMALL, use_parallel_residual=False))),
        "gpt_neox.layers.{i}", "attention", "mlp", "gpt_neox.embed_in", "lm_head", "post_attention_layernorm",
        "post_attention_dropout", _neox_heads),
    "llama": Family(
        "llama", _seeded(lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**SMALL, num_key_value_heads=2))),
        "model.layers.{i}", "self_attn", "mlp", "model.embed_tokens", "lm_head", "post_attention_layernorm",
        "self_attn", LLAMA_HEADS),
    "mistral": Family(  # head_dim set apart from hidden/heads: it must come from the config
        "llama", _seeded(lambda: tf.MistralForCausalLM(tf.MistralConfig(**SMALL, num_key_value_heads=2,
                                                                        head_dim=16))),
        "model.layers.{i}", "self_attn", "mlp", "model.embed_tokens", "lm_head", "post_attention_layernorm",
        "self_attn", LLAMA_HEADS),
    "qwen2": Family(
        "llama", _seeded(lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(**SMALL, num_key_value_heads=1))),
        "model.layers.{i}", "self_attn", "mlp", "model.embed_tokens", "lm_head", "post_attention_layernorm",
        "self_attn", LLAMA_HEADS),
    "gemma3_text": Family(
        "gemma3_text", _seeded(lambda: tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**SMALL, num_key_value_heads=2,
                                                                                head_dim=16))),
        "model.layers.{i}", "self_attn", "mlp", "model.embed_tokens", "lm_head", "pre_feedforward_layernorm",
        "post_attention_layernorm", LLAMA_HEADS),
    "bert": Family(
        "bert", _seeded(lambda: tf.BertModel(tf.BertConfig(**SMALL))),
        "encoder.layer.{i}", "attention.self", "output.dense", "embeddings.word_embeddings", None,
        "intermediate", None, _bert_heads),
}


def _config_layers(config: Any) -> int:
    return getattr(config, "num_hidden_layers", None) or config.n_layer


# -- references from plain hooks -----------------------------------------------------------


def _first(value: Any) -> torch.Tensor:
    return value if isinstance(value, torch.Tensor) else value[0]


def reference(fam: Family, model: nn.Module) -> tuple[dict[str, Any], Any]:
    """Every canonical site's value, read with plain hooks on the real modules."""
    n = _config_layers(model.config)
    reads: dict[str, Any] = {}
    handles = []

    def out_hook(key: str):
        return lambda mod, args, output: reads.setdefault(key, clone_tree(output))

    def in_hook(key: str):
        def hook(mod, args, kwargs):
            reads.setdefault(key, clone_tree(args[0] if args else kwargs["hidden_states"]))

        return hook

    for i in range(n):
        block = model.get_submodule(fam.block.format(i=i))
        handles.append(block.register_forward_hook(out_hook(f"blocks.{i}.resid_post")))
        handles.append(block.register_forward_pre_hook(in_hook(f"blocks.{i}.resid_pre"), with_kwargs=True))
        handles.append(block.get_submodule(fam.attn).register_forward_hook(out_hook(f"blocks.{i}.attn")))
        handles.append(block.get_submodule(fam.mlp).register_forward_hook(out_hook(f"blocks.{i}.mlp")))
        if fam.mid_reader:
            handles.append(block.get_submodule(fam.mid_reader).register_forward_pre_hook(
                in_hook(f"blocks.{i}.resid_mid"), with_kwargs=True))
    handles.append(model.get_submodule(fam.embed).register_forward_hook(out_hook("embed")))
    if fam.unembed:
        handles.append(model.get_submodule(fam.unembed).register_forward_hook(out_hook("unembed")))
    try:
        with torch.no_grad():
            out = model(IDS)
    finally:
        for h in handles:
            h.remove()
    return reads, out


_STATE: dict[str, tuple[nn.Module, dict[str, Any], Any, Any]] = {}


def family_state(key: str) -> tuple[Family, nn.Module, dict[str, Any], Any, Any]:
    """(family, model, hook reads, plain output, tl.trace) — built once per family."""
    fam = FAMILIES[key]
    if key not in _STATE:
        model = fam.build()
        reads, out = reference(fam, model)
        _STATE[key] = (model, reads, out, tl.trace(model, IDS))
    return (fam, *_STATE[key])


# -- the view ------------------------------------------------------------------------------


@pytest.mark.parametrize("key", FAMILIES)
def test_view_sizes_match_config_and_weights(key):
    fam, model, *_ = family_state(key)
    view = tl.arch(model)
    cfg = model.config
    assert view.adapter == fam.name and view.model_type == cfg.model_type
    assert view.n_layers == _config_layers(cfg) == len(view.blocks)
    assert view.blocks == [fam.block.format(i=i) for i in range(view.n_layers)]
    n_heads = getattr(cfg, "num_attention_heads", None) or cfg.n_head
    assert view.n_heads == n_heads
    assert view.n_kv_heads == (getattr(cfg, "num_key_value_heads", None) or n_heads)
    assert view.head_dim == (getattr(cfg, "head_dim", None) or view.d_model // n_heads)
    fam.heads(model, view)


def test_config_head_dim_wins_over_hidden_by_heads():
    _, model, *_ = family_state("gemma3_text")
    view = tl.arch(model)
    assert (view.head_dim, view.d_model // view.n_heads, view.n_kv_heads) == (16, 8, 2)


@pytest.mark.parametrize("key", FAMILIES)
def test_view_resolves_to_the_real_paths(key):
    fam, model, *_ = family_state(key)
    view = tl.arch(model)
    block1 = fam.block.format(i=1)
    assert view.resolve("blocks.1.attn") == f"{block1}.{fam.attn}"
    assert view.resolve("blocks.1.mlp") == f"{block1}.{fam.mlp}"
    assert view.resolve("blocks.1.resid_post") == block1
    assert view.resolve("blocks.1.mlp:2") == f"{block1}.{fam.mlp}:2"
    assert view.resolve("embed") == fam.embed
    assert view.module("blocks.1.mlp") is model.get_submodule(f"{block1}.{fam.mlp}")
    assert view.names("resid_post") == [f"blocks.{i}.resid_post" for i in range(view.n_layers)]


# -- reads ---------------------------------------------------------------------------------


def _names(fam: Family, n: int) -> list[str]:
    kinds = ["attn", "mlp", "resid_pre", "resid_post"] + (["resid_mid"] if fam.mid_reader else [])
    names = [f"blocks.{i}.{k}" for i in range(n) for k in kinds] + ["embed"]
    return names + (["unembed"] if fam.unembed else [])


@pytest.mark.parametrize("key", FAMILIES)
def test_canonical_sites_equal_plain_hooks(key):
    fam, model, reads, _, trace = family_state(key)
    for name in _names(fam, tl.arch(model).n_layers):
        found = trace.find_sites(tl.module(name))
        assert len(found) == 1, name
        assert_equal_tree(found.first().out, reads[name], what=name)


@pytest.mark.parametrize("key", FAMILIES)
def test_canonical_and_real_paths_are_the_same_record(key):
    fam, model, reads, _, trace = family_state(key)
    for i in range(tl.arch(model).n_layers):
        block = fam.block.format(i=i)
        for kind, real in (("attn", f"{block}.{fam.attn}"), ("mlp", f"{block}.{fam.mlp}"), ("resid_post", block)):
            canon = trace[f"blocks.{i}.{kind}"]
            assert canon.record is trace[real].record
            assert canon.record is trace.find_sites(tl.module(real)).first().record


@pytest.mark.parametrize("key", FAMILIES)
def test_resid_pre_of_next_block_is_resid_post(key):
    _, model, reads, _, trace = family_state(key)
    for i in range(tl.arch(model).n_layers - 1):
        pre = trace.find_sites(tl.module(f"blocks.{i + 1}.resid_pre")).first().out
        post = trace[f"blocks.{i}.resid_post"].out
        assert torch.equal(pre, post)
        # and through the module output that serves it during capture
        assert torch.equal(trace[f"blocks.{i + 1}.resid_pre"].out, post)


@pytest.mark.parametrize("key", FAMILIES)
def test_extract_reads_canonical_sites(key):
    fam, model, reads, *_ = family_state(key)
    names = _names(fam, 2)
    got = tl.extract(model, IDS, names)
    for name in names:
        assert_equal_tree(got[name], reads[name], what=name)
    module_only = [n for n in names if "resid_mid" not in n]
    got = tl.extract(model, IDS, {n.replace(".", "_"): n for n in module_only})
    for name in module_only:
        assert_equal_tree(got[name.replace(".", "_")], reads[name], what=name)


def test_in_module_and_label_sites_take_canonical_names():
    fam, model, _, _, trace = family_state("gpt2")
    assert trace.find_sites(tl.in_module("blocks.1.attn")).labels == \
        trace.find_sites(tl.in_module("transformer.h.1.attn")).labels
    assert "blocks.1.mlp" in trace and "blocks.1.mlp:1" in trace
    with pytest.raises(SiteNotFoundError):
        trace["blocks.1.mlp:2"]


# -- edits ---------------------------------------------------------------------------------


def _plain(model: nn.Module, hooks: list[tuple[str, str, Callable]]) -> Any:
    """The output of a plain forward with (address, 'out'|'in', fn) hooks replacing values."""
    handles = []
    for address, where, fn in hooks:
        module = model.get_submodule(address)
        if where == "out":
            handles.append(module.register_forward_hook(lambda m, a, o, fn=fn: fn(o)))
        else:
            handles.append(module.register_forward_pre_hook(lambda m, a, fn=fn: (fn(a[0]), *a[1:])))
    try:
        with torch.no_grad():
            return model(IDS)
    finally:
        for h in handles:
            h.remove()


def _zero_first(output: Any) -> Any:
    if isinstance(output, torch.Tensor):
        return torch.zeros_like(output)
    return (torch.zeros_like(output[0]), *output[1:])


@pytest.mark.parametrize("key", FAMILIES)
def test_capture_time_edit_through_canonical_mlp(key):
    fam, model, *_ = family_state(key)
    want = _plain(model, [(f"{fam.block.format(i=1)}.{fam.mlp}", "out", _zero_first)])
    got = tl.trace(model, IDS, intervene=tl.when(tl.module("blocks.1.mlp"), tl.zero_ablate()))
    assert_equal_tree(got.output, want, what="canonical when")
    hooked = tl.trace(model, IDS, backend="hooks", intervene=tl.when("blocks.1.mlp", tl.zero_ablate()))
    assert_equal_tree(hooked.output, want, what="hooks engine, label site")


@pytest.mark.parametrize("key", [k for k, f in FAMILIES.items() if f.mid_reader])
def test_zeroing_resid_mid_after_and_during_capture(key):
    """Zeroing resid_mid reaches both the MLP and the residual branch: the block then
    outputs mlp(norm(0)). The plain reference makes the addend cancel the block input."""
    fam, model, _, _, trace = family_state(key)
    block = fam.block.format(i=1)
    if fam.mid_addend:
        block_in: list[torch.Tensor] = []
        want = _plain(model, [
            (block, "in", lambda x: block_in.append(x) or x),
            (f"{block}.{fam.mid_addend}", "out",
             lambda o: -block_in[-1] if isinstance(o, torch.Tensor) else (-block_in[-1], *o[1:])),
        ])
    else:  # BERT: resid_mid is a module's output
        want = _plain(model, [(f"{block}.attention.output", "out", torch.zeros_like)])
    forked = trace.fork("mid").do(tl.module("blocks.1.resid_mid"), tl.zero_ablate())
    assert_equal_tree(forked.output, want, what="fork.do")
    during = tl.trace(model, IDS, intervene=tl.when(tl.module("blocks.1.resid_mid"), tl.zero_ablate()))
    assert_equal_tree(during.output, want, what="tl.when")
    assert torch.count_nonzero(forked.find_sites(tl.module("blocks.1.resid_mid")).first().out) == 0


@pytest.mark.parametrize("key", ["gpt2", "llama", "bert"])
def test_scaling_resid_pre_after_and_during_capture(key):
    fam, model, _, _, trace = family_state(key)
    want = _plain(model, [(fam.block.format(i=2), "in", lambda x: x * 0.5)])
    forked = trace.fork().do(tl.module("blocks.2.resid_pre"), tl.scale(0.5))
    assert_equal_tree(forked.output, want, what="fork.do")
    during = tl.trace(model, IDS, intervene=tl.when(tl.module("blocks.2.resid_pre"), tl.scale(0.5)))
    assert_equal_tree(during.output, want, what="tl.when")
    extracted = tl.extract(model, IDS, ["blocks.0.resid_pre"])["blocks.0.resid_pre"]
    assert torch.equal(extracted, trace.find_sites(tl.module("blocks.0.resid_pre")).first().out)


def test_fork_edit_of_a_block_output_reaches_the_next_resid_pre():
    _, model, _, _, trace = family_state("llama")
    by_module = trace.fork().do(tl.module("blocks.0.resid_post"), tl.scale(0.5))
    by_input = trace.fork().do(tl.module("blocks.1.resid_pre"), tl.scale(0.5))
    half = trace["blocks.0.resid_post"].out * 0.5
    assert torch.equal(by_module.find_sites(tl.module("blocks.1.resid_pre")).first().out, half)
    assert torch.equal(by_input.find_sites(tl.module("blocks.1.resid_pre")).first().out, half)
    assert_equal_tree(by_module.output, by_input.output, what="same edit, two names")


def test_one_canonical_intervention_serves_two_families():
    """The When keeps the canonical name; each capture binds it to its own model."""
    step = tl.when(tl.module("blocks.1.mlp"), tl.zero_ablate())
    for key in ("gpt2", "llama"):
        fam, model, *_ = family_state(key)
        want = _plain(model, [(f"{fam.block.format(i=1)}.{fam.mlp}", "out", _zero_first)])
        assert_equal_tree(tl.trace(model, IDS, intervene=step).output, want, what=key)
    assert step.site.path == "blocks.1.mlp"


def test_views_follow_changes_to_the_block_list():
    torch.manual_seed(0)
    model = TinyTransformer().eval()
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(SiteNotFoundError, match="3 blocks"):
        tl.trace(model, ids).find_sites(tl.module("blocks.3"))
    model.layers.append(Block())
    trace = tl.trace(model, ids)
    assert trace["blocks.3"].record.address == "layers.3"


def test_resolving_canonical_names_does_not_keep_the_model_alive():
    import gc
    import weakref

    torch.manual_seed(0)
    model = TinyTransformer().eval()
    trace = tl.trace(model, torch.tensor([[1, 2]]))
    trace["blocks.0.mlp"]
    view = tl.arch(model)
    ref = weakref.ref(model)
    del model, trace
    gc.collect()
    assert ref() is None
    with pytest.raises(SiteNotFoundError, match="no model"):
        view.module("blocks.0.mlp")


# -- sites a model does not have -----------------------------------------------------------


# TransformerLens's names, by its own block code: which hold a canonical site's tensor in each family
# (the rest are refused; tests/test_tl_names.py checks GPT-2 and Llama against HookedTransformer itself).
PRE_NORM_TL = {"hook_resid_pre", "hook_resid_mid", "hook_resid_post", "hook_mlp_out", "hook_embed"}
TL_DECLARED = {"gpt2": PRE_NORM_TL, "gpt_neox": PRE_NORM_TL, "gpt_neox_serial": PRE_NORM_TL, "llama": PRE_NORM_TL,
               "mistral": PRE_NORM_TL, "qwen2": PRE_NORM_TL,
               # hook_mlp_out is after post_feedforward_layernorm; hook_embed: not checked against TransformerLens
               "gemma3_text": {"hook_resid_pre", "hook_resid_mid", "hook_resid_post"},
               # TransformerLens's BertBlock hooks resid_mid and resid_post before the LayerNorm
               "bert": {"hook_resid_pre"}}


@pytest.mark.parametrize("key", FAMILIES)
def test_transformerlens_names_resolve_only_where_they_hold_the_same_tensor(key):
    fam, model, reads, _, trace = family_state(key)
    view = tl.arch(model)
    assert set(view.transformerlens) == TL_DECLARED[key]
    for i in range(view.n_layers):
        for hook, kind in (("hook_resid_pre", "resid_pre"), ("hook_resid_mid", "resid_mid"),
                           ("hook_resid_post", "resid_post"), ("hook_mlp_out", "mlp")):
            name = f"blocks.{i}.{hook}"
            if hook in view.transformerlens and f"blocks.{i}.{kind}" in reads:
                assert_equal_tree(trace[name].out, reads[f"blocks.{i}.{kind}"], what=name)
            else:  # refused (NeoX's parallel residual: no resid_mid at all), never another tensor
                with pytest.raises(SiteNotFoundError) as err:
                    trace[name]
                assert err.value.remedy
    if "hook_embed" in view.transformerlens:
        assert_equal_tree(trace["hook_embed"].out, reads["embed"], what="hook_embed")
    else:
        with pytest.raises(SiteNotFoundError, match="TransformerLens hook name"):
            trace["hook_embed"]


def test_parallel_residual_has_no_resid_mid():
    _, model, _, _, trace = family_state("gpt_neox")
    with pytest.raises(SiteNotFoundError, match="parallel"):
        trace.find_sites(tl.module("blocks.0.resid_mid"))
    with pytest.raises(SiteNotFoundError, match="parallel"):
        tl.trace(model, IDS, intervene=tl.when(tl.module("blocks.0.resid_mid"), tl.zero_ablate()))
    assert "blocks.0.resid_mid" not in tl.arch(model).names()


def test_missing_sites_raise_named_errors():
    _, bert, _, _, trace = family_state("bert")
    with pytest.raises(SiteNotFoundError, match="LM head"):
        tl.arch(bert).selector("unembed")
    with pytest.raises(SiteNotFoundError, match="3 blocks"):
        trace.find_sites(tl.module("blocks.7.mlp"))
    with pytest.raises(SiteNotFoundError):
        trace["blocks.7.resid_post"]
    with pytest.raises(SiteNotFoundError, match="op inside a block"):
        tl.arch(family_state("gpt2")[1]).resolve("blocks.0.resid_mid")
    with pytest.raises(SiteNotFoundError):
        tl.arch(bert).names("heads")
    with pytest.raises(SiteNotFoundError, match="op"):
        tl.trace(family_state("gpt2")[1], IDS, intervene=tl.when(tl.in_module("blocks.0.resid_mid"), 0.0))


def test_hooks_engine_refuses_op_sites():
    from torchlens.errors import InvalidArgumentError

    _, model, *_ = family_state("gpt2")
    with pytest.raises(InvalidArgumentError, match="cannot serve"):
        tl.trace(model, IDS, backend="hooks", intervene=tl.when("blocks.0.resid_mid", 0.0))


# -- real weights ------------------------------------------------------------------------------


def test_minilm_real_weights(minilm):
    model = minilm.model
    view = tl.arch(model)
    assert (view.adapter, view.n_layers, view.n_heads, view.head_dim, view.d_model) == ("bert", 6, 12, 32, 384)
    reads: dict[str, Any] = {}
    handles = [
        model.encoder.layer[3].register_forward_hook(lambda m, a, o: reads.setdefault("post", o.clone())),
        model.encoder.layer[3].intermediate.register_forward_pre_hook(
            lambda m, a: reads.setdefault("mid", a[0].clone())),
    ]
    try:
        with torch.no_grad():
            model(**minilm.kwargs)
    finally:
        for h in handles:
            h.remove()
    got = tl.extract(model, minilm.kwargs, ["blocks.3.resid_post", "blocks.3.resid_mid", "blocks.4.resid_pre"])
    assert torch.equal(got["blocks.3.resid_post"], reads["post"])
    assert torch.equal(got["blocks.3.resid_mid"], reads["mid"])
    assert torch.equal(got["blocks.4.resid_pre"], reads["post"])


# -- the generic adapter -----------------------------------------------------------------------


class SelfAttention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.num_heads, self.embed_dim = heads, d
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.num_heads, d // self.num_heads).permute(2, 0, 3, 1, 4)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, d: int = 16, heads: int = 4) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d)
        self.attention = SelfAttention(d, heads)
        self.norm2 = nn.LayerNorm(d)
        self.ffn = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x):
        x = x + self.attention(self.norm1(x))
        return x + self.ffn(self.norm2(x))


class TinyTransformer(nn.Module):
    """No config, no adapter: only the generic adapter can serve it."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(32, 16)
        self.stages = nn.ModuleList([nn.Linear(16, 16), nn.Linear(16, 16)])  # a decoy list of leaf layers
        self.layers = nn.ModuleList([Block() for _ in range(3)])
        self.lm_head = nn.Linear(16, 32)

    def forward(self, ids):
        x = self.tok(ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(x)


def test_generic_adapter_finds_the_block_list():
    torch.manual_seed(0)
    model = TinyTransformer().eval()
    view = tl.arch(model)
    assert (view.adapter, view.n_layers, view.blocks[0]) == ("generic", 3, "layers.0")
    assert (view.n_heads, view.head_dim, view.d_model) == (4, 4, 16)
    assert view.resolve("blocks.1.attn") == "layers.1.attention"
    assert view.resolve("blocks.1.mlp") == "layers.1.ffn"
    assert (view.resolve("embed"), view.resolve("unembed")) == ("tok", "lm_head")
    ids = torch.tensor([[1, 2, 3, 4]])
    seen: dict[str, torch.Tensor] = {}
    handles = [model.layers[1].register_forward_hook(lambda m, a, o: seen.setdefault("post", o.clone())),
               model.layers[0].register_forward_pre_hook(lambda m, a: seen.setdefault("pre0", a[0].clone())),
               model.layers[2].ffn.register_forward_hook(lambda m, a, o: seen.setdefault("mlp", o.clone())),
               model.layers[0].attention.register_forward_hook(lambda m, a, o: seen.setdefault("attn0", o.clone()))]
    with torch.no_grad():
        model(ids)
    for h in handles:
        h.remove()
    trace = tl.trace(model, ids)
    assert torch.equal(trace["blocks.1.resid_post"].out, seen["post"])
    assert torch.equal(trace.find_sites(tl.module("blocks.2.resid_pre")).first().out, seen["post"])
    assert torch.equal(trace.find_sites(tl.module("blocks.0.resid_pre")).first().out, seen["pre0"])
    assert torch.equal(trace["blocks.2.mlp"].out, seen["mlp"])
    # resid_mid is inferred and checked (pre-norm: block input + attention output), not guessed
    assert torch.equal(trace.find_sites(tl.module("blocks.0.resid_mid")).first().out, seen["pre0"] + seen["attn0"])


def test_model_without_blocks_is_unsupported_with_a_remedy():
    with pytest.raises(UnsupportedModelError) as info:
        tl.arch(nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)))
    assert "adapter" in info.value.remedy and "docs/plugins.md" in info.value.remedy
    with pytest.raises(UnsupportedModelError):
        tl.arch(lambda x: x)
    # real paths keep working on such a model; canonical names just are not there
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU())
    trace = tl.trace(model, torch.ones(1, 3))
    with pytest.raises(SiteNotFoundError):
        trace.find_sites(tl.module("blocks.0.mlp"))
    assert torch.equal(trace["1"].out, torch.relu(model[0](torch.ones(1, 3))))


def test_real_module_named_like_a_canonical_site_wins():
    class Named(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
            self.embed = nn.Linear(4, 4)

        def forward(self, x):
            return self.blocks[1](self.blocks[0](self.embed(x)))

    model = Named().eval()
    x = torch.ones(1, 4)
    trace = tl.trace(model, x)
    assert trace["embed"].record.address == "embed"
    assert trace["blocks.1"].record.address == "blocks.1"
    assert torch.equal(trace.find_sites(tl.module("blocks.1.resid_pre")).first().out, trace["blocks.0"].out)


def test_adapter_docs_page_exists():
    root = pathlib.Path(__file__).resolve().parents[1]
    assert (root / "docs" / "plugins.md").is_file()
