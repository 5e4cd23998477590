"""BERT (``BertModel``, ``BertForMaskedLM`` ...): post-LN encoder blocks under ``encoder.layer``.

BERT folds each residual add into a module: ``attention.output`` computes
``LayerNorm(dense(ctx) + x)`` and ``output`` computes ``LayerNorm(dense(ffn) + h)``. So:

* ``attn`` is ``attention.self``, the module holding the attention computation (the one
  fused attention op, which the facet plugin reads; its output is the heads' combined
  context, before the output projection). ``attention`` would be the wrong choice: its
  output already contains the residual and LayerNorm, so ablating it wipes the stream.
* ``mlp`` is ``output.dense``, the MLP's down-projection: its output before the residual add,
  as for every other family.
* ``resid_mid`` is ``attention.output``'s output (the normalised state the MLP reads).

Block 0's input is ``embeddings``'s output.
``unembed`` exists on ``BertForMaskedLM`` (``cls.predictions.decoder``), not on ``BertModel``.
"""

from __future__ import annotations

from torch import nn

from torchlens.arch import ArchView, Layout, OutputOf

LAYOUT = Layout(blocks="encoder.layer", attn="attention.self", mlp="output.dense",
                resid_mid=OutputOf("attention.output"), embed="embeddings.word_embeddings",
                embed_out="embeddings", unembed="cls.predictions.decoder")


class BertAdapter:
    """Canonical sites for BERT encoders; heads from ``num_attention_heads``."""

    name = "bert"
    model_types = ("bert",)

    def view(self, model: nn.Module) -> ArchView:
        cfg = model.config
        heads = cfg.num_attention_heads
        return LAYOUT.view(model, self.name, n_heads=heads, n_kv_heads=heads,
                           head_dim=cfg.hidden_size // heads, d_model=cfg.hidden_size,
                           # TransformerLens's BERT hooks resid_mid / resid_post before the LayerNorm
                           transformerlens={"hook_resid_pre": "resid_pre"})
