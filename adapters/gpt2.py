"""GPT-2 (``GPT2Model``, ``GPT2LMHeadModel`` ...): pre-LN blocks under ``transformer.h``.

Block code (transformers 5): ``h = attn(ln_1(x))[0] + x; out = h + mlp(ln_2(h))``, so
``resid_mid`` is the block's first own add. Block 0's input is ``transformer.drop``'s output
(token + position embeddings, dropout).
"""

from __future__ import annotations

from torch import nn

from torchlens.arch import ArchView, Layout, ResidualAdd
from torchlens.arch.tl_names import TL_PRE_NORM

LAYOUT = Layout(blocks="h", attn="attn", mlp="mlp", resid_mid=ResidualAdd(1), embed="wte", embed_out="drop",
                unembed="lm_head", pos_embed="wpe")


class GPT2Adapter:
    """Canonical sites for GPT-2; heads from ``n_head``, width from ``n_embd``."""

    name = "gpt2"
    model_types = ("gpt2",)

    def view(self, model: nn.Module) -> ArchView:
        cfg = model.config
        return LAYOUT.view(model, self.name, n_heads=cfg.n_head, n_kv_heads=cfg.n_head,
                           head_dim=cfg.n_embd // cfg.n_head, d_model=cfg.n_embd, transformerlens=TL_PRE_NORM)
