"""TransformerLens 3.9's ``HookedTransformer`` on the same weights as a Hugging Face model, offline.

An independent re-implementation to cross-check against: the config is written by hand
(the fields ``convert_hf_model_config`` would read from the hub), the weights go through
TransformerLens's own conversion (``convert_gpt2_weights`` / ``convert_llama_weights``) and
``load_state_dict``, with no folding, centring or other processing (unless ``fold_ln=True`` asks
for TransformerLens's layer-norm folding, for the results it defines on a folded model), so
activations match the Hugging Face model's (GPT-2, Llama, GPT-NeoX). ``randomized_norms`` gives the norms weights and
biases away from 1 and 0 (and, asked, every other bias away from 0) so a convention that
forgets them shows. The one builder of these twins for every TransformerLens cross-check.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch
from torch import nn

__all__ = ["hooked_gpt2", "hooked_llama", "hooked_neox", "randomized_norms"]


def randomized_norms(model: nn.Module, seed: int = 1, *, biases: bool = False) -> nn.Module:
    """A copy of ``model`` whose norm weights (and biases) are random, not 1 (and 0); with
    ``biases=True`` every other bias too (``0.1 * randn``), so a dropped bias term shows."""
    twin = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        if biases:
            for name, p in twin.named_parameters():
                if name.endswith("bias"):
                    p.copy_(0.1 * torch.randn(p.shape, generator=gen))
        for module in twin.modules():
            if isinstance(module, nn.LayerNorm) or "norm" in type(module).__name__.lower():
                weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
                if isinstance(weight, torch.Tensor):
                    weight.copy_(1 + 0.5 * torch.randn(weight.shape, generator=gen))
                if isinstance(bias, torch.Tensor):
                    bias.copy_(0.5 * torch.randn(bias.shape, generator=gen))
    return twin


def _hooked(cfg_dict: dict[str, Any], state_dict: dict[str, torch.Tensor], fold_ln: bool) -> Any:
    from transformer_lens import HookedTransformer

    with warnings.catch_warnings():  # 3.9 announces HookedTransformer's removal in 4.0; the test extra pins <4
        warnings.simplefilter("ignore", DeprecationWarning)
        model = HookedTransformer(_config(cfg_dict))
    model.load_state_dict(state_dict, strict=False)
    if fold_ln:  # the norms' weights folded into the next weights; nothing centred
        model.process_weights_(fold_ln=True, center_writing_weights=False, center_unembed=False)
    return model.eval()


def _config(cfg_dict: dict[str, Any]) -> Any:
    from transformer_lens import HookedTransformerConfig

    return HookedTransformerConfig(**cfg_dict, device="cpu", dtype=torch.float32)


def hooked_gpt2(hf_model: nn.Module, *, fold_ln: bool = False) -> Any:
    """A ``HookedTransformer`` computing what the ``GPT2LMHeadModel`` ``hf_model`` computes
    (``fold_ln=True``: with the layer norms folded, as ``from_pretrained`` does by default)."""
    from transformer_lens.pretrained.weight_conversions import convert_gpt2_weights

    c = hf_model.config
    cfg = {
        "d_model": c.n_embd, "d_head": c.n_embd // c.n_head, "n_heads": c.n_head, "d_mlp": c.n_inner or 4 * c.n_embd,
        "n_layers": c.n_layer, "n_ctx": c.n_positions, "eps": c.layer_norm_epsilon, "d_vocab": c.vocab_size,
        "act_fn": c.activation_function, "normalization_type": "LN", "original_architecture": "GPT2LMHeadModel",
        "scale_attn_by_inverse_layer_idx": c.scale_attn_by_inverse_layer_idx,
    }
    return _hooked(cfg, convert_gpt2_weights(hf_model, _config(cfg)), fold_ln)


def hooked_llama(hf_model: nn.Module, *, fold_ln: bool = False) -> Any:
    """A ``HookedTransformer`` computing what the ``LlamaForCausalLM`` ``hf_model`` computes (GQA too;
    ``fold_ln`` as in :func:`hooked_gpt2`)."""
    from transformer_lens.pretrained.weight_conversions import convert_llama_weights

    c = hf_model.config
    n_heads, n_kv = c.num_attention_heads, c.num_key_value_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // n_heads
    cfg = {
        "d_model": c.hidden_size, "d_head": head_dim, "n_heads": n_heads, "d_mlp": c.intermediate_size,
        "n_layers": c.num_hidden_layers, "n_ctx": c.max_position_embeddings, "eps": c.rms_norm_eps,
        "d_vocab": c.vocab_size, "act_fn": c.hidden_act, "n_key_value_heads": n_kv if n_kv != n_heads else None,
        "normalization_type": "RMS", "positional_embedding_type": "rotary", "rotary_adjacent_pairs": False,
        "rotary_dim": head_dim, "rotary_base": _rope_theta(c), "final_rms": True, "gated_mlp": True,
        "original_architecture": "LlamaForCausalLM",
    }
    return _hooked(cfg, convert_llama_weights(hf_model, _config(cfg)), fold_ln)


def hooked_neox(hf_model: nn.Module, *, fold_ln: bool = False) -> Any:
    """A ``HookedTransformer`` computing what the ``GPTNeoXForCausalLM`` ``hf_model`` computes (parallel residual
    or not; the fields TransformerLens's ``convert_hf_model_config`` reads for GPT-NeoX)."""
    from transformer_lens.pretrained.weight_conversions import convert_neox_weights

    c = hf_model.config
    head_dim = c.hidden_size // c.num_attention_heads
    rope = getattr(c, "rope_parameters", None) or {}
    pct = rope.get("partial_rotary_factor", getattr(c, "rotary_pct", 1.0))
    cfg = {
        "d_model": c.hidden_size, "d_head": head_dim, "n_heads": c.num_attention_heads, "d_mlp": c.intermediate_size,
        "n_layers": c.num_hidden_layers, "n_ctx": c.max_position_embeddings, "eps": c.layer_norm_eps,
        "d_vocab": c.vocab_size, "act_fn": c.hidden_act, "parallel_attn_mlp": c.use_parallel_residual,
        "positional_embedding_type": "rotary", "rotary_adjacent_pairs": False, "normalization_type": "LN",
        "rotary_dim": round(pct * head_dim), "rotary_base": _rope_theta(c),
        "original_architecture": "GPTNeoXForCausalLM",
    }
    return _hooked(cfg, convert_neox_weights(hf_model, _config(cfg)), fold_ln)


def _rope_theta(config: Any) -> float:
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
