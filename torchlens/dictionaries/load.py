"""SAELens's on-disk layout, read without SAELens and without the hub: ``load_sae(path)``.

A folder written by ``SAE.save_model(path)`` (``cfg.json`` + ``sae_weights.safetensors``) becomes a
:class:`SavedSAE` computing what SAELens's own classes compute, wrapped as a ``FeatureDictionary``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from ..errors import FeatureDictionaryFormatError
from .wrap import FeatureDictionary, as_dictionary

__all__ = ["SavedSAE", "load_sae"]

CFG_FILENAME = "cfg.json"
WEIGHTS_FILENAME = "sae_weights.safetensors"
ARCHITECTURES = ("standard", "jumprelu", "topk")


class SavedSAE(nn.Module):
    """An SAE read from SAELens's on-disk layout: ``standard``, ``jumprelu`` or ``topk``, inference only.

    Computes what SAELens's own classes compute (same ops in the same order), so its features and
    reconstructions match a SAELens ``SAE`` loaded from the same folder.
    """

    def __init__(self, cfg: dict[str, Any], weights: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.cfg_dict = dict(cfg)
        self.architecture = cfg.get("architecture", "standard")
        self.d_in, self.d_sae = int(cfg["d_in"]), int(cfg["d_sae"])
        self.apply_b_dec_to_input = bool(cfg.get("apply_b_dec_to_input", True))
        self.k = int(cfg.get("k", 0) or 0)
        self.rescale_acts_by_decoder_norm = bool(cfg.get("rescale_acts_by_decoder_norm", False))
        for key in ("W_enc", "b_enc", "W_dec", "b_dec", "threshold"):
            if key in weights:
                self.register_parameter(key, nn.Parameter(weights[key], requires_grad=False))

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Feature activations: ReLU / JumpReLU / TopK of ``(x - b_dec) @ W_enc + b_enc``."""
        sae_in = x.to(self.W_enc.dtype)
        sae_in = sae_in - self.b_dec * self.apply_b_dec_to_input
        hidden_pre = sae_in @ self.W_enc + self.b_enc
        if self.architecture == "jumprelu":
            base = torch.relu(hidden_pre)
            return base * (hidden_pre > self.threshold).to(base.dtype)
        if self.architecture == "topk":
            if self.rescale_acts_by_decoder_norm:
                hidden_pre = hidden_pre * self.W_dec.norm(dim=-1)
            top = hidden_pre.topk(self.k, dim=-1, sorted=False)
            return torch.zeros_like(hidden_pre).scatter(-1, top.indices, torch.relu(top.values))
        return torch.relu(hidden_pre)

    def decode(self, f: torch.Tensor) -> torch.Tensor:
        """The reconstruction ``f @ W_dec + b_dec``."""
        if self.architecture == "topk" and self.rescale_acts_by_decoder_norm:
            f = f * (1 / self.W_dec.norm(dim=-1))
        return f @ self.W_dec + self.b_dec

    def extra_repr(self) -> str:
        return f"{self.architecture}, d_in={self.d_in}, d_sae={self.d_sae}"


def load_sae(path: str | Path, *, device: str | torch.device = "cpu",
             dtype: torch.dtype | None = None) -> FeatureDictionary:
    """Read an SAE saved in SAELens's on-disk layout (a folder with ``cfg.json`` and ``sae_weights.safetensors``).

    Args:
        path: the folder (``SAE.save_model(path)`` writes it); nothing is downloaded.
        device: where to put the weights.
        dtype: the weights' dtype (default: the ``dtype`` in ``cfg.json``, else float32).

    Returns:
        A :class:`FeatureDictionary` over a :class:`SavedSAE`.

    Raises:
        FeatureDictionaryFormatError: a file is missing, a weight is missing or mis-shaped, or the
            architecture / activation normalisation is one this reader does not compute.
    """
    folder = Path(path)
    cfg_path, weights_path = folder / CFG_FILENAME, folder / WEIGHTS_FILENAME
    for p in (cfg_path, weights_path):
        if not p.is_file():
            raise FeatureDictionaryFormatError(f"{p} does not exist", path=str(folder))
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise FeatureDictionaryFormatError(f"{cfg_path} is not valid JSON: {exc}", path=str(folder)) from None
    arch = cfg.get("architecture", "standard")
    if arch not in ARCHITECTURES:
        raise FeatureDictionaryFormatError(
            f"{folder} holds a {arch!r} SAE; load_sae reads {', '.join(ARCHITECTURES)}", path=str(folder))
    norm = cfg.get("normalize_activations", "none") or "none"
    if norm != "none":
        raise FeatureDictionaryFormatError(
            f"{folder} normalises activations ({norm!r}); load_sae reads SAEs without run-time normalisation",
            path=str(folder))
    if cfg.get("reshape_activations", "none") not in ("none", None):
        raise FeatureDictionaryFormatError(
            f"{folder} reshapes activations ({cfg['reshape_activations']!r}); load_sae reads flat SAEs",
            path=str(folder))
    if "d_in" not in cfg or "d_sae" not in cfg:
        raise FeatureDictionaryFormatError(f"{cfg_path} does not give d_in and d_sae", path=str(folder))
    weights = load_file(str(weights_path), device=str(device))
    if "scaling_factor" in weights:
        if not torch.all(weights["scaling_factor"] == 1):
            raise FeatureDictionaryFormatError(
                f"{folder} has a fine-tuning scaling factor; load it with SAELens", path=str(folder))
        del weights["scaling_factor"]
    if dtype is None:
        dtype = getattr(torch, str(cfg.get("dtype", "float32")).replace("torch.", ""), torch.float32)
    d_in, d_sae = int(cfg["d_in"]), int(cfg["d_sae"])
    shapes = {"W_enc": (d_in, d_sae), "b_enc": (d_sae,), "W_dec": (d_sae, d_in), "b_dec": (d_in,)}
    if arch == "jumprelu":
        shapes["threshold"] = (d_sae,)
    for key, shape in shapes.items():
        if key not in weights:
            raise FeatureDictionaryFormatError(f"{weights_path} has no {key}", path=str(folder))
        if tuple(weights[key].shape) != shape:
            raise FeatureDictionaryFormatError(
                f"{key} in {weights_path} has shape {tuple(weights[key].shape)}, cfg.json implies {shape}",
                path=str(folder))
    if arch == "topk" and not cfg.get("k"):
        raise FeatureDictionaryFormatError(f"{cfg_path} is a topk SAE without k", path=str(folder))
    weights = {k: v.to(dtype) for k, v in weights.items()}
    return as_dictionary(SavedSAE(cfg, weights), name=f"SAE({folder.name})")
