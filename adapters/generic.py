"""The fallback adapter: infers the layout of a model no family adapter knows.

The blocks are the largest ``nn.ModuleList`` / ``nn.Sequential`` whose children are all of
one class (lists of composite modules beat lists of single layers). Inside a block, the
direct children are ranked, never guessed:

* ``attn``: children named ``attn``/``attention``, norms excluded (``post_attention_layernorm``:
  class name with ``Norm``, or parameters that are all 1-D and no children) and cross-attention
  excluded (``encoder_attn``, ``crossattention``: a role of their own). A BERT-style attention
  (children ``self`` and ``output``, the output folding in the residual) gives ``attention.self``.
* ``mlp``: children named ``mlp``/``ffn``/``feed_forward``/``moe``, norms excluded; else the two
  linears ``fc1``/``fc2`` directly in the block (OPT, BART, Whisper: the MLP's output is
  ``fc2``'s); else ``intermediate``/``output`` (RoBERTa style: ``output.dense``).
* ``resid_mid``: the block's first own add, offered only where it checks out on the recorded
  forward as ``resid_pre + attn_out`` (``torchlens.arch.checks``).

Where candidates still tie, or none is found, the site holds a ``LayoutInferenceError`` naming
them and how to declare the layout. Head counts come from the config when there is one, else
from the attention module's attributes. ``resid_pre`` read after capture is exact (the op
feeding the block); edited during capture it assumes the blocks are chained (block i's input
is block i-1's output), and for block 0 it needs a ``tl.trace`` capture and an after-the-fact
edit (``fork.do``), since no module is known to produce it. ``ArchView.adapter`` is
``"generic"`` and ``ArchView.sources`` says how each part was found (``tl.arch.describe``).
"""

from __future__ import annotations

import re

from torch import nn

from torchlens.arch import ADAPTER_REMEDY, Absent, ArchView, Layout, config_dims
from torchlens.arch.checks import CheckedResidualAdd
from torchlens.errors import LayoutInferenceError, UnsupportedModelError

ATTN = re.compile(r"attn|attention", re.I)
CROSS = re.compile(r"encoder_?attn|cross_?attn|cross_?attention", re.I)
MLP = re.compile(r"mlp|ffn|feed_?forward|moe", re.I)
UNEMBED = ("lm_head", "unembed", "embed_out", "output", "head")
NO_MID = Absent("no attention module was inferred, so there is no residual add to check for resid_mid")


def is_norm(module: nn.Module) -> bool:
    """LayerNorm/RMSNorm-like: ``Norm`` in the class name, or a leaf whose parameters are all 1-D."""
    if "norm" in type(module).__name__.lower():
        return True
    params = [p for _, p in module.named_parameters(recurse=False)]
    return bool(params) and not any(True for _ in module.children()) and all(p.dim() == 1 for p in params)


def _candidate(module: nn.Module) -> bool:
    """A module that can be a sublayer: it has parameters (not a dropout or activation) and is not a norm."""
    return any(True for _ in module.parameters()) and not is_norm(module)


def _refusal(block: str, role: str, found: list[str], rule: str) -> LayoutInferenceError:
    what = f"candidates {found} tie" if found else "no candidate was found"
    return LayoutInferenceError(f"{role} of {block!r} was not inferred: {what} ({rule})", site=role,
                                candidates=found, rule=rule)


def infer_attn(block: nn.Module, address: str) -> tuple[str | LayoutInferenceError, str]:
    """The block's self-attention child (relative path) and how it was chosen, or the refusal."""
    named = [(n, m) for n, m in block.named_children() if ATTN.search(n) and _candidate(m)]
    own = [(n, m) for n, m in named if not CROSS.search(n)]
    if len(own) != 1:
        return _refusal(address, "attention", [n for n, _ in own],
                        "children named attn/attention, norms, dropouts and cross-attention excluded"), ""
    name, module = own[0]
    kids = dict(module.named_children())
    if "self" in kids and "output" in kids:  # BERT style: attention.output folds in the residual
        return f"{name}.self", "inferred: BERT-style attention, its 'self' part (output adds the residual)"
    dropped = [n for n, _ in named if n != name]
    return name, "inferred: the child named like attention" + (f" (not {dropped})" if dropped else "")


def infer_mlp(block: nn.Module, address: str) -> tuple[str | LayoutInferenceError, str]:
    """The block's MLP (relative path; the module whose output joins the residual) and how, or the refusal."""
    kids = dict(block.named_children())
    named = [n for n, m in kids.items() if MLP.search(n) and _candidate(m)]
    if len(named) == 1:
        return named[0], "inferred: the child named like an MLP"
    if named:
        return _refusal(address, "MLP", named, "named mlp/ffn/feed_forward/moe, norms and dropouts excluded"), ""
    if isinstance(kids.get("fc1"), nn.Linear) and isinstance(kids.get("fc2"), nn.Linear):
        return "fc2", "inferred: fc1/fc2 linears in the block, the MLP's output is fc2's"
    output = kids.get("output")
    if "intermediate" in kids and output is not None and isinstance(getattr(output, "dense", None), nn.Linear):
        return "output.dense", "inferred: intermediate/output (BERT style), the down-projection output.dense"
    return _refusal(address, "MLP", [], "no mlp/ffn-named child, no fc1/fc2 pair, no intermediate/output pair"), ""


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


def _mid_source(attn: str | LayoutInferenceError) -> str:
    if not isinstance(attn, str):
        return "refused: no attention"
    if attn.endswith(".self"):
        return "refused: post-norm BERT-style block (the add is inside attention.output)"
    return ("inferred: first add in the block, checked on read (= resid_pre + attn or its post-norm, MLP after it, "
            "resid_post = it + mlp)")


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
        attn, attn_how = infer_attn(block0, f"{container}.0")
        mlp, mlp_how = infer_mlp(block0, f"{container}.0")
        embed, unembed = _embed_unembed(model, container)
        layout = Layout(blocks=container, attn=attn if isinstance(attn, str) else None,
                        mlp=mlp if isinstance(mlp, str) else None, resid_mid=NO_MID, embed=embed, unembed=unembed)
        config = getattr(model, "config", None)
        dims = config_dims(config) if config is not None else {}
        if not dims.get("n_heads"):
            dims = _attn_dims(block0.get_submodule(attn) if isinstance(attn, str) else None)
        view = layout.view(model, self.name, root="", **dims)
        for i, block in enumerate(view.blocks):
            for kind, found in (("attn", attn), ("mlp", mlp)):
                if not isinstance(found, str):
                    fields = found.fields
                    view.targets[f"blocks.{i}.{kind}"] = _refusal(block, fields["site"], fields["candidates"],
                                                                  fields["rule"])
            if isinstance(attn, str) and attn.endswith(".self"):
                view.targets[f"blocks.{i}.resid_mid"] = LayoutInferenceError(
                    f"blocks.{i}.resid_mid: {block} is a post-norm BERT-style block; its attention residual add is "
                    f"inside {attn[:-5]}.output (LayerNorm of the sum), not an add of resid_pre and attn",
                    site=f"blocks.{i}.resid_mid")
            elif isinstance(attn, str):
                view.targets[f"blocks.{i}.resid_mid"] = CheckedResidualAdd(
                    block, f"{block}.{attn}", f"{block}.{mlp}" if isinstance(mlp, str) else None,
                    name=f"blocks.{i}.resid_mid")
        view.sources.update(blocks=f"inferred: {container} (largest list of one block class)",
                            attn=attn_how or "refused", mlp=mlp_how or "refused",
                            resid_mid=_mid_source(attn),
                            resid_pre="inferred: the op feeding the block (exact after capture)",
                            resid_post="inferred: the block's output (check_layout: equals the next resid_pre)",
                            norms="inferred: " + (", ".join(n for n, m in block0.named_children() if is_norm(m))
                                                  or "none among the block's children"),
                            embed="inferred: the first nn.Embedding outside the blocks" if embed else "none found",
                            unembed=f"inferred: {unembed}, a Linear to the vocabulary" if unembed else "none found")
        return view
