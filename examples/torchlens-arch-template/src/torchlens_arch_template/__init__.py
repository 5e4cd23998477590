"""TorchLens support for the toy family: its adapter, and the plugin object the entry point names.

TorchLens finds ``plugin`` through the ``torchlens`` entry point in ``pyproject.toml`` and asks it
for adapters; the adapter claims models whose ``config.model_type`` is ``"toyarch"`` and says
where their parts are, so canonical names (``blocks.1.mlp``, ``blocks.0.resid_mid``) work on them.
"""

from __future__ import annotations

from torchlens.arch import Layout, ResidualAdd
from torchlens.hookspecs import hookimpl

from .model import ToyConfig, ToyForCausalLM

__all__ = ["ToyAdapter", "ToyConfig", "ToyForCausalLM", "plugin"]


class ToyAdapter:
    """Where a toy model keeps its parts (paths relative to the model; ``attn``/``mlp`` to a block)."""

    name = "toyarch"
    model_types = ("toyarch",)

    def view(self, model):
        layout = Layout(blocks="stack", attn="mixer", mlp="ffn", resid_mid=ResidualAdd(1),
                        embed="tok", embed_out="tok", unembed="lm_head")
        config = model.config
        return layout.view(model, self.name, n_heads=config.n_heads, n_kv_heads=config.n_heads,
                           head_dim=config.d_model // config.n_heads, d_model=config.d_model)


class ToyPlugin:
    @hookimpl
    def torchlens_adapters(self):
        return [ToyAdapter()]


plugin = ToyPlugin()
