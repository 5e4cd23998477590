"""Gemma-3 text (``Gemma3ForCausalLM`` / ``Gemma3TextModel``, ``model_type='gemma3_text'``).

Layout (transformers 5): ``model.embed_tokens`` is a scaled embedding (it multiplies by
``sqrt(hidden_size)`` itself, so its output is block 0's input), blocks under
``model.layers``. A block norms each sublayer's output before adding it:
``h = x + post_attention_layernorm(self_attn(input_layernorm(x))[0]);
out = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))``. ``attn`` and
``mlp`` are the ``self_attn`` and ``mlp`` modules (before those post-norms); ``resid_mid`` is
the block's first own add. ``head_dim`` comes from the config (it is not hidden/heads).
"""

from __future__ import annotations

from torch import nn

from torchlens.arch import ArchView, Layout, ResidualAdd
from torchlens.arch.tl_names import TL_PRE_NORM

from .llama import llama_dims

LAYOUT = Layout(blocks="layers", attn="self_attn", mlp="mlp", resid_mid=ResidualAdd(1), embed="embed_tokens",
                embed_out="embed_tokens", unembed="lm_head")


class Gemma3TextAdapter:
    """Canonical sites for Gemma-3 text models."""

    name = "gemma3_text"
    model_types = ("gemma3_text",)

    def view(self, model: nn.Module) -> ArchView:
        # the residual stream only: TransformerLens's hook_mlp_out is after post_feedforward_layernorm
        residual = {k: v for k, v in TL_PRE_NORM.items() if k.startswith("hook_resid")}
        return LAYOUT.view(model, self.name, **llama_dims(model.config), transformerlens=residual)
