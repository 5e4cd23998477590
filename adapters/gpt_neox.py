"""GPT-NeoX / Pythia (``GPTNeoXModel``, ``GPTNeoXForCausalLM``): blocks under ``gpt_neox.layers``.

With ``use_parallel_residual`` (the default, and every Pythia model) a block computes
``x + attn(ln1(x)) + mlp(ln2(x))`` in one go: there is no residual state between attention
and MLP, so ``resid_mid`` does not exist and asking for it says so. Without it the block's
first own add is ``attn_out + x``.
"""

from __future__ import annotations

from torch import nn

from torchlens.arch import Absent, ArchView, Layout, ResidualAdd
from torchlens.arch.tl_names import TL_PRE_NORM

PARALLEL = Absent("GPT-NeoX with use_parallel_residual=True adds attention and MLP to the residual "
                  "stream in one step, so there is no residual state between them")


class GPTNeoXAdapter:
    """Canonical sites for GPT-NeoX; heads from ``num_attention_heads``."""

    name = "gpt_neox"
    model_types = ("gpt_neox",)

    def view(self, model: nn.Module) -> ArchView:
        cfg = model.config
        mid = PARALLEL if cfg.use_parallel_residual else ResidualAdd(1)
        layout = Layout(blocks="layers", attn="attention", mlp="mlp", resid_mid=mid, embed="embed_in",
                        embed_out="emb_dropout", unembed="lm_head")
        heads = cfg.num_attention_heads
        return layout.view(model, self.name, n_heads=heads, n_kv_heads=heads,
                           head_dim=cfg.hidden_size // heads, d_model=cfg.hidden_size, transformerlens=TL_PRE_NORM)
