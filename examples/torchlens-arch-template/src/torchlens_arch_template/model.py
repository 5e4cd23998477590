"""A toy decoder family: pre-norm blocks of causal self-attention (one fused kernel) and an MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ToyConfig", "ToyForCausalLM"]


class ToyConfig:
    """Sizes of one toy model; ``model_type`` is what the adapter claims."""

    model_type = "toyarch"

    def __init__(self, vocab_size: int = 32, d_model: int = 16, n_heads: int = 4, n_layers: int = 2) -> None:
        self.vocab_size, self.d_model, self.n_heads, self.n_layers = vocab_size, d_model, n_heads, n_layers


class ToyAttention(nn.Module):
    def __init__(self, config: ToyConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class ToyBlock(nn.Module):
    def __init__(self, config: ToyConfig) -> None:
        super().__init__()
        self.norm_1 = nn.LayerNorm(config.d_model)
        self.mixer = ToyAttention(config)
        self.norm_2 = nn.LayerNorm(config.d_model)
        self.ffn = nn.Sequential(nn.Linear(config.d_model, 4 * config.d_model), nn.GELU(),
                                 nn.Linear(4 * config.d_model, config.d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mixer(self.norm_1(x))  # the block's first add: resid_mid
        return x + self.ffn(self.norm_2(x))


class ToyForCausalLM(nn.Module):
    def __init__(self, config: ToyConfig) -> None:
        super().__init__()
        self.config = config
        self.tok = nn.Embedding(config.vocab_size, config.d_model)
        self.stack = nn.ModuleList(ToyBlock(config) for _ in range(config.n_layers))
        self.norm_f = nn.LayerNorm(config.d_model)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids)
        for block in self.stack:
            x = block(x)
        return self.lm_head(self.norm_f(x))
