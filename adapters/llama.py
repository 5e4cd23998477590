"""Llama, and Mistral and Qwen2, whose decoder layers have the same layout.

Block code (transformers 5): ``h = x + self_attn(input_layernorm(x))[0];
out = h + mlp(post_attention_layernorm(h))``; ``resid_mid`` is the block's first own add.
Grouped-query attention: ``n_kv_heads`` from ``num_key_value_heads``; ``head_dim`` from the
config when it has one (Llama, Mistral), else ``hidden_size // num_attention_heads`` (Qwen2).
"""

from __future__ import annotations

from torch import nn

from torchlens.arch import ArchView, Layout, ResidualAdd
from torchlens.arch.tl_names import TL_PRE_NORM

LAYOUT = Layout(blocks="layers", attn="self_attn", mlp="mlp", resid_mid=ResidualAdd(1), embed="embed_tokens",
                embed_out="embed_tokens", unembed="lm_head")


def llama_dims(cfg) -> dict[str, int]:
    """Head layout of a Llama-style config (shared with Gemma-3, whose config has the same fields)."""
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return {"n_heads": heads, "n_kv_heads": kv, "head_dim": head_dim, "d_model": cfg.hidden_size}


class LlamaAdapter:
    """Canonical sites for Llama-layout decoders (Llama, Mistral, Qwen2)."""

    name = "llama"
    model_types = ("llama", "mistral", "qwen2")

    def view(self, model: nn.Module) -> ArchView:
        return LAYOUT.view(model, self.name, **llama_dims(model.config), transformerlens=TL_PRE_NORM)
