"""Layout inference across ~30 transformers families (the fast subset of scripts/arch_sweep.py).

Each family is built from its config class with a tiny random config. The test pins where inference
puts each role (``attn``, ``mlp``, ``mixer``, ``cross_attn``, ``router``, ``experts``) in two blocks,
reads every offered canonical site on a ``tl.trace`` capture and compares it with a plain
``register_forward_hook`` read of the module it names, and requires every structural check of
``check_layout`` to hold (the chain ``resid_post[L] == resid_pre[L+1]``, each role's size, the
router's expert count). Roles a block does not have are refused by name, saying what to read instead.
The bad inputs (two tied block lists, sublayers that cannot be told apart, an adapter contradicting the
structure) raise ``LayoutInferenceError`` naming the candidates and the Layout to declare.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache

import pytest
import torch
from conftest import _seeded, assert_model_clean, hook_state
from torch import nn

import torchlens as tl
from torchlens.arch import Layout, ResidualAdd, check_layout
from torchlens.errors import LayoutInferenceError, SiteNotFoundError
from torchlens.hookspecs import hookimpl
from torchlens.plugins import register, unregister

IDS = torch.tensor([[3, 17, 42, 9, 100, 5]])
TINY = dict(num_hidden_layers=2, n_layer=2, num_layers=2, n_layers=2, hidden_size=32, n_embd=32, d_model=32,
            intermediate_size=64, ffn_dim=64, n_inner=64, d_ff=64, d_kv=8, num_attention_heads=2, n_head=2,
            num_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=128, max_position_embeddings=64,
            n_positions=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2,
            encoder_ffn_dim=64, decoder_ffn_dim=64, num_decoder_layers=2, pad_token_id=0, bos_token_id=1,
            eos_token_id=2)
BERT = {i: {"attn": "attention.self", "mlp": "output.dense"} for i in (0, 1)}
PRE = {i: {"attn": "self_attn", "mlp": "mlp"} for i in (0, 1)}
SEQ2SEQ = {i: {"attn": "self_attn", "mlp": "fc2", "cross_attn": "encoder_attn"} for i in (0, 1)}


def _moe(mlp: str = "mlp", router: str = "gate") -> dict:
    return {i: {"attn": "self_attn", "mlp": mlp, "router": f"{mlp}.{router}", "experts": f"{mlp}.experts"}
            for i in (0, 1)}


def _ssm(mixer: str = "mixer") -> dict:
    return {i: {"mixer": mixer} for i in (0, 1)}


@dataclass(frozen=True)
class Fam:
    model_type: str
    model: str
    blocks: str
    roles: dict  # block index -> {role: path relative to the block}
    config: dict = field(default_factory=dict)
    absent: tuple = ()  # (canonical name, words the refusal says)
    decoder_inputs: bool = False


FAMILIES = [
    # decoders with no adapter of their own
    Fam("gpt_neo", "GPTNeoForCausalLM", "transformer.h", {i: {"attn": "attn", "mlp": "mlp"} for i in (0, 1)},
        {"attention_types": [[["global", "local"], 1]]}),
    Fam("gptj", "GPTJForCausalLM", "transformer.h", {i: {"attn": "attn", "mlp": "mlp"} for i in (0, 1)},
        {"rotary_dim": 8}),
    Fam("bloom", "BloomForCausalLM", "transformer.h", {i: {"attn": "self_attention", "mlp": "mlp"} for i in (0, 1)}),
    Fam("mpt", "MptForCausalLM", "transformer.blocks", {i: {"attn": "attn", "mlp": "ffn"} for i in (0, 1)}),
    Fam("stablelm", "StableLmForCausalLM", "model.layers", PRE),
    Fam("phi", "PhiForCausalLM", "model.layers", PRE),
    Fam("starcoder2", "Starcoder2ForCausalLM", "model.layers", PRE),
    Fam("granite", "GraniteForCausalLM", "model.layers", PRE),
    Fam("gemma", "GemmaForCausalLM", "model.layers", PRE),
    # MoE: the MoE block is the mlp role, its gate the router, its experts the experts
    Fam("mixtral", "MixtralForCausalLM", "model.layers", _moe(), absent=()),
    Fam("qwen2_moe", "Qwen2MoeForCausalLM", "model.layers", _moe()),
    Fam("qwen3_moe", "Qwen3MoeForCausalLM", "model.layers", _moe()),
    Fam("olmoe", "OlmoeForCausalLM", "model.layers", _moe()),
    Fam("phimoe", "PhimoeForCausalLM", "model.layers", _moe(router="router")),
    Fam("granitemoe", "GraniteMoeForCausalLM", "model.layers", _moe("block_sparse_moe", "router")),
    Fam("gpt_oss", "GptOssForCausalLM", "model.layers", _moe(router="router")),  # GptOssMLP: no "SSM" in it
    # state-space and hybrid: the mixer role; attention refused on a mixer block, naming mixer
    Fam("mamba", "MambaForCausalLM", "backbone.layers", _ssm(),
        absent=(("blocks.0.attn", "read blocks.L.mixer"), ("blocks.0.mlp", "has one sublayer"))),
    Fam("mamba2", "Mamba2ForCausalLM", "backbone.layers", _ssm(), {"num_heads": 4, "head_dim": 16, "n_groups": 1},
        absent=(("blocks.1.attn", "read blocks.L.mixer"),)),
    Fam("falcon_mamba", "FalconMambaForCausalLM", "backbone.layers", _ssm()),
    Fam("rwkv", "RwkvForCausalLM", "rwkv.blocks", {i: {"mixer": "attention", "mlp": "feed_forward"} for i in (0, 1)},
        absent=(("blocks.1.attn", "read blocks.L.mixer"),)),
    # alternating layer classes: a Mamba layer with an MLP, then an attention layer with an MoE
    Fam("jamba", "JambaForCausalLM", "model.layers",
        {0: {"mixer": "mamba", "mlp": "feed_forward"},
         1: {"attn": "self_attn", "mlp": "feed_forward", "router": "feed_forward.router",
             "experts": "feed_forward.experts"}},
        {"attn_layer_period": 2, "attn_layer_offset": 1}, absent=(("blocks.0.router", "not an MoE block"),)),
    Fam("qwen3_next", "Qwen3NextForCausalLM", "model.layers",
        {0: {"mixer": "linear_attn", "mlp": "mlp", "router": "mlp.gate", "experts": "mlp.experts"},
         1: {"attn": "self_attn", "mlp": "mlp", "router": "mlp.gate", "experts": "mlp.experts"}},
        {"layer_types": ["linear_attention", "full_attention"]}),
    # encoders: BERT-style intermediate/output, DistilBERT's attention/ffn, ALBERT's one shared layer
    Fam("electra", "ElectraForMaskedLM", "electra.encoder.layer", BERT),
    Fam("deberta", "DebertaForMaskedLM", "deberta.encoder.layer", BERT),
    Fam("xlm-roberta", "XLMRobertaForMaskedLM", "roberta.encoder.layer", BERT),
    Fam("distilbert", "DistilBertForMaskedLM", "distilbert.transformer.layer",
        {i: {"attn": "attention", "mlp": "ffn"} for i in (0, 1)}, {"dim": 32, "hidden_dim": 64}),
    Fam("albert", "AlbertForMaskedLM", "albert.encoder.albert_layer_groups.0.albert_layers",
        {i: {"attn": f"attention.dense:{i + 1}", "mlp": f"ffn_output:{i + 1}"} for i in (0, 1)}),
    # encoder-decoders: the decoder stack, cross-attention its own role; T5 through its sublayer wrappers
    Fam("t5", "T5ForConditionalGeneration", "decoder.block",
        {i: {"attn": "layer.0.SelfAttention", "cross_attn": "layer.1.EncDecAttention", "mlp": "layer.2.DenseReluDense"}
         for i in (0, 1)}, absent=(("blocks.0.resid_mid", "inside its sublayer wrappers"),), decoder_inputs=True),
    Fam("bart", "BartForConditionalGeneration", "model.decoder.layers", SEQ2SEQ, decoder_inputs=True),
    Fam("mbart", "MBartForConditionalGeneration", "model.decoder.layers", SEQ2SEQ, decoder_inputs=True),
    Fam("marian", "MarianMTModel", "model.decoder.layers", SEQ2SEQ, decoder_inputs=True),
    Fam("whisper", "WhisperForCausalLM", "model.decoder.layers", SEQ2SEQ),  # no encoder states: cross_attn idle
]
BY_TYPE = {f.model_type: f for f in FAMILIES}


def _first(value):
    while isinstance(value, (tuple, list)):
        value = value[0]
    return value


@cache
def built(model_type: str):
    """(family, model, hook reads {address: [output per pass]}, block inputs, trace), built once."""
    import transformers

    fam = BY_TYPE[model_type]
    config = transformers.AutoConfig.for_model(fam.model_type, **{**TINY, **fam.config})
    config._attn_implementation = "eager"
    model = _seeded(lambda: getattr(transformers, fam.model)(config).eval())
    kwargs = {"decoder_input_ids": torch.tensor([[1, 4, 6]])} if fam.decoder_inputs else {}
    outs: dict[str, list] = {}
    handles = [m.register_forward_hook(lambda mod, a, o, n=n: outs.setdefault(n, []).append(_first(o)))
               for n, m in model.named_modules() if n]
    try:
        with torch.no_grad():
            want = model(IDS, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return fam, model, outs, want, tl.trace(model, IDS, **kwargs)


def _hooked(outs: dict, address: str) -> torch.Tensor:
    address, _, pass_index = address.partition(":")
    return outs[address][int(pass_index) - 1 if pass_index else 0]


@pytest.mark.parametrize("model_type", list(BY_TYPE))
def test_roles_inferred_where_the_structure_puts_them(model_type):
    fam, model, outs, want, trace = built(model_type)
    view = tl.arch(model)
    assert view.adapter == "generic" and view.n_layers == 2
    assert [b.partition(":")[0].rpartition(".")[0] for b in view.blocks] == [fam.blocks] * 2
    for i, roles in fam.roles.items():
        block = view.blocks[i].partition(":")[0]
        offered = {k for k in ("attn", "mlp", "mixer", "cross_attn", "router", "experts")
                   if f"blocks.{i}.{k}" in view.names()}
        assert offered == set(roles), (i, offered)
        for role, path in roles.items():
            assert view.resolve(f"blocks.{i}.{role}") == f"{block}.{path}"
    for name, words in fam.absent:
        with pytest.raises(SiteNotFoundError, match=words):
            view.selector(name)


@pytest.mark.parametrize("model_type", list(BY_TYPE))
def test_every_offered_site_equals_a_hook_read_and_the_structure_checks_out(model_type):
    fam, model, outs, want, trace = built(model_type)
    view = tl.arch(model)
    assert torch.equal(_first(trace.output.to_tuple()), _first(want.to_tuple()))
    idle = {"cross_attn"} if not fam.decoder_inputs else set()
    for name in view.names():
        kind = name.split(".")[-1]
        if not name.startswith("blocks.") or kind in ("resid_pre", "resid_mid") or kind in idle:
            continue
        got = _first(trace.find_sites(tl.module(name)).first().out)
        assert torch.equal(got, _hooked(outs, view.resolve(name))), name
    for i in range(1, 2):  # resid_pre of a block is the previous block's output (hook-read)
        assert torch.equal(_first(trace.find_sites(tl.module(f"blocks.{i}.resid_pre")).first().out),
                           _hooked(outs, view.resolve(f"blocks.{i - 1}")))
    rows = [r for r in check_layout(trace, view) if "resid_mid" not in r[0]]
    assert any("scores each token" in r[0] for r in rows) == any("router" in r for r in fam.roles.values())
    assert [r for r in rows if not r[1]] == [] and len(rows) >= 3


def test_moe_router_is_the_gate_logits_and_experts_add_up_to_the_mlp():
    """Qwen2-MoE: router logits = gate's Linear on the normalised stream; mlp = experts + gated shared expert."""
    fam, model, outs, _, trace = built("qwen2_moe")
    moe = model.model.layers[1].mlp
    x = _hooked(outs, "model.layers.1.post_attention_layernorm").reshape(-1, 32)
    logits = _first(trace.find_sites(tl.module("blocks.1.router")).first().out)
    assert torch.equal(logits.reshape(-1, logits.shape[-1]), nn.functional.linear(x, moe.gate.weight))
    experts = _first(trace.find_sites(tl.module("blocks.1.experts")).first().out).reshape(-1, 32)
    shared = _hooked(outs, "model.layers.1.mlp.shared_expert").reshape(-1, 32)
    gate = torch.sigmoid(_hooked(outs, "model.layers.1.mlp.shared_expert_gate").reshape(-1, 1))
    mlp = _first(trace.find_sites(tl.module("blocks.1.mlp")).first().out).reshape(-1, 32)
    torch.testing.assert_close(mlp, experts + gate * shared, rtol=0, atol=1e-6)


def test_jamba_resid_mid_is_checked_on_the_mamba_layer_and_the_attention_layer():
    fam, model, outs, _, trace = built("jamba")
    for i, first in ((0, "mamba"), (1, "self_attn")):
        block = f"model.layers.{i}"
        mid = _first(trace.find_sites(tl.module(f"blocks.{i}.resid_mid")).first().out)
        pre = _first(trace.find_sites(tl.module(f"blocks.{i}.resid_pre")).first().out)
        assert torch.equal(mid, pre + _hooked(outs, f"{block}.{first}"))
    assert "mixer      model.layers.0.mamba" in tl.arch(model).describe()


def test_albert_blocks_are_the_passes_of_its_shared_layer():
    fam, model, outs, _, trace = built("albert")
    view = tl.arch(model)
    layer = "albert.encoder.albert_layer_groups.0.albert_layers.0"
    assert view.blocks == [f"{layer}:1", f"{layer}:2"] and len(outs[layer]) == 2
    assert torch.equal(_first(trace.find_sites(tl.module("blocks.1.resid_post")).first().out), outs[layer][1])
    with pytest.raises(LayoutInferenceError, match="post-norm"):
        view.selector("blocks.0.resid_mid")


def test_multimodal_model_takes_the_text_blocks_not_the_vision_tower():
    """LLaVA: the vision tower's 3 layers outnumber the text model's 2, but only the text blocks run on ids."""
    import transformers

    cfg = transformers.LlavaConfig(
        text_config=dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, vocab_size=128, max_position_embeddings=64),
        vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                           num_attention_heads=2, image_size=16, patch_size=8), image_token_id=127)
    model = _seeded(lambda: transformers.LlavaForConditionalGeneration(cfg).eval())
    view = tl.arch(model)
    assert view.blocks == ["model.language_model.layers.0", "model.language_model.layers.1"]
    assert "model.vision_tower" not in view.describe() and view.resolve("embed") == "model.language_model.embed_tokens"
    trace = tl.trace(model, IDS)
    read = trace.find_sites(tl.module("blocks.1.mlp")).first().out
    assert torch.equal(read, trace["model.language_model.layers.1.mlp"].out)


# -- bad input ----------------------------------------------------------------------------


class _Block(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.attn, self.mlp = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        x = x + self.attn(x)
        return x + self.mlp(x)


class _TwoTowers(nn.Module):
    """Two stacks of the same blocks, same length and depth, neither a vision tower nor an encoder."""

    def __init__(self) -> None:
        super().__init__()
        self.left = nn.ModuleList([_Block(), _Block()])
        self.right = nn.ModuleList([_Block(), _Block()])

    def forward(self, x):
        for a, b in zip(self.left, self.right, strict=True):
            x = b(a(x))
        return x


class _Twin(nn.Module):
    """A block whose two sublayers are both named like MLPs: nothing tells them apart."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.self_attn, self.mlp_a, self.mlp_b = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        x = x + self.self_attn(x)
        return x + self.mlp_a(x) + self.mlp_b(x)


def test_two_candidate_block_lists_refuse_by_name_and_say_how_to_declare():
    model = _seeded(lambda: _TwoTowers().eval())
    x = torch.randn(1, 3, 8)
    before = hook_state(model)
    with pytest.raises(LayoutInferenceError, match=r"\['left', 'right'\] tie") as info:
        tl.arch(model)
    assert info.value.fields["candidates"] == ["left", "right"] and "Layout(blocks='left'" in info.value.remedy
    trace = tl.trace(model, x)  # real paths keep working; the canonical name raises the same error
    with pytest.raises(LayoutInferenceError, match="tie"):
        trace.find_sites(tl.module("blocks.0.mlp"))
    with torch.no_grad():
        assert torch.equal(trace["right.1"].out, model(x))
    assert_model_clean(model, before)


def test_sublayers_that_cannot_be_told_apart_are_refused_by_name():
    model = _seeded(lambda: nn.Sequential(_Twin(), _Twin()).eval())
    view = tl.arch(model)
    with pytest.raises(LayoutInferenceError, match=r"MLP of '0' was not inferred: candidates \['mlp_a', 'mlp_b'\]"):
        view.selector("blocks.0.mlp")
    assert view.resolve("blocks.1.attn") == "1.self_attn" and view.names("mlp") == []


class _Contradicting:
    """A user adapter whose Layout says the opposite of the structure (attn and mlp swapped), or a wrong list."""

    name = "contradicting"
    model_types = ("qwen2_moe",)

    def __init__(self, **layout) -> None:
        self.layout = Layout(**layout)

    def view(self, model):
        return self.layout.view(model, self.name)


@pytest.mark.parametrize("layout, words, fix", [
    (dict(blocks="layers", attn="mlp", mlp="self_attn", resid_mid=ResidualAdd()),
     r"declares attn='mlp' .* contradicts the structure: 'mlp' is the block's mlp", "attn='self_attn', mlp='mlp'"),
    (dict(blocks="layers", attn="attention", mlp="mlp", resid_mid=ResidualAdd()),
     "no block has a module 'attention'", "attn='self_attn'"),
    (dict(blocks="decoder.layers", attn="self_attn", mlp="mlp", resid_mid=ResidualAdd()),
     r"no module 'model.decoder.layers'; the block lists its module tree shows: \['model.layers'\]",
     "Layout(blocks='layers'"),
])
def test_an_adapter_contradicting_the_structure_is_refused(layout, words, fix):
    _, model, _, _, _ = built("qwen2_moe")
    class Plugin:
        @hookimpl
        def torchlens_adapters(self):
            return [_Contradicting(**layout)]

    register(Plugin(), name="contradicting")
    try:
        with pytest.raises(LayoutInferenceError, match=words) as info:
            tl.arch(model)
        assert fix in info.value.remedy
    finally:
        unregister(name="contradicting")
    assert tl.arch(model).adapter == "generic"


class _WideMlp(nn.Module):
    """The child named ``mlp`` is only the up-projection: its output is twice the stream's width."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.self_attn, self.mlp, self.down = nn.Linear(d, d), nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        x = x + self.self_attn(x)
        return x + self.down(torch.relu(self.mlp(x)))


def test_a_role_whose_output_is_not_stream_sized_is_refused_by_name():
    model = _seeded(lambda: nn.Sequential(_WideMlp(), _WideMlp()).eval())
    x = torch.randn(1, 3, 8)
    trace = tl.trace(model, x)
    assert tl.arch(model).resolve("blocks.0.mlp") == "0.mlp"  # named like the MLP, so inferred ...
    with pytest.raises(LayoutInferenceError, match=r"blocks.1.mlp: not offered.* returned \(1, 3, 16\)"):
        trace.find_sites(tl.module("blocks.1.mlp"))  # ... but the structure refutes it on the recorded forward
    rows = {what: holds for what, holds, _ in check_layout(trace, tl.arch(model))}
    assert rows["blocks.0.attn has resid_pre's size (24)"] and not rows["blocks.0.mlp has resid_pre's size (24)"]
    assert torch.equal(_first(trace.find_sites(tl.module("blocks.1.attn")).first().out), trace["1.self_attn"].out)
