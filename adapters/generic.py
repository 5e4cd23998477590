"""The fallback adapter: finds the repeated block list of a model no family adapter knows.

The blocks are the largest ``nn.ModuleList`` / ``nn.Sequential`` whose children are all of
one class (lists of composite modules beat lists of single layers). Inside a block,
``attn`` and ``mlp`` are the direct children whose names say so (``attn``/``attention``,
``mlp``/``ffn``/``feed_forward``), when exactly one does. ``resid_mid`` is never guessed:
a wrong guess would silently read the wrong tensor. Head counts come from the config when
there is one, else from the attention module's attributes. ``resid_pre`` read after capture
is exact (the op feeding the block); edited during capture it assumes the blocks are chained
(block i's input is block i-1's output), and for block 0 it needs a ``tl.trace`` capture and
an after-the-fact edit (``fork.do``), since no module is known to produce it.
``ArchView.adapter`` is ``"generic"`` so a reader can tell a guess from a family adapter.
"""

from __future__ import annotations

import re

from torch import nn

from torchlens.arch import ADAPTER_REMEDY, Absent, ArchView, Layout, config_dims
from torchlens.errors import UnsupportedModelError

ATTN = re.compile(r"attn|attention", re.I)
MLP = re.compile(r"mlp|ffn|feed_?forward", re.I)
UNEMBED = ("lm_head", "unembed", "embed_out", "output", "head")
NO_MID = Absent("the generic adapter does not guess where the residual add between attention and MLP is")


def find_blocks(model: nn.Module) -> str | None:
    """Address of the repeated block list, or None."""
    best, best_key = None, None
    for name, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(module.children())
        if len(children) < 2 or len({type(c) for c in children}) != 1:
            continue
        composite = any(True for _ in children[0].children())
        key = (composite, len(children), -name.count("."))
        if best_key is None or key > best_key:
            best, best_key = name, key
    return best


def _child(block: nn.Module, pattern: re.Pattern) -> str | None:
    found = [n for n, _ in block.named_children() if pattern.search(n)]
    return found[0] if len(found) == 1 else None


def _embed_unembed(model: nn.Module, container: str) -> tuple[str | None, str | None]:
    embed = next((n for n, m in model.named_modules()
                  if isinstance(m, nn.Embedding) and not n.startswith(container + ".")), None)
    vocab = model.get_submodule(embed).num_embeddings if embed else None
    unembed = None
    for name in UNEMBED:
        m = getattr(model, name, None)
        if isinstance(m, nn.Linear) and (vocab is None or m.out_features == vocab):
            unembed = name
            break
    return embed, unembed


def _attn_dims(attn: nn.Module | None) -> dict[str, int | None]:
    def first(*names: str) -> int | None:
        for n in names:
            v = getattr(attn, n, None)
            if isinstance(v, int) and not isinstance(v, bool):
                return v
        return None

    n_heads = first("num_heads", "n_heads", "n_head", "num_attention_heads")
    d_model = first("embed_dim", "hidden_size", "d_model", "n_embd")
    head_dim = first("head_dim", "d_head") or (d_model // n_heads if d_model and n_heads else None)
    n_kv = first("num_key_value_heads", "n_kv_heads", "num_kv_heads") or n_heads
    return {"n_heads": n_heads, "n_kv_heads": n_kv, "head_dim": head_dim, "d_model": d_model}


class GenericAdapter:
    """Serves any model with a repeated block list; tried after every family adapter."""

    name = "generic"
    model_types = ()
    fallback = True

    def view(self, model: nn.Module) -> ArchView:
        container = find_blocks(model)
        if container is None:
            raise UnsupportedModelError(
                f"{type(model).__name__} has no adapter and no repeated block list "
                "(an nn.ModuleList of two or more modules of one class)",
                remedy=ADAPTER_REMEDY,
            )
        block0 = next(iter(model.get_submodule(container).children()))
        attn, mlp = _child(block0, ATTN), _child(block0, MLP)
        embed, unembed = _embed_unembed(model, container)
        layout = Layout(blocks=container, attn=attn, mlp=mlp, resid_mid=NO_MID, embed=embed, unembed=unembed)
        config = getattr(model, "config", None)
        dims = config_dims(config) if config is not None else {}
        if not dims.get("n_heads"):
            dims = _attn_dims(block0.get_submodule(attn) if attn else None)
        return layout.view(model, self.name, root="", **dims)
